"""``pd-planner`` as its own OS process beside a real 1P1D cluster (router and workers are OS processes, real NIXL,
real HTTP), killed with SIGKILL while requests flow, then started again.

The router runs with ``--api-key`` and ``--api-key-protects-all-paths``: the planner reads ``/workers`` with the
admin key and ``/metrics`` with the API key (both from the environment, as the chart gives them). ``pd-planner``
has no connector that starts local worker processes (``--connector`` is ``kubernetes`` or ``none``); here it runs
with ``none``: it scrapes, decides and exports ``pd:planner_*``, and acts on nothing. In order:

1. the planner reads the cluster as 1P1D (not frozen), and is killed (SIGKILL) in the middle of a load of streamed
   requests: the load goes on, every answer is the offline greedy text, and the router still lists 1P1D;
2. while no planner runs, the cluster grows to 2P1D (a second prefill worker process registered with the router,
   as an operator or another controller would);
3. a new ``pd-planner`` reads the cluster's state from the router: its first decisions export 2 prefill and 1
   decode workers serving, none frozen. No worker holds a page at the end.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from cluster_util import running_cluster, wait_all_free
from overload_kit import references, stream
from prometheus_client.parser import text_string_to_metric_families

from pd_cluster.common.net import free_port
from pd_cluster.launch.autoscale import LocalConnector
from pd_cluster.planner.actions import RouterAdmin

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

API_KEY, ADMIN_KEY = "sk-planner-process", "admin-planner-process"
TOKENS = 8
PROMPTS = ["Once upon a time", "The little dog ran", "Lily had a red ball and",
           "One day Tom went to the park with his mom. " * 3]
INTERVAL = 0.3


def _planner(router_url: str, port: int, log: Path) -> subprocess.Popen:
    """Start ``pd-planner --connector none`` against `router_url`, its metrics on `port`, its log in `log`."""
    script = Path(sys.executable).with_name("pd-planner")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "pd_cluster.planner.main"]
    env = dict(os.environ, PD_ROUTER_ADMIN_API_KEY=ADMIN_KEY, PD_ROUTER_API_KEY=API_KEY)
    with open(log, "ab") as out:
        return subprocess.Popen([*cmd, "--router-url", router_url, "--connector", "none", "--host", "127.0.0.1",
                                 "--port", str(port), "--planner-interval-secs", str(INTERVAL),
                                 "--ttft-slo-ms", "60000", "--itl-slo-ms", "10000", "--max-prefill", "3"],
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _samples(port: int) -> dict[tuple, float] | None:
    """The planner's ``pd:planner_*`` samples by (name, sorted labels), or None while it does not answer."""
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    except httpx.HTTPError:
        return None
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _decisions(samples: dict[tuple, float]) -> float:
    return sum(v for (name, _), v in samples.items() if name == "pd:planner_decisions_total")


