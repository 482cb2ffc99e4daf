"""Goodput of ``pd-serve --autoscale`` (from 1P1D, at most 4 workers) against the static 4-worker splits, in one run.

Each cluster (`launch.autoscale.AutoscaledCluster` or `launch.cluster.LocalCluster`, the embedded stories260K,
real worker and router processes on loopback) gets the same bursty load, sent by pd-bench's request loop
(`bench.runner.Runner`) at the times of pd-bench's arrival process (`bench.arrival.rate_plan`, Poisson within a
phase) with pd-bench's ``random`` prompts (`bench.datasets`):

1. quiet: a low rate of short prompts;
2. burst: 4x the quiet rate, long prompts (prefill-heavy);
3. decode-heavy: short prompts, long outputs.

A request is *good* when it succeeded with its TTFT at most ``--ttft-slo-ms`` and its mean inter-token latency
(TPOT, vLLM's definition) at most ``--itl-slo-ms`` (`bench.metrics.goodput`); goodput is good requests per second
of the run (DistServe's definition). The table gives it for the whole run and per phase, the failed requests, the
TTFT and TPOT p90, and for the autoscaled cluster its planner's scale decisions and the sizes it ended at. The
planner gets the same SLOs as the bench.

Run: ``python -m pd_cluster.bench.scripts.autoscale_goodput`` (about 8 minutes on a 2-core machine).
"""

from __future__ import annotations

import argparse
import secrets
import time
from dataclasses import dataclass

import numpy as np

from pd_cluster.bench.arrival import ArrivalPlan, rate_plan
from pd_cluster.bench.config import DatasetConfig, LoadConfig, TargetConfig
from pd_cluster.bench.datasets import SampledRequest, load_dataset
from pd_cluster.bench.metrics import goodput
from pd_cluster.bench.runner import Runner
from pd_cluster.bench.tokenizer import load_tokenizer, resolve_tokenizer_name
from pd_cluster.launch.autoscale import AutoscaledCluster, autoscale_config
from pd_cluster.launch.cluster import ClusterSpec, LocalCluster, free_port
from pd_cluster.launch.serve import build_parser
from pd_cluster.planner.config import PlannerConfig

MODEL = "stories260K"
ENGINE = ["--kv-cache-memory", "64MiB", "--cpu-threads", "1"]
STATIC = ((1, 3), (2, 2), (3, 1))


@dataclass(frozen=True)
class Phase:
    """``secs`` seconds of Poisson arrivals at ``rate`` req/s; prompts of ``input_len`` tokens, ``output_len`` out."""

    name: str
    secs: float
    rate: float
    input_len: int
    output_len: int


def phases(a: argparse.Namespace) -> list[Phase]:
    return [Phase("quiet", a.phase_secs, a.quiet_rate, a.short_len, a.short_out),
            Phase("burst", a.phase_secs, 4 * a.quiet_rate, a.long_len, a.short_out),
            Phase("decode", a.phase_secs, a.decode_rate, a.short_len, a.long_out)]


def workload(a: argparse.Namespace) -> tuple[list[SampledRequest], ArrivalPlan, list[tuple[str, float, float]]]:
    """The requests, their send times, and each phase's (name, start, end) in seconds from the run's start."""
    tok = load_tokenizer(resolve_tokenizer_name(None, MODEL))
    reqs: list[SampledRequest] = []
    times: list[float] = []
    spans = []
    start = 0.0
    for i, ph in enumerate(phases(a)):
        n = max(1, round(ph.rate * ph.secs))
        ds = load_dataset(DatasetConfig(name="random", num_prompts=n, seed=a.seed + i, random_input_len=ph.input_len,
                                        random_output_len=ph.output_len, random_range_ratio=0.2), tok)
        plan = rate_plan(n, ph.rate, 1.0, a.seed + i)
        reqs += ds.requests
        times += [start + t for t in plan.times]
        spans.append((ph.name, start, start + ph.secs))
        start += ph.secs
    kind = ", then ".join(f"{p.name} {p.rate:g} req/s x {p.secs:g} s ({p.input_len} in, {p.output_len} out)"
                          for p in phases(a))
    return reqs, ArrivalPlan(tuple(times), kind), spans


