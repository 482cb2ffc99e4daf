"""Request migration and fail-fast on a real 2P2D cluster (real processes, real NIXL).

kill -9 a decode worker with streams in flight: every stream must finish with
the text of an undisturbed greedy run (needs workers that answer vLLM's
``return_token_ids``: the router's migration needs the ids). SIGSTOP a decode
worker: no request waits past the idle timeout or the health check, no text is
wrong, and once it runs again every page returns.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
from cluster_util import stream_pieces, PROMPTS, running_cluster, wait_all_free

from pd_cluster.serving.protocol import CompletionRequest

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
needs_token_ids = pytest.mark.skipif("return_token_ids" not in CompletionRequest.model_fields,
                                     reason="the workers do not return token ids (return_token_ids)")

TOKENS = 200
N_STREAMS = 8
N_KILL_STREAMS = 20  # issue 12's scenario: kill -9 a decode with 20 streams in flight


async def _stream(client: httpx.AsyncClient, url: str, i: int, progress: list[int]) -> dict:
    body = {"model": "stories260K", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True}
    rec = {"i": i, "text": "", "error": None, "done": False}
    t = time.monotonic()
    async with client.stream("POST", url + "/v1/completions", json=body,
                             headers={"x-request-id": f"mig-{i}"}) as resp:
        assert resp.status_code == 200
        async for piece in stream_pieces(resp, rec):
            rec["text"] += piece
            progress[i] += 1
    rec["elapsed"] = time.monotonic() - t
    rec["ended_at"] = time.monotonic()
    return rec


@needs_token_ids
def test_kill_decode_with_streams_in_flight_all_complete_with_the_reference_text():
    # the decode workers overlap their steps, as on CUDA (the frozen-decode test below runs without)
    with running_cluster(2, 2, engine_argv=["--enable-overlap-schedule"],
                         router_argv=["--decode-policy", "round_robin", "--upstream-idle-timeout-secs", "5",
                                      "--request-timeout-secs", "120"]) as cluster:
        async def run(fault: bool) -> tuple[list[dict], bool]:
            """The streams; with `fault`, decode-0 is killed once every stream relayed 3 tokens while it still
            runs some (not if a stream ended first: a loaded machine may start the last one late)."""
            progress = [0] * N_KILL_STREAMS
            killed = False
            async with httpx.AsyncClient(timeout=150) as client:
                tasks = [asyncio.ensure_future(_stream(client, cluster.router_url, i, progress))
                         for i in range(N_KILL_STREAMS)]
                d0 = cluster.by_name("decode-0")
                deadline = time.monotonic() + 60
                while fault and not any(t.done() for t in tasks) and time.monotonic() < deadline:
                    if min(progress) >= 3 and (
                            await client.get(d0.url + "/get_load")).json()["num_running_reqs"] > 0:
                        await asyncio.to_thread(cluster.kill, "decode-0")
                        killed = True
                        break
                    await asyncio.sleep(0.01)
                return await asyncio.gather(*tasks), killed

        reference, _ = asyncio.run(run(fault=False))
        assert all(r["done"] and r["error"] is None for r in reference)
        for _ in range(3):  # a round that missed the window is exact too, and is sent again
            got, killed = asyncio.run(run(fault=True))
            if killed:
                break
            assert [r["text"] for r in got] == [r["text"] for r in reference]
        assert killed, "3 rounds ended before every stream relayed 3 tokens with decode-0 busy"
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


def test_frozen_decode_fails_fast_and_corrupts_nothing():
    idle = 3.0
    with running_cluster(2, 2, router_argv=["--decode-policy", "round_robin",
                                            "--upstream-idle-timeout-secs", str(idle),
                                            "--health-failure-threshold", "2"]) as cluster:
        n = N_STREAMS + 4

        async def run(freeze: bool) -> tuple[list[dict], float]:
            progress = [0] * n
            frozen_at = 0.0
            async with httpx.AsyncClient(timeout=150) as client:
                tasks = [asyncio.ensure_future(_stream(client, cluster.router_url, i, progress))
                         for i in range(N_STREAMS)]
                if freeze:
                    deadline = time.monotonic() + 60
                    d0 = cluster.by_name("decode-0")
                    while time.monotonic() < deadline and (min(progress[:N_STREAMS]) < 3 or (
                            await client.get(d0.url + "/get_load")).json()["num_running_reqs"] == 0):
                        await asyncio.sleep(0.01)
                    os.kill(d0.pid, signal.SIGSTOP)  # with streams running on it
                    frozen_at = time.monotonic()
                tasks += [asyncio.ensure_future(_stream(client, cluster.router_url, i, progress))
                          for i in range(N_STREAMS, n)]  # sent while it is frozen
                return await asyncio.gather(*tasks), frozen_at

        reference, _ = asyncio.run(run(freeze=False))
        assert all(r["done"] and r["error"] is None for r in reference)
        try:
            got, frozen_at = asyncio.run(run(freeze=True))
        finally:
            os.kill(cluster.by_name("decode-0").pid, signal.SIGCONT)
        for want, rec in zip(reference, got):
            # ended within the idle timeout (streams held by the frozen worker) or the health
            # check (requests sent to it after the freeze), plus the time to finish elsewhere
            assert rec["ended_at"] - frozen_at < idle + 20, rec
            if rec["error"] is None:
                assert rec["done"] and rec["text"] == want["text"], rec["i"]
            else:  # a stream that could not migrate: what it got is a prefix of the truth
                assert rec["error"]["code"] == "worker_failed_mid_stream"
                assert want["text"].startswith(rec["text"]), rec["i"]
        assert all(r["error"] is None for r in got[N_STREAMS:])
        if "return_token_ids" not in CompletionRequest.model_fields:  # no migration possible
            errors = [(r["i"], len(r["text"].split())) for r in got[:N_STREAMS] if r["error"]]
            assert 1 <= len(errors) <= N_STREAMS // 2, errors
        metrics = httpx.get(cluster.router_url + "/metrics", timeout=10).text
        print("\n" + "\n".join(line for line in metrics.splitlines() if line.startswith(
            ("pd_router_retries_total", "pd_router_migrations_total",
             "pd_router_upstream_failures_total"))))
        loads = wait_all_free(cluster, timeout=60)
        assert all(v["num_free_pages"] == v["num_total_pages"] for v in loads.values()), loads
