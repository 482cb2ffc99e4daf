"""PD with a hybrid-attention model: the KV bytes one transfer moves with KV cache groups and with one group.

    python -m pd_cluster.bench.scripts.hybrid_pd                     # prompts of 1,000, 4,000 and 8,000 tokens
    python -m pd_cluster.bench.scripts.hybrid_pd --lengths 2048 --chunk 256

The model is a tiny random Llama 4 text checkpoint written by transformers with Scout's layer pattern: of every 4
layers, 3 chunked-local (``--chunk`` tokens, default 512) and 1 global NoPE layer (hidden 64, 8 layers, 2 KV heads
of 16, MoE on every second layer). Each mode starts a 1P1D cluster (`launch.cluster.LocalCluster`, fp32 KV,
16-token pages): ``groups`` (the default engine: per-group transfers of only the pages the decode reads) and
``one group`` (``--disable-hybrid-kv-cache-manager``: every layer's page of every prompt token). One request per
prompt length (random token ids, 8 greedy tokens) goes through the router, one at a time; the table gives the
decode worker's counters for it: bytes received (``pd:kv_transfer_received_bytes``) and bytes behind the chunked
layers' window that were not moved (``pd:kv_transfer_window_skipped_bytes``), the request's latency at the
client, and whether both modes returned the same tokens.

Results and the machine go to ``docs/perf/hybrid-pd.md`` by hand (command, machine, date).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import tempfile
import time
from datetime import date
from pathlib import Path

import httpx

from pd_cluster.bench import prom
from pd_cluster.launch.cluster import ClusterSpec, LocalCluster, free_port

PAGE = 16
COUNTERS = ("pd:kv_transfer_received_bytes_total", "pd:kv_transfer_window_skipped_bytes_total")


def build_model(folder: Path, chunk: int, max_len: int) -> None:
    """Save the tiny Llama 4 checkpoint (module docstring) into `folder`."""
    import torch
    from transformers import AutoTokenizer, Llama4ForCausalLM, Llama4TextConfig

    from pd_cluster.engine.assets import DEFAULT_MODEL

    torch.manual_seed(0)
    cfg = Llama4TextConfig(vocab_size=512, hidden_size=64, intermediate_size=32, intermediate_size_mlp=128,
                           num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
                           attention_chunk_size=chunk, no_rope_layer_interval=4, max_position_embeddings=max_len)
    Llama4ForCausalLM(cfg).save_pretrained(folder)
    AutoTokenizer.from_pretrained(DEFAULT_MODEL).save_pretrained(folder)


def _scrape(url: str) -> prom.Scrape:
    return prom.parse(httpx.get(url + "/metrics", timeout=10).text)


def run_mode(model: Path, one_group: bool, lengths: list[int], seed: int) -> list[dict]:
    argv = ["--model", str(model), "--kv-cache-dtype", "fp32", "--page-size", str(PAGE), "--kv-cache-memory",
            "128MiB", "--cpu-threads", "1", *(["--disable-hybrid-kv-cache-manager"] if one_group else [])]
    spec = ClusterSpec(num_prefill=1, num_decode=1, router_port=free_port(), engine_argv=argv, log_level="warning",
                       echo=False)
    cluster = LocalCluster(spec)
    rows = []
    try:
        cluster.start()
        cluster.wait_ready(300)
        decode = next(p.url for p in cluster.procs if p.role == "decode")
        info = httpx.get(decode + "/server_info", timeout=10).json()
        for n in lengths:
            rng = random.Random(seed + n)
            ids = [rng.randrange(3, 500) for _ in range(n)]
            before = _scrape(decode)
            t0 = time.perf_counter()
            r = httpx.post(cluster.router_url + "/v1/completions", timeout=600, json={
                "model": model.name, "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True})
            seconds = time.perf_counter() - t0
            r.raise_for_status()
            after = _scrape(decode)
            rows.append({"tokens": n, "mode": "one group" if one_group else "groups",
                         "received": prom.delta_sum(before, after, COUNTERS[0]),
                         "skipped": prom.delta_sum(before, after, COUNTERS[1]), "seconds": seconds,
                         "token_ids": r.json()["choices"][0]["token_ids"], "groups": info.get("kv_groups", [])})
    finally:
        cluster.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1000, 4000, 8000], help="prompt tokens")
    ap.add_argument("--chunk", type=int, default=512, help="the chunked layers' attention chunk, tokens")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "llama4-hybrid"
        build_model(model, args.chunk, max(args.lengths) + 64)
        grouped = run_mode(model, False, args.lengths, args.seed)
        single = run_mode(model, True, args.lengths, args.seed)
    print(f"# hybrid PD transfer: {date.today()}, {platform.machine()}, {os.cpu_count()} CPUs, "
          f"Llama 4 text (8 layers: 6 chunked of {args.chunk} tokens, 2 global), fp32 KV, page {PAGE}")
    print(f"# KV groups: {grouped[0]['groups']}")
    print("| prompt tokens | mode | bytes received | bytes skipped (behind the window) | received vs one group "
          "| request s | same tokens |")
    print("|---:|---|---:|---:|---:|---:|---|")
    for g, s in zip(grouped, single):
        same = "yes" if g["token_ids"] == s["token_ids"] else "NO"
        for row in (g, s):
            ratio = row["received"] / s["received"] if s["received"] else float("nan")
            print(f"| {row['tokens']:,} | {row['mode']} | {row['received']:,.0f} | {row['skipped']:,.0f} | "
                  f"{ratio:.2f} | {row['seconds']:.2f} | {same} |")


if __name__ == "__main__":
    main()
