"""1P1D against colocated (mixed) workers on the same machine, driven by the real Azure code trace.

Starts each cluster with `launch.cluster.LocalCluster`, replays the first
``--num-prompts`` requests of the shipped Azure LLM inference trace (code
service, 2023) at their recorded arrival times with ``pd-bench``, and prints
one table: TTFT, ITL and E2E p50/p99, throughput, and the share of TTFT spent
in the KV handover (PD only, from the decode worker's
``pd:request_transfer_time_seconds``).

The trace's prompts (mean 2,048 tokens) do not fit the embedded model's
512-token context: input lengths are scaled by ``--input-len-scale`` and
capped, output lengths capped, and pd-bench states the scaling in its report.

Run: ``python -m pd_cluster.bench.scripts.cluster_pd_vs_colocated`` (about 5 minutes).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from pd_cluster.launch.cluster import ClusterSpec, LocalCluster, free_port


def run_bench(url: str, args: argparse.Namespace, out_dir: Path, name: str) -> dict:
    cmd = [sys.executable, "-m", "pd_cluster.bench.cli", "--base-url", url, "--dataset-name", "azure-trace",
           "--num-prompts", str(args.num_prompts), "--input-len-scale", str(args.input_len_scale),
           "--max-input-len", str(args.max_input_len), "--max-output-len", str(args.max_output_len),
           "--trace-speedup", str(args.trace_speedup), "--ignore-eos", "--save-result", "--result-dir", str(out_dir),
           "--result-filename", f"{name}.json", "--disable-tqdm", "--seed", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"pd-bench failed for {name}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    print(proc.stdout)
    return json.loads((out_dir / f"{name}.json").read_text())


def run_cluster(colocated: bool, args: argparse.Namespace, out_dir: Path) -> dict:
    spec = ClusterSpec(num_prefill=1, num_decode=1, colocated=colocated, num_workers=2 if colocated else 0,
                       router_port=free_port(), engine_argv=list(args.engine_arg), log_level="warning", echo=False,
                       router_argv=["--health-check-interval-secs", "1"])
    cluster = LocalCluster(spec)
    try:
        cluster.start()
        cluster.wait_ready(300)
        return run_bench(cluster.router_url, args, out_dir, "colocated" if colocated else "pd_1p1d")
    finally:
        cluster.stop()


def transfer_share(result: dict) -> str:
    phases = {(p["phase"], p["role"]): p for p in (result.get("server_breakdown") or {}).get("phases", [])}
    transfer = phases.get(("transfer", "decode"))
    ttft = result["summary"].get("mean_ttft_ms")
    if not transfer or not ttft:
        return "n/a"
    return f"{transfer['mean_ms']:.1f} ms ({100 * transfer['mean_ms'] / ttft:.0f}% of mean TTFT)"


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False,
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=300)
    ap.add_argument("--input-len-scale", type=float, default=0.1)
    ap.add_argument("--max-input-len", type=int, default=400)
    ap.add_argument("--max-output-len", type=int, default=100)
    ap.add_argument("--trace-speedup", type=float, default=1.0)
    ap.add_argument("--engine-arg", action="append", default=["--kv-cache-memory=128MiB"],
                    help="flag for every worker (repeatable)")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="pd-vs-colocated-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {"PD 1P1D": run_cluster(False, args, out_dir), "colocated x2": run_cluster(True, args, out_dir)}
    keys = [("completed", "completed", "{:.0f}"), ("failed", "failed", "{:.0f}"),
            ("p50_ttft_ms", "TTFT p50 (ms)", "{:.1f}"), ("p99_ttft_ms", "TTFT p99 (ms)", "{:.1f}"),
            ("p50_itl_ms", "ITL p50 (ms)", "{:.1f}"), ("p99_itl_ms", "ITL p99 (ms)", "{:.1f}"),
            ("p50_e2el_ms", "E2E p50 (ms)", "{:.1f}"), ("p99_e2el_ms", "E2E p99 (ms)", "{:.1f}"),
            ("request_throughput", "requests/s", "{:.2f}"), ("output_throughput", "output tok/s", "{:.1f}"),
            ("total_token_throughput", "total tok/s", "{:.1f}")]
    print("| metric | " + " | ".join(results) + " |")
    print("|---|" + "---:|" * len(results))
    for key, label, fmt in keys:
        print(f"| {label} | " + " | ".join(fmt.format(r["summary"][key]) for r in results.values()) + " |")
    print("| KV handover (mean) | " + " | ".join(transfer_share(r) for r in results.values()) + " |")
    print(f"\nscaling: {results['PD 1P1D']['config'].get('resolved', {}).get('scaling')}")
    print(f"results: {out_dir}")


if __name__ == "__main__":
    main()