def run_load(url: str, reqs: list[SampledRequest], plan: ArrivalPlan, spans, a: argparse.Namespace) -> dict:
    target = TargetConfig(base_url=url, ignore_eos=True, temperature=0.0, request_timeout_s=a.request_timeout)
    out = Runner(target, LoadConfig(), MODEL, progress=False).run_sync(reqs, plan)
    slos = (("ttft", a.ttft_slo_ms), ("tpot", a.itl_slo_ms))
    recs = out.records
    whole = goodput(recs, slos, out.duration_s)
    row = {"sent": len(recs), "failed": sum(not r.success for r in recs),
           "errors": sorted({f"{r.reason}: {r.error}"[:120] for r in recs if not r.success})[:3],
           "goodput": whole["request_goodput"], "good": whole["good_requests"]}
    ok = [r for r in recs if r.success]
    row["ttft_p90"] = float(np.percentile([r.ttft for r in ok], 90)) * 1000 if ok else float("nan")
    row["tpot_p90"] = float(np.percentile([r.tpot for r in ok], 90)) * 1000 if ok else float("nan")
    for name, t0, t1 in spans:
        part = [r for r in recs if t0 <= r.planned < t1]
        row[name] = goodput(part, slos, t1 - t0)["request_goodput"] if part else 0.0
    return row


def spec(a: argparse.Namespace, prefill: int, decode: int) -> ClusterSpec:
    return ClusterSpec(num_prefill=prefill, num_decode=decode, router_port=free_port(), engine_argv=list(ENGINE),
                       log_level="warning", echo=False, router_argv=["--health-check-interval-secs", "1"],
                       internal_api_key=secrets.token_urlsafe(24),  # as pd-serve: a new decode worker takes any prefill
                       fork_workers=a.fork_workers)


def run_static(a: argparse.Namespace, prefill: int, decode: int, work) -> dict:
    cluster = LocalCluster(spec(a, prefill, decode))
    try:
        cluster.start(timeout=300)
        row = run_load(cluster.router_url, *work, a)
    finally:
        cluster.stop()
    return dict(row, name=f"static {prefill}P{decode}D", decisions="-", sizes=f"{prefill}P{decode}D")


def add_planner_bench_args(p: argparse.ArgumentParser) -> None:
    """The SLOs, the planner's pace, the request timeout and how workers start, of the autoscale benchmarks."""
    p.add_argument("--ttft-slo-ms", type=float, default=300.0)
    p.add_argument("--itl-slo-ms", type=float, default=50.0)
    p.add_argument("--planner-interval", type=float, default=1.0)
    p.add_argument("--planner-cooldown", type=float, default=5.0)
    p.add_argument("--planner-scale-down-window", type=float, default=PlannerConfig().scale_down_window_secs,
                   help="pd-serve's --planner-scale-down-window-secs (seconds of calm before a role shrinks)")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--fork-workers", action=argparse.BooleanOptionalAction, default=ClusterSpec.fork_workers,
                   help="start workers forked from the zygote, as pd-serve does by default (--no-fork-workers: "
                        "a new interpreter each)")


def planner_config(a: argparse.Namespace, max_prefill: int, max_decode: int, max_workers: int = 0):
    """pd-serve's planner config for `a`'s SLOs and pace, from 1P1D up to the given bounds."""
    parser = build_parser()
    return autoscale_config(parser, parser.parse_args([
        "--autoscale", "--min-prefill", "1", "--max-prefill", str(max_prefill), "--min-decode", "1",
        "--max-decode", str(max_decode), "--max-workers", str(max_workers), "--ttft-slo-ms", str(a.ttft_slo_ms),
        "--itl-slo-ms", str(a.itl_slo_ms), "--planner-interval-secs", str(a.planner_interval),
        "--planner-stable-intervals", "2", "--planner-cooldown-secs", str(a.planner_cooldown),
        "--planner-scale-down-window-secs", str(a.planner_scale_down_window)]))


