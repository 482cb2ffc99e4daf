"""How long a `LocalCluster` (``pd-serve``) takes to start its workers, forked from the zygote or not.

Starts a 1P1D cluster of the embedded model ``--rounds`` times with each way of starting workers (the zygote of
`pd_cluster.launch.zygote`, ``--fork-workers``, then a new interpreter per worker, the default), and prints one table: the
time from `LocalCluster.start` to every worker healthy and the router ready, each worker's CPU seconds at that
moment (psutil), and the zygote's CPU seconds (its one-time import). The first forked round includes the zygote's
import; later rounds reuse it, as a restart or a second cluster of the same launcher does.

Run: ``python -m pd_cluster.bench.scripts.worker_start`` (about a minute on a 2-core machine). Under CPU
starvation: ``--hogs 12 --prefill 1 --decode 2 --fresh-zygote`` (busy-loop processes started and stopped by pid,
`pd_cluster.bench.scripts.cpu_hogs`; each forked round then starts its own zygote, as a launcher's first cluster
does; minutes per round).
"""

from __future__ import annotations

import argparse
import contextlib
import time

import psutil

from pd_cluster.bench.scripts.cpu_hogs import cpu_hogs
from pd_cluster.common.net import free_port
from pd_cluster.launch import zygote
from pd_cluster.launch.cluster import LocalCluster
from pd_cluster.launch.cluster_spec import ClusterSpec


def _cpu(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def one_round(fork: bool, prefill: int = 1, decode: int = 1) -> dict:
    spec = ClusterSpec(num_prefill=prefill, num_decode=decode, router_port=free_port("127.0.0.1"), echo=False,
                       fork_workers=fork)
    cluster = LocalCluster(spec)
    started = time.monotonic()
    try:
        cluster.start()
        cluster.wait_ready(900)
        ready = time.monotonic() - started
        workers = [_cpu(p.pid) for p in cluster.procs]
        zygotes = [_cpu(z.proc.pid) for z in zygote._ZYGOTES] if fork else []
    finally:
        cluster.stop()
    return {"ready_s": ready, "workers_cpu_s": workers, "zygote_cpu_s": sum(zygotes)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefill", type=int, default=1, help="prefill workers of each cluster")
    ap.add_argument("--decode", type=int, default=1, help="decode workers of each cluster")
    ap.add_argument("--hogs", type=int, default=0, help="busy-loop processes running through every round")
    ap.add_argument("--fresh-zygote", action="store_true",
                    help="close the zygote after each forked round (each then pays the zygote's import)")
    args = ap.parse_args()
    rows = []
    with cpu_hogs(args.hogs) if args.hogs else contextlib.nullcontext():
        for fork in (True, False):
            for i in range(args.rounds):
                r = one_round(fork, args.prefill, args.decode)
                rows.append((("zygote" if fork else "new interpreter"), i + 1, r))
                if args.fresh_zygote:
                    while zygote._ZYGOTES:
                        zygote._ZYGOTES.pop().close()
    print("| workers started by | round | ready (s) | CPU per worker at ready (s) | zygote CPU (s) |")
    print("| --- | --- | --- | --- | --- |")
    for how, i, r in rows:
        per = ", ".join(f"{c:.2f}" for c in r["workers_cpu_s"])
        z = f"{r['zygote_cpu_s']:.2f}" if how == "zygote" else "-"
        print(f"| {how} | {i} | {r['ready_s']:.1f} | {per} | {z} |")


if __name__ == "__main__":
    main()
