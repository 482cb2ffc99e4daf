"""OpenAI tools and ``tool_choice``: validation, and ``required`` / named functions forced through structured output.

Serving-neutral: a server validates the request's ``tools`` and ``tool_choice``
(`parse_tools`, `parse_tool_choice`), puts `tool_choice_structured_output` on
`SamplingParams.structured_output`, and turns the constrained text back into
calls with `forced_tool_calls`. ``auto`` is parsed from free text by
`pd_cluster.serving.tools.parsers`.

The schemas follow vLLM's (``vllm/entrypoints/openai/protocol.py``): a named
function constrains the output to its ``parameters`` schema (the output is the
arguments object); ``required`` constrains it to a non-empty JSON array of
``{"name": <one of the tools>, "parameters": {...}}``, each item checked
against its own tool's schema (``anyOf``).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pd_cluster.engine.errors import SamplingParamError
from pd_cluster.engine.sampling.structured import StructuredOutput

MAX_TOOLS = 128
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class FunctionTool:
    """One OpenAI function tool (``{"type": "function", "function": {...}}``)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] = field(default_factory=lambda: dict(EMPTY_PARAMETERS))
    strict: bool | None = None


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: `arguments` is JSON text (OpenAI's shape)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict[str, Any]:
        """``{"id", "type": "function", "function": {"name", "arguments"}}``."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


ToolChoice = Literal["none", "auto", "required"] | FunctionTool


def parse_tools(tools: object) -> list[FunctionTool]:
    """Validate OpenAI ``tools``.

    Raises:
        SamplingParamError: (``param="tools"``) not a list, an entry that is not a function tool, a missing or
            repeated name, parameters that are not a JSON schema object xgrammar can convert.
    """
    if tools is None:
        return []
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise SamplingParamError("tools", f"must be a list of at most {MAX_TOOLS} tools")
    out: list[FunctionTool] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
                or not isinstance(tool.get("function"), dict):
            raise SamplingParamError("tools", f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            raise SamplingParamError("tools", f"tools[{i}].function.name must be a string of 1-64 characters")
        if any(t.name == name for t in out):
            raise SamplingParamError("tools", f"tools[{i}]: the function name {name!r} is repeated")
        params = fn.get("parameters")
        params = dict(EMPTY_PARAMETERS) if params is None else params
        if not isinstance(params, dict):
            raise SamplingParamError("tools", f"tools[{i}].function.parameters must be a JSON schema object")
        try:
            StructuredOutput(json_schema=params, param="tools")
        except SamplingParamError as e:
            raise SamplingParamError("tools", f"tools[{i}].function.parameters: {str(e).split(': ', 1)[-1]}") from None
        desc = fn.get("description")
        out.append(FunctionTool(name, desc if isinstance(desc, str) else None, params, fn.get("strict")))
    return out


def parse_tool_choice(tool_choice: object, tools: list[FunctionTool]) -> ToolChoice:
    """Validate OpenAI ``tool_choice`` against the parsed tools.

    None means ``auto`` with tools and ``none`` without (OpenAI's default).

    Raises:
        SamplingParamError: (``param="tool_choice"``) an unknown value, a named function that is not in
            ``tools``, or ``auto`` / ``required`` / a name without tools.
    """
    if tool_choice is None:
        return "auto" if tools else "none"
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not tools:
            raise SamplingParamError("tool_choice", f"{tool_choice!r} needs a non-empty 'tools'")
        return tool_choice  # type: ignore[return-value]
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        for t in tools:
            if t.name == name:
                return t
        raise SamplingParamError("tool_choice", f"function {name!r} is not in 'tools'")
    raise SamplingParamError("tool_choice", "must be 'none', 'auto', 'required' or "
                                            "{\"type\": \"function\", \"function\": {\"name\": ...}}")


def required_schema(tools: list[FunctionTool], parallel_tool_calls: bool = True) -> dict[str, Any]:
    """The JSON schema of a non-empty list of calls to `tools` (``tool_choice="required"``); exactly one call
    when `parallel_tool_calls` is False (OpenAI's ``parallel_tool_calls``).

    Each tool's ``parameters`` sits deep inside this schema, so its local references (``#/$defs/X``, which
    pydantic writes for every nested model, ``#/definitions/X``, or ``#/...`` into itself) would point at this
    schema's root: they are rewritten to definitions hoisted into the root's ``$defs``, one namespace per tool
    (`_hoisted`)."""
    defs: dict[str, Any] = {}
    items = []
    for k, t in enumerate(tools):
        params = _hoisted(t.parameters, f"tool{k}", defs)
        items.append({"type": "object", "properties": {"name": {"type": "string", "enum": [t.name]},
                                                        "parameters": params},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


_DEF_KEYS = ("$defs", "definitions")


def _hoisted(params: dict[str, Any], ns: str, defs: dict[str, Any]) -> dict[str, Any]:
    """`params` with its local definitions moved into `defs` under ``{ns}.{name}`` and every local ``$ref``
    rewritten to match; a reference to the tool's own root (``#``, ``#/properties/...``) points at a copy of
    the whole schema kept as ``defs[ns]``."""
    def rewrite(node: Any) -> Any:
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: rewrite(v) for k, v in node.items() if k not in _DEF_KEYS}
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            out["$ref"] = _moved(ref, ns)
            if not _is_def_ref(ref):
                needs_root[0] = True
        return out

    needs_root = [False]
    for key in _DEF_KEYS:
        for name, sub in (params.get(key) or {}).items():
            defs[f"{ns}.{name}"] = rewrite(sub)
    body = rewrite(params)
    if needs_root[0]:
        defs[ns] = body
    return body


def _is_def_ref(ref: str) -> bool:
    return any(ref.startswith(f"#/{k}/") for k in _DEF_KEYS)


def _moved(ref: str, ns: str) -> str:
    """Where a local reference of tool namespace `ns` points once its definitions are hoisted."""
    for key in _DEF_KEYS:
        prefix = f"#/{key}/"
        if ref.startswith(prefix):
            return f"#/$defs/{ns}.{ref[len(prefix):]}"
    return f"#/$defs/{ns}{ref[1:]}"


def tool_choice_structured_output(tools: list[FunctionTool], tool_choice: ToolChoice,
                                  parallel_tool_calls: bool = True) -> StructuredOutput | None:
    """The constraint that enforces `tool_choice`: None for ``none`` and ``auto`` (free text, parsed after).

    Args:
        parallel_tool_calls: OpenAI's field; False allows exactly one call under ``required`` (a named
            function is always one call).
    """
    if isinstance(tool_choice, FunctionTool):
        return StructuredOutput(json_schema=tool_choice.parameters, param="tool_choice")
    if tool_choice == "required":
        return StructuredOutput(json_schema=required_schema(tools, parallel_tool_calls), param="tool_choice")
    return None


def forced_tool_calls(text: str, tool_choice: ToolChoice) -> list[ToolCall]:
    """The calls in the output of a request constrained by `tool_choice_structured_output`.

    Raises:
        ValueError: `text` is not complete JSON of the forced shape (the request was cut by ``max_tokens`` or a
            stop string, or `tool_choice` is ``none``/``auto``).
    """
    value = json.loads(text)
    if isinstance(tool_choice, FunctionTool):
        return [ToolCall(tool_choice.name, json.dumps(value, ensure_ascii=False))]
    if tool_choice != "required" or not isinstance(value, list):
        raise ValueError(f"no forced tool calls for tool_choice={tool_choice!r}")
    return [ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in value]
