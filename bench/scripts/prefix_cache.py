"""Prefix-cache benchmark: the Mooncake conversation trace replayed on real PD clusters.

Workload. The first ``--num-requests`` rows of the shipped Mooncake FAST'25
conversation slice (``bench/data/mooncake_conversation_1000.jsonl``). Each
``hash_ids`` entry names a 512-token prefix block; rows with equal ids share
that block. The embedded model has a 512-token context, so every length is
scaled by ``--block-tokens``/512 (default 16/512): one trace block becomes one
KV page of ``--block-tokens`` tokens, and whole trailing blocks beyond
``--max-blocks`` are dropped, so the prefix structure is kept block for block.
A block's tokens are drawn from a generator seeded by its hash id, and prompts
are sent as token ids, so equal hash prefixes are equal token prefixes. Rows
are sent in trace order with ``--concurrency`` requests in flight (the
trace's timestamps are not replayed).

Hit ratio. Next to the block hit ratio the prefill workers achieved (their
``vllm:prefix_cache_hits``, divided by the prompts' full pages), the script
simulates offline, with the engine's rules (full pages only, the last prompt
token never matched, a prompt's tail evicted before its head), an unbounded
cache (the ideal) and an LRU cache of the prefill workers' capacity
(``num_total_pages`` of their ``/get_load``, summed: on 2P2D one LRU of both
pools, the best that perfect routing could approach).

Cache on against off (``--disable-radix-cache``) on 1P1D, and with
``--with-2p2d`` the router's ``cache_aware`` against ``round_robin`` prefill
policy on 2P2D. Per run: prefill tokens computed (``vllm:prompt_tokens``
of the prefill workers), TTFT p50/p99 at the client (streamed), goodput
(requests per second whose TTFT met ``--ttft-slo-ms``), the KV bytes
pushed from prefill to decode (``pd:kv_transfer_bytes`` of the prefill workers)
and the KV bytes the decode workers did not receive because their own prefix
cache held those prompt pages (``pd:kv_transfer_saved_bytes``).

Run: ``python -m pd_cluster.bench.scripts.prefix_cache`` (about a minute with the defaults).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from pd_cluster.bench.datasets.traces import block_layout, read_mooncake
from pd_cluster.launch.cluster import ClusterSpec, LocalCluster, free_port

TRACE = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_1000.jsonl"
TRACE_BLOCK = 512
VOCAB = 512          # stories260K's vocabulary; ids 0..2 are unk, bos, eos
FIRST_ID = 3


@dataclass(frozen=True)
class TraceRequest:
    """One scaled trace row: prompt token ids, the hash id of each full page, and the output length."""

    prompt: list[int]
    page_keys: tuple[int, ...]
    max_tokens: int


def load_trace(path: Path, num: int, block: int, max_blocks: int, max_output: int, seed: int) -> list[TraceRequest]:
    """Scale the first `num` rows to `block`-token blocks (one KV page each), at most `max_blocks` per prompt."""
    scale = block / TRACE_BLOCK
    out = []
    for row in read_mooncake(str(path), num):
        hashes = [int(h) for h in row.get("hash_ids") or []]
        length = min(max(round(int(row["input_length"]) * scale), 2), max_blocks * block)
        ids: list[int] = []
        for h, n in block_layout(hashes, length, block):
            rng = np.random.default_rng([seed, h])
            ids.extend(rng.integers(FIRST_ID, VOCAB, size=block)[:n].tolist())
        ids = ids[:length]
        keys = tuple(hashes[:len(ids) // block])
        out.append(TraceRequest(ids, keys, max(1, min(round(int(row["output_length"]) * scale), max_output))))
    return out


def simulate(reqs: list[TraceRequest], block: int, capacity: int | None) -> tuple[int, int]:
    """Block hits under the engine's rules with an LRU cache of `capacity` pages (None: unbounded).

    Requests run one at a time and hold ``ceil(len/block)`` pages while they run. Returns
    (hit pages, full prompt pages).
    """
    cache: OrderedDict[tuple[int, ...], None] = OrderedDict()   # chain of keys -> present; last = most recent
    hits = total = 0
    for r in reqs:
        n = len(r.prompt)
        total += len(r.page_keys)
        limit = (n - 1) // block
        matched = 0
        while matched < min(limit, len(r.page_keys)) and r.page_keys[:matched + 1] in cache:
            matched += 1
        hits += matched
        chains = [r.page_keys[:j + 1] for j in range(len(r.page_keys))]
        if capacity is not None:
            need = math.ceil(n / block) - matched
            held = set(chains[:matched])
            free = capacity - len(cache)
            for key in list(cache):
                if free >= need:
                    break
                if key not in held:
                    del cache[key]
                    free += 1
        for c in reversed(chains):  # the head most recent: a tail is evicted before its head
            cache[c] = None
            cache.move_to_end(c)
        if capacity is not None:
            while len(cache) > capacity:
                cache.popitem(last=False)
    return hits, total


def trace_block_reuse(path: Path, num: int) -> float:
    """Share of the trace's own 512-token blocks seen before (unbounded cache, the rows as given)."""
    seen: set[int] = set()
    hit = total = 0
    for row in read_mooncake(str(path), num):
        for h in row.get("hash_ids") or []:
            total += 1
            hit += h in seen
            seen.add(h)
    return hit / max(total, 1)


