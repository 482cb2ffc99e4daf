"""Readiness apart from liveness, in-process (no process started): real HTTP servers on loopback answer the
router's health checks slowly, never, or not at all (port closed), and the monitor, the supervisor and the
breakers' bookkeeping are checked on them.

- A worker that answers late (each answer proves it alive), or not at all while its progress counters advance,
  is never marked not ready, never dead.
- A worker that answers nothing and shows no life turns not ready after the threshold, and is not dead.
- A worker seen alive whose port then refuses connections is dead at once, and only then are its in-flight
  attempts failed (``on_dead``).
- The supervisor fails a silent attempt only when its worker shows no life either.
- Breakers count connection failures, not slowness.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiohttp import web

from pd_cluster.router.config import CircuitBreakerConfig, HealthConfig, LimitsConfig, Role
from pd_cluster.router.health import STARTUP_PROBE_SECS, HealthMonitor
from pd_cluster.router.relay import AttemptFailure
from pd_cluster.router.supervisor import Supervisor
from pd_cluster.router.upstream import Upstreams
from pd_cluster.router.workers import WorkerRegistry

TIMEOUT = 0.3  # --health-check-timeout-secs of these tests


class Worker:
    """An in-process worker: ``/health`` answers after `delay` seconds (None: never), with progress counters."""

    def __init__(self) -> None:
        self.delay: float | None = 0.0
        self.steps = 0
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def health(self, request: web.Request) -> web.Response:
        if self.delay is None:
            await asyncio.sleep(3600)
        await asyncio.sleep(self.delay)
        return web.json_response({"status": "ok", "num_steps": self.steps, "num_kv_transfer_events": 0})

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"role": "decode"})

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/server_info", self.server_info)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        await self.runner.cleanup()


async def _monitor(url: str, liveness: float = 5.0):
    registry = WorkerRegistry(CircuitBreakerConfig())
    upstreams = Upstreams(LimitsConfig())
    await upstreams.start()
    monitor = HealthMonitor(registry, upstreams, HealthConfig(timeout_secs=TIMEOUT, failure_threshold=2,
                                                             success_threshold=1),
                            lambda role: False, liveness_secs=liveness)
    worker = registry.add(url, Role.DECODE, "static")
    events: list[str] = []
    monitor.on_unhealthy.append(lambda w: events.append("not_ready"))
    monitor.on_dead.append(lambda w: events.append("dead"))
    return monitor, worker, upstreams, events


async def _tick(monitor, worker, rounds: int, every: float) -> None:
    """The check loop, `rounds` times, `every` seconds apart (checks run in the background, as the router's)."""
    for _ in range(rounds):
        monitor._spawn(monitor.check(worker))
        await asyncio.sleep(every)


@pytest.mark.asyncio
async def test_a_late_answer_is_life_and_a_progressing_silent_worker_stays_ready():
    w = Worker()
    url = await w.start()
    monitor, worker, upstreams, events = await _monitor(url)
    try:
        assert await monitor.check(worker) and worker.healthy
        json.dumps(worker.describe(time.monotonic()), allow_nan=False)  # GET /workers, before any progress
        w.delay = 1.7 * TIMEOUT  # every answer late, each one life
        await _tick(monitor, worker, 8, TIMEOUT)
        await asyncio.sleep(2 * TIMEOUT)
        assert worker.healthy and not worker.dead and events == [], events
        assert worker.slow_checks >= 1
        w.delay = None  # no answer at all, but the steps advance (another probe sees them)
        for _ in range(10):
            w.steps += 1
            worker.note_progress({"num_steps": w.steps, "num_kv_transfer_events": 0}, time.monotonic())
            monitor._spawn(monitor.check(worker))
            await asyncio.sleep(TIMEOUT)
        assert worker.healthy and events == []
        view = worker.describe(time.monotonic())
        assert view["progress"] == w.steps and view["progress_age_secs"] < 1 and not view["dead"]
    finally:
        await monitor.close()
        await upstreams.close()
        await w.stop()


@pytest.mark.asyncio
async def test_a_silent_worker_is_not_ready_but_not_dead_and_a_refusing_one_is_dead_at_once():
    w = Worker()
    url = await w.start()
    monitor, worker, upstreams, events = await _monitor(url)
    try:
        assert await monitor.check(worker)
        w.delay = None  # frozen: no answer, no progress, no bytes
        await _tick(monitor, worker, 10, TIMEOUT)
        assert not worker.healthy and not worker.dead and events == ["not_ready"], events
        w.delay = 0.0
        await monitor.close()  # the frozen probes
        monitor._checking.clear()
        assert await monitor.check(worker) and worker.healthy  # it answers again: ready
        await w.stop()  # the process is gone: its port refuses connections
        await monitor.check(worker)
        assert worker.dead and not worker.healthy and events == ["not_ready", "not_ready", "dead"], events
        await monitor.check(worker)
        assert events.count("dead") == 1  # a fact, told once
    finally:
        await monitor.close()
        await upstreams.close()


@pytest.mark.asyncio
async def test_a_worker_that_never_answered_is_starting_not_dead():
    w = Worker()
    url = await w.start()
    await w.stop()  # nothing listens yet (a worker still loading its model)
    monitor, worker, upstreams, events = await _monitor(url)
    try:
        for _ in range(4):
            await monitor.check(worker)
        assert not worker.healthy and not worker.dead and events == []
    finally:
        await monitor.close()
        await upstreams.close()


async def _not_listening() -> tuple[Worker, str]:
    """A worker whose port is known but not listening yet (a worker still loading its model)."""
    w = Worker()
    url = await w.start()
    port = w.port
    await w.stop()
    w.port = port
    return w, url


async def _ready_within(worker, seconds: float) -> float:
    up = time.monotonic()
    while not worker.healthy and time.monotonic() - up < seconds:
        await asyncio.sleep(0.02)
    return time.monotonic() - up


@pytest.mark.asyncio
async def test_a_starting_worker_is_checked_every_half_second_until_ready_then_each_interval():
    """Kubernetes' startup probe: with ``--health-check-interval-secs 30`` a worker that starts listening after the
    router is ready within about `STARTUP_PROBE_SECS` of it (not up to 30 s later), also one registered while
    the loop sleeps (the planner's); once ready it is checked each interval. A worker that reports another role
    than it was registered with is not probed fast (its error is logged once)."""
    a, url_a = await _not_listening()
    b, url_b = await _not_listening()
    c = Worker()  # listening, but a decode registered as prefill
    url_c = await c.start()
    registry = WorkerRegistry(CircuitBreakerConfig())
    upstreams = Upstreams(LimitsConfig())
    await upstreams.start()
    monitor = HealthMonitor(registry, upstreams, HealthConfig(interval_secs=30.0, timeout_secs=TIMEOUT),
                            lambda role: False)
    first = registry.add(url_a, Role.DECODE, "static")
    checks: dict[str, int] = {url_a: 0, url_b: 0, url_c: 0}
    real_check = monitor.check

    async def counted(wk):
        checks[wk.url] += 1
        return await real_check(wk)

    monitor.check = counted
    loop = asyncio.ensure_future(monitor.run_checks())
    try:
        await asyncio.sleep(1.0)
        assert not first.healthy and 2 <= checks[url_a] <= 4, checks  # refused: starting, probed every 0.5 s
        await a.start()
        assert await _ready_within(first, 5) <= STARTUP_PROBE_SECS + 1.5 and first.healthy  # not 29 s
        n = checks[url_a]
        second = registry.add(url_b, Role.DECODE, "dynamic")  # while the loop sleeps towards its next round
        wrong = registry.add(url_c, Role.PREFILL, "dynamic")
        await asyncio.sleep(1.0)
        await b.start()
        assert await _ready_within(second, 5) <= STARTUP_PROBE_SECS + 1.5 and second.healthy
        await asyncio.sleep(1.0)
        assert checks[url_a] == n  # ready: back to the 30 s interval
        assert not wrong.healthy and checks[url_c] == 1, checks  # refused for its role once, then not probed fast
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await monitor.close()
        await upstreams.close()
        for w in (a, b, c):
            await w.stop()


def test_supervisor_fails_a_silent_attempt_only_when_its_worker_shows_no_life():
    async def main() -> dict:
        life = {"http://busy:1": 0.0, "http://frozen:1": 0.0}
        sup = Supervisor(life=lambda url, answered: life[url])
        out: dict[str, str | None] = {}

        async def request(name: str, url: str, answered: bool) -> None:
            key, entry = sup.enter(3600)
            entry.upstream, entry.answered, entry.last_byte = url, answered, 0.0
            entry.idle_limit = 1.0 if answered else 100.0  # a stream's idle timeout / the first-byte timeout
            entry.stall_limit = 1.0
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                out[name] = entry.stall
            finally:
                sup.leave(key)

        tasks = [asyncio.ensure_future(request(f"{u}-{a}", u, a)) for u in life for a in (False, True)]
        await asyncio.sleep(0)
        for t in (0.5, 1.5, 2.5, 3.5):  # the busy worker keeps showing life; the frozen one stopped at 0
            life["http://busy:1"] = t
            sup.tick(t)
        await asyncio.sleep(0)
        assert out == {"http://frozen:1-False": "idle_timeout", "http://frozen:1-True": "idle_timeout"}, out
        life["http://busy:1"] = 101.0
        sup.tick(101.0)  # no first byte within the first-byte timeout: failed whatever the worker's life
        await asyncio.sleep(0)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return out

    out = asyncio.run(main())
    assert out["http://busy:1-False"] == "idle_timeout" and out.get("http://busy:1-True") is None


@pytest.mark.parametrize("failure,counts", [
    (AttemptFailure("stream_broken", Role.DECODE, after_start=True), True),
    (AttemptFailure("decode_unreachable", Role.DECODE, refused=True), True),
    (AttemptFailure("decode_disconnected", Role.DECODE), True),
    (AttemptFailure("status_502", Role.PREFILL, 502, detail="prefill_unreachable"), True),
    (AttemptFailure("idle_timeout", Role.DECODE, after_start=True), False),
    (AttemptFailure("idle_timeout", None, ambiguous=True), False),
    (AttemptFailure("worker_dead", Role.DECODE), False),
    (AttemptFailure("decode_connect_timeout", None, overloaded=True), False),
    (AttemptFailure("status_504", None, 504, detail="kv_transfer_metadata_unreachable", ambiguous=True), False),
])
def test_breakers_count_connection_failures_not_slowness(failure, counts):
    assert failure.counts is counts
