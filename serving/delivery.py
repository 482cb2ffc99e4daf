"""How a request's choices reach the client: the SSE stream of every choice, interleaved as their deltas come
(each chunk names its choice; usage at the end when asked), or one JSON body once all are done (``best_of``'s
choice made there). An engine error ends the response with an OpenAI error; a client that goes away, or a
choice that fails, aborts every unfinished choice.

`ChoiceDelivery` is a mixin of `OpenAIServing` (``openai_serving.py``), whose `PromptSource` aborts the runs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pd_cluster.serving.choices import ChoiceRun, best_of, request_error, until_disconnect
from pd_cluster.serving.errors import to_http_error
from pd_cluster.serving.metrics import RequestTiming
from pd_cluster.serving.responses import SSE_DONE, ResponseBuilder, merge_choices, merged_usage_chunk, sse

logger = logging.getLogger("pd.serving")


class ChoiceDelivery:
    """`OpenAIServing`'s responses: `_stream` (SSE) and `_collect` (one body)."""

    def _abort_unfinished(self, runs: list[ChoiceRun]) -> None:
        for r in runs:
            if not r.finished:
                self.source.abort(r.engine_id)

    async def _stream(self, runs: list[ChoiceRun], include_usage: bool,
                      timings: list[RequestTiming]) -> AsyncIterator[bytes]:
        """The SSE stream of every choice, interleaved as their deltas come (each chunk names its choice)."""
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            while True:
                item = await runs[i].stream.get()
                merged.put_nowait((i, item))
                if isinstance(item, BaseException) or item.finished:
                    return

        for i, r in enumerate(runs):
            merged.put_nowait((i, r.first))
        pumps = [asyncio.ensure_future(pump(i)) for i, r in enumerate(runs) if not r.first.finished]
        seen: set[int] = set()
        try:
            while not all(r.finished for r in runs):
                i, d = await merged.get()
                run = runs[i]
                if isinstance(d, BaseException):  # the engine died mid-stream: end with an error event
                    err = to_http_error(d)
                    logger.warning("request %s failed mid-stream: %s", run.engine_id, err.message)
                    yield sse(err.body())
                    yield SSE_DONE
                    return
                is_first = i not in seen
                seen.add(i)
                timings[i].on_delta(d)
                run.builder.add(d)
                failed = request_error(d)
                if d.new_text or d.new_token_ids or (d.finished and failed is None) or is_first:
                    yield run.builder.chunk(d, is_first)
                if failed is not None:  # this request failed in the engine (the batch goes on)
                    run.finished = True
                    logger.warning("request %s failed mid-stream: %s", run.engine_id, failed.message)
                    yield sse(failed.body())
                    yield SSE_DONE
                    return
                if d.finished:
                    run.finished = True
                    timings[i].on_finish(run.builder.finish_reason, d)
            if include_usage:
                builders = [r.builder for r in runs]
                yield builders[0].usage_chunk() if len(builders) == 1 else merged_usage_chunk(
                    builders, _one_per_prompt(runs))
            yield SSE_DONE
        finally:
            for t in pumps:
                t.cancel()
            self._abort_unfinished(runs)  # client went away (cancelled), a choice failed, or the server stops

    async def _collect(self, request: Request, runs: list[ChoiceRun], n: int, timings: list[RequestTiming],
                       headers: dict[str, str]) -> Response:
        try:
            for run, timing in zip(runs, timings):
                d = run.first
                while True:
                    timing.on_delta(d)
                    run.builder.add(d)
                    if (failed := request_error(d)) is not None:
                        run.finished = True
                        logger.warning("request %s failed: %s", run.engine_id, failed.message)
                        self._abort_unfinished(runs)
                        return JSONResponse(failed.body(), status_code=failed.status, headers=headers)
                    if d.finished:
                        run.finished = True
                        break
                    d = await until_disconnect(request, asyncio.ensure_future(run.stream.get()))
                    if isinstance(d, BaseException):
                        err = to_http_error(d)
                        logger.warning("request %s failed: %s", run.engine_id, err.message)
                        self._abort_unfinished(runs)
                        return JSONResponse(err.body(), status_code=err.status, headers=headers)
                timing.on_finish(run.builder.finish_reason, d)
        except BaseException:
            self._abort_unfinished(runs)
            raise
        if len(runs) == 1:
            return JSONResponse(runs[0].builder.full(), headers=headers)
        chosen: list[ChoiceRun] = []
        for p_i in sorted({r.prompt for r in runs}):
            mine = [r for r in runs if r.prompt == p_i]
            chosen += best_of(mine, n, base=p_i * n) if len(mine) > n else mine
        unreturned = [r.builder for r in runs if r not in chosen]
        return JSONResponse(merge_choices([r.builder for r in chosen], unreturned, _one_per_prompt(runs)),
                            headers=headers)


def _one_per_prompt(runs: list[ChoiceRun]) -> list[ResponseBuilder]:
    """One builder per prompt of the request (usage counts each prompt once)."""
    seen: dict[int, ResponseBuilder] = {}
    for r in runs:
        seen.setdefault(r.prompt, r.builder)
    return list(seen.values())
