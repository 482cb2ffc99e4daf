"""KV transfer benchmark: NIXL push throughput against memcpy, descriptors per request, handover time.

Two spawned processes, a prefill worker and a decode worker, each hold real
engine KV pools (stories260K's layout, FP8, page sizes 16 and 64) with a
`TransferAgent`, and move pages through the library itself (`KVReceiver.expect`
-> ticket -> `KVSender.add_request` / `push` / `poll`). Measured in one run:

1. Throughput of one request's pages (16, 256, 4,096 pages; page size 16 and 64):
   bytes of the push over the time from the `push` call until `poll` reports the
   push complete (the data is then in decode's pages). In the same process and
   interleaved with it, a single-thread ``torch`` copy of the same bytes between
   two warm buffers gives the memcpy reference. A "fragmented" row gives decode
   every other page, so each page is its own descriptor.
2. Handover: a 2,000-token prompt (real ShareGPT text) prefilled by the real
   model in chunks of 256, each chunk pushed as soon as it is computed; the time
   from the end of the last chunk's forward pass to decode's `poll` reporting
   the transfer complete (both clocks are the host's CLOCK_MONOTONIC). Decode
   polls every 0.2 ms here (every 2 ms during part 1, so that it does not take
   the CPU from the copy being timed on this 2-core host).
3. Which UCX transport carried the WRITEs (UCX's own protocol table, captured
   from the prefill process with ``UCX_PROTO_INFO=y``).

Run: ``python -m pd_cluster.bench.scripts.transfer_throughput`` (add ``--ucx-tls tcp`` to
force TCP, ``--progress-thread`` to run NIXL's progress thread). Prints tables.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import statistics
from pathlib import Path

from pd_cluster.bench.scripts.transfer_peers import (HANDOVER_CHUNK, HANDOVER_TOKENS, PAGE_COUNTS, PAGE_SIZES, Options,
                                          decode_main, prefill_main)


# ---- the parent (the worker processes are in transfer_peers.py) ----
class Pair:
    def __init__(self, opts: Options, timeout: float = 300.0) -> None:
        ctx = mp.get_context("spawn")
        self.timeout = timeout
        self.d, d_child = ctx.Pipe()
        self.p, p_child = ctx.Pipe()
        self.dec = ctx.Process(target=decode_main, args=(d_child, opts), daemon=True)
        self.pre = ctx.Process(target=prefill_main, args=(p_child, opts), daemon=True)
        self.dec.start()
        self.pre.start()
        d_info, p_info = self._recv(self.d), self._recv(self.p)
        self.d.send(p_info)
        self.p.send(d_info)
        self.prefill_agents = {ps: i["agent_name"] for ps, i in p_info.items()}
        self.nbytes_per_page = {ps: i["layout"]["page_nbytes"] for ps, i in p_info.items()}

    def _recv(self, conn):
        if not conn.poll(self.timeout):
            raise TimeoutError("a benchmark worker did not answer")
        return conn.recv()

    def ask(self, conn, *msg):
        conn.send(msg)
        return self._recv(conn)

    def wait_done(self, tid: str) -> float:
        """Decode's completion time of `tid` (CLOCK_MONOTONIC), as decode reports it."""
        kind, done_tid, t = self._recv(self.d)
        if (kind, done_tid) != ("done", tid):
            raise RuntimeError(f"expected completion of {tid}, got {kind} {done_tid}")
        return t

    def close(self) -> None:
        for conn in (self.d, self.p):
            try:
                conn.send(("exit",))
            except OSError:
                pass
        for proc in (self.dec, self.pre):
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def throughput(pair: Pair, opts: Options) -> list[dict]:
    rows = []
    cases = [(ps, n, False) for ps in PAGE_SIZES for n in PAGE_COUNTS] + [(16, 4096, True), (64, 256, True)]
    for ps, n, frag in cases:
        reps = opts.reps_small if n * pair.nbytes_per_page[ps] < (4 << 20) else opts.reps_large
        times, copies, writes, descs = [], [], [], 0
        for i in range(reps + 2):
            ticket = pair.ask(pair.d, "expect", ps, n, n * ps, frag, pair.prefill_agents[ps])
            dt, mc, descs, nbytes, wt = pair.ask(pair.p, "push", ticket, i % 2 == 1)
            pair.wait_done(ticket["transfer_id"])
            if i >= 2:  # the first two warm up (connection, first touch)
                times.append(dt)
                copies.append(mc)
                writes.append(wt)
        t, c, w = statistics.median(times), statistics.median(copies), statistics.median(writes)
        rows.append({"page_size": ps, "pages": n, "fragmented": frag, "bytes": nbytes, "descriptors": descs,
                     "reps": reps, "push_ms": t * 1e3, "write_ms": w * 1e3, "nixl_gbps": nbytes / w / 1e9,
                     "memcpy_gbps": nbytes / c / 1e9, "ratio": c / w,
                     "paired_ratio": statistics.median(ci / wi for wi, ci in zip(writes, copies)),
                     "push_ratio": c / t})
    return rows


