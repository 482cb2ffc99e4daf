"""The planner's runner and scraper without a cluster: percentiles from real Prometheus exposition, the loop's
freeze on a missing source, its hold while an action is under way, its export as ``pd:planner_*``, and a restart
that resumes from the reported counts. (The loop against real processes: tests/cluster/test_autoscale.py.)"""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pd_cluster.planner.config import PlannerConfig
from pd_cluster.planner.decision import RoleCounts, Snapshot
from pd_cluster.planner.runner import PlannerMetrics, PlannerRunner
from pd_cluster.planner.scrape import (ClusterView, MetricsSource, WorkerView, histogram_buckets, owed_transfers,
                                      quantile, window)

BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0)


def _exposition(values: list[float], name: str = "pd_router_time_to_first_token_seconds") -> str:
    reg = CollectorRegistry()
    h = Histogram(name, "x", buckets=BUCKETS, registry=reg)
    for v in values:
        h.observe(v)
    return generate_latest(reg).decode()


def test_quantile_interpolates_inside_the_bucket_as_prometheus_does():
    values = [0.02] * 50 + [0.3] * 40 + [2.0] * 10
    b = histogram_buckets(_exposition(values), "pd_router_time_to_first_token_seconds")
    assert b[float("inf")] == 100 and b[0.05] == 50 and b[0.5] == 90
    # rank 90 of 100 is the top of the (0.1, 0.5] bucket; rank 95 is half-way into (1, 5]
    assert quantile(0.9, b) == pytest.approx(0.5)
    assert quantile(0.95, b) == pytest.approx(3.0)
    assert quantile(0.25, b) == pytest.approx(0.01 + 0.04 * (25 - 0) / 50)
    assert quantile(0.9, {}) is None and quantile(0.9, {1.0: 0, float("inf"): 0}) is None
    assert quantile(0.99, {1.0: 0, float("inf"): 5}) == 1.0  # in +Inf: the largest finite bound


def test_window_is_the_difference_and_restarts_from_zero_after_a_reset():
    before = histogram_buckets(_exposition([0.02] * 10), "pd_router_time_to_first_token_seconds")
    now = histogram_buckets(_exposition([0.02] * 10 + [0.3] * 5), "pd_router_time_to_first_token_seconds")
    w = window(now, before)
    assert w[float("inf")] == 5 and w[0.05] == 0 and w[0.5] == 5
    assert quantile(0.9, w) == pytest.approx(0.1 + 0.4 * 4.5 / 5)
    restarted = histogram_buckets(_exposition([0.3]), "pd_router_time_to_first_token_seconds")
    assert window(restarted, now) == restarted  # a counter went down: the process restarted


class Source:
    """Snapshots in turn (the last one repeated)."""

    def __init__(self, snaps: list[Snapshot]) -> None:
        self.snaps, self.i = snaps, 0

    def fetch(self) -> ClusterView:
        s = self.snaps[min(self.i, len(self.snaps) - 1)]
        self.i += 1
        return ClusterView(s, ())


class Recorder:
    name = "recorder"

    def __init__(self) -> None:
        self.applied, self.under_way = [], {}

    def targets(self) -> dict[str, int]:
        return dict(self.under_way)

    def apply(self, decision, view) -> None:
        self.applied.append(decision)
        self.under_way = {r: decision.target.get(r) for r in ("prefill", "decode")
                          if decision.target.get(r) != decision.current.get(r)}


CFG = PlannerConfig(ttft_slo_ms=100, itl_slo_ms=50, max_prefill=3, max_decode=3, stable_intervals=2,
                    cooldown_secs=0, interval_secs=1, scale_down_window_secs=0)


def _snap(t: float, prefill: int = 1, ttft: float | None = 500.0, missing=()) -> Snapshot:
    return Snapshot(at=t, current=RoleCounts(prefill, 1), ttft_p90_ms=ttft, itl_p90_ms=20.0, decode_kv_usage=0.5,
                    missing=tuple(missing))


def _sample(metrics: PlannerMetrics, name: str, **labels) -> float:
    for fam in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for s in fam.samples:
            if s.name == name and s.labels == labels:
                return s.value
    raise KeyError(name)


