"""How fast can pd-bench send? Scheduler lag and client load at increasing request rates.

Starts the fake OpenAI server (``pd_cluster.bench.fake_server``) in its own process with
near-zero delays, then, for each rate, sends ``rate * --seconds`` Poisson
requests with pd-bench's own runner and prints a table of the achieved send
rate, the scheduler lag (actual start minus planned, p50/p99/max), the
event-loop delay, the client's CPU use and the request outcomes, with the
machine's load average and CPU pressure (PSI: the share of time some task
waited for a CPU), since other work on the machine delays the client's wake-ups.

    python -m pd_cluster.bench.scripts.send_rate --rates 100 250 500 750 1000 --seconds 10
"""

from __future__ import annotations

import argparse
import os

from pd_cluster.bench.arrival import rate_plan
from pd_cluster.bench.config import LoadConfig, ReportConfig, TargetConfig
from pd_cluster.bench.datasets.base import SampledRequest
from pd_cluster.bench.fake_process import FakeServerProcess
from pd_cluster.bench.metrics import count_output_tokens, summarize
from pd_cluster.bench.runner import Runner

HEADER = ("rate", "sent", "achieved/s", "lag p50 ms", "lag p99 ms", "lag max ms", "loop p99 ms",
          "client CPU %", "ok", "failed", "TTFT p50 ms", "E2EL p99 ms", "load", "CPU PSI %")


def cpu_pressure() -> str:
    """Linux PSI: share of the last 10 s in which some runnable task waited for a CPU."""
    try:
        with open("/proc/pressure/cpu") as f:
            some = f.readline().split()
        return f"{float(some[1].split('=')[1]):.0f}"
    except (OSError, IndexError, ValueError):
        return "n/a"


def one_rate(url: str, rate: float, seconds: float, tokens: int, seed: int) -> list[str]:
    n = max(2, int(rate * seconds))
    target = TargetConfig(base_url=url, request_timeout_s=30.0)
    load = LoadConfig(request_rate=rate, seed=seed)
    reqs = [SampledRequest("Once upon a time there was a little", 8, tokens)] * n
    plan = rate_plan(n, rate, 1.0, seed)
    out = Runner(target, load, "stories260K", progress=False).run_sync(reqs, plan)
    count_output_tokens(out.records, None)
    s = summarize(out, ReportConfig(metric_percentiles=(50.0, 99.0)), rate_is_inf=False)
    c = s["client"]
    return [f"{rate:g}", str(len(out.records)), f"{c['achieved_send_rate']:.1f}", f"{c['lag_p50_ms']:.2f}",
            f"{c['lag_p99_ms']:.2f}", f"{c['lag_max_ms']:.2f}", f"{c['loop_delay_p99_ms']:.2f}",
            f"{c['client_cpu_percent']:.0f}", str(s["completed"]), str(s["failed"]),
            f"{s['p50_ttft_ms']:.2f}", f"{s['p99_e2el_ms']:.2f}", f"{os.getloadavg()[0]:.1f}", cpu_pressure()]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--rates", type=float, nargs="+", default=[100, 250, 500, 750, 1000])
    p.add_argument("--seconds", type=float, default=10.0, help="sending time per rate")
    p.add_argument("--num-tokens", type=int, default=4, help="streamed tokens per response")
    p.add_argument("--ttft-ms", type=float, default=0.0)
    p.add_argument("--itl-ms", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    fake_args = ["--ttft-ms", str(a.ttft_ms), "--itl-ms", str(a.itl_ms), "--num-tokens", str(a.num_tokens)]
    print(f"fake server: {' '.join(fake_args)}; load average before: {os.getloadavg()[0]:.2f}")
    rows = []
    with FakeServerProcess(fake_args) as fake:
        for rate in a.rates:
            rows.append(one_rate(fake.url, rate, a.seconds, a.num_tokens, a.seed))
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(HEADER)]
    print("  ".join(h.rjust(w) for h, w in zip(HEADER, widths)))
    for r in rows:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths)))
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
