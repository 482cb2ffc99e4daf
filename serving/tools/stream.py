"""Streamed tool calls: text deltas in, OpenAI chat-completion ``delta`` objects out.

`ToolCallStream` turns the text deltas of one choice into the ``delta`` objects
of OpenAI's streaming shape: ``{"content": ...}`` for text, and for each call a
first ``{"tool_calls": [{"index", "id", "type": "function", "function":
{"name", "arguments"}}]}`` followed, where the arguments arrive in pieces, by
``{"tool_calls": [{"index", "function": {"arguments": ...}}]}``. A client that
concatenates the pieces gets what the non-streamed response holds.

- a named function (`FunctionTool`): the constrained output *is* the arguments; they stream as they come.
- ``required``: the output is a JSON array of calls; each call's name is sent once complete and its
  arguments stream as they come (`json_stream.CallScanner`). Output cut before any name (``max_tokens``) is
  sent as content at the end.
- ``auto`` with a parser: text streams as content until a call may begin (``<tool_call>`` for ``hermes``, a
  leading ``{`` or ``<|python_tag|>`` for ``llama3_json``). hermes: inside a block the name is sent once
  complete and the arguments stream as they come; a block that never yields a name is parsed when closed
  (content if it is not a call). llama3_json: when the output (after an optional ``<|python_tag|>``) starts
  with ``{``, the ``;``-separated call objects are read as they come: each name is sent once complete and its
  ``parameters`` stream; output that never yields a name is parsed at the end (content if it is not a call).

As in vLLM, a call whose name was sent stands: output cut after it (``max_tokens``, ``finish_reason`` ``length``)
leaves that call with the arguments sent so far; the non-streamed response of such an output is what this stream
sends, put together (`pd_cluster.serving.tools.chat.ChatTools.replay`), so both agree.
"""

from __future__ import annotations

from pd_cluster.serving.tools.json_stream import CallScanner
from pd_cluster.serving.tools.parsers import HermesToolParser, Llama3JsonToolParser, ToolParser
from pd_cluster.serving.tools.spec import FunctionTool, ToolCall, ToolChoice, forced_tool_calls


