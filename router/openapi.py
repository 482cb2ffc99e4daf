"""The router's OpenAPI document (``GET /openapi.json``).

The generate endpoints run as raw ASGI (``router.proxy``), outside FastAPI;
:func:`document_generate_routes` declares them on the control-plane app so
that the document lists them, with what the router itself checks (``model``,
``stream``, ``prompt``/``messages``) and the OpenAI error body of every error
status. Other fields are validated by the worker and are open here
(``additionalProperties``). The declared handlers are never called: the
router dispatches those paths before FastAPI sees them.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body (``router.errors``)."""

    error: ErrorDetail


class CompletionRequest(BaseModel):
    """``POST /v1/completions``; sampling fields are checked by the worker."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    stream: bool | None = False
    max_tokens: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(BaseModel):
    """``POST /v1/chat/completions``; sampling fields are checked by the worker."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    messages: list[ChatMessage]
    stream: bool | None = False
    max_tokens: int | None = None


class ResponsesRequest(BaseModel):
    """``POST /v1/responses`` (OpenAI's Responses API); everything but ``input`` is checked by the worker."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[dict[str, Any]]
    stream: bool | None = False


ERROR_STATUSES = (400, 401, 404, 413, 429, 502, 503, 504)


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for FastAPI: each status with the OpenAI error body."""
    return {s: {"model": ErrorResponse, "description": "OpenAI error body"} for s in statuses}


_GENERATED = {200: {"description": "a completion object, or with `stream` an SSE stream of chunks "
                                   "ending in `data: [DONE]`",
                    "content": {"application/json": {"schema": {"type": "object"}},
                                "text/event-stream": {"schema": {"type": "string"}}}}}


def document_generate_routes(app: FastAPI) -> None:
    """Declare the raw-ASGI generate endpoints on ``app`` (for the document only)."""

    async def _never() -> None:  # pragma: no cover - the router serves these paths itself
        raise RuntimeError("served by router.proxy.GenerateHandler")

    async def completions(body: CompletionRequest) -> None:
        await _never()

    async def chat_completions(body: ChatCompletionRequest) -> None:
        await _never()

    async def responses(body: ResponsesRequest) -> None:
        await _never()

    for path, fn, summary in (("/v1/completions", completions, "Create a completion"),
                              ("/v1/chat/completions", chat_completions,
                               "Create a chat completion"),
                              ("/v1/responses", responses, "Create a response (OpenAI's Responses API)")):
        app.add_api_route(path, fn, methods=["POST"], summary=summary,
                          responses={**_GENERATED, **error_responses(*ERROR_STATUSES)})
