"""The OpenAI API of a decode or mixed worker: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

Handlers read the body, then parse, validate and tokenize it (chat: the
tokenizer's chat template) in the tokenizer thread (`tokenization.py`), after a
length bound that refuses prompts too long to fit before tokenizing them; then
they hand the prompt to a `PromptSource`: local prefill (mixed) or a remote
prefill worker (decode). Response headers are sent only once the first token exists, so a
failure before it is an HTTP error status the router can retry (502/503/504).
A client that disconnects aborts the request. The response itself (an SSE
stream or one JSON body) is `delivery.py`'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from abc import ABC, abstractmethod
from typing import Any, NamedTuple

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pd_cluster.common.aio import mark_retrieved
from pd_cluster.engine.kv.text_map import TextMapLog
from pd_cluster.engine.model.generation_config import GenerationDefaults
from pd_cluster.engine.sampling.params import SamplingParams
from pd_cluster.serving.body import parse_json_object, read_body
from pd_cluster.serving.choices import (  # until_disconnect: also for the prefill role's handler
    ChoiceRun,
    choice_params,
    raise_error,
    request_error,
    until_disconnect,
)
from pd_cluster.serving.delivery import ChoiceDelivery
from pd_cluster.serving.errors import HTTPError, error_response, to_http_error
from pd_cluster.serving.metrics import RequestTiming, WorkerMetrics
from pd_cluster.serving.prompt_logprobs import PromptEcho
from pd_cluster.serving.protocol import NO_DEFAULTS, ChatCompletionRequest, CompletionRequest
from pd_cluster.serving.resume import NOTHING, Resumed, prepare_resumed_choices
from pd_cluster.serving.responses import ResponseBuilder
from pd_cluster.serving.token_text import TokenTexts
from pd_cluster.serving.tokenization import Tokenization
from pd_cluster.serving.tools.chat import ChatTools, ToolSettings, chat_tools
from pd_cluster.serving.validation import validate_body

logger = logging.getLogger("pd.serving")


class PromptSource(ABC):
    """Gets a request's prompt KV into the pool and starts its generation."""

    @abstractmethod
    async def start(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    headers: dict[str, str], resumed: list[int] | None = None) -> asyncio.Queue:
        """Start the request; return the queue of its deltas.

        `resumed`: output tokens already generated and delivered (``resume_token_ids``): generation continues
        after them (`LLMEngine.add_request`).

        Raises:
            HTTPError: the request cannot start (400, 502, 503, 504).
        """

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Abort the request wherever it is (idempotent, non-blocking)."""


class Prepared(NamedTuple):
    """A validated, tokenized request (`tools`: chat only; `prompts`: completions, one `PromptEcho` per prompt,
    several when ``prompt`` is a list; chat: the one prompt)."""

    body: Any
    prompts: list[PromptEcho]
    params: SamplingParams
    tools: ChatTools | None = None
    resumed: list[Resumed | None] = []  # ``resume_token_ids`` per choice (None: finished before); []: none


# One choice's run: its `ChoiceRun`, sampling, prompt ids and the output ids it resumes
Run = tuple[ChoiceRun, SamplingParams, list[int], list[int]]


class OpenAIServing(ChoiceDelivery):
    """Request handlers shared by the decode and mixed workers (their responses: `ChoiceDelivery`).

    Args:
        source: where prompts are prefilled.
        tokenizer: the model's tokenizer.
        model_name: the served model name.
        context_length: the engine's context length (tokens): ``/v1/models`` and the length checks.
        metrics: the worker's metrics.
        tool_settings: the worker's ``--tool-call-parser`` and ``--enable-auto-tool-choice``.
        generation: the engine's generation config (``--generation-config``): the defaults of the sampling
            fields and ``max_tokens`` that a request does not set.
        page_size: the KV page size: the worker publishes its text-to-page map (``GET /kv_text_map``,
            `serving.text_map`); None: no map.
    """

    def __init__(self, source: PromptSource, tokenizer: Any, model_name: str, context_length: int,
                 metrics: WorkerMetrics, tool_settings: ToolSettings | None = None,
                 generation: GenerationDefaults = NO_DEFAULTS, page_size: int | None = None) -> None:
        self.source = source
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.context_length = context_length
        self.metrics = metrics
        self.tok = Tokenization(tokenizer, context_length, TextMapLog(page_size) if page_size else None)
        self.tool_settings = tool_settings or ToolSettings()
        self.generation = generation

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
        arrival = time.monotonic()
        try:
            prep = await self._parse(request, kind)
            body = prep.body
            runs = self.make_runs(prep, kind, request_id)
            await self.start_runs(request, prep, runs)
        except asyncio.CancelledError:  # the client went away before the first token (already aborted)
            logger.debug("request %s: client disconnected before the first token", request_id)
            return Response(status_code=499)
        except Exception as e:  # noqa: BLE001 - every failure becomes an OpenAI error body
            err = to_http_error(e)
            if err.status >= 500:
                logger.warning("request %s failed before the first token: %s %s", request_id, err.status, err.message)
            return error_response(err, request_id)
        headers = {"X-Request-Id": request_id}
        choices = [r for r, _, _, _ in runs]
        timings = [RequestTiming(self.metrics, arrival, p.max_tokens, prep.prompts[r.prompt].drop_output)
                   for r, p, _, _ in runs]
        if body.stream:
            gen = self._stream(choices, body.include_usage, timings)
            return StreamingResponse(gen, media_type="text/event-stream", headers=headers)
        return await self._collect(request, choices, body.num_choices, timings, headers)

    async def _parse(self, request: Request, kind: str) -> "Prepared":
        """Read, validate and tokenize the body; everything but reading runs in the tokenizer thread."""
        raw = await read_body(request)
        return await self.tok.run(self._prepare, raw, kind)

    def _prepare(self, raw: bytes, kind: str) -> "Prepared":
        return self.prepare_data(parse_json_object(raw), kind)

    def make_runs(self, prep: Prepared, kind: str, request_id: str) -> list[Run]:
        """One run per choice of every prompt that is not finished yet: its engine id, its `ResponseBuilder`, its
        sampling, prompt ids and the output ids it resumes (`Prepared.resumed`, one per choice)."""
        body = prep.body
        n, count = body.num_choices, body.num_generated
        runs = []
        for p_i, prompt in enumerate(prep.prompts):
            prompt_ids = prompt.token_ids
            want_prompt = prompt.echo or prompt.prompt_top is not None or prompt.drop_output
            for j, params in enumerate(choice_params(prep.params, count, keep_logprobs=count == n)):
                resumed = prep.resumed[p_i * n + j] if prep.resumed else NOTHING
                if resumed is None:  # this choice finished in an earlier attempt of the stream
                    continue
                texts = resumed.texts or TokenTexts(self.tokenizer, prompt_ids, params.skip_special_tokens)
                builder = ResponseBuilder(kind, request_id, self.model_name, texts,
                                          want_logprobs=prep.params.logprobs is not None,
                                          prompt_token_ids=prompt_ids if body.return_token_ids else None,
                                          index=p_i * n + j, tools=prep.tools,
                                          prompt=prompt if want_prompt else None)
                builder.resume(resumed.text)
                # The engine's id is unique per attempt: a router retry of the same request may reach this
                # worker while the failed attempt still holds its pages (waiting for the sender to stop
                # writing into them).
                runs.append((ChoiceRun(f"{request_id}.{uuid.uuid4().hex[:8]}", builder, prompt=p_i), params,
                             prompt_ids, resumed.token_ids))
        return runs

    async def start_runs(self, request: Request, prep: Prepared, runs: list[Run]) -> None:
        """Start every run and wait for each one's first delta (`_start_all`)."""
        # max_tokens 0 with echo: a mixed worker's engine samples a token no client gets; it is not counted
        # as generated (a decode worker's first token is sampled, and counted, by its prefill worker)
        drops = sum(prep.prompts[r.prompt].drop_output for r, _, _, _ in runs) if self.metrics.role == "mixed" else 0
        self.metrics.dropped_tokens += drops
        try:
            await self._start_all(request, runs)
        except BaseException:
            self.metrics.dropped_tokens -= drops
            raise

    def prepare_data(self, data: dict[str, Any], kind: str) -> Prepared:
        """Validate and tokenize a parsed body (in the tokenizer thread)."""
        model = CompletionRequest if kind == "completion" else ChatCompletionRequest
        body = validate_body(model, data)
        if body.model is not None and body.model != self.model_name:
            raise HTTPError(404, f"The model `{body.model}` does not exist.", "model", "model_not_found")
        kwargs = body.sampling_kwargs(self.generation)
        tools = None
        if kind == "completion":
            prompts = body.prompts()
            echoes = []
            for i, prompt in enumerate(prompts):
                if isinstance(prompt, str):
                    self.tok.check_fits([prompt], _prompt_param(prompts, i))
                one = data if len(prompts) == 1 else None  # the map covers a single prompt
                if isinstance(prompt, str):
                    ids = self.tok.encode(prompt, body.add_special_tokens, one)
                else:
                    ids = self.tok.prompt_ids(prompt, one) if one is not None else prompt
                text = prompt if isinstance(prompt, str) else (
                    self.tokenizer.decode(ids, skip_special_tokens=body.skip_special_tokens) if body.echo else "")
                echoes.append(PromptEcho(text, ids, bool(body.echo), body.logprobs, body.prompt_logprobs,
                                         body.echo_only))
            longest = max(len(e.token_ids) for e in echoes)  # one max_tokens for every prompt of the request
            kwargs["max_tokens"] = self.generation.resolve_max_tokens(kwargs["max_tokens"],
                                                                      self.context_length - longest)
            for i, echo in enumerate(echoes):  # each prompt must fit on its own
                self._check_length(len(echo.token_ids), kwargs["max_tokens"], _prompt_param(prompts, i),
                                   body.max_tokens_param)
            params = SamplingParams(**kwargs)
            resumed = prepare_resumed_choices(self.tokenizer, [e.token_ids for e in echoes], params,
                                              body.resumed_output(), body.num_choices, self.context_length)
            return Prepared(body, echoes, params, None, resumed)
        else:
            conversation, param = body.conversation(), "messages"
            tools = chat_tools(body.tools, body.tool_choice, body.parallel_tool_calls, self.tool_settings,
                               kwargs["structured_output"])
            if tools.structured_output is not None:
                kwargs["structured_output"] = tools.structured_output
            self.tok.check_fits([m["content"] for m in conversation], param)
            prompt_ids = self.tok.chat_ids(conversation, body.add_generation_prompt, tools.template_tools,
                                           body.add_special_tokens, data)
        kwargs["max_tokens"] = self.generation.resolve_max_tokens(kwargs["max_tokens"],
                                                                  self.context_length - len(prompt_ids))
        self._check_length(len(prompt_ids), kwargs["max_tokens"], param, body.max_tokens_param)
        params = SamplingParams(**kwargs)
        resumed = prepare_resumed_choices(self.tokenizer, [prompt_ids], params, body.resumed_output(),
                                          body.num_choices, self.context_length)
        return Prepared(body, [PromptEcho("", prompt_ids, prompt_top=body.prompt_logprobs)], params, tools, resumed)

    def _check_length(self, n: int, max_tokens: int | None, param: str, max_tokens_param: str) -> None:
        """Blame the prompt when it leaves no room for one token, else the output budget."""
        ctx = self.context_length
        if n >= ctx:
            raise HTTPError(400, f"This model's maximum context length is {ctx} tokens. However, your {param} "
                                 f"has {n} tokens, which leaves no room for the completion. Please reduce the "
                                 f"length of the {param}.", param, "context_length_exceeded")
        if max_tokens is not None and n + max_tokens > ctx:
            raise HTTPError(400, f"This model's maximum context length is {ctx} tokens. However, you requested "
                                 f"{n + max_tokens} tokens ({n} in the {param}, {max_tokens} in the completion). "
                                 f"Please reduce the length of the {param} or the completion.",
                            max_tokens_param, "context_length_exceeded")

    async def _start_all(self, request: Request, runs: list[Run]) -> None:
        """Start every choice (of every prompt; each with the output it resumes) and wait for each one's first
        delta; on any failure abort them all."""
        tasks = [asyncio.ensure_future(self._start(request, r.engine_id, ids, p, resumed))
                 for r, p, ids, resumed in runs]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            for r, _, _, _ in runs:
                self.source.abort(r.engine_id)
            raise
        for (r, _, _, _), (stream, first) in zip(runs, results):
            r.stream, r.first = stream, first

    async def _start(self, request: Request, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     resumed: list[int]):
        """Start the request and wait for its first delta, aborting if the client goes away."""
        started = asyncio.ensure_future(self.source.start(request_id, prompt_ids, params, dict(request.headers),
                                                          resumed))
        try:
            stream = await until_disconnect(request, started)
            first = raise_error(await until_disconnect(request, asyncio.ensure_future(stream.get())))
        except BaseException:
            started.add_done_callback(mark_retrieved)  # cancelled here: it may still fail, with nobody waiting
            self.source.abort(request_id)
            raise
        if first.finished and first.finish_reason == "abort" and not first.new_token_ids:
            raise HTTPError(503, "the request was aborted before its first token", None, "aborted")
        if (err := request_error(first)) is not None and not first.new_token_ids:
            raise err
        if params.prompt_logprobs is not None and first.prompt_logprobs is None:
            self.source.abort(request_id)  # e.g. a prefill worker of an older version, which does not send them
            raise HTTPError(502, "the prompt logprobs did not come with the first token (is the prefill worker of "
                                 "an older version?)", None, "prompt_logprobs_unavailable")
        return stream, first


