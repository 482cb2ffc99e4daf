"""CPU per request of ``pd-router`` against a peer router, side by side on one fake worker.

Both routers front the same fast fake worker (``pd_cluster.bench.fake_server``: zero TTFT and ITL,
8 tokens per streamed reply, ``--kv-events``: it publishes KV events and a text-to-page map as a real
worker does). The fake and the load generator (`wrk`, HTTP/1.1 keep-alive) are pinned to one CPU and
each router in turn to another (`--router-cpu`). For every cell (case x connections) the routers run
one after the other, in alternating order from round to round (interleaved A/B), so slow drifts of a
shared machine hit both alike. A router's CPU time is read from ``/proc/<pid>/stat`` (user + system,
all threads and child processes) before and after the `wrk` run and divided by the requests `wrk`
completed. Each run also records the machine's 1-minute load average and the CPU that other processes
took meanwhile (``/proc/stat`` busy time minus the router's, the fake's and wrk's), so a reader can tell
a quiet run from a contended one.

Cases (the peer runs ``round_robin`` for the first two, ``cache_aware`` for the others):

* ``plain``: non-streamed completions, ``max_tokens`` 1, policy ``round_robin`` on both;
* ``stream``: streamed completions of 8 token events, ``round_robin``;
* ``precise``: a non-streamed completion whose prompt is ``--prompt-tokens`` (682) tokens of the
  tokenizer long (1,862 characters), pd-router ``cache_aware`` on the fake's KV events through its
  text-to-page map (no tokenizer: what ``pd-serve`` runs); every request sends the same prompt;
* ``precise_unique``: the same, but each request's prompt starts with a different number, so no two
  prompts share a text block (nothing the router learned ever matches);
* ``tokenizer``, ``tokenizer_unique``: the same two with ``--tokenizer-path`` (the router tokenizes).

The peer is ``sglang_router.launch_router`` (sglang-router, Rust) when it is installed; without it
only pd-router is measured. ``--base-tree DIR`` adds a third router: pd-router run from another source
tree (for example ``git archive <commit> | tar -x -C DIR``), to compare two versions in the same run.
``--idle SECONDS`` measures instead what idle routers burn (``router_overhead_idle.py``), and
``--poll-cost N`` an idle router polling N workers.

    python -m pd_cluster.bench.scripts.router_overhead --seconds 10 --rounds 3 --concurrency 16 64
    python -m pd_cluster.bench.scripts.router_overhead --poll-cost 32 --seconds 10
    python -m pd_cluster.bench.scripts.router_overhead --idle 90
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from pd_cluster.bench.fake_process import FakeServerProcess
from pd_cluster.bench.scripts.router_overhead_kit import (
    MODEL,
    Run,
    busy_ticks,
    cpu_ticks,
    make_prompt,
    parse_wrk,
    run_wrk,
    start,
    stop,
    tree_env,
    wait_ready,
)
from pd_cluster.common.net import free_port

CASES = ("plain", "stream", "precise", "precise_unique", "tokenizer", "tokenizer_unique")
PROMPTED = ("precise", "precise_unique", "tokenizer", "tokenizer_unique")
WRK_SCRIPT = """
local counter = 0
local head = os.getenv("BENCH_HEAD")
local tail = os.getenv("BENCH_TAIL")
local unique = os.getenv("BENCH_UNIQUE") == "1"
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = head .. tail
if unique then
  request = function()
    counter = counter + 1
    return wrk.format(nil, nil, nil, head .. counter .. " " .. tail)
  end
