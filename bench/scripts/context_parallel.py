"""Context-parallel prefill on CPU: one long prompt's prefill time and peak memory per rank at CP 1 and CP 2.

    python -m pd_cluster.bench.scripts.context_parallel                    # 4k, 8k, 16k tokens
    python -m pd_cluster.bench.scripts.context_parallel --lengths 4096     # one length
    python -m pd_cluster.bench.scripts.context_parallel --smoke            # checks the script (1k tokens)

The model is a tiny random Llama 3 checkpoint written by transformers (hidden 128, 4 layers of full attention,
4 query and 2 KV heads of 32, MLP 256), ``max_position_embeddings`` past the longest prompt. Each row runs in a
fresh process: the engine loads (fp32 KV, 16-token pages, chunked prefill of 4,096 tokens, attention backend
``cpu``), then one request of random tokens generates one token. Rows: CP 1 on one thread, CP 1 on two
threads (the same two cores CP 2 uses), and ``--prefill-context-parallel-size 2`` (two rank processes of one
thread each, gloo). Reported: the request's wall time (prefill plus one token), the seconds rank 0 spent in
the per-layer K/V all-gathers and their stores (including waits for the other rank), and each rank's peak
resident memory during the request (Linux ``VmHWM``, reset once the engine is ready) over its resident memory
then.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

PAGE, CHUNK = 16, 4096
ROWS = (("1", 1), ("1", 2), ("2", 1))  # (CP size, threads per rank)


def build_model(folder: Path, max_len: int) -> None:
    """Save the tiny Llama 3 checkpoint (module docstring) into `folder`."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from pd_cluster.engine.assets import DEFAULT_MODEL

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=max_len)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    AutoTokenizer.from_pretrained(DEFAULT_MODEL).save_pretrained(folder)


def _status(pid: int | str, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak(pid: int | str) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def run_one(model: str, length: int, cp: int, threads: int) -> dict:
    """In this process: load the engine, prefill one `length`-token prompt, return the measurements."""
    import numpy as np

    from pd_cluster.engine import LLM, SamplingParams

    kv_bytes = 4 * 2 * 2 * 32 * 4 * (length + 2 * PAGE)  # layers x K,V x KV heads x head_dim x fp32
    llm = LLM(model, prefill_context_parallel_size=cp, cpu_threads=threads, attention_backend="cpu",
              kv_cache_dtype="fp32", page_size=PAGE, chunked_prefill_size=CHUNK, context_length=length + 16,
              kv_cache_memory=kv_bytes + (8 << 20), disable_radix_cache=True)
    engine = llm.engine
    pids = ["self"] + ([p.pid for p in engine.tp_driver.procs] if engine.tp_driver else [])
    ready = [_status(p, "VmRSS") for p in pids]
    for p in pids:
        _reset_peak(p)
    prompt = np.random.default_rng(length).integers(3, 512, size=length).tolist()
    started = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    seconds = time.perf_counter() - started
    peaks = [_status(p, "VmHWM") for p in pids]
    runner = engine.shard.cp
    row = {"length": length, "cp": cp, "threads": threads, "seconds": seconds, "token": out[0].token_ids[0],
           "ready": ready, "peak": peaks, "gather": runner.gather_seconds if runner else 0.0,
           "split_steps": runner.split_steps if runner else 0}
    engine.close()
    return row


def _fresh_process(model: str, length: int, cp: str, threads: int) -> dict:
    """`run_one` in a new interpreter (its peak memory is its own), with `threads` OpenMP threads."""
    cmd = [sys.executable, "-m", "pd_cluster.bench.scripts.context_parallel", "--one", model, str(length), cp,
           str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": str(threads)}).stdout
    row = json.loads(out.strip().splitlines()[-1])
    print(f"# {row}", file=sys.stderr, flush=True)
    return row


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--smoke", action="store_true", help="one 1,024-token prompt per row")
    p.add_argument("--one", nargs=4, metavar=("MODEL", "LENGTH", "CP", "THREADS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one[0], int(args.one[1]), int(args.one[2]), int(args.one[3]))))
        return 0
    lengths = [1024] if args.smoke else args.lengths
    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp), max(lengths) + 64)
        rows = [_fresh_process(tmp, length, cp, threads) for length in lengths for cp, threads in ROWS]
    print(f"Context-parallel prefill on CPU: tiny Llama 3 (hidden 128, 4 layers, 4 q / 2 KV heads of 32), fp32 KV, "
          f"page {PAGE}, chunked prefill {CHUNK}, backend cpu; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, {date.today().isoformat()}\n")
    print("| prompt tokens | CP | threads per rank | prefill + 1 token | speed-up vs CP 1 (1 thread) | rank 0 in "
          "all-gather | split steps | peak RSS over ready, per rank (GiB) | RSS at ready, per rank (GiB) | token |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    base: dict[int, float] = {}
    for r in rows:
        if r["cp"] == 1 and r["threads"] == 1:
            base[r["length"]] = r["seconds"]
        speed = base.get(r["length"], r["seconds"]) / r["seconds"]
        over = " / ".join(_gib(pk - rd) for pk, rd in zip(r["peak"], r["ready"]))
        ready = " / ".join(_gib(rd) for rd in r["ready"])
        print(f"| {r['length']:,} | {r['cp']} | {r['threads']} | {r['seconds']:.2f} s | {speed:.2f}x | "
              f"{r['gather']:.2f} s | {r['split_steps']} | {over} | {ready} | {r['token']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
