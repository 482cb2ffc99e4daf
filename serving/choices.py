"""``n`` > 1 and ``best_of``: one request's choices, each its own engine request.

The engine generates one sequence per request (it refuses ``n`` != 1), so a
server fans a request out into ``best_of`` (or ``n``) engine requests with the
same prompt; the prefix cache shares the prompt's pages between them. As in
vLLM, a seeded request gives choice ``i`` the seed ``seed + i`` (the choices
differ, and the same request gives the same choices again); an unseeded one
samples each choice independently. ``best_of`` returns the ``n`` sequences with
the highest cumulative logprob, best first (vLLM's semantic; not streamed).
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass

from pd_cluster.engine.outputs import RequestDelta
from pd_cluster.engine.sampling.params import SamplingParams, fanned_out
from pd_cluster.serving.responses import ResponseBuilder


@dataclass
class ChoiceRun:
    """One choice's engine request: its id, response builder, delta queue and first delta."""

    engine_id: str
    builder: ResponseBuilder
    stream: asyncio.Queue | None = None
    first: RequestDelta | None = None
    finished: bool = False
    prompt: int = 0  # which prompt of the request (``prompt`` as a list)


def choice_params(params: SamplingParams, count: int, keep_logprobs: bool) -> list[SamplingParams]:
    """The params of each of `count` engine requests.

    Args:
        params: the request's params (``n`` is 1: the engine's rule).
        count: sequences to generate (``best_of``, else ``n``).
        keep_logprobs: False when the request ranks sequences (``best_of`` > ``n``) without asking for
            logprobs: the chosen token's logprob is then requested (``logprobs=0``) to rank them.
    """
    if count == 1:
        return [params]
    out = []
    for p in fanned_out(dataclasses.replace(params, n=count)):
        if not keep_logprobs and p.logprobs is None:
            p = dataclasses.replace(p, logprobs=0)
        out.append(p)
    return out


def best_of(runs: list[ChoiceRun], n: int, base: int = 0) -> list[ChoiceRun]:
    """The `n` runs (of one prompt) with the highest cumulative logprob, best first, re-indexed
    base..base+n-1 (`base`: the prompt's first choice index)."""
    ranked = sorted(runs, key=lambda r: r.builder.cumulative_logprob, reverse=True)[:n]
    for i, r in enumerate(ranked):
        r.builder.index = base + i
    return ranked
