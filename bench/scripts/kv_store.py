"""KV store benchmark: the Mooncake conversation trace on 2P2D with and without the cluster-wide KV store.

Workload: the Mooncake conversation rows of `pd_cluster.bench.scripts.prefix_cache` (same scaling: one 512-token
trace block is one 16-token KV page, at most ``--max-blocks`` per prompt; token-id prompts, outputs capped at
``--max-output``), sent in trace order, ``--concurrency`` at a time, through the router of a real 2P2D cluster.
Every worker has a device pool of ``--num-pages`` pages and a host tier of ``--hicache-ratio`` times that: together
far less than the trace's pages, so without the store each worker's tiers keep only its own recent prefixes.

Per run (routing policy x store off/on): the prefill workers' cached prompt tokens by source (``pd:cached_tokens``:
device, host, storage) over the prompts' full-page tokens, against the trace's unlimited ideal (the offline
simulation of `host_tier.py`/`prefix_cache.py`: an unbounded cache with the engine's rules); the prompt tokens the
prefill workers computed; TTFT p50/p99 at the client (streamed); failed requests. The store is Mooncake Store,
started by the cluster (a master and one process lending ``--kv-store-size``, on loopback).

Write policy: the same rules simulated offline for two workers of the run's tier size, round robin, with a store
written when a page is computed (write-through, what the engine does) or only when a worker's own tiers give it up
(write-back): the ratio each reaches of the ideal.

Run: ``python -m pd_cluster.bench.scripts.kv_store`` (the whole shipped slice: 1,000 rows, four 2P2D runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections import OrderedDict
from pathlib import Path

import httpx
import numpy as np

from pd_cluster.bench.scripts.prefix_cache import TRACE, TraceRequest, load_trace, replay, simulate
from pd_cluster.launch.cluster import ClusterSpec, LocalCluster, free_port

SOURCES = ("device", "host", "storage")


def cached_by_source(urls: list[str]) -> dict[str, float]:
    """``pd:cached_tokens_total`` by ``cache_source`` and ``pd:prompt_tokens_total``, summed over `urls`."""
    out = dict.fromkeys(SOURCES + ("computed",), 0.0)
    with httpx.Client(timeout=10) as c:
        for url in urls:
            for line in c.get(url + "/metrics").text.splitlines():
                if line.startswith("pd:cached_tokens_total{"):
                    source = line.split('cache_source="')[1].split('"')[0]
                    out[source] += float(line.split()[-1])
                elif line.startswith("pd:prompt_tokens_total"):
                    out["computed"] += float(line.split()[-1])
    return out


def run_one(policy: str, store: bool, reqs: list[TraceRequest], args: argparse.Namespace) -> dict:
    engine = ["--num-pages", str(args.num_pages), "--cpu-threads", "1", "--page-size", str(args.block_tokens),
              "--enable-hierarchical-cache", "--hicache-ratio", str(args.hicache_ratio)]
    if store:
        engine += ["--hicache-storage-backend", "mooncake"]
    spec = ClusterSpec(num_prefill=2, num_decode=2, router_port=free_port(), engine_argv=engine,
                       router_argv=["--prefill-policy", policy, "--health-check-interval-secs", "0.5"],
                       log_level="warning", echo=args.echo, kv_store_size=args.kv_store_size)
    cluster = LocalCluster(spec)
    load = [os.getloadavg()[0]]
    try:
        cluster.start()
        cluster.wait_ready(timeout=300)
        prefills = [p.url for p in cluster.procs if p.role == "prefill"]
        before = cached_by_source(prefills)
        t0 = time.perf_counter()
        ttfts = asyncio.run(replay(cluster.router_url, reqs, args.concurrency, args.request_timeout))
        wall = time.perf_counter() - t0
        time.sleep(0.5)
        after = cached_by_source(prefills)
        load.append(os.getloadavg()[0])
    finally:
        cluster.stop()
    d = {k: after[k] - before[k] for k in after}
    ok = np.array([t for t in ttfts if t is not None])
    return {"policy": policy, "store": store, "completed": len(ok), "failed": len(ttfts) - len(ok), **d,
            "ttft_p50_ms": float(np.percentile(ok, 50) * 1e3) if len(ok) else float("nan"),
            "ttft_p99_ms": float(np.percentile(ok, 99) * 1e3) if len(ok) else float("nan"),
            "wall_s": wall, "load": load}


def simulate_shared(reqs: list[TraceRequest], block: int, local: int, workers: int, write_through: bool) -> int:
    """Hit pages of `workers` round-robin workers, each an LRU of `local` pages (device + host, the engine's
    rules as `simulate`), over one unbounded store: written when a page is computed (`write_through`) or when a
    worker's LRU drops it (write-back). A page a worker lacks is a hit when the store has it."""
    caches = [OrderedDict() for _ in range(workers)]
    store: set[tuple[int, ...]] = set()
    hits = 0
    for i, r in enumerate(reqs):
        cache = caches[i % workers]
        limit = min((len(r.prompt) - 1) // block, len(r.page_keys))
        chains = [r.page_keys[:j + 1] for j in range(len(r.page_keys))]
        matched = 0
        while matched < limit and (chains[matched] in cache or chains[matched] in store):
            matched += 1
        hits += matched
        for c in reversed(chains):
            cache[c] = None
            cache.move_to_end(c)
            if write_through:
                store.add(c)
        while len(cache) > local:
            dropped, _ = cache.popitem(last=False)
            store.add(dropped)  # write-back: the page reaches the store as the worker gives it up
    return hits


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--max-blocks", type=int, default=28)
    ap.add_argument("--max-output", type=int, default=8)
    ap.add_argument("--num-pages", type=int, default=200, help="device pages per worker")
    ap.add_argument("--hicache-ratio", type=float, default=2.0, help="host tier over device pool, per worker")
    ap.add_argument("--kv-store-size", default="1GiB")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--policies", nargs="+", default=["round_robin", "cache_aware"])
    ap.add_argument("--echo", action="store_true", help="show the cluster's output")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    reqs = load_trace(TRACE, args.num_requests, args.block_tokens, args.max_blocks, args.max_output, args.seed)
    ideal, full_pages = simulate(reqs, args.block_tokens, None)
    local = int(args.num_pages * (1 + args.hicache_ratio))
    full_tokens = full_pages * args.block_tokens
    print(f"Mooncake conversation trace: {len(reqs)} requests, {sum(len(r.prompt) for r in reqs)} prompt tokens, "
          f"{full_pages} full pages of {args.block_tokens}; unlimited ideal hit ratio {ideal / full_pages:.1%}; "
          f"per worker {args.num_pages} device + {local - args.num_pages} host pages (one LRU of that size: "
          f"{simulate(reqs, args.block_tokens, local)[0] / full_pages:.1%})")
    for wt in (True, False):
        h = simulate_shared(reqs, args.block_tokens, local, 2, wt)
        print(f"simulated 2 workers, round robin, store written {'through' if wt else 'back'}: {h / full_pages:.1%} "
              f"({h / ideal:.1%} of the ideal)")
    results = [run_one(p, s, reqs, args) for p in args.policies for s in (False, True)]
    head = (f"{'policy':<12} {'store':>5} {'done':>5} {'fail':>4} {'hits':>6} {'of ideal':>8} {'device':>7} "
            f"{'host':>6} {'storage':>7} {'computed':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'load':>9}")
    print(head)
    print("-" * len(head))
    for r in results:
        hits = sum(r[s] for s in SOURCES) / full_tokens
        print(f"{r['policy']:<12} {'on' if r['store'] else 'off':>5} {r['completed']:>5} {r['failed']:>4} "
              f"{hits:>6.1%} {hits * full_pages / ideal:>8.1%} {r['device'] / full_tokens:>7.1%} "
              f"{r['host'] / full_tokens:>6.1%} {r['storage'] / full_tokens:>7.1%} {r['computed']:>9.0f} "
              f"{r['ttft_p50_ms']:>7.1f}ms {r['ttft_p99_ms']:>7.1f}ms {r['load'][0]:>4.1f}-{r['load'][-1]:<4.1f}")
    print("hits: the prefill workers' cached prompt tokens (device + host + storage) over the prompts' full-page "
          "tokens; of ideal: against the unlimited cache; load: 1-minute load average before and after the run")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": results,
                                         "ideal_pages": ideal, "full_pages": full_pages}, indent=1))


if __name__ == "__main__":
    main()
