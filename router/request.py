"""What the router reads from an OpenAI request body, and nothing more.

The body is forwarded unchanged; the worker validates sampling parameters,
applies the chat template and detokenizes (``docs/worker-api.md``). The router
only checks that the body is a JSON object, reads ``model`` and ``stream``,
checks the types of ``prompt`` / ``messages``, and turns the prompt into text
when a policy asks for it (``cache_aware``'s tree; computed on first use, so
the other policies never pay for it).
"""

from __future__ import annotations

import json
from typing import Any

from pd_cluster.common.responses_input import Refused, to_chat
from pd_cluster.common.routing_text import routing_text


class InvalidRequest(ValueError):
    """The body is not a valid request; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None,
                 code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class ParsedRequest:
    """``model`` (``None`` when absent), ``stream``, the body as parsed (``data``), and the prompt as routing
    text (``text``, computed on first use; `common.routing_text`, which the workers' text-to-page maps use too).
    ``responses``: a Responses API body, routed as the chat body it means (``chat_data``). ``num_prompts``: the
    prompts of a completions request (a list of texts or of token-id lists is several; 1 for a chat).
    ``cost``: the sequences it asks the workers to generate, ``num_prompts × max(n, best_of)``: what it counts
    against the router's admission."""

    __slots__ = ("model", "stream", "data", "chat", "responses", "_text", "num_prompts", "num_generated", "cost")

    def __init__(self, model: str | None, stream: bool, data: dict[str, Any], chat: bool,
                 responses: bool = False) -> None:
        self.model = model
        self.stream = stream
        self.data = data
        self.chat = chat
        self.responses = responses
        self._text: str | None = None
        self.num_prompts = 1 if chat else count_prompts(data.get("prompt"))
        self.num_generated = max(_positive(data.get("n")), _positive(data.get("best_of")))  # per prompt
        self.cost = self.num_prompts * self.num_generated

    @property
    def chat_data(self) -> dict[str, Any]:
        """The body as the workers tokenize it (a Responses body: its chat body; {} when malformed)."""
        if not self.responses:
            return self.data
        try:
            return to_chat(self.data)
        except Refused:
            return {}

    @property
    def text(self) -> str:
        if self._text is None:
            if self.responses:
                self._text = routing_text(self.chat_data, chat=True)
            else:
                self._text = routing_text(self.data, self.chat)
        return self._text


def chat_text(messages: Any) -> str:
    """Messages joined as ``<role>content`` (prefix-preserving across turns)."""
    if not isinstance(messages, list):
        raise InvalidRequest("'messages' must be a list", "messages")
    if not all(isinstance(m, dict) for m in messages):
        raise InvalidRequest("each message must be an object", "messages")
    return routing_text({"messages": messages}, chat=True)


def count_prompts(prompt: Any) -> int:
    """How many prompts a completions ``prompt`` holds: a list of texts or of token-id lists is one per item;
    a text or one list of token ids is one."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt)
    return 1


def _positive(value: Any) -> int:
    """``n`` or ``best_of`` as a count (1 when absent or not a positive integer: the worker refuses those)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 1 else 1


def parse_request(body: bytes, chat: bool, responses: bool = False) -> ParsedRequest:
    """Parse a ``/v1/completions``, ``/v1/chat/completions`` or (`responses`) ``/v1/responses`` body.

    Raises :class:`InvalidRequest` when the body is not a JSON object, or when
    ``model``, ``stream``, ``messages``, ``prompt`` or ``input`` is missing or has the wrong type.
    """
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise InvalidRequest("request body is nested too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object", code="invalid_json")
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest("'model' must be a string", "model")
    stream = data.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be a boolean", "stream")
    if responses:
        if not isinstance(data.get("input"), (str, list)):
            raise InvalidRequest("'input' is required (a string or a list of items)", "input",
                                 "missing_required_parameter" if "input" not in data else "invalid_value")
    elif chat:
        messages = data.get("messages", _MISSING)
        if messages is _MISSING:
            raise InvalidRequest("'messages' is required", "messages", "missing_required_parameter")
        if not isinstance(messages, list):
            raise InvalidRequest("'messages' must be a list", "messages")
        for m in messages:
            if not isinstance(m, dict):
                raise InvalidRequest("each message must be an object", "messages")
    elif "prompt" not in data:
        raise InvalidRequest("'prompt' is required", "prompt", "missing_required_parameter")
    return ParsedRequest(model, stream, data, chat, responses)


_MISSING = object()
