"""How close are pd-bench's numbers to the truth? Errors against a fake server with exact delays.

Starts the fake OpenAI server (``pd_cluster.bench.fake_server``, in its own process, with
``--realtime`` when the OS allows it) with TTFT 50 ms and then 10 ms per token
for 20 tokens, runs pd-bench at each rate, and prints the reported p50/p99 of
TTFT, ITL and TPOT minus the truth, with the scheduler lag and the machine load.

    python -m pd_cluster.bench.scripts.accuracy --rates 10 100 inf
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os

from pd_cluster.bench.args import build_parser, to_config
from pd_cluster.bench.cli import run_benchmark
from pd_cluster.bench.fake_process import FakeServerProcess

TRUTH_MS = {"ttft": 50.0, "itl": 10.0, "tpot": 10.0}


def one(url: str, rate: str, num: int) -> list[str]:
    argv = ["--base-url", url, "--disable-tqdm", "--dataset-name", "random", "--random-input-len", "16",
            "--random-output-len", "64", "--num-prompts", str(num), "--request-rate", rate,
            "--warmup-requests", str(min(num, 50)), "--metric-percentiles", "50,99", "--no-server-metrics"]
    with contextlib.redirect_stdout(io.StringIO()):
        s = run_benchmark(to_config(build_parser().parse_args(argv)))["summary"]
    row = [rate, str(num), str(s["completed"])]
    for m, truth in TRUTH_MS.items():
        row += [f"{s[f'p50_{m}_ms'] - truth:+.2f}", f"{s[f'p99_{m}_ms'] - truth:+.2f}"]
    c = s["client"]
    return row + [f"{c['lag_p50_ms']:.2f}", f"{c['lag_p99_ms']:.2f}", f"{os.getloadavg()[0]:.1f}"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--rates", nargs="+", default=["10", "100", "inf"])
    p.add_argument("--num", type=int, nargs="+", default=[150, 500, 50], help="requests per rate")
    a = p.parse_args(argv)
    header = ["rate", "n", "ok", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "TPOT p50", "TPOT p99",
              "lag p50", "lag p99", "load"]
    with FakeServerProcess(["--ttft-ms", "50", "--itl-ms", "10", "--num-tokens", "20"], realtime=True) as fake:
        print(f"fake server scheduling: {fake.scheduling}; errors in ms (reported - truth)")
        rows = [one(fake.url, r, n) for r, n in zip(a.rates, a.num)]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    for r in rows:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths)))


if __name__ == "__main__":
    main()