def _wait_decisions(proc: subprocess.Popen, port: int, count: int, log: Path, timeout: float = 60) -> dict:
    """Until the planner at `port` has exported `count` decisions; its samples."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"pd-planner exited ({proc.returncode}):\n{log.read_text()[-2000:]}"
        samples = _samples(port)
        if samples is not None and _decisions(samples) >= count:
            return samples
        time.sleep(0.1)
    raise AssertionError(f"pd-planner made fewer than {count} decisions in {timeout:g} s:\n{log.read_text()[-2000:]}")


def _sizes(samples: dict[tuple, float]) -> dict[str, float]:
    return {role: samples[("pd:planner_workers", (("role", role),))] for role in ("prefill", "decode")}


class Load:
    """Streams of `PROMPTS` in turn, `lanes` at a time, in a thread, with the router's API key; at most `limit`
    requests and until `stop`."""

    def __init__(self, url: str, lanes: int = 2, limit: int = 400) -> None:
        self.url, self.lanes, self.limit = url, lanes, limit
        self.records: list[dict] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self.thread.start()

    async def _main(self) -> None:
        sent = 0
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(timeout=60, headers=headers) as client:
            async def lane() -> None:
                nonlocal sent
                while not self.stop.is_set() and sent < self.limit:
                    prompt = PROMPTS[sent % len(PROMPTS)]
                    sent += 1
                    body = {"model": "stories260K", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0,
                            "ignore_eos": True}
                    rec = await stream(client, self.url, body, f"p{sent}")
                    rec["prompt"] = prompt
                    self.records.append(rec)
            await asyncio.gather(*(lane() for _ in range(self.lanes)))

    def ended_after(self, t: float) -> int:
        return sum(1 for r in list(self.records) if r.get("ended", 0) > t)

    def finish(self) -> list[dict]:
        self.stop.set()
        self.thread.join(90)
        assert not self.thread.is_alive(), "the load did not end"
        return self.records


def _check(records: list[dict], refs: dict) -> None:
    failed = [r for r in records if r["error"] is not None or not r["done"]]
    assert not failed, failed[:3]
    wrong = [r["rid"] for r in records if r["texts"].get(0) != refs[r["prompt"]]]
    assert not wrong, wrong


def _roles(router_url: str) -> list[str]:
    workers = httpx.get(router_url + "/workers", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                        timeout=10).json()["workers"]
    return sorted(w["role"] for w in workers if w["healthy"] and not w.get("draining"))


def _until(cond, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.1)


def test_a_killed_planner_leaves_the_cluster_serving_and_a_new_one_resumes_from_its_state(tmp_path):
    refs = references(PROMPTS, TOKENS)
    router_argv = ["--api-key-protects-all-paths"]
    with running_cluster(router_argv=router_argv, api_key=API_KEY, admin_api_key=ADMIN_KEY,
                         internal_api_key="planner-process-internal") as cluster:
        url, log = cluster.router_url, tmp_path / "pd-planner.log"
        procs: list[subprocess.Popen] = []
        try:
            procs.append(_planner(url, free_port(), log))
            port = int(procs[0].args[procs[0].args.index("--port") + 1])
            load = Load(url)
            first = _wait_decisions(procs[0], port, 3, log)
            assert _sizes(first) == {"prefill": 1, "decode": 1}
            assert first[("pd:planner_frozen", ())] == 0, log.read_text()[-2000:]
            # 1. SIGKILL mid-load: nothing in the data path waits on the planner
            _until(lambda: load.ended_after(0) >= 4, 60)
            os.kill(procs[0].pid, signal.SIGKILL)
            assert procs[0].wait(10) == -signal.SIGKILL
            killed_at = time.monotonic()
            _until(lambda: load.ended_after(killed_at) >= 8, 60)
            assert load.ended_after(killed_at) >= 8, "the load stalled after the planner died"
            assert _roles(url) == ["decode", "prefill"]  # the cluster kept its sizes
            # 2. the cluster grows while no planner runs
            admin = RouterAdmin(url, ADMIN_KEY)
            new_url = LocalConnector(cluster, admin, start_timeout_secs=120).start_worker("prefill")
            admin.add(new_url, "prefill")
            admin.wait_healthy(new_url, 60)
            assert _roles(url) == ["decode", "prefill", "prefill"]
            # 3. a new planner reads 2P1D from the router
            procs.append(_planner(url, port, log))
            second = _wait_decisions(procs[1], port, 1, log)
            assert _sizes(second) == {"prefill": 2, "decode": 1}, log.read_text()[-2000:]
            later = _wait_decisions(procs[1], port, 3, log)
            assert _sizes(later) == {"prefill": 2, "decode": 1} and later[("pd:planner_frozen", ())] == 0
            records = load.finish()
        finally:
            if "load" in locals():
                load.stop.set()
            for p in procs:
                if p.poll() is None:
                    os.kill(p.pid, signal.SIGTERM)
                    try:
                        p.wait(10)
                    except subprocess.TimeoutExpired:
                        os.kill(p.pid, signal.SIGKILL)
                        p.wait(10)
        assert procs[1].returncode == 0  # SIGTERM: the planner stops cleanly
        _check(records, refs)
        after_kill = [r for r in records if r["sent"] > killed_at]
        assert len(after_kill) >= 8, len(after_kill)
        for name, load_ in wait_all_free(cluster, 30).items():
            assert load_["num_free_pages"] == load_["num_total_pages"], (name, load_)
            assert load_["num_running_reqs"] == 0 and load_["num_queue_reqs"] == 0, (name, load_)
        print(f"\nplanner process: {len(records)} requests, {len(after_kill)} sent after the SIGKILL, all exact; "
              f"the restarted pd-planner read prefill 2, decode 1")
