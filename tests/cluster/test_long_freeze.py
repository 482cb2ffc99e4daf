"""Long freezes on a real 2P2D cluster (real processes, real NIXL): SIGSTOP decode-0 for 42 s with streams in
flight; 13 s into that, SIGSTOP prefill-0 for at least 24 s with requests mid-prefill; then SIGCONT both.

The freezes outlast every deadline, each set short here so the freezes can be short too: the router's idle (5 s)
and first-byte (10 s) timeouts, the KV transfer deadline (``--kv-transfer-timeout 15`` on both sides, 30 s by
default) and decode-1's quarantine of pages a frozen prefill may still write (10 s). Shown: every request ends
within its timeout plus a stated margin, by migration, a retry or a clear error; every text that completes equals
the healthy cluster's; nothing hangs; once both run again they corrupt nothing (requests through every pair are
exact, also while decode-1 reuses the pages prefill-0 was filling when it froze) and every page is free.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest
from cluster_util import stream_pieces, PROMPTS, running_cluster, wait_all_free
from test_migration import needs_token_ids

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

IDLE, FIRST_BYTE = 5.0, 10.0  # router: --upstream-idle-timeout-secs, --upstream-first-byte-timeout-secs
KV_TIMEOUT, QUARANTINE = 15.0, 10.0  # workers: --kv-transfer-timeout (both roles), --kv-transfer-abort-quarantine
# decode-0 frozen for D_FREEZE; prefill-0 for the last P_FREEZE of it. P_FREEZE outlasts the KV transfer deadline,
# and a first-byte timeout plus the quarantine (decode-1 reuses prefill-0's pages while it is still frozen);
# D_FREEZE - P_FREEZE outlasts the idle timeout, with time to migrate decode-0's streams before prefill-0 stops.
D_FREEZE, P_FREEZE = 42.0, 24.0
assert P_FREEZE > max(KV_TIMEOUT, FIRST_BYTE + QUARANTINE) and D_FREEZE - P_FREEZE - 5 > 2 * IDLE
MARGIN = 30.0  # past its timeout, what a request may take to finish elsewhere on this loaded 2-core host
HANG = 120.0  # a request not over after this is hung
LONG = " ".join(PROMPTS) * 3  # about 300 tokens: with 16-token chunks, prefill takes many steps
SLOW_PREFILL = ["--chunked-prefill-size", "16", "--max-prefill-tokens", "32"]
FAILED_STREAM = {"worker_failed_mid_stream", "request_timeout"}


def _short(i: int, tokens: int) -> dict:
    return {"model": "stories260K", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True}


def _long(i: int) -> dict:
    return {"model": "stories260K", "prompt": f"{i} {LONG}", "max_tokens": 20, "temperature": 0}


BODIES = {**{("s", i, n): _short(i, n) for i in range(len(PROMPTS)) for n in (200, 24)},
          **{("l", i, 20): _long(i) for i in range(8)}}


async def _stream(client: httpx.AsyncClient, url: str, key: tuple, rid: str, progress: dict | None = None) -> dict:
    rec = {"key": key, "rid": rid, "text": "", "error": None, "done": False, "hang": False,
           "sent_at": time.monotonic()}

    async def run() -> None:
        async with client.stream("POST", url + "/v1/completions", json=dict(BODIES[key], stream=True),
                                 headers={"x-request-id": rid}) as resp:
            if resp.status_code != 200:
                rec["error"] = json.loads(await resp.aread())["error"]
                return
            async for piece in stream_pieces(resp, rec):
                rec["text"] += piece
                if progress is not None:
                    progress[rid] = progress.get(rid, 0) + 1

    try:
        await asyncio.wait_for(run(), HANG)
    except asyncio.TimeoutError:
        rec["hang"] = True
    rec["ended_at"] = time.monotonic()
    return rec


async def _until(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await cond():
            return True
        await asyncio.sleep(0.02)
    return False


async def _trickle(client: httpx.AsyncClient, url: str, stop: asyncio.Event, out: list[dict]) -> None:
    """Two short streams at a time until `stop`, at most 3000: load that reuses decode-1's freed pages."""
    n = 0

    async def lane(lane_id: int) -> None:
        nonlocal n
        while not stop.is_set() and n < 3000:
            n += 1
            out.append(await _stream(client, url, ("s", n % len(PROMPTS), 24), f"t{lane_id}-{n}"))

    await asyncio.gather(lane(0), lane(1))


def _check(rec: dict, reference: dict[tuple, str], t_d: float) -> None:
    """Complete with the reference text, or a clear error whose partial text is a prefix of it."""
    want = reference[rec["key"]]
    rec = dict(rec, sent=round(rec["sent_at"] - t_d, 2), ended=round(rec["ended_at"] - t_d, 2))  # for messages
    assert not rec["hang"], rec
    if rec["error"] is None:
        assert rec["done"] and rec["text"] == want, rec
    else:
        assert rec["error"]["code"] in FAILED_STREAM | {"idle_timeout", "no_healthy_worker"}, rec
        assert want.startswith(rec["text"]), rec


