"""How `ActionConnector` turns a decision into actions: which worker it takes, what it calls on the router, and
what it reports while an action is under way, with a connector whose start and stop are recorded (the local
connector's real processes: tests/cluster/test_autoscale.py)."""

from __future__ import annotations

import httpx
from fake_router import FakeRouter, worker_entry

from pd_cluster.planner.actions import ActionConnector, RouterAdmin
from pd_cluster.planner.decision import Decision, RoleCounts, Snapshot
from pd_cluster.planner.runner import PlannerMetrics
from pd_cluster.planner.scrape import ClusterView, WorkerView


class Recorded(ActionConnector):
    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.stopped: list[str] = []

    def stop_worker(self, worker) -> None:
        self.stopped.append(worker.url)


def _setup(busy_polls: int = 2, drain_timeout: float = 10.0):
    log: list = []
    entries = [worker_entry("10.0.0.1", "prefill"), worker_entry("10.0.0.2", "prefill"),
               worker_entry("10.0.0.3", "decode")]
    router = FakeRouter(log, entries, busy_polls)
    conn = Recorded(RouterAdmin("http://router", transport=httpx.MockTransport(router.handle)), PlannerMetrics(),
                    drain_timeout_secs=drain_timeout)
    inflight = {"10.0.0.1": 3, "10.0.0.2": 0, "10.0.0.3": 1}
    view = ClusterView(Snapshot(0.0, RoleCounts(2, 1)), tuple(
        WorkerView(e["id"], e["url"], e["role"], True, inflight=inflight[e["url"][7:15]]) for e in entries))
    return log, router, conn, view


def _decision(cur: tuple[int, int], tgt: tuple[int, int]) -> Decision:
    return Decision(0.0, RoleCounts(*cur), RoleCounts(*tgt), "scale", ())


def test_a_drain_takes_the_least_busy_worker_and_stops_it_only_once_idle():
    log, router, conn, view = _setup()
    conn.apply(_decision((2, 1), (1, 1)), view)
    conn.apply(_decision((2, 1), (1, 1)), view)  # the role is under way: ignored
    assert conn.wait_idle(10)
    assert [d[:3] for d in conn.done] == [("drain", "prefill", "ok")]
    calls = [(m, p) for _, m, p in log]
    assert calls[0] == ("POST", "router/workers/w-10.0.0.2/drain")  # 0 in flight, against 3 on 10.0.0.1
    loads = [i for i, c in enumerate(calls) if c == ("GET", "10.0.0.2/get_load")]
    remove = calls.index(("DELETE", "router/workers"))
    assert len(loads) >= 3 and loads[-1] < remove  # busy twice, then idle for the settle time
    assert conn.stopped == ["http://10.0.0.2:8000"] and conn.targets() == {}
    assert conn.metrics.actions.labels("drain", "prefill", "ok")._value.get() == 1


def test_a_drain_that_never_ends_is_given_up_and_the_worker_serves_again():
    log, router, conn, view = _setup(busy_polls=10**9, drain_timeout=0.3)
    conn.apply(_decision((2, 1), (1, 1)), view)
    assert conn.wait_idle(10)
    assert [d[:3] for d in conn.done] == [("drain", "prefill", "failed")] and "not idle" in conn.done[0][3]
    assert ("router", "DELETE", "router/workers/w-10.0.0.2/drain") in log
    assert not any(e["draining"] for e in router.workers) and not conn.stopped
    assert conn.targets() == {}


def test_at_the_cap_a_switch_takes_the_shrinking_roles_least_busy_worker():
    log, router, conn, view = _setup()
    conn.apply(_decision((2, 1), (1, 2)), view)
    assert conn.wait_idle(10)
    assert [d[:3] for d in conn.done] == [("switch", "decode", "ok")]
    assert [(m, p) for _, m, p in log] == [("POST", "router/workers/w-10.0.0.2/role")]
    assert [e["role"] for e in router.workers] == ["prefill", "decode", "decode"]
    assert not conn.stopped and conn.targets() == {}
