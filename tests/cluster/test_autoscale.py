"""``pd-serve --autoscale`` on a real 1P1D cluster of OS processes (real NIXL, real HTTP), the planner beside it.

The planner's config comes from pd-serve's own parser (``--autoscale --max-prefill 2 ...``). In order:

1. a burst of streamed long prompts puts prefill over ``--ttft-slo-ms``: the planner decides to start a second prefill
   worker (a new process) and dies (its loop stopped) while it starts; the start completes, the router lists it
   healthy, the cluster serves on at 2P1D, and a new planner resumes from the counts the router reports (2 prefill); a light load follows, under
   which the planner drains a prefill worker (the router stops routing to it, its requests end, its pages are free)
   and stops it. Every request succeeds with the offline greedy text, no worker holds a page afterwards, and
   ``pd:planner_*`` on the planner's metrics server count the decisions and actions;
2. a metrics outage (the router killed; pd-serve restarts it) freezes the planner's decisions (``pd:planner_frozen``
   is 1) instead of scaling; pd-serve registers the planner's workers with the restarted router (whose flags name
   a prefill worker the planner stopped: it is never ready from its flags alone), and the planner thaws at the
   same size.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import threading
import time

import httpx
import pytest
from cluster_util import FAST_ENGINE, wait_all_free
from overload_kit import references, stream
from prometheus_client.parser import text_string_to_metric_families

from pd_cluster.common.net import free_port
from pd_cluster.launch.autoscale import AutoscaledCluster, autoscale_config
from pd_cluster.launch.cluster import ClusterSpec
from pd_cluster.launch.serve import build_parser

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TOKENS = 8
LONG = [f"{i} Once upon a time there was a little girl named Lily who loved to play in the park with her friends "
        f"and her dog. " * 4 for i in range(6)]
SHORT = ["Once upon a time", "The little dog ran"]
FLAGS = ["--autoscale", "--min-prefill", "1", "--max-prefill", "2", "--min-decode", "1", "--max-decode", "1",
         "--ttft-slo-ms", "150", "--itl-slo-ms", "1000", "--planner-interval-secs", "0.5",
         "--planner-stable-intervals", "2", "--planner-cooldown-secs", "2", "--planner-scale-down-window-secs", "0"]


@pytest.fixture(scope="module")
def refs():
    return references(LONG + SHORT, TOKENS)


@pytest.fixture(scope="module")
def cluster():
    parser = build_parser()
    config = autoscale_config(parser, parser.parse_args(FLAGS))
    spec = ClusterSpec(router_port=free_port(), engine_argv=list(FAST_ENGINE), log_level="warning", echo=False,
                       router_argv=["--health-check-interval-secs", "0.5"], internal_api_key="autoscale-test-key")
    c = AutoscaledCluster(spec, config)
    try:
        c.start(timeout=240)
        yield c
    finally:
        c.stop()


def _body(prompt: str) -> dict:
    return {"model": "stories260K", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}


def _load(url: str, prompts: list[str], concurrency: int, until: threading.Event, out: list, limit: int,
          pause: float = 0.0) -> None:
    """Streams of `prompts` in turn, `concurrency` at a time, until `until` is set or `limit` were sent."""
    async def main() -> None:
        sent = 0
        async with httpx.AsyncClient(timeout=120) as client:
            async def lane() -> None:
                nonlocal sent
                while not until.is_set() and sent < limit:
                    prompt = prompts[sent % len(prompts)]
                    sent += 1
                    rec = await stream(client, url, _body(prompt), f"r{sent}")
                    rec["prompt"] = prompt
                    out.append(rec)
                    await asyncio.sleep(pause)
            await asyncio.gather(*(lane() for _ in range(concurrency)))
    asyncio.run(main())


def _run_until(cluster, prompts, concurrency, done, timeout, limit, pause=0.0) -> list[dict]:
    records: list = []
    stop = threading.Event()
    t = threading.Thread(target=_load, args=(cluster.router_url, prompts, concurrency, stop, records, limit, pause),
                         daemon=True)
    t.start()
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline and t.is_alive():
        time.sleep(0.1)
    stop.set()
    t.join(120)
    assert not t.is_alive(), "the load did not end"
    return records


def _check(records: list[dict], refs: dict) -> None:
    failed = [r for r in records if r["error"] is not None or not r["done"]]
    assert not failed, failed[:3]
    wrong = [r["rid"] for r in records if r["texts"].get(0) != refs[r["prompt"]]]
    assert not wrong, wrong


def _actions(cluster, action: str, outcome: str = "ok") -> list:
    return [d for d in cluster.connector.done if d[0] == action and d[1] == "prefill" and d[2] == outcome]


def _planner_metric(cluster, name: str, **labels) -> float:
    """A sample of the planner's metrics server (the URL the manifest gives), by name and labels."""
    text = httpx.get(cluster.manifest["planner"]["metrics_url"], timeout=10).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and s.labels == labels:
                return s.value
    raise KeyError(name, labels)


def _no_leaks(cluster) -> None:
    for name, load in wait_all_free(cluster, 30).items():
        assert load["num_free_pages"] == load["num_total_pages"], (name, load)
        assert load["num_running_reqs"] == 0 and load["num_queue_reqs"] == 0, (name, load)


