"""What an idle router burns: CPU per second of wall time, in windows from its start, for each router at once.

Each router fronts its own fake worker (``--kv-events``: KV events and a text-to-page map to poll) and gets
no request. Every ``--window`` seconds each router's CPU time (``/proc/<pid>/stat``, all threads and children) is
read and printed as milliseconds of CPU per second; the summary gives the first minute and the rest.

    python -m pd_cluster.bench.scripts.router_overhead --idle 90
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from pd_cluster.bench.fake_process import FakeServerProcess
from pd_cluster.bench.scripts.router_overhead_kit import cpu_ticks, start, stop
from pd_cluster.common.net import free_port


def idle_cost(seconds: float, window: float, tokenizer_path: str, cpu: int, peer: bool) -> dict[str, list[float]]:
    """ms of CPU per second per window, by router: pd-router with ``cache_aware`` (the text maps), with
    ``--tokenizer-path``, with ``round_robin``, and (`peer`) sglang-router with ``cache_aware``."""
    routers = {
        "pd-router cache_aware": ["--policy", "cache_aware"],
        "pd-router cache_aware --tokenizer-path": ["--policy", "cache_aware", "--tokenizer-path", tokenizer_path],
        "pd-router round_robin": ["--policy", "round_robin"],
    }
    fakes, procs = [], {}
    logs = Path(tempfile.mkdtemp(prefix="router-idle-"))
    try:
        for name, extra in list(routers.items()) + ([("sglang-router cache_aware", None)] if peer else []):
            fake = FakeServerProcess(["--kv-events"])
            fake.__enter__()
            fakes.append(fake)
            port = free_port()
            if extra is None:
                cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
                       str(port), "--worker-urls", fake.url, "--policy", "cache_aware", "--log-level", "warn"]
            else:
                cmd = [sys.executable, "-m", "pd_cluster.router.main", "--host", "127.0.0.1", "--port", str(port),
                       "--worker", fake.url, "--log-level", "warning", *extra]
            procs[name] = start(cmd, cpu, logs / f"{len(procs)}.log")
        tick = os.sysconf("SC_CLK_TCK")
        last = {name: 0 for name in procs}
        out: dict[str, list[float]] = {name: [] for name in procs}
        t0 = time.monotonic()
        print(f"{'seconds':>8}  " + "  ".join(f"{n:>40}" for n in procs), flush=True)
        while time.monotonic() - t0 < seconds:
            time.sleep(window)
            row = []
            for name, proc in procs.items():
                now = cpu_ticks(proc.pid)
                out[name].append((now - last[name]) / tick / window * 1e3)
                last[name] = now
                row.append(f"{out[name][-1]:>34.1f} ms/s")
            print(f"{time.monotonic() - t0:8.0f}  " + "  ".join(row), flush=True)
        return out
    finally:
        for proc in procs.values():
            stop(proc)
        for fake in fakes:
            fake.__exit__(None, None, None)


def report(out: dict[str, list[float]], window: float) -> None:
    first = max(1, int(60 / window))
    print("\nIdle CPU, ms per second (mean over the windows)")
    for name, values in out.items():
        head, rest = values[:first], values[first:]
        tail = f"{sum(rest) / len(rest):.1f}" if rest else "-"
        print(f"  {name:42s} first minute {sum(head) / len(head):6.1f}   after {tail:>6}")
