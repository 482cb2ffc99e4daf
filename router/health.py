"""Active health checks, ``/server_info`` learning and ``/get_load`` polling.

Health: ``GET /health`` every ``--health-check-interval-secs``; a worker turns
unhealthy after ``--health-failure-threshold`` failures in a row and healthy
after ``--health-success-threshold`` successes (one for a worker never seen
healthy). A failed load poll, or a connection error on the data path, counts
as a failed check at once, so a dead worker leaves the rotation within a few
load periods rather than a few health periods. Turning healthy closes the
worker's circuit breaker: the check just proved it answers.

On turning healthy the router reads ``/server_info``: the served model name,
the role, which must match the role the worker was registered with (a
decode worker registered as prefill is never used, and an error is logged),
and ``max_running_requests`` (its capacity, ``router.capacity``).

**Busy is not dead.** Liveness is read apart from load: a check or a load poll
that times out counts as a failure only if the worker sent nothing since it
began. A worker that is slow to answer a probe but still streams tokens to
this router (any byte on its data-path connections, ``router.upstream``), or
answers another probe meanwhile, is busy: the timeout is counted in
``slow_checks`` and nothing else happens, so its in-flight requests are never
failed because it is loaded. A refused connection, a reset or a non-200
answer still count at once.
"""

from __future__ import annotations

import asyncio
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


class HealthMonitor:
    """Runs the check and poll loops over the registry's current workers."""

    def __init__(self, registry: WorkerRegistry, upstreams: Upstreams, config: HealthConfig,
                 polled_roles: Callable[[Role], bool], on_room: Callable[[], None] = lambda: None) -> None:
        self.registry = registry
        self.upstreams = upstreams
        self.config = config
        self._polled_roles = polled_roles
        self._checking: set[str] = set()
        self._polling: set[str] = set()
        self._timeout = aiohttp.ClientTimeout(total=config.timeout_secs)
        self._tasks: set[asyncio.Task] = set()
        self.on_unhealthy: list[Callable[[Worker], None]] = []
        self.on_room = on_room  # a load report or a health change may have made room (``CapacityGate``)

    async def _get_json(self, worker: Worker, path: str) -> tuple[int, object]:
        async with self.upstreams.control.get(worker.url + path, timeout=self._timeout) as resp:
            raw = await resp.read()
            if resp.status != 200:
                return resp.status, None
            return resp.status, json.loads(raw)

    def apply(self, worker: Worker, ok: bool) -> None:
        """Fold one check result into the worker's health."""
        if ok:
            worker.ok_streak += 1
            worker.fail_streak = 0
            need = self.config.success_threshold if worker.checked else 1
            if not worker.healthy and worker.ok_streak >= need:
                worker.healthy = True
                worker.checked = True
                worker.breaker.reset()
                log.info("worker healthy", extra={"worker": worker.url, "role": worker.role.value})
                self.on_room()
        else:
            worker.fail_streak += 1
            worker.ok_streak = 0
            if worker.healthy and worker.fail_streak >= self.config.failure_threshold:
                worker.healthy = False
                worker.load = None
                log.warning("worker unhealthy", extra={"worker": worker.url,
                                                       "role": worker.role.value})
                for fn in self.on_unhealthy:
                    fn(worker)

    async def check(self, worker: Worker) -> bool:
        """One health check (skipped if one is already running for this worker)."""
        if worker.url in self._checking:
            return worker.healthy
        self._checking.add(worker.url)
        try:
            was_healthy = worker.healthy
            started = time.monotonic()
            try:
                status, _ = await self._get_json(worker, self.config.endpoint)
                ok = status == 200
            except asyncio.TimeoutError:
                if self._alive_since(worker, started):
                    self._slow(worker, "health check")
                    return worker.healthy
                ok = False
            except (aiohttp.ClientError, OSError, ValueError):
                ok = False
            if ok:
                worker.probe_seen = time.monotonic()
            if ok and not was_healthy and not await self._learn_info(worker):
                ok = False
            self.apply(worker, ok)
            return worker.healthy
        finally:
            self._checking.discard(worker.url)

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
            log.error("worker reports another role; not used", extra={
                "worker": worker.url, "registered_role": worker.role.value, "reported_role": role})
            return False
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

    def _alive_since(self, worker: Worker, started: float) -> bool:
        """The worker sent a byte (data path, or another probe's answer) since ``started``: it is alive."""
        return max(self.upstreams.last_seen(worker.url), worker.probe_seen) >= started

    def _slow(self, worker: Worker, what: str) -> None:
        worker.slow_checks += 1
        if worker.slow_checks == 1 or worker.slow_checks % 100 == 0:
            log.info("worker busy: a probe timed out while it keeps sending; not counted as a failure", extra={
                "worker": worker.url, "role": worker.role.value, "probe": what, "slow_checks": worker.slow_checks})

    async def poll_load(self, worker: Worker) -> None:
        """One ``/get_load`` poll; a failure counts as a failed health check."""
        if worker.url in self._polling:
            return
        self._polling.add(worker.url)
        started = time.monotonic()
        try:
            status, body = await self._get_json(worker, "/get_load")
            if status == 200 and isinstance(body, dict):
                now = time.monotonic()
                worker.set_load(LoadReport.from_json(body, now))
                worker.probe_seen = now
                self.on_room()
            else:
                self.apply(worker, False)
        except asyncio.TimeoutError:
            if self._alive_since(worker, started):
                self._slow(worker, "load poll")
            else:
                self.apply(worker, False)
        except (aiohttp.ClientError, OSError, ValueError):
            self.apply(worker, False)
        finally:
            self._polling.discard(worker.url)

    def poke(self, worker: Worker) -> None:
        """Check ``worker`` now, in the background (after a data-path connection error)."""
        self._spawn(self.check(worker))

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def check_all(self) -> None:
        """Check every worker once and wait for the answers."""
        await asyncio.gather(*(self.check(w) for w in self.registry.all()))

    async def run_checks(self) -> None:
        """Loop: a health check of every worker each interval."""
        while True:
            for worker in self.registry.all():
                self._spawn(self.check(worker))
            await asyncio.sleep(self.config.interval_secs)

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
