"""OpenAI's Responses API request (``POST /v1/responses``) as the chat-completions request the workers serve.

The worker serves ``/v1/responses`` through its chat path (``serving/openai_responses.py``): the same chat template,
tokenization, sampling, structured outputs and tool calls as ``/v1/chat/completions``, so one request's greedy text
is the same through both. The router reads the same conversion for its routing text (``common/routing_text.py``).

Mapping (OpenAI's API reference; vLLM serves the same subset without its stored-response features):

- ``instructions``: a first ``system`` message; ``input``: a string (one ``user`` message) or items: messages
  (``role`` and text content: a string or ``input_text`` / ``output_text`` parts), ``function_call`` items (an
  assistant message's ``tool_calls``) and ``function_call_output`` items (``tool`` messages);
- ``tools`` of type ``function`` (``name``, ``description``, ``parameters``, ``strict``) and ``tool_choice``
  (``none`` / ``auto`` / ``required`` / ``{"type": "function", "name"}``);
- ``text.format``: ``text``, ``json_object`` or ``json_schema`` (``name``, ``schema``, ``strict``) as
  ``response_format``;
- ``max_output_tokens`` (``max_completion_tokens``), ``temperature``, ``top_p``, ``parallel_tool_calls``,
  ``stream``; and the sampling fields the chat path takes beyond OpenAI's (`PASSED`).

Nothing is stored (``store: false``): ``store: true``, ``previous_response_id``, ``background``, ``conversation``,
``include``, ``reasoning``, non-function tools, image/file/audio input and every other field that would change the
answer and is not honoured are refused with a 400 naming the field (`Refused`); fields that are only labels
(``metadata``, ``user``, ``safety_identifier``, ``prompt_cache_key``...) are accepted.

Standard library only.
"""

from __future__ import annotations

from typing import Any

LABELS = ("model", "metadata", "user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
          "service_tier")
"""Fields that do not change the answer (the response echoes ``metadata``)."""
PASSED = ("seed", "top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "stop",
          "ignore_eos", "min_tokens", "skip_special_tokens")
"""Sampling fields the chat path takes and validates (vLLM's extras)."""
HONOURED = ("input", "instructions", "tools", "tool_choice", "text", "max_output_tokens", "temperature", "top_p",
            "parallel_tool_calls", "stream", "store", "truncation", "stream_options")
TEXT_PARTS = ("input_text", "output_text", "text")


class Refused(ValueError):
    """A field the server does not honour, or a malformed one; ``param`` names it (a 400)."""

    def __init__(self, message: str, param: str, code: str = "unsupported_parameter") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def to_chat(data: dict[str, Any]) -> dict[str, Any]:
    """The chat-completions body of a Responses body (see the module docstring).

    Raises:
        Refused: a field that is not honoured or not well formed, named in ``param``.
    """
    _refuse_unhonoured(data)
    chat: dict[str, Any] = {"messages": messages(data)}
    for key in ("model", "temperature", "top_p", "parallel_tool_calls", "stream", *PASSED):
        if data.get(key) is not None:
            chat[key] = data[key]
    if data.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = data["max_output_tokens"]
    if data.get("tools"):
        chat["tools"] = [_tool(t, i) for i, t in enumerate(_list(data["tools"], "tools"))]
    if data.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(data["tool_choice"])
    fmt = _text_format(data.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    return chat


def messages(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages of a Responses body: ``instructions``, then ``input``.

    Raises:
        Refused: an input item or part that is not text, a function call or its output.
    """
    out: list[dict[str, Any]] = []
    instructions = data.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise Refused("instructions: must be a string", "instructions", "invalid_value")
        out.append({"role": "system", "content": instructions})
    items = data.get("input")
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    for i, item in enumerate(_list(items, "input")):
        if not isinstance(item, dict):
            raise Refused(f"input[{i}]: must be an object", f"input[{i}]", "invalid_value")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise Refused(f"input[{i}].role: must be user, assistant, system or developer", f"input[{i}].role",
                              "invalid_value")
            out.append({"role": role, "content": _text(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            call = {"id": _str(item, "call_id", i), "type": "function",
                    "function": {"name": _str(item, "name", i), "arguments": _str(item, "arguments", i)}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") and not out[-1]["content"]:
                out[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, f"input[{i}].output")
            out.append({"role": "tool", "tool_call_id": _str(item, "call_id", i), "content": text})
        else:
            raise Refused(f"input[{i}]: items of type {kind!r} are not supported (messages, function_call and "
                          f"function_call_output are)", f"input[{i}].type")
    return out


def _refuse_unhonoured(data: dict[str, Any]) -> None:
    for key, value in data.items():
        if key in HONOURED or key in LABELS or key in PASSED:
            continue
        if value is None or value is False or value == [] or value == {} or (key == "top_logprobs" and value == 0):
            continue  # the field's no-op value
        raise Refused(f"{key}: not supported by this server (responses are not stored; only text and function "
                      f"tools are served)", key)
    if data.get("store"):
        raise Refused("store: responses are not stored here; send store: false", "store")
    if data.get("truncation") not in (None, "disabled"):
        raise Refused("truncation: only 'disabled' is supported (a prompt over the context is refused)", "truncation")
    options = data.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise Refused("stream_options: must be an object", "stream_options", "invalid_value")
    if (options or {}).get("include_obfuscation"):
        raise Refused("stream_options.include_obfuscation: not supported", "stream_options.include_obfuscation")
    if data.get("service_tier") not in (None, "auto", "default"):
        raise Refused("service_tier: only 'auto' and 'default' are served", "service_tier")
    if data.get("input") is None:
        raise Refused("input: required", "input", "missing_required_parameter")


def _tool(tool: Any, i: int) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise Refused(f"tools[{i}]: tools of type {kind!r} are not supported (function tools are)", f"tools[{i}].type")
    if not isinstance(tool.get("name"), str):
        raise Refused(f"tools[{i}].name: required", f"tools[{i}].name", "missing_required_parameter")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _tool_choice(choice: Any) -> Any:
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise Refused("tool_choice: 'none', 'auto', 'required' or {'type': 'function', 'name': ...}", "tool_choice")


def _text_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise Refused("text: must be an object", "text", "invalid_value")
    if text.get("verbosity") is not None:
        raise Refused("text.verbosity: not supported", "text.verbosity")
    fmt = text.get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise Refused("text.format.schema: required (a JSON schema)", "text.format.schema",
                          "missing_required_parameter")
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": spec}
    raise Refused("text.format: 'text', 'json_object' or 'json_schema'", "text.format")


def _text(content: Any, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(_list(content, param)):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise Refused(f"{param}[{j}]: parts of type {kind!r} are not supported: the server runs a language "
                          f"model on text (input_text parts)", f"{param}[{j}]")
        parts.append(part["text"])
    return "".join(parts)


def _list(value: Any, param: str) -> list:
    if not isinstance(value, list):
        raise Refused(f"{param}: must be a string or a list" if param == "input" else f"{param}: must be a list",
                      param, "invalid_value")
    return value


def _str(item: dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise Refused(f"input[{i}].{key}: required (a string)", f"input[{i}].{key}", "missing_required_parameter")
    return value