end
"""


# ---- the routers --------------------------------------------------------------------------------------------
def pd_router_cmd(port: int, worker: str, case: str, a: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, "-m", "pd_cluster.router.main", "--host", "127.0.0.1", "--port", str(port),
           "--worker", worker, "--log-level", "warning"]
    if case.startswith("tokenizer"):
        cmd += ["--policy", "cache_aware", "--tokenizer-path", a.tokenizer_path]
    elif case.startswith("precise"):
        cmd += ["--policy", "cache_aware"]
    else:
        cmd += ["--policy", "round_robin"]
    return cmd + a.router_args


def peer_cmd(port: int, worker: str, case: str, a: argparse.Namespace) -> list[str]:
    policy = "cache_aware" if case in PROMPTED else "round_robin"
    return [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", worker, "--policy", policy, "--log-level", "warn"]


# ---- wrk ------------------------------------------------------------------------------------------------------
def body_parts(case: str, prompt: str) -> tuple[str, str]:
    """The request body as (head, tail): the unique cases put a counter between them."""
    stream = case == "stream"
    tokens = 8 if stream else 1
    text = prompt if case in PROMPTED else "Once upon a time"
    tail = json.dumps(text)[1:] + f', "max_tokens": {tokens}, "stream": {json.dumps(stream)}}}'
    return f'{{"model": "{MODEL}", "prompt": "', tail


def measure(name: str, proc: subprocess.Popen, port: int, case: str, conns: int, rnd: int,
            a: argparse.Namespace, env: dict, script: Path, fake_pid: int) -> Run:
    t0, own0, fake0, busy0 = time.monotonic(), cpu_ticks(proc.pid), cpu_ticks(fake_pid), busy_ticks()
    wrk_before = os.times()
    out = run_wrk(port, conns, a.seconds, script, env, a.client_cpu)
    wrk_after = os.times()
    own1, fake1, busy1 = cpu_ticks(proc.pid), cpu_ticks(fake_pid), busy_ticks()
    tick = os.sysconf("SC_CLK_TCK")
    wrk_cpu = (wrk_after.children_user + wrk_after.children_system
               - wrk_before.children_user - wrk_before.children_system)
    others = (busy1 - busy0 - (own1 - own0) - (fake1 - fake0)) / tick - wrk_cpu
    w = parse_wrk(out)
    if not w["requests"]:
        print(out, file=sys.stderr)
    return Run(name, case, conns, rnd, w["requests"], w["seconds"] or time.monotonic() - t0, w["p50_us"],
               w["p99_us"], w["non_2xx"], w["socket_errors"], (own1 - own0) / tick, max(0.0, others),
               os.getloadavg()[0])


# ---- the comparison -------------------------------------------------------------------------------------------
def compare(a: argparse.Namespace) -> list[Run]:
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is needed (apt-get install wrk)")
    logs = Path(tempfile.mkdtemp(prefix="router-overhead-"))
    routers = {"pd-router": (pd_router_cmd, None)}
    if a.base_tree:
        routers["pd-router@base"] = (pd_router_cmd, tree_env(a.base_tree, logs))
    if importlib.util.find_spec("sglang_router") is not None and not a.no_peer:
        routers["sglang-router"] = (peer_cmd, None)
    script = logs / "bench.lua"
    script.write_text(WRK_SCRIPT)
    os.sched_setaffinity(0, {a.client_cpu})
    prompt = make_prompt(a.tokenizer_path, a.prompt_tokens) if any(c in PROMPTED for c in a.cases) else ""
    runs: list[Run] = []
    print(f"machine: {os.cpu_count()} CPUs; routers on CPU {a.router_cpu}, wrk and the fake on CPU "
          f"{a.client_cpu}; load average {os.getloadavg()}; logs in {logs}", flush=True)
    with FakeServerProcess(["--ttft-ms", "0", "--itl-ms", "0", "--num-tokens", "8", "--kv-events",
                            "--page-size", str(a.page_size)]) as fake:
        os.sched_setaffinity(fake.proc.pid, {a.client_cpu})
        for case in a.cases:
            head, tail = body_parts(case, prompt)
            env = dict(os.environ, BENCH_HEAD=head, BENCH_TAIL=tail,
                       BENCH_UNIQUE="1" if case.endswith("_unique") else "0")
            procs = {}
            try:
                for name, (cmd, router_env) in routers.items():
                    port = free_port()
                    proc = start(cmd(port, fake.url, case, a), a.router_cpu, logs / f"{name}-{case}.log", router_env)
                    procs[name] = (proc, port)
                    wait_ready(f"http://127.0.0.1:{port}", proc)
                for rnd in range(a.rounds):
                    for conns in a.concurrency:
                        order = list(procs) if rnd % 2 == 0 else list(reversed(procs))
                        for name in order:
                            proc, port = procs[name]
                            run = measure(name, proc, port, case, conns, rnd, a, env, script, fake.proc.pid)
                            runs.append(run)
                            print(f"  {case:16s} c={conns:3d} round {rnd} {name:13s} {run.requests / run.seconds:8.0f}"
                                  f" req/s {run.us_per_req:7.1f} us/req  non-2xx {run.non_2xx} socket errors "
                                  f"{run.socket_errors}  others {run.others_cpu_s / run.seconds:4.2f} CPU  "
                                  f"load {run.load1:.2f}", flush=True)
            finally:
                for proc, _ in procs.values():
                    stop(proc)
    return runs


def report(runs: list[Run], a: argparse.Namespace) -> None:
    header = ["case", "conns", "router", "req/s", "p50 ms", "p99 ms", "non-2xx", "sock err",
              "CPU us/req (median)", "min-max", "ratio to peer", "others CPU", "load1"]
    rows = []
    cells = sorted({(r.case, r.conns) for r in runs}, key=lambda k: (CASES.index(k[0]), k[1]))
    for case, conns in cells:
        mine = [r for r in runs if r.case == case and r.conns == conns]
        names = list(dict.fromkeys(r.router for r in mine))
        for name in names:
            rs = [r for r in mine if r.router == name]
            us = [r.us_per_req for r in rs]
            ratio = "-"
            if name.startswith("pd-router") and "sglang-router" in names:
                peer = {r.round: r.us_per_req for r in mine if r.router == "sglang-router"}
                ratio = f"{statistics.median(r.us_per_req / peer[r.round] for r in rs if r.round in peer):.2f}x"
            rows.append([case, str(conns), name,
                         f"{statistics.median(r.requests / r.seconds for r in rs):.0f}",
                         f"{statistics.median(r.p50_us for r in rs) / 1e3:.2f}",
                         f"{statistics.median(r.p99_us for r in rs) / 1e3:.2f}",
                         str(sum(r.non_2xx for r in rs)), str(sum(r.socket_errors for r in rs)),
                         f"{statistics.median(us):.0f}", f"{min(us):.0f}-{max(us):.0f}", ratio,
                         f"{statistics.median(r.others_cpu_s / r.seconds for r in rs):.2f}",
                         f"{statistics.median(r.load1 for r in rs):.2f}"])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print(f"\nCPU per request, {a.rounds} interleaved round(s) of {a.seconds:g} s per router and cell "
          f"(medians; 'ratio to peer' is the median of the per-round ratios)")
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    for r in rows:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths)))


def poll_cost(a: argparse.Namespace) -> None:
    """Idle router CPU spent polling ``--poll-cost`` workers' ``/get_load`` (and health)."""
    n = a.poll_cost // 2
    with FakeServerProcess(["--role", "prefill", "--host", "0.0.0.0"]) as prefill, \
            FakeServerProcess(["--role", "decode", "--host", "0.0.0.0"]) as decode:
        def aliases(url: str) -> list[str]:  # n loopback aliases per fake: the router sees 2n workers
            port = url.rsplit(":", 1)[1]
            return [f"http://127.0.0.{i}:{port}" for i in range(1, n + 1)]

        port = free_port()
        cmd = [sys.executable, "-m", "pd_cluster.router.main", "--host", "127.0.0.1", "--port", str(port),
               "--prefill", *aliases(prefill.url), "--decode", *aliases(decode.url), "--log-level", "warning",
               *a.router_args]
        router = start(cmd, a.router_cpu, Path(tempfile.mkstemp(suffix=".log")[1]))
        try:
            time.sleep(5)
            cpu0, t0 = cpu_ticks(router.pid), time.perf_counter()
            time.sleep(a.seconds)
            cpu, wall = (cpu_ticks(router.pid) - cpu0) / os.sysconf("SC_CLK_TCK"), time.perf_counter() - t0
        finally:
            stop(router)
    polls = 2 * n * wall / 0.1
    print(f"\nIdle router polling {2 * n} workers every 100 ms ({a.seconds:g} s): "
          f"{cpu / wall * 100:.1f}% of a CPU, {cpu / polls * 1e6:.0f} us per poll")


