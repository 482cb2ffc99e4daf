"""The planner's loop: scrape, decide, act, export; the same code in ``pd-serve --autoscale`` and ``pd-planner``.

Every ``--planner-interval-secs`` the runner takes a `ClusterView` (`pd_cluster.planner.scrape.MetricsSource`),
adds what its connector is still carrying out (`Connector.targets`: a role with an action under way holds), asks the decision core
(`pd_cluster.planner.decision.Planner.decide`), logs the decision and its reasons, exports it as ``pd:planner_*``
metrics (`PlannerMetrics`), and hands a ``scale`` decision to the connector, which acts in the background (start a
worker, drain one, or switch one's role) while the loop keeps deciding for the other role.

The runner keeps no state of the cluster's: a restarted planner reads the counts serving now from the router
(the workers a previous planner started included) and resumes from them. An exception in a step is logged and the
loop goes on; a planner that dies leaves the cluster serving at its current sizes (nothing in the data path waits
on it). A metrics source that does not answer freezes the decision (``pd:planner_frozen`` is 1).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics

from pd_cluster.planner.config import PlannerConfig
from pd_cluster.planner.decision import ROLES, Decision, Planner, RoleCounts
from pd_cluster.planner.scrape import ClusterView, MetricsSource

log = logging.getLogger("pd_cluster.planner")
disable_created_metrics()  # no *_created series, as the router and the workers


class Connector(Protocol):
    """What acts on a decision: the local launcher's processes (``launch.autoscale.LocalConnector``) or the
    Kubernetes workloads (``planner.kube.KubernetesConnector``)."""

    name: str

    def targets(self) -> dict[str, int]:
        """The count each role's action under way brings it to (roles with none are absent)."""

    def apply(self, decision: Decision, view: ClusterView) -> None:
        """Start the actions that take `view`'s cluster to ``decision.target``; returns without waiting."""


class PlannerMetrics:
    """The planner's ``pd:planner_*`` metrics on their own registry.

    ``pd:planner_decisions_total{action}`` (``hold``, ``scale``, ``frozen``), ``pd:planner_workers{role}`` (serving
    now), ``pd:planner_target_workers{role}``, ``pd:planner_last_decision_timestamp_seconds`` (Unix time),
    ``pd:planner_frozen`` (1 while a metrics source is missing), ``pd:planner_actions_total{action,role,outcome}``
    (``start``, ``drain``, ``switch``; ``ok``, ``failed``).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.decisions = Counter("pd:planner_decisions", "Planner decisions, by action.", ["action"], registry=r)
        self.workers = Gauge("pd:planner_workers", "Workers serving each role at the last decision.", ["role"],
                             registry=r)
        self.target = Gauge("pd:planner_target_workers", "The count the last decision wants per role.", ["role"],
                            registry=r)
        self.last = Gauge("pd:planner_last_decision_timestamp_seconds", "Unix time of the last decision.",
                          registry=r)
        self.frozen = Gauge("pd:planner_frozen", "1 while a metrics source is missing (decisions frozen).",
                            registry=r)
        self.actions = Counter("pd:planner_actions", "Connector actions, by kind, role and outcome.",
                               ["action", "role", "outcome"], registry=r)
        for action in ("hold", "scale", "frozen"):
            self.decisions.labels(action)

    def observe(self, d: Decision) -> None:
        self.decisions.labels(d.action).inc()
        for role in ROLES:
            self.workers.labels(role).set(d.current.get(role))
            self.target.labels(role).set(d.target.get(role))
        self.last.set(time.time())
        self.frozen.set(1.0 if d.action == "frozen" else 0.0)


class PlannerRunner:
    """Runs the loop of the module docstring.

    Args:
        config: the planner's flags.
        source: the scraper.
        connector: what acts.
        metrics: where decisions are exported (a fresh `PlannerMetrics` when None).
        sleep: waits between steps (an `threading.Event`'s ``wait`` by default, so `stop` interrupts it).
    """

    def __init__(self, config: PlannerConfig, source: MetricsSource, connector: Connector,
                 metrics: PlannerMetrics | None = None) -> None:
        self.config, self.source, self.connector = config, source, connector
        self.metrics = metrics or PlannerMetrics()
        self.planner = Planner(config)
        self.decisions: list[Decision] = []  # the last ones (tests, logs)
        self.scales: list[Decision] = []  # the last scale decisions (benchmarks: the planner's history of a run)
        self.paused: str | None = None  # a source the caller knows to be unreliable now: decisions freeze
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def step(self) -> Decision:
        """One scrape, decision and (for ``scale``) hand-over to the connector."""
        before = self.connector.targets()  # an action that ends during the scrape still counts as under way
        view = self.source.fetch()
        snap = view.snapshot
        if self.paused:
            snap = replace(snap, missing=(*snap.missing, self.paused))
        under_way = {**before, **self.connector.targets()}
        if under_way and not snap.missing:
            cur = snap.current
            snap = replace(snap, pending=RoleCounts(under_way.get("prefill", cur.prefill),
                                                    under_way.get("decode", cur.decode)))
        d = self.planner.decide(snap)
        self.metrics.observe(d)
        self.decisions = (self.decisions + [d])[-100:]
        if d.action == "scale":
            self.scales = (self.scales + [d])[-100:]
            log.info("planner: scale prefill %d -> %d, decode %d -> %d: %s", d.current.prefill, d.target.prefill,
                     d.current.decode, d.target.decode, "; ".join(d.reasons))
            self.connector.apply(d, replace(view, snapshot=snap))
        elif d.action == "frozen":
            log.warning("planner: frozen: %s", "; ".join(d.reasons))
        elif d.reasons:
            log.info("planner: hold (prefill %d, decode %d): %s", d.current.prefill, d.current.decode,
                     "; ".join(d.reasons))
        return d

    def run(self, on_error: Callable[[BaseException], None] | None = None) -> None:
        """Step every ``interval_secs`` until `stop`; a failed step is logged and the loop goes on."""
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - the planner never takes serving down with it
                log.exception("planner: step failed; the cluster keeps its sizes")
                if on_error is not None:
                    on_error(e)
            self._stop.wait(max(0.0, self.config.interval_secs - (time.monotonic() - started)))

    def start(self) -> None:
        """Run in a daemon thread."""
        self._thread = threading.Thread(target=self.run, name="pd-planner", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
