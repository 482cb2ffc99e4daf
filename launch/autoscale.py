"""``pd-serve --autoscale``: the planner beside a local cluster, starting and draining worker processes.

`AutoscaledCluster` is a `LocalCluster` that, once ready, runs a `pd_cluster.planner.runner.PlannerRunner` in a
thread with a `LocalConnector`: a new worker is one more ``pd-worker`` process on a free loopback port (started
as the launch's workers are, from the launcher's one spawner thread, and registered with the router once it
answers ``/health``); a drained worker leaves the launcher's list before it is sent SIGTERM, so the supervision
loop never restarts it. The planner's ``pd:planner_*`` metrics are served on ``--planner-metrics-port``
(``prometheus_client``'s HTTP server; 0: a free port), whose URL is in the manifest under ``planner``.

Flags (`add_autoscale_args`): ``--autoscale`` and the planner's own (`pd_cluster.planner.config`:
``--ttft-slo-ms``, ``--itl-slo-ms``, ``--min-prefill``, ``--max-prefill``, ``--min-decode``, ``--max-decode``,
``--max-workers``, ``--planner-*``), as Dynamo's SLA planner takes its targets and bounds.
"""

from __future__ import annotations

import argparse
import signal
import time

import httpx

from pd_cluster.common.net import free_port
from pd_cluster.launch.cluster import LocalCluster, Proc, signal_all, wait_or_kill
from pd_cluster.planner.actions import ActionConnector, ActionFailed, RouterAdmin
from pd_cluster.planner.config import PlannerConfig, add_planner_args, planner_config_from_args
from pd_cluster.planner.runner import PlannerMetrics, PlannerRunner
from pd_cluster.planner.scrape import MetricsSource, WorkerView


def add_autoscale_args(p: argparse.ArgumentParser) -> None:
    """``--autoscale``, ``--planner-metrics-port`` and the planner's flags on pd-serve's parser."""
    p.add_argument("--autoscale", action="store_true",
                   help="run the planner: size each role to --ttft-slo-ms and --itl-slo-ms within --min-*/--max-* by "
                        "starting, draining and switching workers (docs/elastic.md)")
    p.add_argument("--planner-metrics-port", type=int, default=0,
                   help="with --autoscale: the port of the planner's pd:planner_* metrics (0: a free port)")
    add_planner_args(p)


def autoscale_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> PlannerConfig | None:
    """The planner's config with ``--autoscale`` (a bad flag stops `parser`, naming it), else None."""
    if not args.autoscale:
        from pd_cluster.planner.config import PLANNER_FLAGS

        given = [f.name for f in PLANNER_FLAGS if getattr(args, f.dest) != parser.get_default(f.dest)]
        if given or args.planner_metrics_port:
            parser.error(f"{(given or ['--planner-metrics-port'])[0]} is a planner flag: it needs --autoscale")
        return None
    if args.colocated:
        parser.error("--autoscale sizes prefill and decode workers: it does not apply to --colocated")
    if not 0 <= args.planner_metrics_port < 65536:
        parser.error(f"--planner-metrics-port: {args.planner_metrics_port} is not a TCP port")
    config = planner_config_from_args(parser, args)
    if args.ray_address and config.max_workers:
        parser.error("--max-workers with --ray-address: at the cap the planner switches a worker's role, which the "
                     "router does not do for workers its Ray discovery found; bound each role with --max-prefill and "
                     "--max-decode")
    return config


class LocalConnector(ActionConnector):
    """Starts and stops ``pd-worker`` processes of a `LocalCluster` (`ActionConnector` does the rest)."""

    name = "local"

    def __init__(self, cluster: LocalCluster, admin: RouterAdmin, metrics: PlannerMetrics | None = None,
                 **kw) -> None:
        super().__init__(admin, metrics, **kw)
        self.cluster = cluster
        self.changed = False  # the launcher's list changed (the manifest is written again)

    def start_worker(self, role: str) -> str:
        c = self.cluster
        names = {p.name for p in c.procs}
        name = next(f"{role}-{i}" for i in range(len(names) + 1) if f"{role}-{i}" not in names)
        c._add_worker(name, role, free_port(c.spec.host))
        p = c.procs[-1]
        c._spawn(p)
        self.changed = True
        deadline = time.monotonic() + self.start_timeout_secs
        with httpx.Client(timeout=2.0) as client:
            while True:
                if not p.alive():
                    c.procs.remove(p)
                    raise ActionFailed(f"{name} exited with code {p.popen.poll()} during start-up")
                try:
                    if client.get(p.url + "/health").status_code == 200:
                        return p.url
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    self._stop(p)
                    raise ActionFailed(f"{name} did not answer /health within {self.start_timeout_secs:g} s")
                time.sleep(0.2)

    def stop_worker(self, worker: WorkerView) -> None:
        p = next((q for q in self.cluster.procs if q.url == worker.url), None)
        if p is None:
            raise ActionFailed(f"{worker.url} is not a process of this launcher")
        self._stop(p)

    def _stop(self, p: Proc) -> None:
        self.cluster.procs.remove(p)  # first: the supervision loop must not restart it
        self.changed = True
        signal_all([p], signal.SIGTERM)
        wait_or_kill([p], 30.0, None, self.cluster._say)


