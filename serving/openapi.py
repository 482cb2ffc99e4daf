"""The OpenAPI 3.1 document of a worker (``GET /openapi.json``), precise enough to fuzz against.

Request bodies are the `protocol` models themselves (the same pydantic models that validate requests),
response bodies the models below; every error is OpenAI's error object. The handlers read raw requests
(to parse bodies safely, see `body.py`), so the document is assembled here rather than by FastAPI.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any, Literal

from pydantic import BaseModel, Field
from pydantic.json_schema import models_json_schema

from pd_cluster.serving.fields import HARMLESS_FIELDS, REFUSED_FIELDS
from pd_cluster.serving.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body, for every 4xx and 5xx."""

    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"]
    content: str | None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(BaseModel):
    prompt: str


class Health(BaseModel):
    status: str
    reason: str | None = None


class Version(BaseModel):
    version: str


class Load(BaseModel):
    """``/get_load`` (see docs/worker-api.md; role-specific queue depths are added)."""

    role: str
    num_running_reqs: int = Field(ge=0)
    num_queue_reqs: int = Field(ge=0)


_MODELS = [ErrorResponse, CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest,
           CompletionResponse, ChatCompletionResponse, ModelList, TokenizeResponse, DetokenizeResponse, Health,
           Version, Load]


def _ref(model: type[BaseModel]) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _json(model: type[BaseModel] | None, description: str) -> dict[str, Any]:
    schema = _ref(model) if model is not None else {"type": "object"}
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_ERROR = _json(ErrorResponse, "an error in OpenAI's format")


def _op(summary: str, ok: dict[str, Any], body: type[BaseModel] | None = None,
        extra: dict[str, Any] | None = None) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": {"200": ok, **(extra or {}), "default": _ERROR}}
    if body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(body)}}}
    return op


