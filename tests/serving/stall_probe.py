"""Measure how a large prompt affects the streams of a worker: refusal time and inter-token gaps.

    PYTHONPATH=... python tests/serving/stall_probe.py --sizes-mb 1 5 25 --streams 8

Starts a mixed worker (embedded model) in this process, keeps `--streams` greedy streams running, sends one
prompt of each size to ``/v1/completions`` and prints, per size: the time to the answer (and its status) and
the p50, p99 and largest gap between consecutive tokens of the streams meanwhile, next to a baseline window of
the same length without the large prompt. Timing belongs here, not in the tests (their bound is loose).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_large_prompt import Streamer  # noqa: E402
from worker_kit import PROMPTS, running_worker  # noqa: E402


def gaps(streams: list[Streamer], a: float, b: float) -> list[float]:
    return [y - x for s in streams for ts in s.runs for x, y in zip(ts, ts[1:]) if a <= y and x <= b]


def row(label: str, g: list[float]) -> str:
    if not g:
        return f"| {label} | - | - | - |"
    q = sorted(g)
    p99 = q[min(len(q) - 1, int(0.99 * len(q)))]
    return f"| {label} | {1000 * statistics.median(q):.1f} | {1000 * p99:.1f} | {1000 * q[-1]:.1f} |"


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 5, 25])
    ap.add_argument("--streams", type=int, default=8)
    args = ap.parse_args()
    with running_worker() as w:
        streams = [Streamer(w.url, PROMPTS[i % len(PROMPTS)], 200) for i in range(args.streams)]
        for s in streams:
            s.start()
        time.sleep(2.0)
        print("| window | gap p50 (ms) | gap p99 (ms) | gap max (ms) |\n| --- | --- | --- | --- |")
        answers = []
        with httpx.Client(base_url=w.url, timeout=120) as c:
            for mb in args.sizes_mb:
                base_start = time.monotonic()
                time.sleep(1.0)
                print(row("1 s without", gaps(streams, base_start, time.monotonic())))
                body = json.dumps({"prompt": "Once upon a time " * int(mb * 1e6 / 17), "max_tokens": 4}).encode()
                t0 = time.monotonic()
                r = c.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
                t1 = time.monotonic()
                answers.append(f"{mb:g} MB: HTTP {r.status_code} in {1000 * (t1 - t0):.0f} ms")
                print(row(f"{mb:g} MB prompt ({1000 * (t1 - t0):.0f} ms)", gaps(streams, t0, t1)))
        for s in streams:
            s.stop.set()
        for s in streams:
            s.join(120)
        print("\n" + "; ".join(answers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
