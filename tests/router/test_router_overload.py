"""Overload is not death: a cluster driven past its capacity fails no admitted request; the rest are refused
up front with 429/503 and ``Retry-After``; a worker that refused for capacity is left alone meanwhile."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from router_testkit import FakeWorker, RouterProc, metric_value

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TOKENS = 10
# A decode worker that runs 4 requests at once (200 ms each: 20 ms to the first token, then 20 ms per
# token), queues 4 more and refuses the rest with 503 "overloaded"; while every slot is taken its /health
# and /get_load answer 1.5 s late (past the router's probe timeout), as a worker whose HTTP loop lags
# behind a full batch. Its capacity is 20 requests/s.
SMALL_DECODE = ["--ttft-ms", "20", "--itl-ms", "20", "--num-tokens", str(TOKENS), "--max-running-requests", "4",
                "--max-queued-requests", "4", "--probe-delay-at-capacity-ms", "1500"]
QUEUE_TIMEOUT = 1.5


async def _one(client: httpx.AsyncClient, url: str, i: int, start_at: float) -> dict:
    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    sent = time.monotonic()
    out: dict = {"i": i, "events": []}
    body = {"model": "stories260K", "prompt": f"request {i}", "max_tokens": TOKENS, "stream": True}
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            out["status"], out["headers"] = r.status_code, dict(r.headers)
            out["answered_after"] = time.monotonic() - sent
            if r.status_code != 200:
                out["body"] = json.loads(await r.aread())
                return out
            async for line in r.aiter_lines():
                if line:
                    out["events"].append(line)
    except httpx.HTTPError as exc:
        out["error"] = repr(exc)
    return out


async def _drive(url: str, rate: float, seconds: float) -> list[dict]:
    """Open-loop arrivals at ``rate`` per second for ``seconds`` (each request bounded by the client timeout)."""
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0), limits=limits) as client:
        t0 = time.monotonic() + 0.2
        n = int(rate * seconds)
        return await asyncio.gather(*(_one(client, url, i, t0 + i / rate) for i in range(n)))


def test_a_cluster_driven_at_3x_its_capacity_fails_no_admitted_request():
    with FakeWorker("prefill") as p, FakeWorker("decode", SMALL_DECODE) as d, \
            RouterProc(["--prefill", p.url, "--decode", d.url, "--health-check-interval-secs", "0.5",
                        "--health-check-timeout-secs", "0.5", "--health-failure-threshold", "2",
                        "--queue-timeout-secs", str(QUEUE_TIMEOUT), "--queue-size", "64"]) as router:
        results = asyncio.run(_drive(router.url, rate=60.0, seconds=4.0))
        served = [r for r in results if r.get("status") == 200]
        refused = [r for r in results if r.get("status") in (429, 503)]
        print(f"\n{len(results)} requests at 3x capacity: {len(served)} served whole, {len(refused)} refused "
              f"(slowest refusal {max((r['answered_after'] for r in refused), default=0):.2f} s)")
        assert not [r for r in results if "error" in r or r.get("status") not in (200, 429, 503)], \
            [r for r in results if "error" in r or r.get("status") not in (200, 429, 503)][:3]
        for r in served:  # every admitted request completed, whole
            assert r["events"][-1] == "data: [DONE]", r
            assert not any('"error"' in e for e in r["events"]), r
            assert sum('"text":" ' in e for e in r["events"]) == TOKENS, r
        for r in refused:  # refused up front: before any work, with when to come back
            assert r["headers"].get("retry-after") == "1", r
            assert r["body"]["error"]["type"] in ("rate_limit_error", "server_error"), r
            assert r["answered_after"] < QUEUE_TIMEOUT + 3.0, r
        assert len(served) >= 20 and len(refused) >= 40, (len(served), len(refused))
        m = router.metrics()
        assert metric_value(m, "pd_router_upstream_failures_total", role="decode") == 0
        assert metric_value(m, "pd_router_migrations_total") == 0
        assert metric_value(m, "pd_router_worker_healthy", worker=d.url) == 1
        log = router.log()
        assert "worker unhealthy" not in log and "failing in-flight requests" not in log
        assert "worker busy" in log  # its late probes were seen, and read as load


def test_a_worker_that_refused_for_capacity_is_left_alone_for_its_retry_after():
    """1P1D, a decode that refuses every other request (503, as when other routers filled its queue): the
    refused request is sent again only after the refuser's Retry-After (1 s), not a few ms later."""
    fast = ["--ttft-ms", "5", "--itl-ms", "1", "--fail-every", "2", "--fail-status", "503"]
    with FakeWorker("prefill") as p, FakeWorker("decode", fast) as d, \
            RouterProc(["--prefill", p.url, "--decode", d.url, "--retry-initial-backoff-ms", "5",
                        "--queue-timeout-secs", "10"]) as router:
        for i in range(3):
            r = httpx.post(router.url + "/v1/completions", timeout=30, headers={"x-request-id": f"busy-{i}"},
                           json={"model": "stories260K", "prompt": "a b", "max_tokens": 2})
            assert r.status_code == 200, r.text
        seen = d.recent()
        refusals = [k for k, e in enumerate(seen) if e["status"] == 503]
        assert refusals, seen
        for k in refusals:
            if k + 1 < len(seen):
                assert seen[k + 1]["arrival"] - seen[k]["arrival"] >= 0.9, (seen[k], seen[k + 1])
                assert seen[k + 1]["request_id"] == seen[k]["request_id"]  # the refused one went first
