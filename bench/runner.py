"""The request loop: sends each request at its planned time and collects the records.

One sender coroutine sleeps until each request is due (monotonic deadlines,
never accumulated sleeps, on the microsecond timers of ``pd_cluster.bench.precise_loop``)
and then, before any other callback runs, writes it on an idle keep-alive
connection; a task waits for the answer (and opens a connection first when
none was idle). With ``--max-concurrency``, a request that finds no free slot
waits for one. The loop is bounded in count (the dataset) and time
(``--duration`` stops sending; every request has ``--request-timeout``), so a
run ends by ``duration + request_timeout``.

The client measures itself while it runs: its CPU time, the scheduler lag of
every request, and the event-loop delay (how long a callback scheduled with
``call_soon`` waits to run, sampled every 5 ms), which bounds how late a
timestamp can be.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

from pd_cluster.bench.arrival import ArrivalPlan
from pd_cluster.bench.client import RequestRecord, begin_request, build_payload, finish_request, header_lines
from pd_cluster.bench.config import LoadConfig, TargetConfig
from pd_cluster.bench.datasets.base import SampledRequest
from pd_cluster.bench.http_client import ArrivalClock, HttpPool

PROBE_INTERVAL_S = 0.005


@dataclass
class ClientStats:
    """How busy the client was: CPU seconds, event-loop delays (s), wall time of the send window."""

    cpu_s: float = 0.0
    wall_s: float = 0.0
    loop_delays: list[float] = field(default_factory=list)


@dataclass
class RunOutput:
    """Everything the timed phase produced. ``records`` holds the requests that were sent."""

    records: list[RequestRecord]
    planned: int
    duration_s: float
    start_unix: float
    client: ClientStats
    warmup_sent: int = 0
    warmup_failed: int = 0
    warmup_errors: list[str] = field(default_factory=list)

    @property
    def not_sent(self) -> int:
        return self.planned - len(self.records)


class Progress:
    """A tqdm bar over completed requests (a no-op when disabled)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="req", mininterval=0.25, smoothing=0.1)

    def update(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class Runner:
    """Runs one benchmark against ``target`` with ``model`` (see module docstring)."""

    def __init__(self, target: TargetConfig, load: LoadConfig, model: str, progress: bool = True,
                 run_id: str | None = None) -> None:
        self.target = target
        self.load = load
        self.model = model
        self.progress = progress
        self.run_id = run_id or os.urandom(4).hex()
        self._slots: Slots | None = None
        self.clock = ArrivalClock()

    def _request(self, pool: HttpPool, req: SampledRequest, request_id: str) -> bytes:
        body = build_payload(self.target, self.model, req)
        return pool.request_bytes("POST", self.target.endpoint, header_lines(self.target, request_id), body)

    def run_sync(self, requests: list[SampledRequest], plan: ArrivalPlan,
                 warmup: Sequence[SampledRequest] = (),
                 before_timed: Callable[[], None] | None = None) -> RunOutput:
        """:meth:`run` on a new ``pd_cluster.bench.precise_loop`` event loop (precise timers, arrival stamps)."""
        with asyncio.Runner(loop_factory=self.clock.new_loop) as r:
            return r.run(self.run(requests, plan, warmup, before_timed))

    async def run(self, requests: list[SampledRequest], plan: ArrivalPlan,
                  warmup: Sequence[SampledRequest] = (),
                  before_timed: Callable[[], None] | None = None) -> RunOutput:
        """Warm up, call ``before_timed`` (e.g. a metrics scrape), then send ``requests`` at
        ``plan.times``; returns when every sent request has finished."""
        pool = HttpPool(self.target.base_url, self.clock)
        self._slots = Slots(self.load.max_concurrency) if self.load.max_concurrency else None
        payloads = [self._request(pool, r, f"bench-{self.run_id}-{i}") for i, r in enumerate(requests)]
        try:
            wsent, wfailed, werrors = await self._warmup(pool, list(warmup))
            if before_timed is not None:
                before_timed()
            out = await self._timed(pool, requests, payloads, plan)
        finally:
            pool.close()
        out.warmup_sent, out.warmup_failed, out.warmup_errors = wsent, wfailed, werrors
        return out

    async def _warmup(self, pool: HttpPool,
                      warmup: list[SampledRequest]) -> tuple[int, int, list[str]]:
        if not warmup:
            return 0, 0, []
        origin = time.monotonic()
        recs = [RequestRecord(i, r.prompt_len, r.output_len, 0.0, f"warmup-{self.run_id}-{i}")
                for i, r in enumerate(warmup)]
        await asyncio.gather(*(self._queued(pool, rec, self._request(pool, r, rec.request_id), origin, None)
                               for rec, r in zip(recs, warmup)))
        errors = sorted({f"{r.reason}: {r.error}" for r in recs if not r.success})
        return len(recs), sum(not r.success for r in recs), errors

    async def _timed(self, pool: HttpPool, requests: list[SampledRequest],
                     payloads: list[bytes], plan: ArrivalPlan) -> RunOutput:
        loop = asyncio.get_running_loop()
        bar = Progress(len(requests), self.progress)
        stats = ClientStats()
        probe = loop.create_task(_probe_loop(stats.loop_delays))
        cpu0, start_unix = _cpu_seconds(), time.time()
        origin = time.monotonic()
        stop_at = origin + self.load.duration_s if self.load.duration_s else float("inf")
        records: list[RequestRecord] = []
        tasks: list[asyncio.Task] = []
        for i, (req, due) in enumerate(zip(requests, plan.times)):
            when = origin + due
            if when > stop_at:
                break
            delay = when - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if time.monotonic() > stop_at:
                break
            rec = RequestRecord(i, req.prompt_len, req.output_len, due, f"bench-{self.run_id}-{i}")
            records.append(rec)
            tasks.append(loop.create_task(self._dispatch(pool, rec, payloads[i], origin, bar)))
        if tasks:
            await asyncio.wait(tasks)
        end = time.monotonic()
        probe.cancel()
        bar.close()
        stats.cpu_s = _cpu_seconds() - cpu0
        stats.wall_s = end - origin
        return RunOutput(records, len(requests), end - origin, start_unix, stats)

    def _dispatch(self, pool: HttpPool, rec: RequestRecord, request: bytes, origin: float,
                  bar: Progress) -> Awaitable[None]:
        """Start a due request now: with a free slot it is written before any other callback runs
        (``begin_request``); the returned awaitable waits for its answer."""
        rec.started = time.monotonic() - origin
        if self._slots is not None and not self._slots.try_take():
            return self._queued(pool, rec, request, origin, bar)
        st, pending = begin_request(pool, request, rec, origin, self.target.request_timeout_s)
        return self._complete(pool, request, rec, st, pending, bar)

    async def _queued(self, pool: HttpPool, rec: RequestRecord, request: bytes, origin: float,
                      bar: Progress | None) -> None:
        """Wait for a concurrency slot, then send (warm-up requests come this way too)."""
        if rec.started != rec.started:
            rec.started = time.monotonic() - origin
        if self._slots is not None:
            await self._slots.take()
        st, pending = begin_request(pool, request, rec, origin, self.target.request_timeout_s)
        await self._complete(pool, request, rec, st, pending, bar)

    async def _complete(self, pool: HttpPool, request: bytes, rec: RequestRecord, st: Any,
                        pending: Any, bar: Progress | None) -> None:
        try:
            await finish_request(pool, request, rec, st, pending, self.target.request_timeout_s)
        finally:
            if self._slots is not None:
                self._slots.release()
            if bar is not None:
                bar.update()


class Slots:
    """A ``--max-concurrency`` limit whose free slot can be taken without awaiting."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._waiters: deque[asyncio.Future] = deque()

    def try_take(self) -> bool:
        if self.used < self.limit and not self._waiters:
            self.used += 1
            return True
        return False

    async def take(self) -> None:
        if self.try_take():
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        await fut  # the releasing request hands its slot over

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.used -= 1


async def _probe_loop(delays: list[float]) -> None:
    """Samples how long a ``call_soon`` callback waits (seconds) every ``PROBE_INTERVAL_S``."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(PROBE_INTERVAL_S)
        fut = loop.create_future()
        t = time.monotonic()
        loop.call_soon(lambda f=fut, t0=t: f.done() or f.set_result(time.monotonic() - t0))
        delays.append(await fut)


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system