def run_autoscaled(a: argparse.Namespace, work) -> dict:
    config = planner_config(a, 3, 3, 4)
    cluster = AutoscaledCluster(spec(a, 1, 1), config)
    try:
        cluster.start(timeout=300)
        t0 = time.monotonic()
        row = run_load(cluster.router_url, *work, a)
        cluster.runner.stop()
        cluster.connector.wait_idle(120)
        scales = cluster.runner.scales
        done = [f"{act} {role} {outcome} ({detail})" for act, role, outcome, detail in cluster.connector.done]
        roles = [w["role"] for w in cluster.connector.admin.workers() if not w.get("draining")]  # switches included
        sizes = f"{roles.count('prefill')}P{roles.count('decode')}D"
        decisions = "; ".join(f"+{d.at - t0:.0f}s {d.current.prefill}P{d.current.decode}D->"
                              f"{d.target.prefill}P{d.target.decode}D" for d in scales) or "none"
        print(f"autoscale actions: {done or 'none'}")
        for d in scales:
            print(f"  +{d.at - t0:.1f} s: {'; '.join(d.reasons)}")
    finally:
        cluster.stop()
    return dict(row, name="autoscale from 1P1D", decisions=decisions, sizes=sizes)


def table(rows: list[dict], spans) -> str:
    names = [n for n, _, _ in spans]
    head = ["cluster", "goodput req/s", "good/sent", "failed", "TTFT p90 ms", "TPOT p90 ms",
            *[f"{n} req/s" for n in names], "ends at", "scale decisions"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["name"], f"{r['goodput']:.2f}", f"{r['good']}/{r['sent']}", str(r["failed"]),
                 f"{r['ttft_p90']:.0f}", f"{r['tpot_p90']:.1f}", *[f"{r[n]:.2f}" for n in names], r["sizes"],
                 r["decisions"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--phase-secs", type=float, default=25.0, help="seconds of each of the three phases")
    p.add_argument("--quiet-rate", type=float, default=4.0, help="req/s of the quiet phase (the burst is 4x)")
    p.add_argument("--decode-rate", type=float, default=8.0, help="req/s of the decode-heavy phase")
    p.add_argument("--short-len", type=int, default=32, help="prompt tokens of the quiet and decode phases")
    p.add_argument("--long-len", type=int, default=384, help="prompt tokens of the burst")
    p.add_argument("--short-out", type=int, default=16, help="output tokens of the quiet phase and the burst")
    p.add_argument("--long-out", type=int, default=128, help="output tokens of the decode-heavy phase")
    add_planner_bench_args(p)
    p.add_argument("--only", choices=["autoscale", "1P3D", "2P2D", "3P1D"], action="append",
                   help="run only these clusters (repeatable; default: all four)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    work = workload(a)
    print(f"load: {work[1].kind}; SLOs: TTFT {a.ttft_slo_ms:g} ms, TPOT {a.itl_slo_ms:g} ms; {len(work[0])} requests")
    rows = []
    want = a.only or ["autoscale", "1P3D", "2P2D", "3P1D"]
    if "autoscale" in want:
        rows.append(run_autoscaled(a, work))
        print(table(rows[-1:], work[2]), flush=True)
    for prefill, decode in STATIC:
        if f"{prefill}P{decode}D" in want:
            rows.append(run_static(a, prefill, decode, work))
            print(table(rows[-1:], work[2]), flush=True)
    for r in rows:
        if r["errors"]:
            print(f"{r['name']}: failures: {r['errors']}")
    print()
    print(table(rows, work[2]))
    static = [r for r in rows if r["name"].startswith("static")]
    auto = [r for r in rows if r["name"].startswith("autoscale")]
    if static and auto:
        best = max(static, key=lambda r: r["goodput"])
        print(f"\nbest static: {best['name']} {best['goodput']:.2f} req/s; autoscale {auto[0]['goodput']:.2f} req/s "
              f"({auto[0]['goodput'] / best['goodput']:.2f}x), {auto[0]['failed']} failed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