class AutoscaledCluster(LocalCluster):
    """A `LocalCluster` with the planner running beside it once ready (module docstring)."""

    def __init__(self, spec, planner: PlannerConfig, metrics_port: int = 0) -> None:
        super().__init__(spec)
        self.planner_config = planner
        self.metrics_port = metrics_port
        self.runner: PlannerRunner | None = None
        self.connector: LocalConnector | None = None
        self._metrics_server = None
        self._resynced_pid: int | None = None  # the router process resync_router last registered workers with

    def start(self, timeout: float | None = None) -> None:
        super().start(timeout)
        self._resynced_pid = self.router.pid  # started with the launch's workers: nothing to register
        if timeout is not None:
            self.start_planner()

    def start_planner(self) -> None:
        """Start the planner's loop (again, after `PlannerRunner.stop`: a new planner reads the cluster's counts
        and resumes from them); the metrics server and its counters are kept across restarts."""
        from prometheus_client import start_http_server

        if self._metrics_server is None:
            self.metrics = PlannerMetrics()
            port = self.metrics_port or free_port(self.spec.host)
            self._metrics_server, _ = start_http_server(port, self.spec.host, registry=self.metrics.registry)
            self.metrics_port = port
        admin = RouterAdmin(self.router_url, self.spec.admin_api_key)
        self.connector = LocalConnector(self, admin, self.metrics)
        source = MetricsSource(self.router_url, self.spec.admin_api_key, api_key=self.spec.api_key)
        self.runner = PlannerRunner(self.planner_config, source, self.connector, self.metrics)
        if self.router.restarts.awaiting_health or not self.router.alive():
            self.runner.paused = "the router (restarting)"
        self.runner.start()
        self._say(f"planner running: every {self.planner_config.interval_secs:g} s, pd:planner_* metrics on "
                  f"http://{self.spec.host}:{self.metrics_port}/metrics")

    def tend(self, now: float | None = None) -> bool:
        router = self.router
        router_down = router.restarts.awaiting_health or not router.alive()
        if router_down and self.runner is not None:  # until the restarted router knows the planner's workers
            self.runner.paused = "the router (restarting)"
        changed = super().tend(now)
        # A restarted router's flags name the launch's workers: when the planner has stopped one of those, the
        # router is never ready (no usable pair) until it learns the planner's workers, so register them as soon
        # as it is alive (/health), before readiness, and on every later step until that succeeds; the planner
        # thaws only then.
        if router.alive() and router.pid != self._resynced_pid and (
                not router.restarts.awaiting_health or self._router_live()):
            if self.resync_router():
                self._resynced_pid = router.pid
        if (self.runner is not None and self.runner.paused and router.alive()
                and not router.restarts.awaiting_health and router.pid == self._resynced_pid):
            self.runner.paused = None
        if self.connector is not None and self.connector.changed:
            self.connector.changed = False
            changed = True
        return changed

    def _router_live(self) -> bool:
        try:
            return httpx.get(self.router_url + "/health", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def resync_router(self) -> bool:
        """After a router restart: its flags name the launch's workers, not the planner's. Register every worker
        process in the role it serves now (``/server_info``) and remove what is no longer a process.

        Returns False (and says why) when the router or a worker did not answer; the next `tend` tries again."""
        headers = {"Authorization": f"Bearer {self.spec.admin_api_key}"} if self.spec.admin_api_key else {}
        failed = []
        with httpx.Client(timeout=5.0, headers=headers) as c:
            try:
                listed = {w["url"]: w["role"] for w in c.get(self.router_url + "/workers").json()["workers"]}
                for url in set(listed) - {p.url for p in self.procs}:
                    c.request("DELETE", self.router_url + "/workers", params={"url": url}).raise_for_status()
            except (httpx.HTTPError, ValueError, KeyError) as e:
                failed.append(f"the router ({e!r})")
                listed = None
            # a worker down or restarting is registered by the supervision step once it answers (`LocalCluster.tend`)
            serving = [p for p in self.procs if p.alive() and not p.restarts.awaiting_health]
            for p in serving if listed is not None else []:
                try:
                    role = c.get(p.url + "/server_info").json().get("role", p.role)
                    if listed.get(p.url) not in (None, role):
                        c.request("DELETE", self.router_url + "/workers", params={"url": p.url}).raise_for_status()
                    if listed.get(p.url) != role:
                        c.post(self.router_url + "/workers", json={"url": p.url, "role": role}).raise_for_status()
                except (httpx.HTTPError, ValueError, KeyError) as e:
                    failed.append(f"{p.name} ({e!r})")
        if failed:
            self._say(f"could not register every worker with the restarted router yet: {'; '.join(failed)}")
        return not failed

    def stop(self, timeout: float = 15.0, force=None) -> None:
        if self.runner is not None:
            self.runner.stop()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        super().stop(timeout, force)

    @property
    def manifest(self) -> dict:
        m = super().manifest
        if self.runner is not None:
            m["planner"] = {"metrics_url": f"http://{self.spec.host}:{self.metrics_port}/metrics"}
        return m
