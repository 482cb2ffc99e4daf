"""``n`` > 1 and ``best_of``: one request's choices, each its own engine request.

The engine generates one sequence per request (it refuses ``n`` != 1), so a
server fans a request out into ``best_of`` (or ``n``) engine requests with the
same prompt; the prefix cache shares the prompt's pages between them. As in
vLLM, a seeded request gives choice ``i`` the seed ``seed + i`` (the choices
differ, and the same request gives the same choices again); an unseeded one
samples each choice independently. ``best_of`` returns the ``n`` sequences with
the highest cumulative logprob, best first (vLLM's semantic; not streamed).

Waiting on a run: `until_disconnect` (aborts when the client leaves), `request_error` (a delta that ends its
request with an engine error), `raise_error` (an error the engine loop put in a run's queue).
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from pd_cluster.engine.outputs import RequestDelta
from pd_cluster.engine.sampling.params import SamplingParams, fanned_out
from pd_cluster.serving.errors import HTTPError
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


DISCONNECT_POLL_S = 0.1
"""How often a handler waiting for the engine checks that its client is still there (seconds)."""


def request_error(d: RequestDelta) -> HTTPError | None:
    """The error of a delta that ends its request with ``finish_reason == "error"`` (the engine failed this
    request alone, e.g. while preparing its logits or sampling; see `LLMEngine.fail_request`), else None."""
    if not (d.finished and d.finish_reason == "error"):
        return None
    return HTTPError(500, f"the request failed in the engine: {d.error or 'unknown error'}", None, "request_failed")


def raise_error(d: Any) -> Any:
    """A stream item, or raise it when the engine loop put an error there (`EngineDeadError`)."""
    if isinstance(d, BaseException):
        raise d
    return d


async def until_disconnect(request: Request, task: asyncio.Future) -> Any:
    """Await `task`, cancelling it and raising `asyncio.CancelledError` if the client disconnects."""
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            raise asyncio.CancelledError("client disconnected")
