"""Active health checks, ``/server_info`` learning and ``/get_load`` polling: readiness apart from liveness.

**Readiness** (may it take new work?): ``GET /health`` every ``--health-check-interval-secs`` (every
`STARTUP_PROBE_SECS` for a worker never seen ready, for up to `STARTUP_PROBE_LIMIT_SECS`); a worker turns
*not ready* after ``--health-failure-threshold`` misses in a row and ready after ``--health-success-threshold``
good answers (one for a worker never seen ready). A good answer is a 200 within ``--health-check-timeout-secs``;
a miss is a non-200 answer (a worker starting, draining or whose engine died answers 503), or a probe (health
check or load poll) still unanswered past that timeout while the worker showed no sign of life since it was sent
(a byte on its data-path connections, any probe answer, or its progress counters advancing). A probe that
answers late proves the worker alive: it is counted in ``slow_checks``, never as a miss, and a late 200 is a
good answer (a starved host answers everything late; refusing all its workers work would fail the service). A worker that is not
ready gets no new requests; its requests in flight go on, each to its own deadline (``router.supervisor``).

**Liveness** (is it dead?): death is a fact, not a timeout. A worker seen alive whose probe connection is refused
or reset is *dead* at once: not ready, and every attempt in flight on it is failed now (``on_dead``), to be
retried or migrated. Turning ready clears it and closes the worker's circuit breaker: the check just proved it
answers. Kubernetes separates the two the same way (a readiness probe stops traffic, a liveness failure
restarts); sglang-router and Dynamo tell connection failures from slowness.

**Progress**: the workers' ``/health`` and ``/get_load`` carry ``num_steps`` and ``num_kv_transfer_events``; the
router notes when they last advanced (``Worker.progress_at``). The supervisor never fails an attempt on a worker
whose counters advance (``router.supervisor``).

On turning ready the router reads ``/server_info``: the served model name, the role, which must match the role
the worker was registered with (a decode worker registered as prefill is never used, and an error is logged),
and ``max_running_requests`` (its capacity, ``router.capacity``).
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import time
from collections.abc import Callable

import aiohttp

from pd_cluster.router.config import HealthConfig, Role
from pd_cluster.router.load import LoadReport
from pd_cluster.router.upstream import Upstreams
from pd_cluster.router.workers import Worker, WorkerRegistry

log = logging.getLogger("pd_cluster.router.health")

STARTUP_PROBE_SECS = 0.5
"""How often a worker never seen ready is checked, whatever ``--health-check-interval-secs`` says (Kubernetes'
startup probe beside its readiness probe): a starting worker takes work within half a second of answering
``/health``, not at the next round of checks (up to 5 s later by default, a wait every cold start and every worker
the planner adds paid). Checking a port that is not listening yet costs one refused connection."""

STARTUP_PROBE_LIMIT_SECS = 900.0
"""How long after its registration a worker never seen ready is probed every `STARTUP_PROBE_SECS` (a big
checkpoint loads for minutes); past it, at ``--health-check-interval-secs`` like every other worker."""


def refused_or_reset(exc: BaseException) -> bool:
    """True when `exc` (from aiohttp or the socket layer) says nothing listens on the worker's port or the worker
    reset the connection: the process is gone. Timeouts and other errors are not."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, (ConnectionRefusedError, ConnectionResetError, aiohttp.ServerDisconnectedError)):
            return True
        if isinstance(exc, OSError) and exc.errno in (errno.ECONNREFUSED, errno.ECONNRESET):
            return True
        exc, seen = exc.__cause__ or exc.__context__ or getattr(exc, "os_error", None), seen + 1
    return False