def _prompt_param(prompts: list, i: int) -> str:
    """The body path of prompt `i`: ``prompt``, or ``prompt[i]`` among several."""
    return "prompt" if len(prompts) == 1 else f"prompt[{i}]"


def serving_routes(serving: "OpenAIServing") -> list:
    """The OpenAI routes of a worker, as (path, handler, methods) for `create_worker_app`: completions, chat,
    responses (`openai_responses.py`), models, vLLM's ``/tokenize``, ``/detokenize`` and ``/tokenizer_info``, and
    the text-to-page map (``/kv_text_map``)."""
    from pd_cluster.serving.openai_responses import ResponsesServing
    from pd_cluster.serving.tokenizer_routes import TokenizerRoutes

    tok = TokenizerRoutes(serving)
    routes = [("/v1/completions", serving.completions, ["POST"]),
              ("/v1/chat/completions", serving.chat_completions, ["POST"]),
              ("/v1/responses", ResponsesServing(serving).create, ["POST"]),
              ("/v1/models", serving.models, ["GET"]),
              ("/tokenize", tok.tokenize, ["POST"]),
              ("/detokenize", tok.detokenize, ["POST"]),
              ("/tokenizer_info", tok.tokenizer_info, ["GET"])]
    if serving.tok.text_map is not None:
        routes.append(("/kv_text_map", tok.kv_text_map, ["GET"]))
    return routes
