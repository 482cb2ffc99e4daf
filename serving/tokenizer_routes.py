"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` on decode and mixed workers.

``/tokenize`` takes ``{"prompt": str}`` or chat ``{"messages": [...]}`` (rendered with the chat
template) and answers ``{"count", "max_model_len", "tokens", "token_strs"}``; ``/detokenize`` takes
``{"tokens": [int]}`` and answers ``{"prompt": str}``. Both run in the tokenizer thread and refuse
texts that cannot fit the context before tokenizing them, like the completion endpoints.

``GET /tokenizer_info`` answers vLLM's shape: the tokenizer's configuration (its ``init_kwargs``, special
tokens as their strings, file paths left out), ``tokenizer_class`` and the ``chat_template``. lm-eval's
``tokenizer_backend=remote`` reads it (``eos_token``, ``bos_token``, ``chat_template``) and then tokenizes
through ``/tokenize``.

``GET /kv_text_map`` (worker-internal) serves the text-to-page map the tokenizer publishes
(``engine/kv/text_map.py``), for the router's ``cache_aware`` policy.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pd_cluster.serving.body import parse_json_object, read_body
from pd_cluster.serving.errors import HTTPError, error_response, to_http_error
from pd_cluster.serving.protocol import DetokenizeRequest, TokenizeRequest
from pd_cluster.serving.validation import validate_body


class TokenizerRoutes:
    """Handlers over an `OpenAIServing`'s tokenizer (`Tokenization`)."""

    def __init__(self, serving: Any) -> None:
        self.serving = serving
        self.tok = serving.tok

    async def tokenize(self, request: Request) -> Response:
        return await self._handle(request, self._tokenize)

    async def detokenize(self, request: Request) -> Response:
        return await self._handle(request, self._detokenize)

    async def tokenizer_info(self, request: Request) -> Response:
        return JSONResponse(tokenizer_info(self.tok.tokenizer))

    async def kv_text_map(self, request: Request) -> Response:
        """``GET /kv_text_map?since=N&limit=M``: the text-to-page map entries after ``since``
        (`engine.kv.text_map.TextMapLog.read`; the router polls it with the internal key)."""
        try:
            since, limit = _param(request, "since"), _param(request, "limit")
            if limit is not None and limit < 1:
                raise HTTPError(400, "limit: must be >= 1", "limit", "invalid_value")
            return JSONResponse(self.tok.text_map.read(since, 4096 if limit is None else limit))
        except HTTPError as e:
            return error_response(e)

    async def _handle(self, request: Request, fn) -> Response:
        try:
            raw = await read_body(request)
            return JSONResponse(await self.tok.run(fn, raw))
        except Exception as e:  # noqa: BLE001 - every failure becomes an OpenAI error body
            return error_response(to_http_error(e))

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.serving.model_name:
            raise HTTPError(404, f"The model `{model}` does not exist.", "model", "model_not_found")

    def _tokenize(self, raw: bytes) -> dict[str, Any]:
        body = validate_body(TokenizeRequest, parse_json_object(raw))
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise HTTPError(400, "give exactly one of `prompt` and `messages`", "prompt", "invalid_value")
        if body.prompt is not None:
            self.tok.check_fits([body.prompt], "prompt")
            ids = self.tok.encode(body.prompt, True if body.add_special_tokens is None else body.add_special_tokens)
        else:
            conversation = [{"role": m.role, "content": m.text(i)} for i, m in enumerate(body.messages)]
            self.tok.check_fits([m["content"] for m in conversation], "messages")
            ids = self.tok.chat_ids(conversation, body.add_generation_prompt)
            bos = self.tok.tokenizer.bos_token_id
            if body.add_special_tokens and bos is not None:
                ids = [bos] + ids
        strs = self.tok.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.tok.context_length, "tokens": ids, "token_strs": strs}

    def _detokenize(self, raw: bytes) -> dict[str, Any]:
        body = validate_body(DetokenizeRequest, parse_json_object(raw))
        self._check_model(body.model)
        vocab = len(self.tok.tokenizer)
        bad = next((i for i, t in enumerate(body.tokens) if t >= vocab), None)
        if bad is not None:
            raise HTTPError(400, f"tokens[{bad}]: {body.tokens[bad]} is not a token id (the vocabulary has {vocab})",
                            f"tokens[{bad}]", "invalid_value")
        return {"prompt": self.tok.decode(body.tokens)}


def _param(request: Request, name: str) -> int | None:
    raw = request.query_params.get(name)
    if raw is None:
        return None
    if not raw.isdigit() or len(raw) > 18:
        raise HTTPError(400, f"{name}: must be a non-negative integer", name, "invalid_value")
    return int(raw)


_PATH_KEYS = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path", "is_local", "local_files_only")


def tokenizer_info(tokenizer: Any) -> dict[str, Any]:
    """vLLM's ``/tokenizer_info`` body for an HF tokenizer (module doc)."""
    config = {k: v for k, v in dict(getattr(tokenizer, "init_kwargs", None) or {}).items() if k not in _PATH_KEYS}
    config = _jsonable(config)
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = getattr(tokenizer, name, None)
        if config.get(name) is None and value is not None:
            config[name] = str(value)
    config["tokenizer_class"] = type(tokenizer).__name__
    if getattr(tokenizer, "chat_template", None):
        config["chat_template"] = tokenizer.chat_template
    return config


def _jsonable(obj: Any) -> Any:
    """Special tokens (``AddedToken``) as their text; maps and lists walked; anything else JSON lacks as a string."""
    if hasattr(obj, "content"):
        return obj.content
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    return str(obj)
