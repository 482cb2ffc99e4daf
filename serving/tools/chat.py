"""Chat tool calls over HTTP: the request's ``tools`` / ``tool_choice`` checked against the worker's settings, and
each choice's output turned into OpenAI's ``message.tool_calls`` or streamed tool-call deltas.

- ``required`` and a named function are enforced by structured output
  (`pd_cluster.serving.tools.spec.tool_choice_structured_output`): the output is the calls' JSON.
- ``auto`` is parsed from free text by the worker's ``--tool-call-parser`` (vLLM's flag and names:
  ``hermes``, ``llama3_json``); as in vLLM it needs ``--enable-auto-tool-choice``, else a request whose
  ``tool_choice`` is ``auto`` (the default when ``tools`` is given) gets a 400 naming ``tool_choice``.
- ``none``: plain content; the tools still reach the chat template.

A choice with calls has ``content`` null (``auto``: the text before the first call, if any), ``tool_calls``
with ids ``call_...``, type ``function`` and the arguments as JSON text, and ``finish_reason`` ``tool_calls``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pd_cluster.engine.errors import RequestRejected, SamplingParamError
from pd_cluster.engine.sampling.structured import StructuredOutput
from pd_cluster.serving.tools.parsers import get_tool_parser
from pd_cluster.serving.tools.stream import ToolCallStream
from pd_cluster.serving.tools.spec import (ToolChoice, forced_tool_calls, parse_tool_choice, parse_tools,
                                              tool_choice_structured_output)

TOOL_CALL_PARSERS = ("hermes", "llama3_json")


@dataclass(frozen=True)
class ToolSettings:
    """The worker's tool-calling flags (vLLM's).

    Attributes:
        tool_call_parser: ``--tool-call-parser``: how ``auto`` finds calls in the output, or None.
        enable_auto_tool_choice: ``--enable-auto-tool-choice``: allow ``tool_choice="auto"`` (needs the parser).

    Raises:
        ValueError: an unknown parser, or auto tool choice without a parser.
    """

    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")


def add_tool_args(p: Any) -> None:
    """``--tool-call-parser`` and ``--enable-auto-tool-choice`` (vLLM's names) on an argparse parser."""
    p.add_argument("--tool-call-parser", choices=list(TOOL_CALL_PARSERS), default=None,
                   help="how tool_choice=auto finds tool calls in the output (vLLM's flag)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="allow tool_choice=auto (needs --tool-call-parser; vLLM's flag)")


def tool_settings_from_args(args: Any) -> ToolSettings:
    """The `ToolSettings` of parsed `add_tool_args` flags (ValueError: auto without a parser)."""
    return ToolSettings(args.tool_call_parser, args.enable_auto_tool_choice)


def tool_argv(args: Any) -> list[str]:
    """The `add_tool_args` flags of parsed args, as argv for the workers (``pd-serve``)."""
    out = ["--tool-call-parser", args.tool_call_parser] if args.tool_call_parser else []
    return out + (["--enable-auto-tool-choice"] if args.enable_auto_tool_choice else [])


@dataclass(frozen=True)
class ChatTools:
    """One chat request's tools.

    Attributes:
        choice: the parsed ``tool_choice``.
        template_tools: the request's ``tools`` for the chat template (None without tools).
        structured_output: the constraint enforcing ``required`` / a named function, else None.
        parser_name: the ``auto`` parser, else None.
    """

    choice: ToolChoice
    template_tools: list[dict[str, Any]] | None
    structured_output: StructuredOutput | None
    parser_name: str | None

    @property
    def active(self) -> bool:
        """Whether the output may hold tool calls."""
        return self.structured_output is not None or self.parser_name is not None

    def stream(self) -> ToolCallStream | None:
        """A fresh per-choice `ToolCallStream`, or None when the output is plain content."""
        if not self.active:
            return None
        return ToolCallStream(self.choice, get_tool_parser(self.parser_name) if self.parser_name else None)

    def extract(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, OpenAI tool calls) of a complete output; no calls when it holds none (free text under
        ``auto``): then the content is the text.

        An output that does not parse whole (cut by ``max_tokens`` or a stop string) gets what its stream would
        have sent (`replay`): a call whose name was complete stands, with the arguments generated so far, so
        the streamed and non-streamed answers to one request agree."""
        if self.structured_output is not None:
            try:
                calls = forced_tool_calls(text, self.choice)
            except (ValueError, KeyError, TypeError):
                return self.replay(text)
            return None, [c.to_openai() for c in calls]
        if self.parser_name is None:
            return text, []
        found = get_tool_parser(self.parser_name).extract_tool_calls(text)
        if not found.tools_called:
            return self.replay(text)
        return found.content or None, [c.to_openai() for c in found.tool_calls]

    def replay(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, OpenAI tool calls) as the client of a stream of `text` would put them together: the deltas
        of a fresh `ToolCallStream` fed `text` whole, then finished; (text, []) when it sends no call."""
        stream = self.stream()
        if stream is None:
            return text, []
        content: list[str] = []
        calls: dict[int, dict[str, Any]] = {}
        for delta in stream.feed(text) + stream.finish():
            if "content" in delta:
                content.append(delta["content"])
            for piece in delta.get("tool_calls", ()):
                call = calls.setdefault(piece["index"], {"id": piece.get("id"), "type": "function",
                                                         "function": {"name": "", "arguments": ""}})
                fn = piece.get("function", {})
                call["function"]["name"] += fn.get("name") or ""
                call["function"]["arguments"] += fn.get("arguments") or ""
        if not calls:
            return text, []
        return "".join(content) or None, [calls[i] for i in sorted(calls)]


def chat_tools(tools: Any, tool_choice: Any, parallel_tool_calls: bool | None, settings: ToolSettings,
               structured: StructuredOutput | None) -> ChatTools:
    """Validate a chat request's tool fields against the worker's `settings`.

    Args:
        structured: the request's own structured output (``response_format`` / ``guided_*``), which cannot be
            combined with a forced tool choice.

    Raises:
        SamplingParamError / RequestRejected: 400 naming ``tools``, ``tool_choice`` or the conflicting field.
    """
    parsed = parse_tools(tools)
    choice = parse_tool_choice(tool_choice, parsed)
    if choice == "auto" and not settings.enable_auto_tool_choice:
        raise RequestRejected('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                              'set', param="tool_choice", code="unsupported_parameter")
    forced = tool_choice_structured_output(parsed, choice, parallel_tool_calls is not False)
    if forced is not None and structured is not None:
        raise SamplingParamError("tool_choice", f"a forced tool choice cannot be combined with {structured.param}")
    parser = settings.tool_call_parser if choice == "auto" else None  # also under guided_* (as vLLM parses)
    return ChatTools(choice, tools if parsed else None, forced, parser)
