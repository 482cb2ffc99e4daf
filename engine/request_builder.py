"""Building an engine `Request`: every check that can be made before it is queued, and the replay of resumed
output (``resume_token_ids``, the router's request migration: NVIDIA Dynamo's idea, made exact here by replaying
the grammar and the seeded draws).

The checks read a frozen `RequestLimits` that the engine builds once at start-up, not the engine itself.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from pd_cluster.engine.errors import (ContextLengthExceeded, EngineOverloaded, PoolCapacityExceeded, RequestRejected,
                                     SamplingParamError)
from pd_cluster.engine.kv.groups import KVGroups
from pd_cluster.engine.request import Request
from pd_cluster.engine.sampling.params import SamplingParams

if TYPE_CHECKING:
    from pd_cluster.engine.sampling.grammar import GrammarManager
    from pd_cluster.engine.sampling.sampler import Sampler


@dataclass(frozen=True)
class RequestLimits:
    """What every new request of one engine is checked against; fixed when the engine starts.

    Attributes:
        vocab_size: token ids must be in ``[0, vocab_size)``.
        context_length: prompt plus ``max_tokens`` must fit (tokens; ``--context-length`` or the model's).
        page_size: tokens per KV page.
        num_pages: pages in the whole KV pool (the null page excluded).
        max_queued_requests: requests that may wait for admission (``--max-queued-requests``).
        eos_token_ids: the model's EOS ids (the tokenizer's included).
        role: ``mixed``, ``prefill`` or ``decode``; a prefill engine samples one token per request.
        kv_groups: the pool's KV groups when they are hybrid (`pd_cluster.engine.kv.groups`): a request needs
            each group's most pages at once, fewer than its tokens for windowed groups; None: one page per
            ``page_size`` tokens.
        chunk: the most tokens computed per step (``--chunked-prefill-size``), for `kv_groups`.
        long_rope_from: longrope's ``original_max_position_embeddings``: a request of more tokens rotates by the
            long factors (`Request.rope_variant`); None without longrope.
    """

    vocab_size: int
    context_length: int
    page_size: int
    num_pages: int
    max_queued_requests: int
    eos_token_ids: tuple[int, ...]
    role: str
    kv_groups: KVGroups | None = None
    chunk: int = 0
    long_rope_from: int | None = None

    @property
    def pool_tokens(self) -> int:
        """Tokens the whole KV pool holds (SGLang's ``max_total_num_tokens``)."""
        return self.num_pages * self.page_size

    def pages_needed(self, total_tokens: int) -> int:
        """The most pages a request of `total_tokens` tokens holds at once (every group counted)."""
        if self.kv_groups is None:
            return -(-total_tokens // self.page_size)
        return self.kv_groups.max_pages(total_tokens, self.chunk, self.page_size)


def make_request(limits: RequestLimits, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                 remote_kv: bool, resumed: list[int], num_waiting: int, sampler: Sampler,
                 grammars: GrammarManager) -> Request:
    """A new `Request`, checked against everything that can be known before it is queued.

    Args:
        limits: the engine's `RequestLimits`.
        request_id: an id not in use (the engine checks).
        remote_kv: decode role: the prompt's KV comes from a prefill worker.
        resumed: output tokens an earlier attempt generated (``resume_token_ids``): they count as output and
            are replayed (`replay_resumed`).
        num_waiting: requests waiting for admission now.
        sampler: gives a seeded request its generator (and advances it over the resumed tokens).
        grammars: compiles a structured-output request's matcher.

    Raises:
        RequestRejected: an empty or out-of-vocabulary prompt, invalid parameters, resumed tokens
            that leave nothing to generate or that the grammar refuses.
        ContextLengthExceeded: prompt plus ``max_tokens`` beyond the context length.
        PoolCapacityExceeded: more than the whole KV pool.
        EngineOverloaded: the admission queue is full.
    """
    vocab = limits.vocab_size
    n = len(prompt_token_ids)
    if n == 0:
        raise RequestRejected("prompt: must contain at least one token", param="prompt")
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
        raise RequestRejected(f"prompt: token ids must be in [0, {vocab})", param="prompt")
    if params.n != 1:
        raise RequestRejected("n: the engine generates one sequence per request; the server fans n out",
                              param="n")
    try:
        params.check_vocab(vocab)
    except SamplingParamError as e:
        raise RequestRejected(str(e), param=e.param) from e
    k = len(resumed)
    if k and (min(resumed) < 0 or max(resumed) >= vocab):
        raise RequestRejected(f"resume_token_ids: token ids must be in [0, {vocab})", param="resume_token_ids")
    if limits.role == "prefill":  # it samples the one token after the prompt and the resumed output
        params = replace(params, max_tokens=k + 1, min_tokens=min(params.min_tokens, k + 1))
    elif params.max_tokens is None:
        params = replace(params, max_tokens=max(limits.context_length - n, k + 1))
    if k >= params.max_tokens:
        raise RequestRejected(f"resume_token_ids: {k} tokens were already generated, but max_tokens is "
                              f"{params.max_tokens}: nothing is left to generate", param="resume_token_ids")
    total = n + params.max_tokens
    if total > limits.context_length:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {limits.context_length} tokens. However, you requested "
            f"{total} tokens ({n} in the prompt, {params.max_tokens} in the completion). Please reduce the "
            f"length of the prompt or the completion.")
    capacity = limits.pool_tokens
    if limits.kv_groups is not None:
        pages = limits.pages_needed(total)
        if pages > limits.num_pages:
            raise PoolCapacityExceeded(
                f"The request needs up to {pages} KV pages at once over the model's KV groups ({n} prompt + "
                f"{params.max_tokens} completion tokens; {limits.kv_groups.describe()}) but the whole KV pool "
                f"holds {limits.num_pages} pages of {limits.page_size} tokens; raise --kv-cache-memory / "
                "--mem-fraction-static or shorten it.")
    elif total > capacity:
        raise PoolCapacityExceeded(
            f"The request needs up to {total} tokens of KV cache ({n} prompt + {params.max_tokens} completion) "
            f"but the whole KV pool holds {capacity} tokens ({limits.num_pages} pages of "
            f"{limits.page_size}); raise --kv-cache-memory / --mem-fraction-static or shorten it.")
    if num_waiting >= limits.max_queued_requests:
        raise EngineOverloaded(f"the admission queue is full ({num_waiting} requests waiting)")
    req = Request(request_id, prompt_token_ids, params, limits.eos_token_ids, remote_kv=remote_kv,
                  resumed_output_ids=resumed)
    if limits.long_rope_from is not None:  # the same choice on a prefill and a decode worker: their lengths agree
        req.rope_variant = int(len(req.token_ids) > limits.long_rope_from)
    req.generator = sampler.new_request_generator(params.seed)
    if params.structured_output is not None:
        try:
            req.grammar = grammars.new_request_grammar(params.structured_output)
        except SamplingParamError as e:
            raise RequestRejected(str(e), param=e.param) from e
    replay_resumed(req, resumed, sampler)
    return req


def replay_resumed(req: Request, resumed: list[int], sampler: Sampler) -> None:
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
        sampler.skip(req.params, req.generator)
    if req.grammar is not None and req.grammar.is_terminated:
        raise RequestRejected("resume_token_ids: the output already completes the request's "
                              f"{req.grammar.spec.kind} constraint", param="resume_token_ids")
