"""Stability of ``pd-serve --autoscale`` under a long steady load: its scale decisions over a sped-up trace.

A steady load should move the planner once (to the size the load needs) and then not at all: a planner that
scales up and down again under the same load (Dynamo's 2 <-> 1 oscillation, PR #9294) churns workers for
nothing. This replays the Azure code trace shipped with the bench (``bench/data/azure_code_1000.csv``: its
arrival times sped up ``--speedup`` times, its prompt and output lengths scaled to the tiny model, random prompts
of those lengths), looped end to end for ``--minutes``, against `launch.autoscale.AutoscaledCluster` (the embedded
stories260K, real worker and router processes on loopback) started at 1P1D, and sends it with pd-bench's request
loop (`bench.runner.Runner`). It prints every scale decision with its time and reasons, the decisions after the
first (the criterion: none), the failed requests, goodput against the planner's SLOs, and the sizes it ended at.

Run: ``python -m pd_cluster.bench.scripts.autoscale_stability`` (``--minutes`` plus about a minute).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from pd_cluster.bench.arrival import ArrivalPlan
from pd_cluster.bench.config import DatasetConfig, LengthScaling, LoadConfig, TargetConfig
from pd_cluster.bench.datasets import load_dataset
from pd_cluster.bench.metrics import goodput
from pd_cluster.bench.runner import Runner
from pd_cluster.bench.scripts.autoscale_goodput import MODEL, add_planner_bench_args, planner_config, spec
from pd_cluster.bench.tokenizer import load_tokenizer, resolve_tokenizer_name
from pd_cluster.launch.autoscale import AutoscaledCluster

TRACE = Path(__file__).resolve().parents[1] / "data" / "azure_code_1000.csv"


def workload(a: argparse.Namespace):
    """The trace's requests looped to ``a.minutes`` at ``a.speedup`` x its rate: (requests, plan)."""
    tok = load_tokenizer(resolve_tokenizer_name(None, MODEL))
    scaling = LengthScaling(a.input_scale, 1.0, a.max_input_len, a.max_output_len)
    ds = load_dataset(DatasetConfig(name="azure-trace", path=str(a.trace), seed=a.seed, scaling=scaling), tok)
    base = [r.timestamp / a.speedup for r in ds.requests]
    span = base[-1] + (base[-1] - base[0]) / max(len(base) - 1, 1)  # one mean gap between two passes
    reqs, times, offset = [], [], 0.0
    while offset < a.minutes * 60:
        for r, t in zip(ds.requests, base):
            if offset + t >= a.minutes * 60:
                break
            reqs.append(r)
            times.append(offset + t)
        offset += span
    kind = (f"{a.trace.name} x {a.speedup:g} speed, looped every {span:.0f} s for {a.minutes:g} min "
            f"({len(reqs) / (a.minutes * 60):.2f} req/s; prompts x {a.input_scale:g} up to {a.max_input_len}, "
            f"outputs up to {a.max_output_len})")
    return reqs, ArrivalPlan(tuple(times), kind)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--speedup", type=float, default=4.0, help="times the trace's arrival rate")
    p.add_argument("--input-scale", type=float, default=0.1, help="prompt lengths times this")
    p.add_argument("--max-input-len", type=int, default=384, help="the model's context is 512 tokens")
    p.add_argument("--max-output-len", type=int, default=64)
    p.add_argument("--max-prefill", type=int, default=2)
    p.add_argument("--max-decode", type=int, default=2)
    add_planner_bench_args(p)
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    reqs, plan = workload(a)
    print(f"load: {len(reqs)} requests, {plan.kind}", flush=True)
    config = planner_config(a, a.max_prefill, a.max_decode)
    cluster = AutoscaledCluster(spec(a, 1, 1), config)
    try:
        cluster.start(timeout=300)
        t0 = time.monotonic()
        target = TargetConfig(base_url=cluster.router_url, ignore_eos=True, temperature=0.0,
                              request_timeout_s=a.request_timeout)
        out = Runner(target, LoadConfig(), MODEL, progress=False).run_sync(reqs, plan)
        scales = list(cluster.runner.scales)
        cluster.runner.stop()
        cluster.connector.wait_idle(120)
        roles = [w["role"] for w in cluster.connector.admin.workers() if not w.get("draining")]
        actions = [f"{act} {role} {outcome}" for act, role, outcome, _ in cluster.connector.done]
    finally:
        cluster.stop()
    recs = out.records
    ok = [r for r in recs if r.success]
    good = goodput(recs, (("ttft", a.ttft_slo_ms), ("tpot", a.itl_slo_ms)), out.duration_s)
    print("\n| t (s) | decision | reasons |\n|---|---|---|")
    for d in scales:
        print(f"| {d.at - t0:.0f} | {d.current.prefill}P{d.current.decode}D -> {d.target.prefill}P{d.target.decode}D "
              f"| {'; '.join(d.reasons)} |")
    later = scales[1:]
    print(f"\nscale decisions: {len(scales)} ({len(later)} after the first"
          f"{', from +%.0f s' % (later[0].at - t0) if later else ''}); actions: {actions or 'none'}")
    print(f"requests: {len(recs)} sent, {len(recs) - len(ok)} failed; goodput {good['request_goodput']:.2f} req/s "
          f"({good['good_requests']} good); TTFT p90 "
          f"{float(np.percentile([r.ttft for r in ok], 90)) * 1000 if ok else float('nan'):.0f} ms; TPOT p90 "
          f"{float(np.percentile([r.tpot for r in ok], 90)) * 1000 if ok else float('nan'):.1f} ms; "
          f"ended at {roles.count('prefill')}P{roles.count('decode')}D after {out.duration_s:.0f} s")
    failed = [r for r in recs if not r.success]
    if failed:
        reasons: dict[str, int] = {}
        for r in failed:
            key = f"{r.reason}: {r.error}"[:160]
            reasons[key] = reasons.get(key, 0) + 1
        print("failures by reason (sent at, seconds into the run: first, last):")
        for key, n in sorted(reasons.items(), key=lambda kv: -kv[1])[:8]:
            at = [r.planned for r in failed if f"{r.reason}: {r.error}"[:160] == key]
            print(f"  {n} x {key} ({min(at):.0f}-{max(at):.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
