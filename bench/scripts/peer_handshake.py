"""First contact with a new prefill worker: does it stall the streams a decode worker is running?

Starts a local 2P1D cluster (real worker processes, real NIXL), warms the
decode worker up with prefill-0, then runs ``--streams`` streams that decode
through prefill-0. While they stream, one request names prefill-1, which the
decode worker has never met: its handshake (fetching prefill-1's agent info,
loading its NIXL metadata, setting up the connection) happens now. The script
records when every token of every stream arrived and reports the largest gap
between two tokens of a stream while that first request was starting, against
the largest gap over the rest of the run. With ``--prefills N`` it meets N - 1 new
prefill workers one after the other, for more samples. It also reports how
long each handshake took in the decode worker (its ``connected to peer ...
in X ms`` log line): the stall every running stream would see if the
handshake ran in the engine thread. The target (issue 11): no gap over 50 ms
caused by first contact.

    python -m pd_cluster.bench.scripts.peer_handshake --streams 8 --max-tokens 300 --prefills 4

Timing on a loaded machine is noisy; run it on an idle one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import time

import httpx

from pd_cluster.launch.cluster import ClusterSpec, LocalCluster, free_port

PROMPT = "Once upon a time, there was a little dog named Max who"


async def _stream(client: httpx.AsyncClient, decode: str, prefill: str, max_tokens: int, i: int) -> list[float]:
    times: list[float] = []
    body = {"prompt": f"{i} {PROMPT}", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    async with client.stream("POST", decode + "/v1/completions", json=body,
                             headers={"X-PD-Prefill-Url": prefill}) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["choices"][0].get("text"):
                    times.append(time.monotonic())
    return times


async def _one(client: httpx.AsyncClient, decode: str, prefill: str) -> tuple[float, float, int]:
    t0 = time.monotonic()
    resp = await client.post(decode + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0},
                             headers={"X-PD-Prefill-Url": prefill})
    return t0, time.monotonic(), resp.status_code


async def _run(decode: str, prefills: list[str], streams: int, max_tokens: int, delay: float) -> dict:
    during, other, firsts = [], [], []
    async with httpx.AsyncClient(timeout=120) as client:
        _, _, status = await _one(client, decode, prefills[0])  # decode meets prefill-0 (and warms up)
        assert status == 200, status
        for new in prefills[1:]:
            tasks = [asyncio.ensure_future(_stream(client, decode, prefills[0], max_tokens, i))
                     for i in range(streams)]
            await asyncio.sleep(delay)
            start, end, status = await _one(client, decode, new)  # first contact with `new`
            assert status == 200, status
            firsts.append(end - start)
            for times in await asyncio.gather(*tasks):
                for a, b in zip(times, times[1:]):
                    (during if b > start and a < end else other).append(b - a)
    q = statistics.quantiles
    return {"first_contacts": len(firsts), "first_request_s_max": max(firsts),
            "max_gap_during_first_contact_ms": 1e3 * max(during, default=0.0),
            "p99_gap_during_first_contact_ms": 1e3 * q(during, n=100)[98] if len(during) > 1 else 0.0,
            "max_gap_otherwise_ms": 1e3 * max(other, default=0.0),
            "p99_gap_otherwise_ms": 1e3 * q(other, n=100)[98] if len(other) > 1 else 0.0,
            "gaps_during": len(during), "gaps_otherwise": len(other)}


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=300)
    p.add_argument("--delay", type=float, default=1.0, help="seconds of streaming before the first contact")
    p.add_argument("--prefills", type=int, default=2, help="prefill workers; the decode worker meets all but one "
                                                            "while streaming")
    p.add_argument("--engine-args", default="--kv-cache-memory 64MiB --cpu-threads 1")
    args = p.parse_args()
    spec = ClusterSpec(num_prefill=max(args.prefills, 2), num_decode=1, router_port=free_port(),
                       engine_argv=args.engine_args.split(), log_level="info", echo=False)
    cluster = LocalCluster(spec)
    try:
        cluster.start()
        cluster.wait_ready(timeout=240)
        decode = next(w.url for w in cluster.procs if w.role == "decode")
        prefills = [w.url for w in cluster.procs if w.role == "prefill"]
        result = asyncio.run(_run(decode, prefills, args.streams, args.max_tokens, args.delay))
        name = next(w.name for w in cluster.procs if w.role == "decode")
        handshakes = [float(m.group(1)) for line in cluster.logs.get(name, ())
                      if (m := re.search(r"connected to peer \S+ .* in ([0-9.]+) ms", line))]
        result["decode_handshakes"] = len(handshakes)
        result["decode_handshake_ms_max"] = max(handshakes, default=0.0)
    finally:
        cluster.stop()
    for k, v in result.items():
        print(f"{k:36s} {v:.1f}" if isinstance(v, float) else f"{k:36s} {v}")
    print("PASS" if result["max_gap_during_first_contact_ms"] <= 50 else "FAIL", "(target: no gap over 50 ms)")


if __name__ == "__main__":
    main()