def main(argv: list[str] | None = None) -> None:
    from pd_cluster.engine.assets import DEFAULT_MODEL

    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=10.0, help="length of one wrk run")
    p.add_argument("--rounds", type=int, default=3, help="interleaved A/B rounds per cell")
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    p.add_argument("--router-cpu", type=int, default=1)
    p.add_argument("--client-cpu", type=int, default=0, help="CPU of wrk and the fake worker")
    p.add_argument("--tokenizer-path", default=DEFAULT_MODEL,
                   help="tokenizer of the tokenizer cases (default: the embedded stories260K model)")
    p.add_argument("--prompt-tokens", type=int, default=682)
    p.add_argument("--page-size", type=int, default=32,
                   help="the fake's page size in word tokens (32: the 682-token prompt's ~10 pages of 64 tokens)")
    p.add_argument("--no-peer", action="store_true", help="measure pd-router only")
    p.add_argument("--base-tree", default=None, help="also run pd-router from this source tree")
    p.add_argument("--json", default=None, help="also write every run to this file")
    p.add_argument("--poll-cost", type=int, default=0, metavar="N",
                   help="instead: idle router CPU with N workers polled (loopback aliases)")
    p.add_argument("--idle", type=float, default=0.0, metavar="SECONDS",
                   help="instead: CPU that idle routers burn over SECONDS (router_overhead_idle.py)")
    p.add_argument("--router-args", nargs=argparse.REMAINDER, default=[],
                   help="extra pd-router flags (last on the line)")
    a = p.parse_args(argv)
    if a.idle:
        from pd_cluster.bench.scripts.router_overhead_idle import idle_cost, report as idle_report

        peer = importlib.util.find_spec("sglang_router") is not None and not a.no_peer
        idle_report(idle_cost(a.idle, 5.0, a.tokenizer_path, a.router_cpu, peer), 5.0)
        return
    if a.poll_cost:
        poll_cost(a)
        return
    runs = compare(a)
    report(runs, a)
    print(f"\nload average after: {os.getloadavg()}")
    if a.json:
        Path(a.json).write_text(json.dumps([dict(asdict(r), us_per_req=r.us_per_req) for r in runs], indent=1))


if __name__ == "__main__":
    main()
