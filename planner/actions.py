"""Carrying out a decision: the router's admin calls and the connector's background actions.

A decision changes each role by at most one worker (`pd_cluster.planner.decision`). `ActionConnector.apply` turns
it into actions, each run in its own thread so the planner keeps deciding meanwhile (a role with an action under
way holds, the other does not: `targets`):

* one role +1 and the other -1 (at ``--max-workers``): **switch** a worker of the shrinking role
  (``POST /workers/{id}/role`` on the router: it drains and re-registers, no weights reloaded);
* a role +1: **start** a worker (`ActionConnector.start_worker`, the connector's own way) and wait until the
  router lists it healthy;
* a role -1: **drain** a worker, then stop it: the router stops routing to it and waits for its own requests
  on it to leave (``POST /workers/{id}/drain``); then the worker's ``/get_load`` must show nothing running,
  queued or in transfer and every page free for `SETTLE_S` in a row; then it leaves the router
  (``DELETE /workers``) and is stopped (`ActionConnector.stop_worker`). A drain that does not end in time is
  given up and the worker serves again. The worker chosen is the one with the fewest requests in flight.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import httpx

from pd_cluster.planner.decision import ROLES, Decision
from pd_cluster.planner.runner import PlannerMetrics
from pd_cluster.planner.scrape import ClusterView, WorkerView

log = logging.getLogger("pd_cluster.planner.actions")

SETTLE_S = 0.2
"""Seconds a drained worker must stay idle before it is stopped (a call routed just before the drain arrives)."""


class ActionFailed(RuntimeError):
    """An action that did not complete (the cluster keeps its size for that role)."""


class RouterAdmin:
    """The router's admin API calls a connector makes (with the admin key when there is one)."""

    def __init__(self, router_url: str, admin_api_key: str | None = None, timeout: float = 30.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.url = router_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {admin_api_key}"} if admin_api_key else {}
        self.timeout = timeout
        self.transport = transport  # httpx's own by default

    def _call(self, method: str, path: str, timeout: float | None = None, **kw) -> Any:
        with httpx.Client(timeout=timeout or self.timeout, headers=self.headers, transport=self.transport) as c:
            r = c.request(method, self.url + path, **kw)
        if r.status_code >= 400:
            raise ActionFailed(f"{method} {path}: {r.status_code} {r.text[:300]}")
        return r.json()

    def switch_role(self, worker_id: str, role: str, timeout_secs: float) -> dict:
        return self._call("POST", f"/workers/{worker_id}/role", timeout_secs + 60,
                          json={"role": role, "timeout_secs": timeout_secs})

    def drain(self, worker_id: str, timeout_secs: float) -> dict:
        return self._call("POST", f"/workers/{worker_id}/drain", timeout_secs + 30,
                          params={"timeout_secs": timeout_secs})

    def undrain(self, worker_id: str) -> dict:
        return self._call("DELETE", f"/workers/{worker_id}/drain")

    def add(self, url: str, role: str) -> dict:
        return self._call("POST", "/workers", json={"url": url, "role": role})

    def remove(self, url: str) -> None:
        self._call("DELETE", "/workers", params={"url": url})

    def workers(self) -> list[dict]:
        return self._call("GET", "/workers")["workers"]

    def wait_healthy(self, url: str, timeout: float) -> None:
        """Until the router lists `url` healthy and not draining.

        Raises:
            ActionFailed: not within `timeout` seconds.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if any(w["url"] == url and w["healthy"] and not w.get("draining") for w in self.workers()):
                    return
            except (httpx.HTTPError, ActionFailed):
                pass
            time.sleep(0.2)
        raise ActionFailed(f"the router did not list {url} healthy within {timeout:g} s")


def worker_idle(load: dict) -> bool:
    """Nothing running, queued or in KV transfer on a worker, and every page free (``/get_load``)."""
    return (load.get("num_running_reqs") == 0 and load.get("num_queue_reqs") == 0
            and load.get("num_free_pages") == load.get("num_total_pages")
            and not load.get("num_prefill_inflight_queue_reqs") and not load.get("num_decode_transfer_queue_reqs")
            and not load.get("num_decode_prealloc_queue_reqs"))


def wait_worker_idle(url: str, timeout: float, transport: httpx.BaseTransport | None = None) -> dict:
    """Poll ``url``'s ``/get_load`` until `worker_idle` holds `SETTLE_S` in a row; returns the last load.

    Raises:
        ActionFailed: not idle within `timeout` seconds.
    """
    deadline = time.monotonic() + timeout
    quiet_since = None
    load: dict = {}
    with httpx.Client(timeout=5.0, transport=transport) as c:
        while True:
            now = time.monotonic()
            try:
                load = c.get(url + "/get_load").json()
            except (httpx.HTTPError, ValueError):
                load = {}
            if load and worker_idle(load):
                quiet_since = now if quiet_since is None else quiet_since
                if now - quiet_since >= SETTLE_S:
                    return load
            else:
                quiet_since = None
            if now > deadline:
                raise ActionFailed(f"{url} was not idle after {timeout:g} s: {load}")
            time.sleep(0.02)


class ActionConnector:
    """Turns decisions into background actions (module docstring). A subclass starts and stops workers its way.

    Args:
        admin: the router's admin API.
        metrics: where each action's outcome is counted.
        drain_timeout_secs: the most a drain or a role switch may take.
        start_timeout_secs: the most a new worker may take to serve.
    """

    name = "actions"
    discovered = False  # the router finds this connector's workers itself (Ray discovery): no admin add, and a
    # drained worker is stopped before it leaves the router

    def __init__(self, admin: RouterAdmin, metrics: PlannerMetrics | None = None, drain_timeout_secs: float = 600.0,
                 start_timeout_secs: float = 300.0) -> None:
        self.admin, self.metrics = admin, metrics
        self.drain_timeout_secs, self.start_timeout_secs = drain_timeout_secs, start_timeout_secs
        self._lock = threading.Lock()
        self._targets: dict[str, int] = {}  # role -> the count its action under way brings it to
        self.threads: list[threading.Thread] = []
        self.done: list[tuple[str, str, str, str]] = []  # (action, role, outcome, detail), in order

    # ---- to override ------------------------------------------------------------------------------------------
    def start_worker(self, role: str) -> str:
        """Start a worker of `role`; returns its URL once it answers (the router is told by the caller)."""
        raise NotImplementedError

    def stop_worker(self, worker: WorkerView) -> None:
        """Stop a drained worker that has left the router."""
        raise NotImplementedError

    # ---- Connector --------------------------------------------------------------------------------------------
    def targets(self) -> dict[str, int]:
        with self._lock:
            return dict(self._targets)

    def apply(self, decision: Decision, view: ClusterView) -> None:
        cur, tgt = decision.current, decision.target
        delta = {r: tgt.get(r) - cur.get(r) for r in ROLES}
        with self._lock:
            if any(delta[r] and r in self._targets for r in ROLES):
                return  # a role already under way: its next decision sees the result
            for r in ROLES:
                if delta[r]:
                    self._targets[r] = tgt.get(r)
        if delta["prefill"] * delta["decode"] < 0:
            grow = "prefill" if delta["prefill"] > 0 else "decode"
            shrink = "decode" if grow == "prefill" else "prefill"
            self._spawn("switch", (grow, shrink), self._switch, view, shrink, grow)
            return
        for role in ROLES:
            if delta[role] > 0:
                self._spawn("start", (role,), self._start, role)
            elif delta[role] < 0:
                self._spawn("drain", (role,), self._drain, view, role)

    def wait_idle(self, timeout: float) -> bool:
        """Until no action is under way (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        for t in list(self.threads):
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self.threads)

    # ---- actions ----------------------------------------------------------------------------------------------
    def _spawn(self, action: str, roles: tuple[str, ...], fn, *args) -> None:
        def run() -> None:
            outcome, detail = "ok", ""
            try:
                detail = fn(*args) or ""
            except Exception as e:  # noqa: BLE001 - reported, counted; the role keeps its size
                outcome, detail = "failed", str(e)
                log.warning("planner: %s %s failed: %s", action, "/".join(roles), e)
            finally:
                with self._lock:
                    for r in roles:
                        self._targets.pop(r, None)
            self.done.append((action, roles[0], outcome, detail))
            if self.metrics is not None:
                self.metrics.actions.labels(action, roles[0], outcome).inc()
        t = threading.Thread(target=run, name=f"planner-{action}", daemon=True)
        self.threads = [x for x in self.threads if x.is_alive()] + [t]
        t.start()

    @staticmethod
    def _pick(view: ClusterView, role: str) -> WorkerView:
        """The serving worker of `role` with the fewest requests in flight (the newest on a tie)."""
        workers = view.serving(role)
        if not workers:
            raise ActionFailed(f"no serving {role} worker to take")
        busy = {w.id: w.inflight + ((w.load or {}).get("num_running_reqs", 0)) for w in workers}
        return min(reversed(workers), key=lambda w: busy[w.id])

    def _switch(self, view: ClusterView, old: str, new: str) -> str:
        w = self._pick(view, old)
        log.info("planner: switching %s (%s) from %s to %s", w.id, w.url, old, new)
        out = self.admin.switch_role(w.id, new, self.drain_timeout_secs)
        return f"{w.url} {old} -> {new} in {out.get('switch_secs')} s"

    def _start(self, role: str) -> str:
        t0 = time.monotonic()
        url = self.start_worker(role)
        if not self.discovered:
            self.admin.add(url, role)
        self.admin.wait_healthy(url, self.start_timeout_secs)
        took = time.monotonic() - t0
        log.info("planner: new %s worker %s serving after %.1f s", role, url, took)
        return f"{url} serving after {took:.1f} s"

    def drain_worker(self, w: WorkerView) -> None:
        """The router stops routing to `w` and its requests leave it; then `w` must be idle with every page free.

        Raises:
            ActionFailed: a refusal, or not idle in time (the drain is given up: `w` serves again).
        """
        log.info("planner: draining %s worker %s (%s)", w.role, w.id, w.url)
        self.admin.drain(w.id, self.drain_timeout_secs)
        try:
            wait_worker_idle(w.url, self.drain_timeout_secs, self.admin.transport)
        except ActionFailed:
            self.admin.undrain(w.id)
            raise

    def _drain(self, view: ClusterView, role: str) -> str:
        w = self._pick(view, role)
        t0 = time.monotonic()
        self.drain_worker(w)
        if self.discovered:  # gone first: the router's discovery would list a worker that still answers again
            self.stop_worker(w)
            try:
                self.admin.remove(w.url)
            except ActionFailed:  # discovery forgot it first
                pass
        else:
            self.admin.remove(w.url)
            self.stop_worker(w)
        took = time.monotonic() - t0
        log.info("planner: %s worker %s drained and stopped in %.1f s", role, w.url, took)
        return f"{w.url} drained and stopped in {took:.1f} s"