def _generation(summary: str, request: type[BaseModel], response: type[BaseModel]) -> dict[str, Any]:
    ok = _json(response, "the completion; with `stream: true`, server-sent events ending in `data: [DONE]`")
    ok["content"]["text/event-stream"] = {"schema": {  # one server-sent event
        "type": "object", "required": ["data"],
        "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}}}}
    return _op(summary, ok, request)


_PATHS: dict[str, dict[str, Any]] = {
    "/v1/completions": {"post": _generation("Create a completion", CompletionRequest, CompletionResponse)},
    "/v1/chat/completions": {"post": _generation("Create a chat completion", ChatCompletionRequest,
                                                 ChatCompletionResponse)},
    "/v1/responses": {"post": {
        "summary": "Create a response (OpenAI's Responses API, served by the chat path; nothing is stored)",
        "requestBody": {"required": True, "content": {"application/json": {"schema": {
            "type": "object", "required": ["input"],
            "properties": {"input": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
                           "instructions": {"type": "string"}, "model": {"type": "string"},
                           "stream": {"type": "boolean"}}}}}},
        "responses": {"200": {"description": "a response object; with `stream: true`, server-sent events "
                                             "(response.created ... response.completed)",
                              "content": {"application/json": {"schema": {"type": "object"}},
                                          "text/event-stream": {"schema": {"type": "object"}}}},
                      "default": _ERROR}}},
    "/v1/models": {"get": _op("The served model", _json(ModelList, "the model list"))},
    "/tokenize": {"post": _op("Tokenize a prompt or chat messages (vLLM)", _json(TokenizeResponse, "the tokens"),
                              TokenizeRequest)},
    "/detokenize": {"post": _op("Detokenize token ids (vLLM)", _json(DetokenizeResponse, "the text"),
                                DetokenizeRequest)},
    "/tokenizer_info": {"get": _op("The tokenizer's configuration and chat template (vLLM)",
                                   _json(None, "tokenizer_class, special tokens, chat_template, ..."))},
    "/health": {"get": _op("Liveness", _json(Health, "serving"), extra={"503": _json(Health, "starting, "
                                                                                       "draining or dead")})},
    "/get_load": {"get": _op("Load numbers for the router", _json(Load, "the load"))},
    "/server_info": {"get": _op("Static facts about the worker", _json(None, "role, model, KV layout"))},
    "/expert_distribution": {"get": _op("EPLB: each MoE layer's expert load since start and its placement, and the "
                                        "rebalances so far (under DP attention this rank's tokens)",
                                        _json(None, "enabled (false without --ep-num-redundant-experts or "
                                                    "--enable-eplb), iterations, rebalances, experts_moved, "
                                                    "layers"))},
    "/metrics": {"get": _op("Prometheus metrics", {"description": "Prometheus text format",
                                                    "content": {"text/plain": {"schema": {"type": "string"}}}})},
    "/version": {"get": _op("pd-cluster's version", _json(Version, "the version"))},
    "/openapi.json": {"get": _op("This document", _json(None, "OpenAPI 3.1"))},
    "/prefill": {"post": _op("Prefill a prompt and push its KV (called by decode workers)",
                             _json(None, "the first token and timings"), extra={"409": _ERROR})},
    "/kv_events": {"get": dict(_op("KV cache events after `since`, or a snapshot (called by the router; "
                                   "docs/router.md)", _json(None, "an event batch")),
                               parameters=[{"name": n, "in": "query", "required": False,
                                            "schema": {"type": "integer", "minimum": m, "maximum": 10 ** 18 - 1}}
                                           for n, m in (("since", 0), ("limit", 1))]
                               + [{"name": "token_ids", "in": "query", "required": False,
                                   "schema": {"type": "string", "enum": ["true", "false"]},
                                   "description": "false: stored pages without their token ids"},
                                  {"name": "hashes", "in": "query", "required": False,
                                   "schema": {"type": "string", "enum": ["list", "packed"]},
                                   "description": "packed: block_hashes as base64 of little-endian u64"}])},
    "/kv_text_map": {"get": dict(_op("Text-to-page map entries after `since` (called by the router; "
                                     "docs/router.md)", _json(None, "entries, base64")),
                                 parameters=[{"name": n, "in": "query", "required": False,
                                              "schema": {"type": "integer", "minimum": m,
                                                         "maximum": 10 ** 18 - 1}}
                                             for n, m in (("since", 0), ("limit", 1))])},
    "/abort": {"post": _op("Abort a prefill job (called by decode workers)", _json(None, "aborted"))},
    "/kv_transfer/connect": {"post": _op("Handshake with the worker the body names (called by decode workers "
                                         "before they report ready)", _json(None, "the agent met"))},
}


def package_version() -> str:
    """pd-cluster's version (its installed distribution's, else the source tree's), for ``/version`` and the
    document's ``info.version``."""
    try:
        return importlib.metadata.version("pd-cluster")
    except importlib.metadata.PackageNotFoundError:
        return "0.1.0+source"


def worker_openapi(role: str, paths: list[str]) -> dict[str, Any]:
    """The OpenAPI document of a worker of `role` serving `paths` (those this module describes)."""
    _, schemas = models_json_schema([(m, "validation") for m in _MODELS],
                                    ref_template="#/components/schemas/{model}")
    defs = schemas.get("$defs", {})
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        _close_request_schema(defs[name])
    return {
        "openapi": "3.1.0",
        "info": {"title": f"pd-cluster {role} worker", "version": package_version(),
                 "description": "OpenAI-compatible API of a pd-cluster worker; see docs/worker-api.md."},
        "paths": {p: _PATHS[p] for p in paths if p in _PATHS} | {"/openapi.json": _PATHS["/openapi.json"]},
        "components": {"schemas": defs},
    }


def _close_request_schema(schema: dict[str, Any]) -> None:
    """Unknown fields are refused (`fields.py`): list the metadata accepted and the fields refused unless
    no-op, and allow nothing else."""
    props = schema.setdefault("properties", {})
    for name in HARMLESS_FIELDS:
        props.setdefault(name, {"description": "metadata: accepted and ignored"})
    for name in REFUSED_FIELDS:
        props.setdefault(name, {"description": "not supported: refused with a 400 unless it has its no-op value"})
    schema["additionalProperties"] = False