def test_scales_prefill_up_under_a_burst_and_drains_it_under_light_load(cluster, refs):
    first = cluster.connector
    burst = _run_until(cluster, LONG, 32, lambda: "prefill" in first.targets() or bool(first.done), 60, 5000)
    assert first.targets() == {"prefill": 2} or first.done, [d.reasons for d in cluster.runner.decisions[-5:]]
    _check(burst, refs)
    # the planner dies with the new worker starting: the start completes, the cluster serves on at 2P1D
    cluster.runner.stop()
    assert not cluster.runner._thread.is_alive()
    assert first.wait_idle(120)
    started = [d for d in first.done if d[:3] == ("start", "prefill", "ok")]
    assert len(first.done) == 1 and started, first.done
    assert _planner_metric(cluster, "pd:planner_actions_total", action="start", role="prefill", outcome="ok") == 1
    new = next(p for p in cluster.procs if p.name == "prefill-1")
    workers = httpx.get(cluster.router_url + "/workers", timeout=10).json()["workers"]
    assert any(w["url"] == new.url and w["healthy"] for w in workers), workers
    records = _run_until(cluster, SHORT, 2, lambda: False, 1.0, 6)
    _check(records, refs)
    assert len(records) == 6 and len([p for p in cluster.procs if p.role == "prefill"]) == 2
    # a new planner resumes from the router's counts
    old = cluster.runner
    cluster.start_planner()
    deadline = time.monotonic() + 10
    while not cluster.runner.decisions and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cluster.runner is not old and cluster.runner.decisions[0].current.prefill == 2

    light = _run_until(cluster, SHORT, 1, lambda: bool(_actions(cluster, "drain")), 60, 300, pause=0.05)
    assert _actions(cluster, "drain"), (cluster.connector.done, [d.reasons for d in cluster.runner.decisions[-5:]])
    _check(light, refs)
    assert len(light) >= 3  # the drain happened with requests going on
    assert len([p for p in cluster.procs if p.role == "prefill"]) == 1
    workers = httpx.get(cluster.router_url + "/workers", timeout=10).json()["workers"]
    assert sorted(w["role"] for w in workers) == ["decode", "prefill"], workers
    _no_leaks(cluster)
    assert _planner_metric(cluster, "pd:planner_decisions_total", action="scale") >= 2
    assert _planner_metric(cluster, "pd:planner_workers", role="prefill") in (1.0, 2.0)
    assert [d[2] for d in cluster.connector.done] == ["ok"]
    print(f"\nautoscale: {len(burst)} burst requests, start: {started[0][3]}; {len(light)} light requests, "
          f"drain: {_actions(cluster, 'drain')[0][3]}")


def test_a_metrics_outage_freezes_decisions(cluster, refs):
    # the cluster at 2P1D with no load: a planner that read the missing metrics as calm would drain to 1P1D
    cluster.runner.stop()
    admin = cluster.connector.admin
    # the restarted router's flags name the launch's prefill-0: stopped (drained above, or here), the router
    # has no usable pair from its flags and is never ready until pd-serve registers the planner's workers with it
    while len([p for p in cluster.procs if p.role == "prefill" and p.name != "prefill-0"]) < 2:
        cluster.connector.start_worker("prefill")
        admin.add(cluster.procs[-1].url, "prefill")
        admin.wait_healthy(cluster.procs[-1].url, 60)
    original = next((p for p in cluster.procs if p.name == "prefill-0"), None)
    if original is not None:
        admin.remove(original.url)
        cluster.connector._stop(original)
    before = sorted(p.url for p in cluster.procs)
    router = cluster.router
    os.killpg(router.popen.pid, signal.SIGKILL)  # the outage: nothing restarts it until the test calls tend()
    router.popen.wait(10)
    # --min-prefill 2 from here: after the outage the planner must hold at 2, neither start nor drain a worker
    cluster.planner_config = dataclasses.replace(cluster.planner_config, min_prefill=2)
    cluster.start_planner()
    # at least 4 decisions (a fixed sleep gave fewer on a loaded machine, each scrape waiting on slow workers)
    deadline = time.monotonic() + max(60.0, 8 * cluster.planner_config.interval_secs)
    while len(cluster.runner.decisions) < 4 and time.monotonic() < deadline:
        time.sleep(cluster.planner_config.interval_secs)
    assert _planner_metric(cluster, "pd:planner_frozen") == 1
    decisions = list(cluster.runner.decisions)
    assert len(decisions) >= 4 and all(d.action == "frozen" and d.target == d.current for d in decisions), decisions
    assert "router /workers" in decisions[-1].reasons[0]
    assert not cluster.connector.done and not cluster.connector.targets()
    assert sorted(p.url for p in cluster.procs) == before
    # pd-serve's supervision restarts the router and registers the planner's worker with it again; decisions thaw
    deadline = time.monotonic() + 60
    while _planner_metric(cluster, "pd:planner_frozen") != 0 and time.monotonic() < deadline:
        cluster.tend()
        time.sleep(0.2)
    assert _planner_metric(cluster, "pd:planner_frozen") == 0
    listed = httpx.get(cluster.router_url + "/workers", timeout=10).json()["workers"]
    assert sorted(w["url"] for w in listed) == before, listed
    _check(_run_until(cluster, SHORT, 2, lambda: False, 1.0, 4), refs)
    thawed = [d for d in cluster.runner.decisions if d.action != "frozen"]
    assert thawed and all(d.current.prefill == 2 and d.action == "hold" for d in thawed), thawed
    assert not cluster.connector.done and sorted(p.url for p in cluster.procs) == before
    _no_leaks(cluster)