def handover(pair: Pair, opts: Options) -> list[dict]:
    rows = []
    pair.d.send(("interval", 0.0002))
    for ps in PAGE_SIZES:
        lat, pushes, compute = [], 0, []
        n_pages = -(-HANDOVER_TOKENS // ps)
        for i in range(opts.handover_runs + 1):
            ticket = pair.ask(pair.d, "expect", ps, n_pages, HANDOVER_TOKENS, False, pair.prefill_agents[ps])
            r = pair.ask(pair.p, "handover", ticket)
            done = pair.wait_done(ticket["transfer_id"])
            if i >= 1:
                lat.append(done - r["last_forward_end"])
                compute.append(r["compute_s"])
                pushes = r["pushes"]
        lat.sort()
        rows.append({"page_size": ps, "pages": n_pages, "pushes": pushes, "runs": len(lat),
                     "p50_ms": statistics.median(lat) * 1e3, "p90_ms": lat[math.ceil(0.9 * len(lat)) - 1] * 1e3,
                     "max_ms": lat[-1] * 1e3, "prefill_compute_ms": statistics.median(compute) * 1e3})
    return rows


def print_tables(tp: list[dict], ho: list[dict], ucx: list[str], opts: Options) -> None:
    print(f"# KV transfer: NIXL push between two processes vs single-thread memcpy "
          f"(UCX_TLS={opts.ucx_tls or os.environ.get('UCX_TLS') or 'default'}, "
          f"progress thread {'on' if opts.progress_thread else 'off'}, "
          f"pools in {'huge' if opts.hugepages else '4 KiB'} pages)\n")
    print("| page size | pages | layout on decode | bytes | descriptors | reps | push -> done ms | WRITE ms "
          "| WRITE GB/s | memcpy GB/s | WRITE / memcpy | paired (p50) | push -> done / memcpy |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in tp:
        size = f"{r['bytes'] / 2**20:.2f} MiB" if r["bytes"] >= 2**20 else f"{r['bytes'] / 2**10:.0f} KiB"
        print(f"| {r['page_size']} | {r['pages']} | {'every other page' if r['fragmented'] else 'consecutive'} "
              f"| {size} | {r['descriptors']} | {r['reps']} | {r['push_ms']:.3f} | {r['write_ms']:.3f} "
              f"| {r['nixl_gbps']:.2f} | {r['memcpy_gbps']:.2f} | {100 * r['ratio']:.0f}% "
              f"| {100 * r['paired_ratio']:.0f}% | {100 * r['push_ratio']:.0f}% |")
    print(f"\n# Handover: {HANDOVER_TOKENS}-token prompt, chunks of {HANDOVER_CHUNK}, end of the last forward pass "
          "-> decode poll sees completion\n")
    print("| page size | pages | pushes | runs | p50 ms | p90 ms | max ms | prefill compute ms (p50) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in ho:
        print(f"| {r['page_size']} | {r['pages']} | {r['pushes']} | {r['runs']} | {r['p50_ms']:.3f} "
              f"| {r['p90_ms']:.3f} | {r['max_ms']:.3f} | {r['prefill_compute_ms']:.1f} |")
    print("\nUCX protocols for remote memory writes (prefill process, UCX_PROTO_INFO=y): "
          + ("; ".join(ucx) if ucx else "(none reported)"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--ucx-tls", default=None, help="UCX_TLS for both workers (default: the environment's / UCX's)")
    ap.add_argument("--progress-thread", action="store_true", help="run NIXL's UCX progress thread")
    ap.add_argument("--no-hugepages", action="store_true", help="keep the pools in 4 KiB pages")
    ap.add_argument("--reps-small", type=int, default=60, help="repetitions of transfers under 4 MiB")
    ap.add_argument("--reps-large", type=int, default=30, help="repetitions of transfers of 4 MiB or more")
    ap.add_argument("--handover-runs", type=int, default=20)
    ap.add_argument("--json", default=None, help="also write the raw rows to this file")
    a = ap.parse_args(argv)
    opts = Options(a.ucx_tls, a.progress_thread, not a.no_hugepages, a.reps_small, a.reps_large, a.handover_runs)
    pair = Pair(opts)
    try:
        tp = throughput(pair, opts)
        ho = handover(pair, opts)
        ucx = pair.ask(pair.p, "ucx")
    finally:
        pair.close()
    print_tables(tp, ho, ucx, opts)
    if a.json:
        Path(a.json).write_text(json.dumps({"throughput": tp, "handover": ho, "ucx": ucx}, indent=1))


if __name__ == "__main__":
    main()
