"""Host-tier benchmark: the prefix cache with and without ``--enable-hierarchical-cache`` on a device pool
that the workload overflows.

Workload: the Mooncake conversation rows of `pd_cluster.bench.scripts.prefix_cache` (same scaling: one
512-token trace block is one KV page of ``--block-tokens`` tokens), run offline through `LLM` one request
at a time (``max_running_requests=1``, so the order is the trace's, as in that script's offline LRU
simulation). The device pool has ``--num-pages`` pages, far fewer than the run's prompt pages, so the
device cache evicts; the host tier keeps what it evicts (``--hicache-ratio`` x the device pages).

Per run: prompt tokens computed (`EngineStats.prompt_tokens_total`), the full-page hit ratio (cached
tokens over the prompts' full-page tokens) split into device hits and host hits, the tokens loaded back
and spilled, and the wall time. Next to it, the simulated LRU hit ratio (the engine's rules) at the device
capacity and at device + host capacity: the host tier's hits can approach the second.

Run: ``python -m pd_cluster.bench.scripts.host_tier`` (about a minute with the defaults).
"""

from __future__ import annotations

import argparse
import time

from pd_cluster.bench.scripts.prefix_cache import TRACE, load_trace, simulate
from pd_cluster.engine import LLM, SamplingParams


def run_one(name: str, reqs, args, **engine_kwargs) -> dict:
    llm = LLM(page_size=args.block_tokens, num_pages=args.num_pages, max_running_requests=1,
              kv_cache_dtype=args.kv_cache_dtype, **engine_kwargs)
    started = time.monotonic()
    for r in reqs:
        llm.generate([r.prompt], SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True))
    wall = time.monotonic() - started
    st, host = llm.engine.stats, llm.engine.host_tier
    ps = args.block_tokens
    return {"name": name, "prompt_tokens": st.prompt_tokens_total, "device_hits": st.prefix_cache_hits,
            "host_hits": st.external_prefix_cache_hits,
            "load_back": host.load_back_pages_total * ps if host else 0,
            "backup": host.backup_pages_total * ps if host else 0,
            "host_pages": host.num_pages if host else 0, "wall_s": wall}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--max-blocks", type=int, default=28)
    ap.add_argument("--max-output", type=int, default=8)
    ap.add_argument("--num-pages", type=int, default=200, help="device pool pages (the run has ~3,200 prompt pages)")
    ap.add_argument("--hicache-ratio", type=float, nargs="+", default=[2.0, 8.0])
    ap.add_argument("--kv-cache-dtype", default="fp32")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    reqs = load_trace(TRACE, args.num_requests, args.block_tokens, args.max_blocks, args.max_output, args.seed)
    _, full_pages = simulate(reqs, args.block_tokens, None)
    runs = [run_one("cache off", reqs, args, disable_radix_cache=True),
            run_one("device cache only", reqs, args)]
    runs += [run_one(f"+ host tier x{r:g}", reqs, args, enable_hierarchical_cache=True, hicache_ratio=r)
             for r in args.hicache_ratio]
    full_tokens = full_pages * args.block_tokens
    print(f"{len(reqs)} requests, {sum(len(r.prompt) for r in reqs)} prompt tokens, {full_pages} full pages of "
          f"{args.block_tokens}; device pool {args.num_pages} pages")
    head = (f"{'run':<20} {'host pages':>10} {'prompt tok computed':>19} {'hits':>6} {'device':>7} {'host':>6} "
            f"{'LRU sim':>7} {'loaded tok':>10} {'spilled tok':>11} {'wall':>7}")
    print(head)
    print("-" * len(head))
    for r in runs:
        sim = simulate(reqs, args.block_tokens, args.num_pages + r["host_pages"])[0] / full_pages \
            if r["name"] != "cache off" else 0.0
        hits = r["device_hits"] + r["host_hits"]
        print(f"{r['name']:<20} {r['host_pages']:>10} {r['prompt_tokens']:>19} {hits / full_tokens:>6.1%} "
              f"{r['device_hits'] / full_tokens:>7.1%} {r['host_hits'] / full_tokens:>6.1%} {sim:>7.1%} "
              f"{r['load_back']:>10} {r['backup']:>11} {r['wall_s']:>6.1f}s")


if __name__ == "__main__":
    main()
