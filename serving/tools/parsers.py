"""Tool calls parsed from free model output (``tool_choice="auto"``), by the chat template's convention.

Parsers, selected by name as vLLM's ``--tool-call-parser``:

- ``hermes``: Hermes 2 Pro / Qwen 2.5+ templates: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number of them, with free text before the first one (the ``content``).
- ``llama3_json``: Llama 3.1+ JSON tool calling: the output is ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``), several calls separated by ``;``.

Output that does not follow the convention is plain content (no tool call), never an error.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from pd_cluster.serving.tools.spec import ToolCall


@dataclass
class ExtractedToolCalls:
    """What a parser found in one complete output.

    Attributes:
        tools_called: at least one call was found.
        tool_calls: the calls, in order.
        content: the text that is not a call (None when there is none), for the message's ``content``.
    """

    tools_called: bool
    tool_calls: list[ToolCall] = field(default_factory=list)
    content: str | None = None


def _call_from(obj: object, args_keys: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models put the arguments' JSON text in a string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolParser:
    """Base: `extract_tool_calls(text)` on a complete output."""

    name = ""

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        raise NotImplementedError


class HermesToolParser(ToolParser):
    """``<tool_call>`` JSON ``</tool_call>`` blocks; an unclosed last block (cut at EOS) is parsed too."""

    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"
    _block = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        if self.start not in text:
            return ExtractedToolCalls(False, [], text)
        calls = []
        for m in self._block.finditer(text):
            body = (m.group(1) if m.group(1) is not None else m.group(2)).strip()
            try:
                call = _call_from(json.loads(body), ("arguments", "parameters"))
            except json.JSONDecodeError:
                call = None
            if call is None:  # a malformed block: the whole output is content (vLLM's behaviour)
                return ExtractedToolCalls(False, [], text)
            calls.append(call)
        content = text[:text.index(self.start)].strip()
        return ExtractedToolCalls(True, calls, content or None)


class Llama3JsonToolParser(ToolParser):
    """One or more ``{"name": ..., "parameters": {...}}`` objects (``arguments`` accepted), ``;``-separated."""

    name = "llama3_json"
    python_tag = "<|python_tag|>"

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        body = text.strip()
        if body.startswith(self.python_tag):
            body = body[len(self.python_tag):].lstrip()
        if not body.startswith("{"):
            return ExtractedToolCalls(False, [], text)
        decoder, pos, calls = json.JSONDecoder(), 0, []
        while pos < len(body):
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                return ExtractedToolCalls(False, [], text)
            call = _call_from(obj, ("parameters", "arguments"))
            if call is None:
                return ExtractedToolCalls(False, [], text)
            calls.append(call)
            rest = body[pos:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            elif rest:
                return ExtractedToolCalls(False, [], text)
            pos = len(body) - len(rest)
        return ExtractedToolCalls(True, calls, None)


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser)}


def get_tool_parser(name: str) -> ToolParser:
    """The parser called `name` (vLLM's ``--tool-call-parser`` names).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; choose from {sorted(TOOL_PARSERS)}") from None
