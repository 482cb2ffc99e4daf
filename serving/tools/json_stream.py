"""Tool calls read from JSON text as it arrives, so that their arguments stream in pieces (as vLLM and OpenAI
stream them) rather than in one piece once the output is complete.

`CallScanner` is fed the text of one or more call objects (``{"name": ..., "arguments": {...}}``; the
``parameters`` key is read the same way) at a fixed nesting depth: 0 for one object (a hermes ``<tool_call>``
block), 1 for the objects of an array (``tool_choice="required"``). It keeps one pass of scanner state
(depth, inside a string, escapes, where the current key and value began), so each character is read once.
It reports, per call in order of appearance, the name once its string is complete, then the raw JSON text of
the arguments value as it grows, ending exactly at the value's last character: the pieces concatenate to
valid JSON equal to what the complete output holds (whitespace as the model wrote it). An arguments value
written as a JSON string (some models quote the object) is sent once complete, unquoted. Arguments that
come before the name are held until the name is known.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

ARG_KEYS = ("arguments", "parameters")


@dataclass
class _Call:
    """One call object being read."""

    state: str = "key"  # key -> colon -> value -> in_value -> after_value -> key ...
    key: str | None = None
    key_start: int | None = None
    value_start: int | None = None
    name: str | None = None
    args_start: int | None = None  # where the arguments value began (raw text streamed from here)
    args_end: int | None = None
    args_sent: int | None = None  # how far the arguments were sent
    args_quoted: bool = False
    announced: bool = False


class CallScanner:
    """Incremental reader of tool-call objects (module doc).

    Args:
        obj_depth: the nesting depth at which each call object's ``{`` appears.
        max_calls: stop reading after this many call objects (None: no bound).
    """

    def __init__(self, obj_depth: int, max_calls: int | None = None) -> None:
        self.obj_depth = obj_depth
        self.max_calls = max_calls
        self.buf = ""
        self.depth = 0
        self.in_str = False
        self.esc = False
        self.calls: list[_Call] = []
        self.cur: _Call | None = None

    @property
    def announced(self) -> int:
        """How many calls were announced (their names sent)."""
        return sum(c.announced for c in self.calls)

    def feed(self, text: str) -> list[tuple[str, int, str]]:
        """Read `text`; the events it completes: ``("name", k, name)`` and ``("args", k, piece)`` for call k."""
        start = len(self.buf)
        self.buf += text
        events: list[tuple[str, int, str]] = []
        for i in range(start, len(self.buf)):
            self._step(i, self.buf[i], events)
        for k, c in enumerate(self.calls):
            self._send_args(k, c, len(self.buf), events)
        return events

    # ---- the scanner -------------------------------------------------------------------------
    def _step(self, i: int, ch: str, ev: list) -> None:
        level = self.obj_depth + 1  # the depth of a call object's own keys and values
        cur = self.cur
        if self.in_str:
            if self.esc:
                self.esc = False
            elif ch == "\\":
                self.esc = True
            elif ch == '"':
                self.in_str = False
                if cur is not None and self.depth == level:
                    if cur.state == "key":
                        cur.key, cur.key_start, cur.state = _loads(self.buf[cur.key_start:i + 1]), None, "colon"
                    elif cur.state == "in_value":
                        self._value_end(i + 1, ev)
            return
        if cur is not None and self.depth == level and cur.state == "value" and not ch.isspace():
            cur.state, cur.value_start = "in_value", i
            if cur.key in ARG_KEYS and cur.args_start is None:
                cur.args_start = cur.args_sent = i
                cur.args_quoted = ch == '"'
        if ch == '"':
            self.in_str = True
            if cur is not None and self.depth == level and cur.state == "key":
                cur.key_start = i
        elif ch in "{[":
            if ch == "{" and self.depth == self.obj_depth and cur is None \
                    and (self.max_calls is None or len(self.calls) < self.max_calls):
                self.cur = _Call()
                self.calls.append(self.cur)
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if cur is None:
                return
            if self.depth == level and cur.state == "in_value":  # a container value closed
                self._value_end(i + 1, ev)
            elif self.depth == self.obj_depth:  # the call object closed
                if cur.state == "in_value":
                    self._value_end(i, ev)
                self.cur = None
        elif cur is not None and self.depth == level:
            if ch == ":" and cur.state == "colon":
                cur.state = "value"
            elif ch == ",":
                if cur.state == "in_value":
                    self._value_end(i, ev)
                cur.state = "key"

    def _value_end(self, end: int, ev: list) -> None:
        cur = self.cur
        cur.state = "after_value"
        if cur.key == "name" and cur.name is None:
            name = _loads(self.buf[cur.value_start:end])
            if isinstance(name, str):
                cur.name = name
                cur.announced = True
                ev.append(("name", self.calls.index(cur), name))
        elif cur.key in ARG_KEYS and cur.args_end is None and cur.value_start == cur.args_start:
            cur.args_end = end

    def _send_args(self, k: int, c: _Call, upto: int, ev: list) -> None:
        """Send call k's arguments text that is final (held until the name is known)."""
        if not c.announced or c.args_start is None:
            return
        if c.args_quoted:  # a quoted object: sent whole once the string is complete
            if c.args_end is not None and c.args_sent == c.args_start:
                inner = _loads(self.buf[c.args_start:c.args_end])
                c.args_sent = c.args_end
                if isinstance(inner, str) and inner:
                    ev.append(("args", k, inner))
            return
        end = c.args_end if c.args_end is not None else upto
        if end > c.args_sent:
            ev.append(("args", k, self.buf[c.args_sent:end]))
            c.args_sent = end


def _loads(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None