def scrape(urls: list[str], names: tuple[str, ...]) -> dict[str, float]:
    """Sum of each counter sample `name` (any labels) over the workers' ``/metrics``."""
    sums = dict.fromkeys(names, 0.0)
    with httpx.Client(timeout=10) as c:
        for url in urls:
            for line in c.get(url + "/metrics").text.splitlines():
                name = line.split("{")[0].split(" ")[0]
                if name in sums:
                    sums[name] += float(line.split()[-1])
    return sums


COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
            "pd:kv_transfer_bytes_total")
DECODE_COUNTERS = ("pd:kv_transfer_received_bytes_total", "pd:kv_transfer_saved_bytes_total")


async def replay(url: str, reqs: list[TraceRequest], concurrency: int, timeout: float) -> list[float | None]:
    """Send every request streamed, `concurrency` at a time; TTFT in seconds (None: failed)."""
    sem = asyncio.Semaphore(concurrency)
    ttfts: list[float | None] = [None] * len(reqs)

    async def one(i: int, r: TraceRequest, client: httpx.AsyncClient) -> None:
        async with sem:
            body = {"model": "stories260K", "prompt": r.prompt, "max_tokens": r.max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            t0 = time.perf_counter()
            try:
                async with client.stream("POST", url + "/v1/completions", json=body) as resp:
                    if resp.status_code != 200:
                        return
                    async for line in resp.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]" and ttfts[i] is None:
                            ttfts[i] = time.perf_counter() - t0
            except httpx.HTTPError:
                ttfts[i] = None

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=5.0)) as client:
        await asyncio.gather(*(one(i, r, client) for i, r in enumerate(reqs)))
    return ttfts


@dataclass
class Run:
    name: str
    num_prefill: int
    num_decode: int
    engine_argv: list[str]
    policy: str


