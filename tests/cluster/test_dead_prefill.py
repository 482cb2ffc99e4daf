"""Acceptance: a prefill worker dies with requests in flight; 2P1D retries on the other prefill, nothing hangs.
A prefill chunk that computes longer than the KV transfer timeout does not fail its transfer, while a frozen
prefill is still cut off by that timeout."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
from cluster_util import PROMPTS, running_cluster, wait_all_free, worker_loads

from pd_cluster.prefill.jobs import FAULT_CHUNK_DELAY_ENV

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py: the fast tier starts none)

# Small chunks and a small step budget make each prefill take many steps, so requests are in flight at the kill.
SLOW_PREFILL = ["--chunked-prefill-size", "4", "--max-prefill-tokens", "8"]  # ~100 steps: a wide window to freeze in
LONG = " ".join(PROMPTS) * 3  # about 300 tokens


async def _one(client: httpx.AsyncClient, url: str, i: int) -> tuple[str, float, int | None]:
    t = time.monotonic()
    try:
        r = await asyncio.wait_for(client.post(url + "/v1/completions", json={
            "model": "stories260K", "prompt": f"{i} {LONG}", "max_tokens": 20, "temperature": 0}), 30)
        if r.status_code == 200:
            return "ok", time.monotonic() - t, 200
        return "error", time.monotonic() - t, r.status_code
    except asyncio.TimeoutError:
        return "hang", time.monotonic() - t, None


@pytest.mark.timeout(600)
def test_killed_prefill_is_retried_on_the_other_and_nothing_hangs():
    with running_cluster(2, 1, engine_argv=SLOW_PREFILL) as cluster:
        async def run():
            async with httpx.AsyncClient(timeout=60) as client:
                tasks = [asyncio.ensure_future(_one(client, cluster.router_url, i)) for i in range(24)]
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline:  # wait until prefill-0 really has work in flight
                    load = worker_loads(cluster)["prefill-0"]
                    if load["num_running_reqs"] or load["num_queue_reqs"] or load["num_prefill_inflight_queue_reqs"]:
                        break
                    await asyncio.sleep(0.02)
                killed_with = worker_loads(cluster)["prefill-0"]
                cluster.kill("prefill-0")
                return killed_with, await asyncio.gather(*tasks)

        killed_with, results = asyncio.run(run())
        assert killed_with["num_running_reqs"] + killed_with["num_queue_reqs"] > 0
        outcomes = [r[0] for r in results]
        assert "hang" not in outcomes
        assert all(elapsed < 30 for _, elapsed, _ in results)
        # Requests whose prefill died before the first token are retried on prefill-1 and succeed.
        assert outcomes.count("ok") == len(results), results
        router_metrics = httpx.get(cluster.router_url + "/metrics").text
        retries = sum(float(line.split()[-1]) for line in router_metrics.splitlines()
                      if line.startswith("pd_router_retries_total"))
        assert retries >= 1
        loads = wait_all_free(cluster, timeout=10)
        decode = loads["decode-0"]
        assert decode["num_free_pages"] == decode["num_total_pages"], decode
        assert loads["prefill-1"]["num_free_pages"] == loads["prefill-1"]["num_total_pages"]


KV_TIMEOUT, CHUNK_DELAY = 2.0, 2.5  # each chunk of a "slowchunk" request computes longer than the KV timeout


def _prefill_outlasting_the_kv_timeout(cluster, chunk_delay: float = CHUNK_DELAY,
                                       kv_timeout: float = KV_TIMEOUT) -> None:
    """Every prefill chunk of one request computes `chunk_delay` s > --kv-transfer-timeout (both sides): the
    prefill's heartbeats keep the transfer alive, so the router answers at once, without a retry (header and
    metric), with the text of a request whose chunks were not slowed. A second request whose ticket reaches
    that prefill during the long chunk (it waits for the step to end) is named by the heartbeats too."""
    body = {"model": "stories260K", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
    url = cluster.router_url
    decode = next(p for p in cluster.procs if p.role == "decode")
    prefills = [p for p in cluster.procs if p.role == "prefill"]

    async def run():
        async with httpx.AsyncClient(timeout=60) as c:
            ref = await c.post(url + "/v1/completions", json=body, headers={"x-request-id": "reference-1"})
            t = time.monotonic()
            slow = asyncio.ensure_future(c.post(url + "/v1/completions", json=body,
                                                headers={"x-request-id": "slowchunk-1"}))
            busy = None
            while busy is None and time.monotonic() - t < 10:  # the slow job is added: its first chunk computes
                for p in prefills:
                    if (await c.get(p.url + "/get_load")).json()["num_prefill_inflight_queue_reqs"]:
                        busy = p
                await asyncio.sleep(0.01)
            assert busy is not None
            behind = await c.post(decode.url + "/v1/completions", json=body, headers={
                "X-Request-Id": "behind-1", "X-PD-Prefill-Url": busy.url})
            behind_s = time.monotonic() - t
            r = await slow
            return ref, r, time.monotonic() - t, behind, behind_s

    ref, r, elapsed, behind, behind_s = asyncio.run(run())
    assert ref.status_code == 200, ref.text
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == ref.json()["choices"][0]["text"]
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # computed, not hidden by a cache
    assert elapsed > chunk_delay > kv_timeout  # a chunk did compute past the deadline
    assert r.headers["x-pd-retries"] == "0" and ref.headers["x-pd-retries"] == "0"
    assert behind.status_code == 200, behind.text  # waited for the long step, its deadline kept by heartbeats
    assert behind.json()["choices"][0]["text"] == ref.json()["choices"][0]["text"]
    assert behind_s > chunk_delay
    with httpx.Client(timeout=60) as c:
        router = c.get(url + "/metrics").text
        assert "pd_router_retries_total{" not in router, [x for x in router.splitlines() if "retries" in x]
        for p in cluster.procs:
            if p.role in ("prefill", "decode"):
                m = c.get(p.url + "/metrics").text
                assert "pd:kv_transfer_failed_total{" not in m, (p.name, [x for x in m.splitlines() if "failed" in x])


@pytest.mark.timeout(600)
def test_tp2_prefill_chunk_outlasting_the_kv_timeout_keeps_every_rank_alive(monkeypatch):
    """The same under tensor parallelism (prefill and decode at TP 2): a ticket that reaches the prefill worker
    during the long chunk is announced to every rank (rank 0's side channel to rank 1), so each rank's
    heartbeats name its part while the engine thread sleeps. A longer timeout than above (4 s: heartbeats every
    1 s, a 2 s idle stop) leaves four engine processes on a small machine room; the chunk is 1.5 times it."""
    kv_timeout, chunk_delay = 4.0, 6.0
    deadline = ["--kv-transfer-timeout", str(kv_timeout)]
    monkeypatch.setenv(FAULT_CHUNK_DELAY_ENV, f"{chunk_delay}:slowchunk")
    with running_cluster(1, 1, engine_argv=SLOW_PREFILL + ["--disable-radix-cache", "--tp-size", "2"],
                         role_argv={"decode": deadline, "prefill": deadline}) as cluster:
        _prefill_outlasting_the_kv_timeout(cluster, chunk_delay, kv_timeout)
        loads = wait_all_free(cluster, timeout=10)
        assert all(v["num_free_pages"] == v["num_total_pages"] for v in loads.values()), loads


@pytest.mark.timeout(600)
def test_retry_with_the_same_request_id_while_the_failed_attempt_still_holds_pages(monkeypatch):
    """A router retry reuses X-Request-Id; it must not collide with the failed attempt, whose decode pages stay
    held (quarantined) while the frozen prefill cannot confirm it stopped writing into them. First, in the same
    cluster: a prefill chunk longer than the KV timeout does not fail its transfer (the freeze below is still
    cut off by that timeout: a frozen process sends no heartbeat)."""
    fast_deadline = ["--kv-transfer-timeout", str(KV_TIMEOUT)]
    monkeypatch.setenv(FAULT_CHUNK_DELAY_ENV, f"{CHUNK_DELAY}:slowchunk")
    with running_cluster(2, 1, engine_argv=SLOW_PREFILL + ["--disable-radix-cache"],
                         role_argv={"decode": fast_deadline, "prefill": fast_deadline}) as cluster:
        _prefill_outlasting_the_kv_timeout(cluster)
        decode = next(p for p in cluster.procs if p.role == "decode")
        p0, p1 = (cluster.by_name(n) for n in ("prefill-0", "prefill-1"))
        body = {"model": "stories260K", "prompt": LONG, "max_tokens": 8, "temperature": 0}
        try:
            async def run():
                async with httpx.AsyncClient(timeout=60) as client:
                    first = asyncio.ensure_future(client.post(decode.url + "/v1/completions", json=body, headers={
                        "X-Request-Id": "same-id", "X-PD-Prefill-Url": p0.url}))
                    deadline = time.monotonic() + 20
                    while time.monotonic() < deadline and not (
                            await client.get(p0.url + "/get_load")).json()["num_running_reqs"]:
                        await asyncio.sleep(0.005)
                    os.kill(p0.pid, signal.SIGSTOP)  # frozen mid-prefill: it can neither push nor confirm
                    r1 = await first
                    held = (await client.get(decode.url + "/get_load")).json()  # (prefill-0 is frozen)
                    r2 = await client.post(decode.url + "/v1/completions", json=body, headers={
                        "X-Request-Id": "same-id", "X-PD-Prefill-Url": p1.url})
                    return r1, held, r2

            r1, held, r2 = asyncio.run(run())
        finally:
            os.kill(p0.pid, signal.SIGCONT)
        assert r1.status_code == 504, r1.text  # the KV deadline
        assert held["num_free_pages"] < held["num_total_pages"]  # the failed attempt's pages are quarantined
        assert r2.status_code == 200, r2.text
        assert r2.headers["x-request-id"] == "same-id"
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            load = httpx.get(decode.url + "/get_load").json()
            if load["num_free_pages"] == load["num_total_pages"]:
                break
            time.sleep(0.1)
        assert load["num_free_pages"] == load["num_total_pages"]