def test_the_loop_scales_holds_while_under_way_and_exports_each_decision():
    conn = Recorder()
    runner = PlannerRunner(CFG, Source([_snap(t) for t in range(6)]), conn)
    actions = [runner.step().action for _ in range(4)]
    assert actions == ["hold", "scale", "hold", "hold"]  # pressure must last 2 snapshots; then the start is under way
    assert len(conn.applied) == 1 and conn.applied[0].target == RoleCounts(2, 1)
    assert runner.scales == conn.applied  # the scale decisions are kept apart from the holds
    assert "holding until the last change (1 -> 2)" in runner.decisions[-1].reasons[0]
    m = runner.metrics
    assert _sample(m, "pd:planner_decisions_total", action="scale") == 1
    assert _sample(m, "pd:planner_decisions_total", action="hold") == 3
    assert _sample(m, "pd:planner_target_workers", role="prefill") == 1  # the last decision held at 1
    assert _sample(m, "pd:planner_workers", role="decode") == 1
    assert _sample(m, "pd:planner_frozen") == 0
    assert _sample(m, "pd:planner_last_decision_timestamp_seconds") > 1.7e9


def test_a_missing_source_freezes_and_never_reaches_the_connector():
    conn = Recorder()
    snaps = [_snap(0, prefill=3, ttft=None), _snap(1, prefill=3, ttft=None, missing=["router /metrics"])]
    runner = PlannerRunner(CFG, Source(snaps * 1 + [snaps[1]] * 5), conn)
    decisions = [runner.step() for _ in range(7)]
    assert [d.action for d in decisions[1:]] == ["frozen"] * 6
    assert all(d.target == d.current == RoleCounts(3, 1) for d in decisions[1:])  # calm-looking: not scaled down
    assert not conn.applied
    assert _sample(runner.metrics, "pd:planner_frozen") == 1
    assert _sample(runner.metrics, "pd:planner_decisions_total", action="frozen") == 6


def test_a_restarted_planner_resumes_from_the_reported_counts():
    conn = Recorder()
    first = PlannerRunner(CFG, Source([_snap(t) for t in range(3)]), conn)
    for _ in range(2):
        first.step()
    assert conn.applied[-1].target.prefill == 2
    # the planner dies with the worker started; the new one reads 2 serving, no streak and no cool-down
    conn.under_way = {}
    second = PlannerRunner(CFG, Source([_snap(t, prefill=2, ttft=60.0) for t in range(10, 14)]), conn)
    decisions = [second.step() for _ in range(4)]
    assert all(d.current.prefill == 2 and d.action == "hold" for d in decisions)  # in the band: no change
    assert len(conn.applied) == 1


def test_a_step_that_raises_does_not_end_the_loop():
    class Flaky(Source):
        def fetch(self):
            if self.i == 0:
                self.i += 1
                raise RuntimeError("scrape blew up")
            return super().fetch()

    runner = PlannerRunner(PlannerConfig(interval_secs=0.01), Flaky([_snap(0, ttft=None)]), Recorder())
    errors = []

    def on_error(e):
        errors.append(e)

    import threading
    t = threading.Thread(target=runner.run, args=(on_error,))
    t.start()
    try:
        deadline = 200
        while len(runner.decisions) < 3 and deadline:
            threading.Event().wait(0.01)
            deadline -= 1
    finally:
        runner.stop()
        t.join(5)
    assert len(errors) == 1 and len(runner.decisions) >= 3 and not math.isnan(runner.decisions[-1].at)


def test_transfers_waiting_on_the_prefill_are_its_backlog_not_decode_pressure():
    """A decode worker reserves pages before the prompt is computed: its waiting transfers include the prefill's
    queue. Only the rest (computed, not delivered) is decode's; each transfer counts once, not once per side."""
    def worker(role: str, **load) -> WorkerView:
        return WorkerView(id=role, url="http://127.0.0.1:1", role=role, healthy=True, load=load)

    prefill = [worker("prefill", num_queue_reqs=40, num_running_reqs=8, num_prefill_inflight_queue_reqs=50)]
    decode = [worker("decode", num_decode_transfer_queue_reqs=50)]
    assert owed_transfers(prefill, decode, computing=48) == 2
    snap = MetricsSource("http://127.0.0.1:1")._signals(Snapshot(at=0.0, current=RoleCounts(1, 1)), "",
                                                        prefill + decode, {}, 0.0)
    assert snap.outstanding_transfers == 2 and snap.prefill_waiting == 48
    stuck = [worker("decode", num_decode_transfer_queue_reqs=30)]
    idle = [worker("prefill", num_queue_reqs=0, num_running_reqs=0, num_prefill_inflight_queue_reqs=30)]
    assert owed_transfers(idle, stuck, computing=0) == 30