@needs_token_ids
def test_decode_frozen_42s_and_prefill_frozen_24s_end_every_request_and_leak_nothing():
    router_argv = ["--decode-policy", "round_robin", "--prefill-policy", "round_robin",
                   "--upstream-idle-timeout-secs", str(IDLE), "--upstream-first-byte-timeout-secs", str(FIRST_BYTE),
                   "--health-failure-threshold", "2", "--request-timeout-secs", str(HANG - 10)]
    deadline = ["--kv-transfer-timeout", str(KV_TIMEOUT)]
    role_argv = {"prefill": SLOW_PREFILL + deadline,
                 "decode": deadline + ["--kv-transfer-abort-quarantine", str(QUARANTINE)]}
    with running_cluster(2, 2, router_argv=router_argv, echo=bool(os.environ.get("PD_TEST_ECHO")),
                         role_argv=role_argv) as cluster:
        url = cluster.router_url
        d0, p0 = cluster.by_name("decode-0"), cluster.by_name("prefill-0")

        async def healthy_reference() -> dict[tuple, str]:
            async with httpx.AsyncClient(timeout=HANG) as client:
                recs = await asyncio.gather(*(_stream(client, url, k, f"ref-{j}") for j, k in enumerate(BODIES)))
            assert all(r["done"] and r["error"] is None for r in recs), recs
            return {r["key"]: r["text"] for r in recs}

        reference = asyncio.run(healthy_reference())

        async def frozen() -> dict:
            out: dict = {"trickle": []}
            progress: dict[str, int] = {}
            async with httpx.AsyncClient(timeout=HANG) as client:
                a = [asyncio.ensure_future(_stream(client, url, ("s", i % len(PROMPTS), 200), f"a{i}", progress)) for i in range(8)]

                async def d0_streaming() -> bool:
                    return (len(progress) == 8 and min(progress.values()) >= 3
                            and (await client.get(d0.url + "/get_load")).json()["num_running_reqs"] > 0)

                assert await _until(d0_streaming, 60)
                os.kill(d0.pid, signal.SIGSTOP)
                out["t_d"] = t_d = time.monotonic()
                a += [asyncio.ensure_future(_stream(client, url, ("s", i % len(PROMPTS), 200), f"a{i}")) for i in range(8, 12)]
                stop = asyncio.Event()
                trickle = asyncio.ensure_future(_trickle(client, url, stop, out["trickle"]))
                await asyncio.sleep(max(0.0, t_d + D_FREEZE - P_FREEZE - 5 - time.monotonic()))
                b = [asyncio.ensure_future(_stream(client, url, ("l", i, 20), f"b{i}")) for i in range(8)]

                async def p0_prefilling() -> bool:
                    out["p0_load"] = load = (await client.get(p0.url + "/get_load")).json()
                    return bool(load["num_running_reqs"] or load["num_prefill_inflight_queue_reqs"])

                assert await _until(p0_prefilling, 20)
                os.kill(p0.pid, signal.SIGSTOP)  # right after a load that showed prefills in flight
                out["t_p"] = time.monotonic()
                await asyncio.sleep(max(0.0, t_d + D_FREEZE - time.monotonic()))
                os.kill(d0.pid, signal.SIGCONT)
                os.kill(p0.pid, signal.SIGCONT)
                out["t_cont"] = time.monotonic()
                out["a"], out["b"] = await asyncio.gather(*a), await asyncio.gather(*b)
                await asyncio.sleep(10)  # the trickle goes on while both late workers catch up
                stop.set()
                await trickle
            return out

        try:
            got = asyncio.run(frozen())
        finally:
            for p in (d0, p0):
                os.kill(p.pid, signal.SIGCONT)
        t_d, t_p = got["t_d"], got["t_p"]
        assert got["t_cont"] - t_d >= D_FREEZE - 1 and got["t_cont"] - t_p >= P_FREEZE - 1
        assert got["p0_load"]["num_running_reqs"] + got["p0_load"]["num_prefill_inflight_queue_reqs"] > 0
        for rec in got["a"] + got["b"] + got["trickle"]:
            _check(rec, reference, t_d)
        for rec in got["a"][:8]:  # streaming on the frozen decode: silent for the idle timeout, then migrated
            assert rec["ended_at"] - t_d < IDLE + MARGIN, rec
        for rec in got["a"][8:] + got["b"] + got["trickle"]:  # at most a first-byte timeout, then a retry
            assert rec["ended_at"] - rec["sent_at"] < FIRST_BYTE + MARGIN, rec
        assert all(r["error"] is None for r in got["a"][:8]), [r for r in got["a"] if r["error"]]  # migrated
        assert len(got["trickle"]) >= 20
        after = [r for r in got["trickle"] if r["sent_at"] > got["t_cont"]]
        assert len(after) >= 5 and all(r["error"] is None for r in after), len(after)

        metrics = httpx.get(url + "/metrics", timeout=10).text
        migrated = sum(float(line.split()[-1]) for line in metrics.splitlines()
                       if line.startswith("pd_router_migrations_total"))
        assert migrated >= 1
        print(f"\nmigrations {migrated:.0f}; trickle {len(got['trickle'])} requests; errors "
              f"{[(r['rid'], r['error']['code']) for r in got['a'] + got['b'] + got['trickle'] if r['error']]}")

        # The late workers corrupt nothing: every pair answers exactly, then every page is free.
        deadline = time.monotonic() + 30
        with httpx.Client(timeout=60) as c:
            for d in (p for p in cluster.procs if p.role == "decode"):
                for p in (p for p in cluster.procs if p.role == "prefill"):
                    for i in range(3):
                        key = ("s", i, 24)
                        while True:
                            r = c.post(d.url + "/v1/completions", json=BODIES[key],
                                       headers={"X-PD-Prefill-Url": p.url, "X-Request-Id": f"z-{d.name}-{p.name}-{i}"})
                            if r.status_code == 200 or time.monotonic() > deadline:
                                break
                            time.sleep(0.5)  # a late worker may still be draining what it held
                        assert r.status_code == 200, (d.name, p.name, r.text)
                        assert r.json()["choices"][0]["text"] == reference[key], (d.name, p.name, i)
        loads = wait_all_free(cluster, timeout=60)
        assert set(loads) == {"prefill-0", "prefill-1", "decode-0", "decode-1"}
        assert all(v["num_free_pages"] == v["num_total_pages"] for v in loads.values()), loads