class ToolCallStream:
    """One choice's streamed tool calls.

    Args:
        tool_choice: the parsed ``tool_choice`` (`pd_cluster.serving.tools.spec.parse_tool_choice`).
        parser: the ``auto`` parser (`get_tool_parser`); None: no tool parsing (plain content).
    """

    def __init__(self, tool_choice: ToolChoice, parser: ToolParser | None = None) -> None:
        self.tool_choice = tool_choice
        self.parser = parser if tool_choice == "auto" else None
        self.tool_calls: list[ToolCall] = []
        self._held = ""       # text not sent yet
        self._holding = False  # a call may have begun: hold everything from here
        self._plain = False    # llama3_json: the output is plain text
        self._named: ToolCall | None = None
        self._scanner = CallScanner(1) if tool_choice == "required" else None  # hermes: one per block
        self._base = 0  # index of the scanner's first call
        self._fed = 0  # hermes: characters of the open block fed to its scanner; llama3_json: of the output
        self._calls_at: int | None = None  # llama3_json: where the call objects begin (-1: not a '{')
        self._index_of: dict[tuple[int, int], int] = {}  # (base, scanner's call) -> the call's index

    @property
    def tools_called(self) -> bool:
        """Whether a call was sent (the choice's ``finish_reason`` is then ``tool_calls``)."""
        return bool(self.tool_calls)

    def feed(self, text: str) -> list[dict]:
        """The ``delta`` objects for a new piece of the output's text."""
        if not text:
            return []
        if isinstance(self.tool_choice, FunctionTool):
            out = []
            if self._named is None:
                self._named = ToolCall(self.tool_choice.name, "")
                self.tool_calls.append(self._named)
                out.append(self._call_delta(0, self._named))
            return out + [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}]
        self._held += text
        if self.tool_choice == "required":
            return self._scan(self._take(len(self._held)))
        if isinstance(self.parser, HermesToolParser):
            return self._feed_hermes()
        if isinstance(self.parser, Llama3JsonToolParser):
            return self._feed_llama3()
        return self._content(self._take(len(self._held)))

    def finish(self) -> list[dict]:
        """The ``delta`` objects for whatever is held back when the output ends."""
        if isinstance(self.tool_choice, FunctionTool):
            return []
        rest, self._held = self._held, ""
        if self.tool_choice == "required":
            if self._scanner.announced:
                return []
            text = self._scanner.buf
            try:
                calls = forced_tool_calls(text, "required")
            except (ValueError, KeyError, TypeError):  # cut by max_tokens: the text is all there is
                return self._content(text)
            return [self._add(c) for c in calls]
        if self.parser is None or not rest:
            return self._content(rest)
        if self._holding and self._scanner is not None and self._scanner.announced:
            return []  # an unclosed last block (cut at EOS) whose call was streamed already
        found = self.parser.extract_tool_calls(rest)
        if not found.tools_called:
            return [] if self.tool_calls else self._content(rest)  # hermes: text after calls is dropped
        return [self._add(c) for c in found.tool_calls]

    # ---- auto parsers ---------------------------------------------------------------
    def _feed_hermes(self) -> list[dict]:
        out: list[dict] = []
        start, end = HermesToolParser.start, HermesToolParser.end
        while True:
            if not self._holding:
                i = self._held.find(start)
                if i < 0:  # send all but trailing whitespace and a possible beginning of the tag
                    sendable = self._held[:len(self._held) - _partial_suffix(self._held, start)].rstrip()
                    piece = self._take(len(sendable))
                    return out + ([] if self.tool_calls else self._content(piece))  # text after calls: dropped
                piece = self._take(i)
                out += [] if self.tool_calls else self._content(piece.rstrip())
                self._holding = True
                self._scanner, self._base, self._fed = CallScanner(0, max_calls=1), len(self.tool_calls), len(start)
            j = self._held.find(end)
            upto = len(self._held) - _partial_suffix(self._held, end) if j < 0 else j
            out += self._scan(self._held[self._fed:upto])
            self._fed = max(self._fed, upto)
            if j < 0:
                return out
            block = self._take(j + len(end))
            if not self._scanner.announced:  # no name was read as it came: parse the closed block
                found = self.parser.extract_tool_calls(block)
                if not found.tools_called:  # malformed: it is content after all
                    out += self._content(block)
                else:
                    out += [self._add(c) for c in found.tool_calls]
            self._holding = False

    def _feed_llama3(self) -> list[dict]:
        if self._holding:
            return self._scan_llama3()
        tag = Llama3JsonToolParser.python_tag
        body = self._held.lstrip()
        if not self._plain:
            if not body or (tag.startswith(body) and body != tag):
                return []  # nothing yet, or maybe the tag: decided when more text comes
            if body.startswith("{") or body.startswith(tag):
                self._holding = True  # the output is a call (or not JSON at all): held to the end
                return self._scan_llama3()
            self._plain = True  # a call is only a whole output that starts with '{'
        return self._content(self._take(len(self._held)))

    def _scan_llama3(self) -> list[dict]:
        """Stream the calls of a held llama3_json output once its objects begin with '{' (the parser's rule)."""
        if self._calls_at is None:
            tag = Llama3JsonToolParser.python_tag
            lead = len(self._held) - len(self._held.lstrip())
            if self._held.startswith(tag, lead):
                lead += len(tag)
            rest = self._held[lead:]
            if not rest.strip():
                return []  # the first character after the tag is still to come
            self._calls_at = lead + len(rest) - len(rest.lstrip()) if rest.lstrip().startswith("{") else -1
            if self._calls_at >= 0:
                self._scanner, self._base, self._fed = CallScanner(0), len(self.tool_calls), self._calls_at
        if self._calls_at < 0:
            return []  # not JSON: parsed (as content) at the end
        out = self._scan(self._held[self._fed:])
        self._fed = len(self._held)
        return out

    def _scan(self, text: str) -> list[dict]:
        """Feed the call scanner; the deltas of the names and argument pieces it read."""
        out = []
        for kind, k, value in self._scanner.feed(text):
            if kind == "name":
                self._index_of[(self._base, k)] = len(self.tool_calls)
                out.append(self._add(ToolCall(value, "")))
            else:
                index = self._index_of[(self._base, k)]
                out.append({"tool_calls": [{"index": index, "function": {"arguments": value}}]})
        return out

    # ---- pieces ----------------------------------------------------------------
    def _take(self, n: int) -> str:
        piece, self._held = self._held[:n], self._held[n:]
        return piece

    @staticmethod
    def _content(text: str) -> list[dict]:
        return [{"content": text}] if text else []

    def _add(self, call: ToolCall) -> dict:
        self.tool_calls.append(call)
        return self._call_delta(len(self.tool_calls) - 1, call)

    @staticmethod
    def _call_delta(index: int, call: ToolCall) -> dict:
        return {"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                "function": {"name": call.name, "arguments": call.arguments}}]}


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
