"""``pd-serve --ray-address ADDR --autoscale``: the planner beside a cluster of Ray actors (the Ray connector).

`AutoscaledRayCluster` is a `RayCluster` that, once ready, runs the planner (`PlannerRunner`) in a thread with a
`RayConnector`. A new worker is one more `ProcessActor` in a placement group of its own, placed and named as the
launch's workers are (``pd-worker-<role>-<i>``), so the router's Ray discovery finds it; the connector then waits
until the router lists it healthy. A drained worker (`ActionConnector`: the router stops routing to it, its
requests end, its pages are free) leaves the router, and its actor is stopped (its process drains on SIGINT),
killed and its placement group removed; discovery forgets it at its next poll. A local Ray instance
(``--ray-address local``) gets a CPU slot for every worker the planner may run (``--max-prefill`` +
``--max-decode``, or ``--max-workers``).
"""

from __future__ import annotations

import sys
import threading
import time

from pd_cluster.launch.ray_cluster import ACTOR_PREFIX, STOP_TIMEOUT_S, RayCluster
from pd_cluster.planner.actions import ActionConnector, ActionFailed, RouterAdmin
from pd_cluster.planner.config import PlannerConfig
from pd_cluster.planner.runner import PlannerMetrics, PlannerRunner
from pd_cluster.planner.scrape import MetricsSource, WorkerView


class RayConnector(ActionConnector):
    """Starts and stops worker actors of an `AutoscaledRayCluster` (`ActionConnector` does the rest)."""

    name = "ray"
    discovered = True  # the router's Ray discovery lists the actors

    def __init__(self, cluster: AutoscaledRayCluster, admin: RouterAdmin, metrics: PlannerMetrics | None = None,
                 **kw) -> None:
        super().__init__(admin, metrics, **kw)
        self.cluster = cluster

    def start_worker(self, role: str) -> str:
        try:
            return self.cluster.add_worker(role, self.start_timeout_secs)
        except RuntimeError as e:
            raise ActionFailed(str(e)) from e

    def stop_worker(self, worker: WorkerView) -> None:
        if not self.cluster.remove_worker(worker.url):
            raise ActionFailed(f"{worker.url} is not an actor of this launcher")


class AutoscaledRayCluster(RayCluster):
    """A `RayCluster` with the planner running beside it once ready (module docstring)."""

    def __init__(self, address: str, spec, tp_size: int | None, planner: PlannerConfig,
                 metrics_port: int = 0) -> None:
        super().__init__(address, spec, tp_size)
        self.planner_config = planner
        self.metrics_port = metrics_port
        self.metrics = PlannerMetrics()
        self.runner: PlannerRunner | None = None
        self.connector: RayConnector | None = None
        self._metrics_server = None
        self._lock = threading.Lock()  # the actor lists: the connector's threads and `tend`
        self._changed = False
        self._reserved: set[str] = set()  # names of actors being placed

    def max_local_workers(self) -> int:
        cfg = self.planner_config
        return max(len(self.roles()), cfg.max_workers or cfg.max_prefill + cfg.max_decode)

    def start(self, timeout: float) -> None:
        super().start(timeout)
        self.start_planner()

    def start_planner(self) -> None:
        """Start the planner's loop (again after `PlannerRunner.stop`: it resumes from the router's counts); the
        metrics server and its counters are kept."""
        from prometheus_client import start_http_server

        from pd_cluster.common.net import free_port

        if self._metrics_server is None:
            port = self.metrics_port or free_port(self.spec.host)
            self._metrics_server, _ = start_http_server(port, self.spec.host, registry=self.metrics.registry)
            self.metrics_port = port
        self.connector = RayConnector(self, RouterAdmin(self.router_url, self.spec.admin_api_key), self.metrics)
        source = MetricsSource(self.router_url, self.spec.admin_api_key, api_key=self.spec.api_key)
        self.runner = PlannerRunner(self.planner_config, source, self.connector, self.metrics)
        self.runner.start()
        self.manifest["planner"] = {"metrics_url": f"http://{self.spec.host}:{self.metrics_port}/metrics"}
        print(f"pd-serve: planner running: every {self.planner_config.interval_secs:g} s, pd:planner_* metrics on "
              f"{self.manifest['planner']['metrics_url']}", file=sys.stderr, flush=True)

    # ---- the connector's actions (its threads) ----------------------------------------------------------------
    def add_worker(self, role: str, timeout: float) -> str:
        """Start one more `role` worker actor and wait for its ``/health``; returns its URL.

        Raises:
            RuntimeError: no node had its resources, or it did not answer within `timeout` s (it is removed).
        """
        import ray

        deadline = time.monotonic() + timeout
        with self._lock:
            taken = set(self.names) | self._reserved
            index = next(i for i in range(len(taken) + 1) if f"{ACTOR_PREFIX}-{role}-{i}" not in taken)
            name = f"{ACTOR_PREFIX}-{role}-{index}"
            self._reserved.add(name)
        try:
            placed = self.place_worker(role, index, deadline)  # no lock held: it may wait for resources
            with self._lock:
                self.add_actor(*placed)
        finally:
            self._reserved.discard(name)
        actor = placed[1]
        try:
            info = ray.get(actor.info.remote(), timeout=max(deadline - time.monotonic(), 1.0))
            self._wait_ready(ray, [info], deadline, [actor], router=False)
        except Exception as e:
            self._remove(name)
            raise RuntimeError(f"{name} did not start: {e}") from e
        with self._lock:
            self.manifest.setdefault("workers", []).append(dict(info, restarts=0))
            self._changed = True
        return info["url"]

    def remove_worker(self, url: str) -> bool:
        """Stop the worker actor serving `url` (`_remove`); False when none of this launcher's does."""
        with self._lock:
            name = next((w["name"] for w in self.manifest.get("workers", []) if w["url"] == url), None)
        return name is not None and self._remove(name)

    def _remove(self, name: str) -> bool:
        """Stop actor `name` (its process drains on SIGINT), kill it and remove its placement group."""
        import ray
        from ray.util.placement_group import remove_placement_group

        with self._lock:
            if name not in self.names:
                return False
            i = self.names.index(name)
            actor, pg = self.workers.pop(i), self.groups.pop(i)
            self.names.pop(i)
            self.manifest["workers"] = [w for w in self.manifest.get("workers", []) if w["name"] != name]
            self._changed = True
        try:
            ray.get(actor.stop.remote(), timeout=STOP_TIMEOUT_S + 10)
        except Exception as e:  # noqa: BLE001 - gone already: its child got the parent-death signal
            print(f"pd-serve: {name} was already gone ({type(e).__name__})", file=sys.stderr, flush=True)
        ray.kill(actor)
        remove_placement_group(pg)
        print(f"pd-serve: stopped {name}", file=sys.stderr, flush=True)
        return True

    # ---- supervision ---------------------------------------------------------------------------------------------
    def tend(self) -> bool:
        with self._lock:
            changed = super().tend() or self._changed
            self._changed = False
        return changed

    def stop(self) -> None:
        if self.runner is not None:
            self.runner.stop()
        if self.connector is not None:
            self.connector.wait_idle(STOP_TIMEOUT_S)
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        super().stop()
