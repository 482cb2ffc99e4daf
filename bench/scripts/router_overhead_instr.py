"""pd-router's user-space instructions per request, counted by valgrind (a measure other jobs on the machine do not move).

On a shared machine, CPU time per request moves by ±20% between runs of the same router (other jobs take the
cores and the caches), which hides a change of a few percent. Instructions do not move: this runs pd-router
under ``valgrind --tool=cachegrind --cache-sim=no`` behind the same fake worker as ``router_overhead.py``,
sends ``--requests`` requests of a case (16 client connections, at ``--rate`` requests/s), then five times as
many, and prints the difference of the instruction totals over the difference of the requests (the start-up
cancels out). The polls the router runs per second (loads, KV events, text maps) are counted too, for the
seconds the run lasted: the same seconds for every router, at the same rate.
Instructions are not time (a cache miss costs more than many of them; system calls are not counted), so this
complements ``router_overhead.py``; it does not replace it.

    python -m pd_cluster.bench.scripts.router_overhead_instr --cases precise_unique --base-tree /path/to/tree
"""

from __future__ import annotations

import argparse
import http.client
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from pd_cluster.bench.fake_process import FakeServerProcess
from pd_cluster.bench.scripts.router_overhead import body_parts, pd_router_cmd
from pd_cluster.bench.scripts.router_overhead_kit import make_prompt, pinned, tree_env, wait_ready
from pd_cluster.common.net import free_port
from pd_cluster.engine.assets import DEFAULT_MODEL

CONNS = 16


def _drive(port: int, head: str, tail: str, unique: bool, n: int, first: int, rate: float) -> None:
    """`n` requests over `CONNS` keep-alive connections, request ``i`` sent no sooner than ``i / rate`` seconds
    after the start; the unique cases number theirs from `first`."""
    counter, lock, t0 = iter(range(first, first + n)), threading.Lock(), time.monotonic()

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            wait = t0 + (i - first) / rate - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            body = head + (f"{i} " if unique else "") + tail
            conn.request("POST", "/v1/completions", body=body.encode(), headers={"content-type": "application/json"})
            answer = conn.getresponse()
            answer.read()
            if answer.status != 200:
                raise RuntimeError(f"status {answer.status}")

    threads = [threading.Thread(target=client) for _ in range(CONNS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def instructions(case: str, n: int, a: argparse.Namespace, env: dict | None, logs: Path,
                 name: str) -> tuple[int, float]:
    """(instructions of one router process serving `n` requests of `case`, seconds the requests took), behind a
    fresh fake worker (a router starts with a snapshot of its KV events and text map: the same one for every run)."""
    with FakeServerProcess(["--ttft-ms", "0", "--itl-ms", "0", "--num-tokens", "8", "--kv-events",
                            "--page-size", "32"]) as fake:
        os.sched_setaffinity(fake.proc.pid, {a.client_cpu})
        return _count(case, n, fake.url, a, env, logs, name)


def _count(case: str, n: int, fake_url: str, a: argparse.Namespace, env: dict | None, logs: Path,
           name: str) -> tuple[int, float]:
    port = free_port()
    out = logs / f"{name}-{case}-{n}.cachegrind"
    cmd = ["valgrind", "--tool=cachegrind", "--cache-sim=no", f"--cachegrind-out-file={out}",
           *pd_router_cmd(port, fake_url, case, a)]
    log = logs / f"{name}-{case}-{n}.log"
    with open(log, "wb") as sink:
        proc = subprocess.Popen(cmd, preexec_fn=pinned({a.router_cpu}), stdout=sink, stderr=subprocess.STDOUT,
                                env=env)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, timeout=600)
        head, tail = body_parts(case, a.prompt)
        t0 = time.monotonic()
        _drive(port, head, tail, case.endswith("_unique"), n, 1, a.rate)
        took = time.monotonic() - t0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as answer:
            routed = {src: float(v) for src, v in re.findall(r'routed_total\{[^}]*source="(\w+)"[^}]*\} (\S+)',
                                                             answer.read().decode())}
        print(f"    {name} {case} {n} requests: routed by {routed}", flush=True)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=600)
    found = re.search(r"I\s+refs:\s+([\d,]+)", log.read_text())
    if found is None:
        raise RuntimeError(f"no instruction count in {log}")
    return int(found.group(1).replace(",", "")), took


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--cases", nargs="+", default=["precise_unique"],
                   choices=["plain", "precise", "precise_unique"])
    p.add_argument("--requests", type=int, default=100, help="the shorter run's requests (the longer: 5x)")
    p.add_argument("--rate", type=float, default=20.0,
                   help="requests/s sent at most (below what the router serves under valgrind, so every router "
                        "runs the same seconds, and the polls it runs per second weigh the same)")
    p.add_argument("--base-tree", default=None, help="also count pd-router from this source tree")
    p.add_argument("--tokenizer-path", default=DEFAULT_MODEL,
                   help="builds the prompt (default: the embedded model's tokenizer, as router_overhead.py)")
    p.add_argument("--prompt-tokens", type=int, default=682)
    p.add_argument("--router-cpu", type=int, default=1)
    p.add_argument("--client-cpu", type=int, default=0)
    a = p.parse_args(argv)
    a.router_args = []
    a.prompt = make_prompt(a.tokenizer_path, a.prompt_tokens)
    logs = Path(tempfile.mkdtemp(prefix="router-instr-"))
    trees = {"pd-router": None}
    if a.base_tree:
        trees["pd-router@base"] = tree_env(a.base_tree, logs)
    os.sched_setaffinity(0, {a.client_cpu})
    rows = []
    for case in a.cases:
        for name, env in trees.items():
            # compile the tree's bytecode first: a run that compiles it counts the compiler's instructions
            subprocess.run([sys.executable, "-c", "import pd_cluster.router.main"], env=env, check=True)
            short, t_short = instructions(case, a.requests, a, env, logs, name)
            long, t_long = instructions(case, 5 * a.requests, a, env, logs, name)
            per = (long - short) / (4 * a.requests)
            rows.append((case, name, per, t_short, t_long))
            print(f"  {case:15s} {name:15s} {per:12,.0f} instructions/request  ({t_short:.0f} s and "
                  f"{t_long:.0f} s of requests)", flush=True)
    print(f"\nuser-space instructions per request (valgrind, {CONNS} connections; logs in {logs})")
    print(f"{'case':>15s}  {'router':>15s}  {'instructions/req':>16s}")
    for case, name, per, _, _ in rows:
        print(f"{case:>15s}  {name:>15s}  {per:16,.0f}")


if __name__ == "__main__":
    sys.exit(main())
