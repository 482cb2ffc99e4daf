"""Router acceptance on real 2P2D clusters: cache-aware routing of shared prefixes, and fault injection."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from cluster_util import running_cluster, wait_all_free

from pd_cluster.launch.cluster import free_port, router_ready

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py: the fast tier starts none)

TRACE = Path(__file__).resolve().parents[2] / "bench" / "data" / "mooncake_conversation_1000.jsonl"
ROWS, SCALE, CAP = 400, 0.01, 300


def _kept_blocks() -> list[list[int]]:
    """Each request's prefix blocks after pd-bench's scaling (block = round(512 * scale) tokens, capped)."""
    rows = [json.loads(line) for line in TRACE.read_text().splitlines()[:ROWS]]
    block = round(512 * SCALE)
    out = []
    for r in rows:
        length = min(max(1, round(r["input_length"] * SCALE)), CAP)
        out.append([h for j, h in enumerate(r["hash_ids"]) if j * block < length])
    return out


def _continuations(blocks: list[list[int]]) -> list[tuple[int, int]]:
    """(request, earlier request) pairs where the request shares >= 2 leading blocks with the earlier one
    (block 0 is a system prompt every request shares), the earlier one being the longest match."""
    pairs = []
    for i, k in enumerate(blocks):
        best, who = 0, None
        for j in range(i):
            n = 0
            for a, b in zip(k, blocks[j]):
                if a != b:
                    break
                n += 1
            if n >= best and n > 0:
                best, who = n, j
        if best >= 2:
            pairs.append((i, who))
    return pairs


def _prefill_of(lines) -> dict[int, str]:
    """Request index -> prefill URL, from a router's request log (pd-bench ids end with the index)."""
    out = {}
    for line in lines:
        if '"request finished"' not in line:
            continue
        rec = json.loads(line)
        rid = rec.get("request_id", "")
        if rid.startswith("bench-") and rec.get("status") == 200:
            out[int(rid.rsplit("-", 1)[1])] = rec["prefill"]
    return out


def _replay(url: str, tmp: Path, name: str) -> dict:
    cmd = [sys.executable, "-m", "pd_cluster.bench.cli", "--base-url", url, "--dataset-name", "mooncake-trace",
           "--num-prompts", str(ROWS), "--input-len-scale", str(SCALE), "--max-input-len", str(CAP),
           "--max-output-len", "4", "--output-len-scale", "0.01", "--trace-speedup", "10", "--disable-tqdm",
           "--save-result", "--result-dir", str(tmp), "--result-filename", f"{name}.json", "--seed", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads((tmp / f"{name}.json").read_text())


@contextlib.contextmanager
def _another_router(cluster, policy: str, log: Path):
    """A second router over `cluster`'s workers, the cluster's router flags but ``--prefill-policy policy``;
    yields its URL; its log goes to `log`. Stopped (by its pid) on exit."""
    argv, port = list(cluster.router.argv), free_port()
    argv[argv.index("--port") + 1] = str(port)
    argv[argv.index("--prefill-policy") + 1] = policy
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT)
    try:
        with httpx.Client(timeout=5) as c:
            deadline = time.monotonic() + 60
            while not (router_ready(c, url) and all(w["healthy"] for w in c.get(url + "/workers").json()["workers"])):
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(1800)
def test_cache_aware_keeps_shared_prefixes_on_one_prefill_worker(tmp_path, capsys):
    """The approximate prefix tree (cache_aware without KV events: ``--no-kv-events``, the fallback when events lag)
    keeps continuations on one prefill worker. Routing on the workers' real cache state trades some of that
    stickiness for load and is measured by server-side hits in `tests/cluster/test_kv_events_routing.py`."""
    pairs = _continuations(_kept_blocks())
    assert len(pairs) >= 30
    share = {}
    chosen = {}
    # one set of workers for both policies: each policy is its own router (round_robin's started after
    # cache_aware's replay); which prefill worker a router picks does not depend on the workers' caches
    with running_cluster(2, 2, router_argv=["--prefill-policy", "cache_aware", "--enable-log-requests",
                                            "--log-level", "info", "--no-kv-events"]) as cluster:
        result = _replay(cluster.router_url, tmp_path, "cache_aware")
        assert result["summary"]["completed"] == ROWS
        time.sleep(0.5)
        chosen["cache_aware"] = _prefill_of(cluster.logs.get("router", []))
        log = tmp_path / "router-round_robin.log"
        with _another_router(cluster, "round_robin", log) as url:
            result = _replay(url, tmp_path, "round_robin")
            assert result["summary"]["completed"] == ROWS
            time.sleep(0.5)
        chosen["round_robin"] = _prefill_of(log.read_text().splitlines())
        loads = wait_all_free(cluster, timeout=30)
        assert all(v["num_free_pages"] == v["num_total_pages"] for v in loads.values()), loads
    for policy in ("cache_aware", "round_robin"):
        assert len(chosen[policy]) == ROWS
        same = sum(chosen[policy][i] == chosen[policy][j] for i, j in pairs)
        share[policy] = same / len(pairs)
        counts = {u: list(chosen[policy].values()).count(u) for u in set(chosen[policy].values())}
        with capsys.disabled():
            print(f"\n[{policy}] {same}/{len(pairs)} continuations on their earlier turn's prefill worker "
                  f"({100 * share[policy]:.0f}%); requests per prefill worker: {sorted(counts.values())}")
        assert len(counts) == 2  # both prefill workers were used
    assert share["cache_aware"] >= 0.8
    assert share["round_robin"] < 0.7  # about chance (1/2) with two workers