def run_one(run: Run, reqs: list[TraceRequest], args: argparse.Namespace) -> dict:
    spec = ClusterSpec(num_prefill=run.num_prefill, num_decode=run.num_decode, router_port=free_port(),
                       engine_argv=["--kv-cache-memory", args.kv_cache_memory, "--cpu-threads", "1",
                                    "--page-size", str(args.block_tokens), *run.engine_argv],
                       router_argv=["--prefill-policy", run.policy, "--health-check-interval-secs", "0.5"],
                       log_level="warning")
    cluster = LocalCluster(spec)
    try:
        cluster.start()
        cluster.wait_ready(timeout=300)
        prefills = [p.url for p in cluster.procs if p.role == "prefill"]
        capacity = sum(httpx.get(u + "/get_load", timeout=10).json()["num_total_pages"] for u in prefills)
        decodes = [p.url for p in cluster.procs if p.role == "decode"]
        before = {**scrape(prefills, COUNTERS), **scrape(decodes, DECODE_COUNTERS)}
        t0 = time.perf_counter()
        ttfts = asyncio.run(replay(cluster.router_url, reqs, args.concurrency, args.request_timeout))
        wall = time.perf_counter() - t0
        time.sleep(0.5)  # the last step's counters
        after = {**scrape(prefills, COUNTERS), **scrape(decodes, DECODE_COUNTERS)}
    finally:
        cluster.stop()
    d = {k: after[k] - before[k] for k in COUNTERS + DECODE_COUNTERS}
    ok = np.array([t for t in ttfts if t is not None])
    full_pages = sum(len(r.page_keys) for r in reqs)
    return {"name": run.name, "capacity_pages": capacity, "completed": len(ok), "failed": len(ttfts) - len(ok),
            "hit_tokens": d["vllm:prefix_cache_hits_total"], "query_tokens": d["vllm:prefix_cache_queries_total"],
            "block_hit_ratio": d["vllm:prefix_cache_hits_total"] / args.block_tokens / max(full_pages, 1),
            "prefill_tokens": d["vllm:prompt_tokens_total"], "kv_bytes": d["pd:kv_transfer_bytes_total"],
            "kv_received_bytes": d["pd:kv_transfer_received_bytes_total"],
            "kv_saved_bytes": d["pd:kv_transfer_saved_bytes_total"],
            "ttft_p50_ms": float(np.percentile(ok, 50) * 1e3) if len(ok) else float("nan"),
            "ttft_p99_ms": float(np.percentile(ok, 99) * 1e3) if len(ok) else float("nan"),
            "goodput_rps": float((ok <= args.ttft_slo_ms / 1e3).sum() / wall), "wall_s": wall}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--block-tokens", type=int, default=16, help="tokens per trace block = KV page size")
    ap.add_argument("--max-blocks", type=int, default=28, help="blocks kept per prompt (context 512)")
    ap.add_argument("--max-output", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=1,
                    help="requests in flight (1: the offline simulation's order exactly)")
    ap.add_argument("--kv-cache-memory", default="32MiB", help="per worker; small enough that the LRU matters")
    ap.add_argument("--ttft-slo-ms", type=float, default=500.0)
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--with-2p2d", action="store_true", help="also 2P2D cache_aware against round_robin")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)

    reqs = load_trace(args.trace, args.num_requests, args.block_tokens, args.max_blocks, args.max_output, args.seed)
    runs = [Run("1P1D cache on", 1, 1, [], "round_robin"),
            Run("1P1D cache off", 1, 1, ["--disable-radix-cache"], "round_robin")]
    if args.with_2p2d:
        runs += [Run("2P2D cache_aware", 2, 2, [], "cache_aware"), Run("2P2D round_robin", 2, 2, [], "round_robin")]
    results = [run_one(r, reqs, args) for r in runs]
    ideal_hits, full_pages = simulate(reqs, args.block_tokens, None)
    lru = {c: simulate(reqs, args.block_tokens, c)[0] for c in sorted({r["capacity_pages"] for r in results})}
    prompt_tokens = sum(len(r.prompt) for r in reqs)

    print(f"Mooncake conversation trace: {len(reqs)} requests, {prompt_tokens} prompt tokens, {full_pages} full "
          f"pages of {args.block_tokens} tokens; the trace's own 512-token block reuse over these rows: "
          f"{trace_block_reuse(args.trace, args.num_requests):.1%}; concurrency {args.concurrency}")
    print(f"simulated block hit ratio: unbounded {ideal_hits / full_pages:.1%}; "
          + ", ".join(f"LRU of {c} pages {h / full_pages:.1%}" for c, h in lru.items()))
    head = (f"{'run':<18} {'done':>5} {'fail':>4} {'block hits':>10} {'LRU':>6} {'/ LRU':>6} {'prefill tok':>11} "
            f"{'TTFT p50':>9} {'TTFT p99':>9} {'goodput':>8} {'KV MiB':>7} {'saved MiB':>9}")
    print(head)
    print("-" * len(head))
    for r in results:
        lru_ratio = lru[r["capacity_pages"]] / full_pages
        of_lru = r["block_hit_ratio"] / lru_ratio if lru_ratio else float("nan")
        print(f"{r['name']:<18} {r['completed']:>5} {r['failed']:>4} {r['block_hit_ratio']:>10.1%} {lru_ratio:>6.1%} "
              f"{of_lru:>6.1%} {r['prefill_tokens']:>11.0f} {r['ttft_p50_ms']:>7.1f}ms {r['ttft_p99_ms']:>7.1f}ms "
              f"{r['goodput_rps']:>6.1f}/s {r['kv_bytes'] / 2**20:>7.2f} {r['kv_saved_bytes'] / 2**20:>9.2f}")
    print(f"LRU: simulated with the run's prefill capacity (2P2D: one LRU of both pools); goodput: requests/s "
          f"with TTFT <= {args.ttft_slo_ms:.0f} ms; KV MiB: pushed prefill -> decode; saved MiB: prompt pages the "
          f"decode workers' own caches held, so not transferred")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": results,
                                         "sim": {"full_pages": full_pages, "ideal_hits": ideal_hits,
                                                 "lru_hits": {str(c): h for c, h in lru.items()}}}, indent=1))


if __name__ == "__main__":
    main()
