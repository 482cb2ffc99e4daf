"""The request loop: sends each request at its planned time and collects the records.

One sender coroutine sleeps until each request is due (monotonic deadlines,
never accumulated sleeps; see :func:`_wait_until` for sub-millisecond
precision) and starts it as its own task; a request then waits
for a ``--max-concurrency`` slot if there is a limit. The loop is bounded in
count (the dataset) and time (``--duration`` stops sending; every request has
``--request-timeout``), so a run ends by ``duration + request_timeout``.

The client measures itself while it runs: its CPU time, the scheduler lag of
every request, and the event-loop delay (how long a callback scheduled with
``call_soon`` waits to run, sampled every 5 ms), which bounds how late a
timestamp can be.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from bench.arrival import ArrivalPlan
from bench.client import RequestRecord, build_payload, header_lines, send_request
from bench.config import LoadConfig, TargetConfig
from bench.datasets.base import SampledRequest
from bench.http_client import HttpPool

PROBE_INTERVAL_S = 0.005
SPIN_S = 0.001
SPIN_MIN_GAP_S = 0.004


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
        self._sem: asyncio.Semaphore | None = None

    def _request(self, pool: HttpPool, req: SampledRequest, request_id: str) -> bytes:
        body = build_payload(self.target, self.model, req)
        return pool.request_bytes("POST", self.target.endpoint, header_lines(self.target, request_id), body)

    async def run(self, requests: list[SampledRequest], plan: ArrivalPlan,
                  warmup: Sequence[SampledRequest] = (),
                  before_timed: Callable[[], None] | None = None) -> RunOutput:
        """Warm up, call ``before_timed`` (e.g. a metrics scrape), then send ``requests`` at
        ``plan.times``; returns when every sent request has finished."""
        pool = HttpPool(self.target.base_url)
        if self.load.max_concurrency:
            self._sem = asyncio.Semaphore(self.load.max_concurrency)
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
        await asyncio.gather(*(self._one(pool, rec, self._request(pool, r, rec.request_id), origin, None)
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
        origin = loop.time()
        stop_at = origin + self.load.duration_s if self.load.duration_s else float("inf")
        records: list[RequestRecord] = []
        tasks: list[asyncio.Task] = []
        prev_due = -1.0
        for i, (req, due) in enumerate(zip(requests, plan.times)):
            when = origin + due
            if when > stop_at:
                break
            await _wait_until(loop, when, spin=due - prev_due >= SPIN_MIN_GAP_S)
            prev_due = due
            if loop.time() > stop_at:
                break
            rec = RequestRecord(i, req.prompt_len, req.output_len, due, f"bench-{self.run_id}-{i}")
            records.append(rec)
            tasks.append(loop.create_task(self._one(pool, rec, payloads[i], origin, bar)))
        if tasks:
            await asyncio.wait(tasks)
        end = loop.time()
        probe.cancel()
        bar.close()
        stats.cpu_s = _cpu_seconds() - cpu0
        stats.wall_s = end - origin
        return RunOutput(records, len(requests), end - origin, start_unix, stats)

    async def _one(self, pool: HttpPool, rec: RequestRecord, request: bytes,
                   origin: float, bar: Progress | None) -> None:
        rec.started = time.monotonic() - origin
        timeout = self.target.request_timeout_s
        try:
            if self._sem is None:
                await send_request(pool, request, rec, origin, timeout)
            else:
                async with self._sem:
                    await send_request(pool, request, rec, origin, timeout)
        finally:
            if bar is not None:
                bar.update()


async def _wait_until(loop: asyncio.AbstractEventLoop, when: float, spin: bool) -> None:
    """Sleep until ``when`` (``loop.time()`` seconds).

    asyncio timers wake up to 1 ms late (epoll counts whole milliseconds), so
    for a send that is at least ``SPIN_MIN_GAP_S`` after the previous one the
    last ``SPIN_S`` is spent yielding to the loop (which keeps serving I/O)
    instead; at higher rates the CPU that would cost is not worth it.
    """
    delay = when - loop.time()
    if delay <= 0:
        return
    if not spin:
        await asyncio.sleep(delay)
        return
    if delay > SPIN_S:
        await asyncio.sleep(delay - SPIN_S)
    while loop.time() < when:
        await asyncio.sleep(0)


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
