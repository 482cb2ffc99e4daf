"""The OpenAI API of a decode or mixed worker: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

Handlers validate, tokenize (chat: the tokenizer's chat template), then hand
the prompt to a `PromptSource`: local prefill (mixed) or a remote prefill worker
(decode). Response headers are sent only once the first token exists, so a
failure before it is an HTTP error status the router can retry (502/503/504).
A client that disconnects aborts the request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pd_cluster.engine.outputs import RequestDelta
from pd_cluster.engine.sampling.params import SamplingParams
from pd_cluster.serving.errors import HTTPError, to_http_error
from pd_cluster.serving.metrics import WorkerMetrics
from pd_cluster.serving.protocol import ChatCompletionRequest, CompletionRequest
from pd_cluster.serving.responses import SSE_DONE, ResponseBuilder

logger = logging.getLogger("pd.serving")

DISCONNECT_POLL_S = 0.1


class PromptSource(ABC):
    """Gets a request's prompt KV into the pool and starts its generation."""

    @abstractmethod
    async def start(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    headers: dict[str, str]) -> asyncio.Queue:
        """Start the request; return the queue of its deltas.

        Raises:
            HTTPError: the request cannot start (400, 502, 503, 504).
        """

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Abort the request wherever it is (idempotent, non-blocking)."""


class OpenAIServing:
    """Request handlers shared by the decode and mixed workers.

    Args:
        source: where prompts are prefilled.
        tokenizer: the model's tokenizer.
        model_name: the served model name.
        context_length: for ``/v1/models``.
        metrics: the worker's metrics.
    """

    def __init__(self, source: PromptSource, tokenizer: Any, model_name: str, context_length: int,
                 metrics: WorkerMetrics) -> None:
        self.source = source
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.context_length = context_length
        self.metrics = metrics

    # ---- routes ------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": 0, "owned_by": "pd-cluster",
            "root": self.model_name, "max_model_len": self.context_length}]})

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, "chat")

    # ---- the request path ------------------------------------------------------------
    async def _serve(self, request: Request, kind: str) -> Response:
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        # The engine's id is unique per attempt: a router retry of the same request may reach this worker while
        # the failed attempt still holds its pages (waiting for the sender to stop writing into them).
        engine_id = f"{request_id}.{uuid.uuid4().hex[:8]}"
        arrival = time.monotonic()
        try:
            body, prompt_ids, params = await self._parse(request, kind)
            builder = ResponseBuilder(kind, request_id, self.model_name, self.tokenizer,
                                      want_logprobs=params.logprobs is not None)
            stream, first = await self._start(request, engine_id, prompt_ids, params)
        except Exception as e:  # noqa: BLE001 - every failure becomes an OpenAI error body
            err = to_http_error(e)
            if err.status >= 500:
                logger.warning("request %s failed before the first token: %s %s", request_id, err.status, err.message)
            return JSONResponse(err.body(), status_code=err.status, headers={"X-Request-Id": request_id, **err.headers})
        headers = {"X-Request-Id": request_id}
        timing = _Timing(self.metrics, arrival)
        if body.stream:
            gen = self._stream(engine_id, builder, stream, first, body.include_usage, timing)
            return StreamingResponse(gen, media_type="text/event-stream", headers=headers)
        return await self._collect(request, engine_id, builder, stream, first, timing, headers)

    async def _parse(self, request: Request, kind: str):
        raw = await request.body()
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise HTTPError(400, f"malformed JSON body: {e}", None, "invalid_json") from e
        if not isinstance(data, dict):
            raise HTTPError(400, "the request body must be a JSON object", None, "invalid_json")
        try:
            body = (CompletionRequest if kind == "completion" else ChatCompletionRequest).model_validate(data)
        except ValidationError as e:
            first = e.errors()[0]
            param = ".".join(str(x) for x in first.get("loc", ())) or None
            raise HTTPError(400, f"{param}: {first.get('msg')}", param, "invalid_value") from e
        if body.model is not None and body.model != self.model_name:
            raise HTTPError(404, f"The model `{body.model}` does not exist.", "model", "model_not_found")
        if kind == "completion":
            prompt = body.single_prompt()
            prompt_ids = self.tokenizer(prompt).input_ids if isinstance(prompt, str) else prompt
        else:
            text = self.tokenizer.apply_chat_template(body.conversation(), tokenize=False, add_generation_prompt=True)
            prompt_ids = self.tokenizer(text, add_special_tokens=False).input_ids
        params = SamplingParams(**body.sampling_kwargs())
        return body, prompt_ids, params

    async def _start(self, request: Request, request_id: str, prompt_ids: list[int], params: SamplingParams):
        """Start the request and wait for its first delta, aborting if the client goes away."""
        started = asyncio.ensure_future(self.source.start(request_id, prompt_ids, params, dict(request.headers)))
        try:
            stream = await until_disconnect(request, started)
            first = await until_disconnect(request, asyncio.ensure_future(stream.get()))
        except BaseException:
            self.source.abort(request_id)
            raise
        if first.finished and first.finish_reason == "abort" and not first.new_token_ids:
            raise HTTPError(503, "the request was aborted before its first token", None, "aborted")
        return stream, first

    async def _stream(self, request_id: str, builder: ResponseBuilder, stream: asyncio.Queue,
                      first: RequestDelta, include_usage: bool, timing: "_Timing") -> AsyncIterator[bytes]:
        finished = False
        try:
            d, is_first = first, True
            while True:
                timing.on_delta(d)
                builder.add(d)
                if d.new_text or d.new_token_ids or d.finished or is_first:
                    yield builder.chunk(d, is_first)
                is_first = False
                if d.finished:
                    finished = True
                    break
                d = await stream.get()
            if include_usage:
                yield builder.usage_chunk()
            yield SSE_DONE
        finally:
            if not finished:  # client went away (cancelled) or the server is stopping
                self.source.abort(request_id)
            else:
                timing.on_finish(builder.finish_reason, d)

    async def _collect(self, request: Request, request_id: str, builder: ResponseBuilder, stream: asyncio.Queue,
                       first: RequestDelta, timing: "_Timing", headers: dict[str, str]) -> Response:
        d = first
        try:
            while True:
                timing.on_delta(d)
                builder.add(d)
                if d.finished:
                    break
                d = await until_disconnect(request, asyncio.ensure_future(stream.get()))
        except BaseException:
            self.source.abort(request_id)
            raise
        timing.on_finish(builder.finish_reason, d)
        return JSONResponse(builder.full(), headers=headers)


async def until_disconnect(request: Request, task: asyncio.Future) -> Any:
    """Await `task`, cancelling it and raising `asyncio.CancelledError` if the client disconnects."""
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            raise asyncio.CancelledError("client disconnected")


class _Timing:
    """Per-request latency metrics at the worker."""

    def __init__(self, metrics: WorkerMetrics, arrival: float) -> None:
        self.m = metrics
        self.arrival = arrival
        self.last: float | None = None

    def on_delta(self, d: RequestDelta) -> None:
        if not d.new_token_ids:
            return
        now = time.monotonic()
        if self.last is None:
            self.m.ttft.observe(now - self.arrival)
        else:
            gap = (now - self.last) / len(d.new_token_ids)
            for _ in d.new_token_ids:
                self.m.itl.observe(gap)
        self.last = now

    def on_finish(self, finish_reason: str | None, d: RequestDelta) -> None:
        self.m.e2e.observe(time.monotonic() - self.arrival)
        self.m.request_success.labels(finish_reason=finish_reason or "unknown").inc()
        t = d.times
        if t is None:
            return
        # Each worker reports the phases it ran: a decode worker its page wait, the handover and decoding; the
        # prefill worker reports the prefill queue and compute of the same request.
        if t.admitted is not None:
            self.m.queue_time.observe(max(t.admitted - t.arrival, 0.0))
        if t.kv_wait_s is None and t.first_scheduled is not None and t.prefill_done is not None:  # local prefill
            self.m.prefill_time.observe(max(t.prefill_done - t.first_scheduled, 0.0))
        if t.transfer_s is not None:
            self.m.transfer_time.observe(t.transfer_s)
        if t.prefill_done is not None and t.finished is not None:
            self.m.decode_time.observe(max(t.finished - t.prefill_done, 0.0))


def serving_routes(serving: "OpenAIServing") -> list:
    """The OpenAI routes of a worker, as (path, handler, methods) for `create_worker_app`."""
    return [("/v1/completions", serving.completions, ["POST"]),
            ("/v1/chat/completions", serving.chat_completions, ["POST"]),
            ("/v1/models", serving.models, ["GET"])]