async def _stream(client: httpx.AsyncClient, url: str, i: int) -> dict:
    rec = {"i": i, "tokens": 0, "status": None, "error": None, "done": False}
    t = time.monotonic()
    try:
        async with client.stream("POST", url + "/v1/completions", json={
                "model": "stories260K", "prompt": f"Story {i}: once upon a time there was a", "max_tokens": 40,
                "temperature": 0, "ignore_eos": True, "stream": True}) as resp:
            rec["status"] = resp.status_code
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    data = json.loads(line[6:])
                    if "error" in data:
                        rec["error"] = data["error"]
                    elif data.get("choices") and data["choices"][0].get("text"):
                        rec["tokens"] += 1
                elif line == "data: [DONE]":
                    rec["done"] = True
    except httpx.HTTPError as e:
        rec["error"] = repr(e)
    rec["elapsed"] = time.monotonic() - t
    return rec


@pytest.mark.timeout(1200)
def test_fault_injection_kill_and_restart_under_load():
    with running_cluster(2, 2, router_argv=["--request-timeout-secs", "60"]) as cluster:
        async def run():
            async with httpx.AsyncClient(timeout=90) as client:
                tasks = []
                for i in range(200):  # a steady 10 requests/s
                    tasks.append(asyncio.ensure_future(_stream(client, cluster.router_url, i)))
                    if i == 50:
                        await asyncio.to_thread(cluster.kill, "prefill-0")
                    if i == 80:
                        await asyncio.to_thread(cluster.kill, "decode-0")
                    if i == 120:
                        await asyncio.to_thread(cluster.restart, "prefill-0")
                        await asyncio.to_thread(cluster.restart, "decode-0")
                    await asyncio.sleep(0.1)
                return await asyncio.gather(*tasks)

        recs = asyncio.run(run())
        assert all(r["elapsed"] < 70 for r in recs)  # nothing hangs past the request timeout
        failed = [r for r in recs if not (r["status"] == 200 and r["done"] and r["tokens"] == 40)]
        # Only streams already running on the killed decode worker may fail; everything else is retried.
        assert all(r["tokens"] > 0 for r in failed), failed
        assert len(failed) <= 20
        with httpx.Client(timeout=10) as c:  # the restarted workers rejoin and take traffic
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                workers = c.get(cluster.router_url + "/workers").json()["workers"]
                if len(workers) == 4 and all(w["healthy"] for w in workers):
                    break
                time.sleep(0.5)
            assert all(w["healthy"] for w in workers), workers
            before = c.get(cluster.router_url + "/metrics").text
            for _ in range(8):
                r = c.post(cluster.router_url + "/v1/completions", json={"model": "stories260K", "prompt": "Hi",
                                                                         "max_tokens": 4})
                assert r.status_code == 200
            after = c.get(cluster.router_url + "/metrics").text
        for name in ("prefill-0", "decode-0"):
            url = cluster.by_name(name).url
            assert _worker_count(after, url) > _worker_count(before, url), name
        loads = wait_all_free(cluster, timeout=15)
        assert all(v["num_free_pages"] == v["num_total_pages"] for v in loads.values()), loads


def _worker_count(metrics: str, url: str) -> float:
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith("pd_router_worker_requests_total") and f'"{url}"' in line:
            total += float(line.split()[-1])
    return total
