"""Building an engine `Request`: every check that can be made before it is queued, and the replay of resumed
output (``resume_token_ids``, the router's request migration: NVIDIA Dynamo's idea, made exact here by replaying
the grammar and the seeded draws)."""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import TYPE_CHECKING

from pd_cluster.engine.errors import (ContextLengthExceeded, EngineOverloaded, PoolCapacityExceeded, RequestRejected,
                                     SamplingParamError)
from pd_cluster.engine.request import Request
from pd_cluster.engine.sampling.params import SamplingParams

if TYPE_CHECKING:
    from pd_cluster.engine.llm_engine import LLMEngine


def make_request(engine: "LLMEngine", request_id: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 remote_kv: bool, resumed: list[int]) -> Request:
    """A new `Request` of `engine`, checked against everything that can be known before it is queued.

    Args:
        resumed: output tokens an earlier attempt generated (``resume_token_ids``): they count as output and
            are replayed (`replay_resumed`).

    Raises:
        RequestRejected: an id in use, an empty or out-of-vocabulary prompt, invalid parameters, resumed tokens
            that leave nothing to generate or that the grammar refuses.
        ContextLengthExceeded: prompt plus ``max_tokens`` beyond the context length.
        PoolCapacityExceeded: more than the whole KV pool.
        EngineOverloaded: the admission queue is full.
    """
    request_id = request_id or uuid.uuid4().hex
    if request_id in engine.requests:
        raise RequestRejected(f"request id {request_id!r} is already in use", param="request_id")
    n = len(prompt_token_ids)
    if n == 0:
        raise RequestRejected("prompt: must contain at least one token", param="prompt")
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= engine.arch.vocab_size:
        raise RequestRejected(f"prompt: token ids must be in [0, {engine.arch.vocab_size})", param="prompt")
    if params.n != 1:
        raise RequestRejected("n: the engine generates one sequence per request; the server fans n out",
                              param="n")
    try:
        params.check_vocab(engine.arch.vocab_size)
    except SamplingParamError as e:
        raise RequestRejected(str(e), param=e.param) from e
    k = len(resumed)
    if k and (min(resumed) < 0 or max(resumed) >= engine.arch.vocab_size):
        raise RequestRejected(f"resume_token_ids: token ids must be in [0, {engine.arch.vocab_size})",
                              param="resume_token_ids")
    if engine.role == "prefill":  # it samples the one token after the prompt and the resumed output
        params = replace(params, max_tokens=k + 1, min_tokens=min(params.min_tokens, k + 1))
    elif params.max_tokens is None:
        params = replace(params, max_tokens=max(engine.context_length - n, k + 1))
    if k >= params.max_tokens:
        raise RequestRejected(f"resume_token_ids: {k} tokens were already generated, but max_tokens is "
                              f"{params.max_tokens}: nothing is left to generate", param="resume_token_ids")
    total = n + params.max_tokens
    if total > engine.context_length:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {engine.context_length} tokens. However, you requested "
            f"{total} tokens ({n} in the prompt, {params.max_tokens} in the completion). Please reduce the "
            f"length of the prompt or the completion.")
    capacity = engine.pool.max_total_num_tokens
    if total > capacity:
        raise PoolCapacityExceeded(
            f"The request needs up to {total} tokens of KV cache ({n} prompt + {params.max_tokens} completion) "
            f"but the whole KV pool holds {capacity} tokens ({engine.pool.num_pages} pages of "
            f"{engine.layout.page_size}); raise --kv-cache-memory / --mem-fraction-static or shorten it.")
    if len(engine.scheduler.waiting) >= engine.config.scheduler.max_queued_requests:
        raise EngineOverloaded(f"the admission queue is full ({len(engine.scheduler.waiting)} requests waiting)")
    req = Request(request_id, prompt_token_ids, params, engine.eos_token_ids, remote_kv=remote_kv,
                  resumed_output_ids=resumed)
    req.generator = engine.runner.sampler.new_request_generator(params.seed)
    if params.structured_output is not None:
        try:
            req.grammar = engine.grammars.new_request_grammar(params.structured_output)
        except SamplingParamError as e:
            raise RequestRejected(str(e), param=e.param) from e
    replay_resumed(engine, req, resumed)
    return req


def replay_resumed(engine: "LLMEngine", req: Request, resumed: list[int]) -> None:
    """Bring a resumed request's per-token state to where generating `resumed` left it: the grammar
    matcher accepts each token and the seeded generator makes each token's draw, so the continuation
    samples as the interrupted run would have (the idea of Dynamo's request migration, made exact).

    Raises:
        RequestRejected: a resumed token ended the output (EOS, a stop id) or the request's grammar refuses
            it, or the grammar is complete after them.
    """
    p = req.params
    for i, token in enumerate(resumed):
        if i + 1 >= p.min_tokens and (token in p.stop_token_ids or (token in req.eos_token_ids
                                                                     and not p.ignore_eos)):
            raise RequestRejected(f"resume_token_ids[{i}]: token {token} already ended the output",
                                  param="resume_token_ids")
        if req.grammar is not None and not req.grammar.accept(token):
            raise RequestRejected(f"resume_token_ids[{i}]: token {token} is not allowed by the request's "
                                  f"{req.grammar.spec.kind} constraint", param="resume_token_ids")
        engine.runner.sampler.skip(req.params, req.generator)
    if req.grammar is not None and req.grammar.is_terminated:
        raise RequestRejected("resume_token_ids: the output already completes the request's "
                              f"{req.grammar.spec.kind} constraint", param="resume_token_ids")
