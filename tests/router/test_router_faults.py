"""Fault injection under load, 2P2D of fake workers (the real-cluster run is separate).

200 streamed requests at a steady 20 req/s. One prefill and one decode worker
are killed (SIGKILL) during the run and restarted on the same ports later.
The decode workers are token-level fakes that return token ids, so streams
running on the killed decode worker migrate: every request ends within its
timeout with its full answer; the restarted workers rejoin and take traffic;
every pool ends all-free and the router's in-flight accounting returns to zero.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import httpx
import pytest
from router_testkit import FakeWorker, RouterProc, metric_value, wait_http

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

N_REQUESTS = 200
RATE = 20.0
KILL_AT = 2.0
RESTART_AT = 5.0
REQUEST_TIMEOUT = 15.0
TOKENS = 20
DECODE = ["--token-model", "--ttft-ms", "30", "--itl-ms", "10"]


@dataclass
class Outcome:
    index: int
    start: float
    end: float = 0.0
    first: float | None = None
    tokens: int = 0
    done: bool = False
    error: str | None = None
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.done and self.tokens == TOKENS and self.error is None


async def one(client: httpx.AsyncClient, url: str, out: Outcome) -> None:
    body = {"model": "stories260K", "prompt": f"story number {out.index}", "max_tokens": TOKENS,
            "stream": True}
    async with client.stream("POST", url + "/v1/completions", json=body,
                             headers={"x-request-id": f"fault-{out.index}"}) as r:
        if r.status_code != 200:
            out.error = f"HTTP {r.status_code}"
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out.done = True
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out.error = event["error"]["message"]
            elif event["choices"] and event["choices"][0]["text"]:
                out.first = out.first or time.monotonic()
                out.tokens += 1


async def run_load(url: str, t0: float) -> list[Outcome]:
    outcomes = [Outcome(i, 0.0) for i in range(N_REQUESTS)]

    async def timed(o: Outcome, client: httpx.AsyncClient) -> None:
        await asyncio.sleep(max(0.0, t0 + o.index / RATE - time.monotonic()))
        o.start = time.monotonic()
        try:
            await asyncio.wait_for(one(client, url, o), REQUEST_TIMEOUT)
        except asyncio.TimeoutError:
            o.timed_out = True
        except httpx.HTTPError as exc:
            o.error = repr(exc)
        o.end = time.monotonic()

    limits = httpx.Limits(max_connections=400, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT, limits=limits) as client:
        await asyncio.gather(*(timed(o, client) for o in outcomes))
    return outcomes


async def chaos(p0: FakeWorker, d0: FakeWorker, t0: float, marks: dict) -> None:
    await asyncio.sleep(max(0.0, t0 + KILL_AT - time.monotonic()))
    marks["kill"] = time.monotonic()
    p0.kill()
    d0.kill()
    await asyncio.sleep(max(0.0, t0 + RESTART_AT - time.monotonic()))
    await asyncio.to_thread(p0.start)
    await asyncio.to_thread(d0.start)
    marks["restart"] = time.monotonic()


def test_kill_and_restart_one_prefill_and_one_decode_under_load():
    p0, p1 = FakeWorker("prefill"), FakeWorker("prefill")
    d0, d1 = FakeWorker("decode", DECODE), FakeWorker("decode", DECODE)
    workers = [p0, p1, d0, d1]
    try:
        for w in workers:
            w.start()
        args = ["--prefill", p0.url, p1.url, "--decode", d0.url, d1.url,
                "--health-check-interval-secs", "0.5", "--health-failure-threshold", "2",
                "--health-success-threshold", "1", "--retry-max-retries", "4",
                "--retry-initial-backoff-ms", "20", "--request-timeout-secs", "12"]
        with RouterProc(args) as router:
            marks: dict = {}

            async def scenario() -> list[Outcome]:
                t0 = time.monotonic() + 0.2
                load = asyncio.create_task(run_load(router.url, t0))
                await chaos(p0, d0, t0, marks)
                return await load

            outcomes = asyncio.run(scenario())
            kill = marks["kill"]

            assert not [o.index for o in outcomes if o.timed_out], "a request hung"
            assert all(o.end - o.start < REQUEST_TIMEOUT for o in outcomes)
            failed = [o for o in outcomes if not o.ok]
            # Streams running on the killed decode worker migrated; nothing failed.
            assert failed == [], [(o.index, o.error, o.first and o.first - kill) for o in failed]
            m = router.metrics()
            # streams were running on the killed decode worker (about 5 at any time)
            assert metric_value(m, "pd_router_migrations_total") >= 1

            # The restarted workers rejoin and take traffic again.
            wait_http(router.url + "/workers", 15, ok=lambda r: all(
                w["healthy"] for w in r.json()["workers"]))
            for i in range(12):
                r = httpx.post(router.url + "/v1/completions", timeout=30,
                               headers={"x-request-id": f"after-{i}"},
                               json={"model": "stories260K", "prompt": f"after {i}",
                                     "max_tokens": 2})
                assert r.status_code == 200
            assert any(e["request_id"].startswith("after-") for e in d0.recent())
            prefills_used = {e["headers"]["x-pd-prefill-url"]
                             for d in (d0, d1) for e in d.recent()
                             if e["request_id"].startswith("after-")}
            assert p0.url in prefills_used

            # Every pool ends all-free; the router holds nothing in flight.
            for w in workers:
                load = httpx.get(w.url + "/get_load", timeout=5).json()
                assert load["num_running_reqs"] == 0, (w.url, load)
                assert load["num_free_pages"] == load["num_total_pages"], (w.url, load)
            m = router.metrics()
            assert metric_value(m, "pd_router_worker_inflight_requests") == 0
            assert metric_value(m, "pd_router_running_requests") == 0
            print(f"\nok={N_REQUESTS - len(failed)} failed={len(failed)} "
                  f"retries={metric_value(m, 'pd_router_retries_total'):.0f} "
                  f"migrations={metric_value(m, 'pd_router_migrations_total'):.0f}")
    finally:
        for w in workers:
            w.stop()
