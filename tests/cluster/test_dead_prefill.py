"""Acceptance: a prefill worker dies with requests in flight; 2P1D retries on the other prefill, nothing hangs."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from cluster_util import PROMPTS, running_cluster, wait_all_free, worker_loads

# Small chunks and a small step budget make each prefill take many steps, so requests are in flight at the kill.
SLOW_PREFILL = ["--chunked-prefill-size", "16", "--max-prefill-tokens", "32"]
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