class HealthMonitor:
    """Runs the check and poll loops over the registry's current workers.

    ``liveness_secs``: how long a probe may stay unanswered before it is given up (its late answer still proves
    the worker alive until then); the router passes ``--upstream-idle-timeout-secs``.
    """

    def __init__(self, registry: WorkerRegistry, upstreams: Upstreams, config: HealthConfig,
                 polled_roles: Callable[[Role], bool], on_room: Callable[[], None] = lambda: None,
                 liveness_secs: float = 30.0) -> None:
        self.registry = registry
        self.upstreams = upstreams
        self.config = config
        self._polled_roles = polled_roles
        self._checking: dict[str, float] = {}  # url -> when its outstanding health check was sent
        self._polling: dict[str, float] = {}   # url -> when its outstanding load poll was sent
        self._missed_at: dict[str, float] = {}  # url -> when a miss was last counted for an outstanding probe
        self._wrong_role: set[str] = set()  # urls whose /server_info reported another role than registered
        self._timeout = aiohttp.ClientTimeout(total=max(config.timeout_secs, liveness_secs))
        self._tasks: set[asyncio.Task] = set()
        self.on_unhealthy: list[Callable[[Worker], None]] = []  # turned not ready (dead or not)
        self.on_dead: list[Callable[[Worker], None]] = []
        self.on_room = on_room  # a load report or a health change may have made room (``CapacityGate``)

    async def _get_json(self, worker: Worker, path: str) -> tuple[int, object]:
        async with self.upstreams.control.get(worker.url + path, timeout=self._timeout) as resp:
            raw = await resp.read()
            worker.probe_seen = time.monotonic()
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = None
            worker.note_progress(body, worker.probe_seen)
            return resp.status, body

    # ---- readiness ------------------------------------------------------------------------------------------
    def apply(self, worker: Worker, ok: bool) -> None:
        """Fold one check result into the worker's readiness."""
        if ok:
            worker.ok_streak += 1
            worker.fail_streak = 0
            need = self.config.success_threshold if worker.checked else 1
            if not worker.healthy and worker.ok_streak >= need:
                worker.healthy = True
                worker.checked = True
                worker.dead = False
                worker.breaker.reset()
                log.info("worker healthy", extra={"worker": worker.url, "role": worker.role.value})
                self.on_room()
        else:
            worker.fail_streak += 1
            worker.ok_streak = 0
            if worker.healthy and worker.fail_streak >= self.config.failure_threshold:
                self._not_ready(worker, "missed health checks")

    def _not_ready(self, worker: Worker, why: str) -> None:
        worker.healthy = False
        worker.load = None
        log.warning("worker unhealthy (not ready): no new requests; those in flight continue", extra={
            "worker": worker.url, "role": worker.role.value, "reason": why})
        for fn in self.on_unhealthy:
            fn(worker)

    def mark_dead(self, worker: Worker, why: str) -> None:
        """`worker` refused or reset a connection: dead now (if it was seen alive; a worker that never answered
        is still starting). Its in-flight attempts are failed (``on_dead``)."""
        if not worker.checked:
            self.apply(worker, False)
            return
        worker.fail_streak = max(worker.fail_streak + 1, self.config.failure_threshold)
        worker.ok_streak = 0
        if worker.dead:
            return
        worker.dead = True
        log.warning("worker dead: its in-flight requests are retried or migrated", extra={
            "worker": worker.url, "role": worker.role.value, "reason": why})
        if worker.healthy:
            self._not_ready(worker, why)
        for fn in self.on_dead:
            fn(worker)

    def life(self, worker: Worker) -> float:
        """``time.monotonic()`` of the worker's last sign of life: a data-path byte, a probe answer, or its
        progress counters advancing."""
        return max(self.upstreams.last_seen(worker.url), worker.probe_seen, worker.progress_at)

    def _overdue(self, worker: Worker, sent: float) -> None:
        """A probe sent at `sent` is still unanswered: past the check timeout with no sign of life since, it is a
        miss (at most one per timeout period); with signs of life, the worker is busy."""
        now = time.monotonic()
        if now - sent < self.config.timeout_secs:
            return
        since = max(sent, self._missed_at.get(worker.url, float("-inf")))
        if now - since < self.config.timeout_secs:
            return
        self._missed_at[worker.url] = now
        if self.life(worker) >= since:
            self._slow(worker, "probe")
        else:
            self.apply(worker, False)

    def _slow(self, worker: Worker, what: str) -> None:
        worker.slow_checks += 1
        if worker.slow_checks == 1 or worker.slow_checks % 100 == 0:
            log.info("worker busy: a probe answered late while it showed signs of life; not a failure", extra={
                "worker": worker.url, "role": worker.role.value, "probe": what, "slow_checks": worker.slow_checks})

    def _failed(self, worker: Worker, exc: BaseException) -> None:
        """A probe failed without an answer: refused or reset is death; anything else (a timeout at the
        liveness bound, a client error) a miss."""
        if refused_or_reset(exc):
            self.mark_dead(worker, f"connection refused or reset ({type(exc).__name__})")
        else:
            self.apply(worker, False)

    # ---- probes ---------------------------------------------------------------------------------------------
    async def check(self, worker: Worker) -> bool:
        """One health check (while one is outstanding for this worker, only count it overdue; none while it
        switches role: it drains and re-registers, ``router.role_switch``)."""
        if worker.switching is not None:
            return worker.healthy
        sent = self._checking.get(worker.url)
        if sent is not None:
            self._overdue(worker, sent)
            return worker.healthy
        sent = self._checking[worker.url] = time.monotonic()
        try:
            was_healthy = worker.healthy
            try:
                status, _ = await self._get_json(worker, self.config.endpoint)
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
                self._failed(worker, exc)
                return worker.healthy
            if time.monotonic() - sent > self.config.timeout_secs:
                self._slow(worker, "health check")  # late, but an answer: slow is not dead
            ok = status == 200
            if ok and not was_healthy and not await self._learn_info(worker):
                ok = False
            self.apply(worker, ok)
            return worker.healthy
        finally:
            self._checking.pop(worker.url, None)
            self._missed_at.pop(worker.url, None)

    async def _learn_info(self, worker: Worker) -> bool:
        """Read ``/server_info``; False when the worker reports another role."""
        try:
            status, info = await self._get_json(worker, "/server_info")
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
            return True  # the health check passed; the info is optional
        if status != 200 or not isinstance(info, dict):
            return True
        role = info.get("role")
        if isinstance(role, str) and role != worker.role.value:
            if worker.url not in self._wrong_role:  # logged once, not at every check
                self._wrong_role.add(worker.url)
                log.error("worker reports another role; not used", extra={
                    "worker": worker.url, "registered_role": worker.role.value, "reported_role": role})
            return False
        self._wrong_role.discard(worker.url)
        name = info.get("served_model_name") or info.get("model")
        if isinstance(name, str) and name != worker.served_model_name:
            worker.served_model_name = name
            self.registry.touch()
        incarnation = info.get("incarnation")
        if incarnation is not None:
            worker.incarnation = str(incarnation)
        cap = info.get("max_running_requests")
        if isinstance(cap, int) and not isinstance(cap, bool) and cap > 0:
            worker.max_running = cap
        return True

    async def poll_load(self, worker: Worker) -> None:
        """One ``/get_load`` poll (while one is outstanding, only count it overdue); a non-200 answer counts as a
        failed check, a refused or reset connection as death."""
        if worker.switching is not None:
            return
        sent = self._polling.get(worker.url)
        if sent is not None:
            self._overdue(worker, sent)
            return
        self._polling[worker.url] = time.monotonic()
        try:
            try:
                status, body = await self._get_json(worker, "/get_load")
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
                self._failed(worker, exc)
                return
            if status == 200 and isinstance(body, dict):
                try:
                    worker.set_load(LoadReport.from_json(body, time.monotonic()))
                except ValueError:
                    self.apply(worker, False)
                    return
                self.on_room()
            else:
                self.apply(worker, False)
        finally:
            self._polling.pop(worker.url, None)

    def poke(self, worker: Worker) -> None:
        """Check ``worker`` now, in the background (after a data-path failure)."""
        self._spawn(self.check(worker))

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def check_all(self) -> None:
        """Check every worker once and wait for the answers."""
        await asyncio.gather(*(self.check(w) for w in self.registry.all()))

    def _starting(self, worker: Worker, now: float) -> bool:
        """Never seen ready, registered under `STARTUP_PROBE_LIMIT_SECS` ago, and not refused for its role: probed
        every `STARTUP_PROBE_SECS`."""
        return (not worker.checked and worker.url not in self._wrong_role
                and now - worker.added_at < STARTUP_PROBE_LIMIT_SECS)

    async def run_checks(self) -> None:
        """Loop: a health check of every worker each interval, and of a worker never seen ready every
        `STARTUP_PROBE_SECS` until it is."""
        next_round = 0.0
        while True:
            now = time.monotonic()
            full = now >= next_round
            if full:
                next_round = now + self.config.interval_secs
            for worker in self.registry.all():
                if full or self._starting(worker, now):
                    self._spawn(self.check(worker))
            if full:
                self.on_room()  # a breaker that turned half-open, a worker that turned ready: waiters look again
            # wake at least every STARTUP_PROBE_SECS: a worker registered meanwhile (the planner's) is probed then
            await asyncio.sleep(max(0.0, min(next_round - time.monotonic(), STARTUP_PROBE_SECS)))

    async def run_load_polls(self) -> None:
        """Loop: ``/get_load`` of each healthy worker whose role's policy uses load."""
        while True:
            for worker in self.registry.all():
                if worker.healthy and self._polled_roles(worker.role):
                    self._spawn(self.poll_load(worker))
            await asyncio.sleep(self.config.load_interval_secs)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
