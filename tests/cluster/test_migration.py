"""Request migration on a real 2P2D cluster: kill -9 a decode worker with streams in flight.

Every stream must finish with the text of an undisturbed greedy run, no stream
may hang, and every worker's pages must return to its total. Needs workers
that answer vLLM's ``return_token_ids`` (the router's migration needs the ids).
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from cluster_util import PROMPTS, running_cluster, wait_all_free

from pd_cluster.serving.protocol import CompletionRequest

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow,
              pytest.mark.skipif("return_token_ids" not in CompletionRequest.model_fields,
                                 reason="the workers do not return token ids (return_token_ids)")]

TOKENS = 48
N_STREAMS = 8


async def _stream(client: httpx.AsyncClient, url: str, i: int, progress: list[int]) -> dict:
    body = {"model": "stories260K", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True}
    rec = {"i": i, "text": "", "error": None, "done": False}
    t = time.monotonic()
    async with client.stream("POST", url + "/v1/completions", json=body,
                             headers={"x-request-id": f"mig-{i}"}) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line == "data: [DONE]":
                rec["done"] = True
            elif line.startswith("data: {"):
                data = json.loads(line[6:])
                if "error" in data:
                    rec["error"] = data["error"]
                elif data["choices"] and data["choices"][0]["text"]:
                    rec["text"] += data["choices"][0]["text"]
                    progress[i] += 1
    rec["elapsed"] = time.monotonic() - t
    return rec


def test_kill_decode_with_streams_in_flight_all_complete_with_the_reference_text():
    with running_cluster(2, 2, router_argv=["--decode-policy", "round_robin",
                                            "--upstream-idle-timeout-secs", "5",
                                            "--request-timeout-secs", "120"]) as cluster:
        async def run(fault: bool) -> list[dict]:
            progress = [0] * N_STREAMS
            async with httpx.AsyncClient(timeout=150) as client:
                tasks = [asyncio.ensure_future(_stream(client, cluster.router_url, i, progress))
                         for i in range(N_STREAMS)]
                if fault:
                    deadline = time.monotonic() + 60
                    while min(progress) < 3 and time.monotonic() < deadline:
                        await asyncio.sleep(0.01)
                    await asyncio.to_thread(cluster.kill, "decode-0")
                return await asyncio.gather(*tasks)

        reference = asyncio.run(run(fault=False))
        assert all(r["done"] and r["error"] is None for r in reference)
        got = asyncio.run(run(fault=True))
        for want, rec in zip(reference, got):
            assert rec["error"] is None and rec["done"], rec
            assert rec["text"] == want["text"], rec["i"]
            assert rec["elapsed"] < 90
        metrics = httpx.get(cluster.router_url + "/metrics", timeout=10).text
        migrated = sum(float(line.split()[-1]) for line in metrics.splitlines()
                       if line.startswith("pd_router_migrations_total"))
        assert migrated >= 1
        loads = wait_all_free(cluster, timeout=30)
        assert all(v["num_free_pages"] == v["num_total_pages"] for v in loads.values()), loads
