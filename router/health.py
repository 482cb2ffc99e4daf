"""Active health checks, ``/server_info`` learning and ``/get_load`` polling.

Health: ``GET /health`` every ``--health-check-interval-secs``; a worker turns
unhealthy after ``--health-failure-threshold`` failures in a row and healthy
after ``--health-success-threshold`` successes (one for a worker never seen
healthy). A failed load poll, or a connection error on the data path, counts
as a failed check at once, so a dead worker leaves the rotation within a few
load periods rather than a few health periods. Turning healthy closes the
worker's circuit breaker: the check just proved it answers.

On turning healthy the router reads ``/server_info``: the served model name,
and the role, which must match the role the worker was registered with (a
decode worker registered as prefill is never used, and an error is logged).
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
                 polled_roles: Callable[[Role], bool]) -> None:
        self.registry = registry
        self.upstreams = upstreams
        self.config = config
        self._polled_roles = polled_roles
        self._checking: set[str] = set()
        self._polling: set[str] = set()
        self._timeout = aiohttp.ClientTimeout(total=config.timeout_secs)
        self._tasks: set[asyncio.Task] = set()
        self.on_unhealthy: list[Callable[[Worker], None]] = []

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
            try:
                status, _ = await self._get_json(worker, self.config.endpoint)
                ok = status == 200
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
                ok = False
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
        if isinstance(name, str):
            worker.served_model_name = name
        incarnation = info.get("incarnation")
        if incarnation is not None:
            worker.incarnation = str(incarnation)
        return True

    async def poll_load(self, worker: Worker) -> None:
        """One ``/get_load`` poll; a failure counts as a failed health check."""
        if worker.url in self._polling:
            return
        self._polling.add(worker.url)
        try:
            status, body = await self._get_json(worker, "/get_load")
            if status == 200 and isinstance(body, dict):
                worker.set_load(LoadReport.from_json(body, time.monotonic()))
            else:
                self.apply(worker, False)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
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
