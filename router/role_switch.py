"""Role switching (elastic PD): ``POST /workers/{id}/role`` turns a prefill worker into a decode worker or back,
without reloading its weights.

The router's half of the switch, in order:

1. Refusals, in OpenAI's error format: an unknown id (404 ``worker_not_found``), a role other than ``prefill`` or
   ``decode`` (400, ``param: "role"``), a mixed worker (400), a worker found by discovery (409: its labels give
   its role), a switch already under way (409 ``switch_in_progress``), and a switch that would leave no worker
   of the role it leaves (409 ``would_leave_no_worker``, naming the role). A worker already in the role
   answers 200 with ``"switched": false``.
2. The worker is marked ``switching`` (`Worker.switching`): from that moment no new request is routed to it
   in its old role, and it is neither probed nor polled.
3. The router waits for its own requests in flight on the worker to leave it (a prefill's until its first
   token, a decode's until their end), then calls the worker's internal ``POST /role``
   (``launch/role_switch.py``): the worker finishes what it still holds (a prefill's outstanding KV pushes, a
   decode's running requests), releases every page, tears down its role's parts (server, KV sender or
   receiver, NIXL agent), keeps the engine (weights and KV pool), and sets the new role's parts up.
4. On its 200 the worker is re-registered under the new role (same URL, same id, same source) and checked once,
   so it serves new traffic at once. On a failure it keeps its old role and is routed to again.

Each switch is logged and counted (``pd_router_role_switches_total{from_role,to_role,outcome}``), and a
successful one timed (``pd_router_role_switch_duration_seconds``). SGLang's runtime role switching (PR #28403)
and vLLM's RFC #56133 are the anchors; ``docs/elastic.md`` has the measurements.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx

from pd_cluster.router.config import Role, RouterConfig
from pd_cluster.router.health import HealthMonitor
from pd_cluster.router.metrics import RouterMetrics
from pd_cluster.router.workers import Worker, WorkerRegistry

log = logging.getLogger("pd_cluster.router.role_switch")

SWITCHABLE_SOURCES = ("static", "admin")
"""Sources whose workers may switch role: a discovery source (Kubernetes, Ray) re-adds a worker in the role its
labels give."""

WORKER_ROLE_PATH = "/role"
SETUP_MARGIN_S = 30.0
"""Seconds the router waits for the worker past the drain deadline it gives it (the new role's set-up)."""
"""The worker's internal endpoint that performs the switch (``launch/role_switch.py``)."""


class SwitchRefused(Exception):
    """A switch refused or failed: the HTTP status, message, param and code of its OpenAI error body (or the
    worker's own body, relayed)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 body: bytes | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.body = status, message, param, code, body


class RoleSwitcher:
    """Runs role switches over the registry (one per worker at a time).

    Args:
        config: the router's config (its internal key goes on the call to the worker).
        registry, monitor, metrics: the router's live objects.
        poll_s: how often the wait for the router's in-flight requests on the worker looks (seconds).
    """

    def __init__(self, config: RouterConfig, registry: WorkerRegistry, monitor: HealthMonitor,
                 metrics: RouterMetrics, poll_s: float = 0.02) -> None:
        self.config, self.registry, self.monitor, self.metrics = config, registry, monitor, metrics
        self.poll_s = poll_s

    def _check(self, worker: Worker | None, worker_id: str, role: str) -> tuple[Worker, Role]:
        """Step 1's refusals; returns the worker and its new role."""
        if worker is None:
            raise SwitchRefused(404, f"no worker with id {worker_id!r}", "id", "worker_not_found")
        if role not in (Role.PREFILL.value, Role.DECODE.value):
            raise SwitchRefused(400, f"role must be 'prefill' or 'decode', got {role!r}", "role", "invalid_value")
        if worker.role is Role.MIXED:
            raise SwitchRefused(400, f"worker {worker.id} is a mixed worker: it has no PD role to switch",
                                "role", "invalid_value")
        if worker.switching is not None:
            raise SwitchRefused(409, f"worker {worker.id} is already switching to {worker.switching.value}",
                                None, "switch_in_progress")
        if worker.draining:
            raise SwitchRefused(409, f"worker {worker.id} is draining", None, "worker_draining")
        if worker.source not in SWITCHABLE_SOURCES:
            raise SwitchRefused(409, f"worker {worker.id} was found by {worker.source} discovery, whose labels "
                                f"give its role; change the workload's labels instead", None, "discovered_worker")
        new = Role(role)
        if new is worker.role:
            return worker, new
        if not self._others(worker):
            raise SwitchRefused(409, f"switching worker {worker.id} to {new.value} would leave no "
                                f"{worker.role.value} worker", "role", "would_leave_no_worker")
        return worker, new

    async def switch(self, worker_id: str, role: Any, timeout_secs: float) -> dict[str, Any]:
        """Switch worker `worker_id` to `role`; returns its ``/workers`` entry with the switch's timings.

        Raises:
            SwitchRefused: a refusal (step 1), a timeout (504) or the worker's failure (its status and body).
        """
        worker, new = self._check(self.registry.by_id(worker_id), worker_id, role if isinstance(role, str) else
                                  repr(role))
        if new is worker.role:
            return dict(worker.describe(time.monotonic()), switched=False)
        old = worker.role
        started = time.monotonic()
        deadline = started + timeout_secs
        worker.switching = new
        self.registry.touch()
        log.info("role switch started: no new %s work", old.value, extra={
            "worker": worker.url, "id": worker.id, "from_role": old.value, "to_role": new.value})
        try:
            while worker.inflight > 0:  # the router's own requests on it leave first
                if time.monotonic() > deadline:
                    raise SwitchRefused(504, f"worker {worker.id} still had {worker.inflight} request(s) of this "
                                        f"router in flight after {timeout_secs:g} s", None, "switch_timeout")
                await asyncio.sleep(self.poll_s)
            routed_away = time.monotonic() - started
            answer = await self._call_worker(worker, new, max(1.0, deadline - time.monotonic()))
        except BaseException as exc:
            worker.switching = None  # it keeps its old role and takes work again
            self.registry.touch()
            self.metrics.role_switches.labels(old.value, new.value, "failed").inc()
            log.warning("role switch failed; the worker keeps its role", extra={
                "worker": worker.url, "id": worker.id, "from_role": old.value, "to_role": new.value,
                "reason": str(exc)})
            raise
        self.registry.remove(worker.url)
        again = self.registry.add(worker.url, new, worker.source)
        await self.monitor.check(again)
        took = time.monotonic() - started
        self.metrics.role_switches.labels(old.value, new.value, "ok").inc()
        self.metrics.role_switch_seconds.labels(old.value, new.value).observe(took)
        log.info("role switch done", extra={
            "worker": again.url, "id": again.id, "from_role": old.value, "to_role": new.value,
            "secs": round(took, 3), "healthy": again.healthy})
        return dict(again.describe(time.monotonic()), switched=True, from_role=old.value, switch_secs=round(took, 3),
                    router_drain_secs=round(routed_away, 3), worker=answer)

    def _others(self, worker: Worker) -> list[Worker]:
        """The workers of `worker`'s role that would still serve it without `worker`."""
        return [w for w in self.registry.of_role(worker.role)
                if w is not worker and w.switching is None and not w.draining]

    async def drain(self, worker_id: str, timeout_secs: float) -> dict[str, Any]:
        """Stop routing new work to worker `worker_id` and wait until this router's requests on it have left it
        (a prefill's until their first token, a decode's until their end): the first half of a scale-down (a
        planner then waits for the worker's own queues and pages, stops it and removes it). The worker stays in
        the registry, marked ``draining``, until removed; ``DELETE`` it, or a failed drain (504 past
        `timeout_secs`) routes to it again.

        Raises:
            SwitchRefused: 404 unknown id, 409 a worker switching role, already draining, or the last of its role
                (``would_leave_no_worker``), 504 ``drain_timeout``.
        """
        worker = self.registry.by_id(worker_id)
        if worker is None:
            raise SwitchRefused(404, f"no worker with id {worker_id!r}", "id", "worker_not_found")
        if worker.switching is not None or worker.draining:
            raise SwitchRefused(409, f"worker {worker.id} is already switching role or draining", None,
                                "switch_in_progress")
        if worker.role is not Role.MIXED and not self._others(worker):
            raise SwitchRefused(409, f"draining worker {worker.id} would leave no {worker.role.value} worker",
                                None, "would_leave_no_worker")
        started = time.monotonic()
        worker.draining = True
        self.registry.touch()
        log.info("drain started: no new work", extra={"worker": worker.url, "id": worker.id,
                                                      "role": worker.role.value})
        while worker.inflight > 0:
            if time.monotonic() - started > timeout_secs:
                worker.draining = False
                self.registry.touch()
                raise SwitchRefused(504, f"worker {worker.id} still had {worker.inflight} request(s) of this router "
                                    f"in flight after {timeout_secs:g} s; it takes work again", None, "drain_timeout")
            await asyncio.sleep(self.poll_s)
        took = time.monotonic() - started
        log.info("drain done", extra={"worker": worker.url, "id": worker.id, "secs": round(took, 3)})
        return dict(worker.describe(time.monotonic()), drain_secs=round(took, 3))

    async def _call_worker(self, worker: Worker, role: Role, timeout: float) -> dict[str, Any]:
        """The worker's ``POST /role``: it drains, re-sets-up its role and answers with its timings."""
        key = self.config.security.internal_api_key
        headers = {"X-PD-Internal-Key": key} if key else {}
        client_timeout = httpx.Timeout(timeout + SETUP_MARGIN_S, connect=self.config.limits.connect_timeout_secs)
        try:
            async with httpx.AsyncClient(timeout=client_timeout) as client:
                r = await client.post(worker.url + WORKER_ROLE_PATH, headers=headers,
                                      json={"role": role.value, "timeout_secs": timeout})
        except httpx.HTTPError as exc:
            raise SwitchRefused(502, f"worker {worker.id} did not answer its role switch: {type(exc).__name__}",
                                None, "worker_unreachable") from None
        if r.status_code != 200:
            raise SwitchRefused(r.status_code, f"worker {worker.id} refused the switch", body=r.content)
        try:
            return r.json()
        except ValueError:
            return {}
