"""PD at different TP sizes on P and D: the KV bytes, pushes and NIXL descriptors one request's transfer takes,
for each prefill/decode size pair against the same-size pairs.

    python -m pd_cluster.bench.scripts.tp_pairs                         # pairs 1-1 2-2 1-2 2-1 2-4
    python -m pd_cluster.bench.scripts.tp_pairs --pairs 1-1 2-1 --models llama3

Two tiny random checkpoints written by transformers: a Llama 3 with 4 KV heads of 16 (GQA: heads are split over the
decode ranks, so every head crosses once whatever the pair, and a decode rank is fed by one or several prefill
ranks), and a DeepSeek-V3 (MLA: the latent of 56 values a token is replicated on every rank, so each decode rank
receives it once and the bytes grow with the decode's TP size). Each pair starts `pd-serve`'s local cluster
(`launch.cluster.LocalCluster`, per-role ``--tp-size`` as ``--prefill-arg``/``--decode-arg`` give it, fp32 KV,
16-token pages, 1 CPU thread a rank) and sends the same prompts (random token ids, 4 greedy tokens), one at a time.
The table gives, per request: the decode's received bytes (``pd:kv_transfer_received_bytes``), the prefill's pushes
(``pd:kv_transfer_latency_seconds`` count) and descriptors (``pd:kv_transfer_num_descriptors`` sum), the bytes
against the same-size pair at the decode's TP size, and whether the tokens equal the 1-1 pair's.

Results and the machine go to ``docs/perf/transfer.md`` by hand (command, machine, date).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import tempfile
from datetime import date
from pathlib import Path

import httpx

from pd_cluster.bench import prom
from pd_cluster.launch.cluster import ClusterSpec, LocalCluster, free_port

PAGE = 16
RECEIVED = "pd:kv_transfer_received_bytes_total"
PUSHES = "pd:kv_transfer_latency_seconds_count"
DESCS = "pd:kv_transfer_num_descriptors_sum"


def build_model(kind: str, folder: Path) -> None:
    """Save the tiny `kind` (``llama3`` or ``deepseek-v3``) checkpoint (module docstring) into `folder`."""
    import torch
    from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

    from pd_cluster.engine.assets import DEFAULT_MODEL

    torch.manual_seed(0)
    if kind == "llama3":
        model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                             head_dim=16, max_position_embeddings=1024))
    else:
        model = DeepseekV3ForCausalLM(DeepseekV3Config(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
            kv_lora_rank=40, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24, max_position_embeddings=1024,
            num_hidden_layers=2, first_k_dense_replace=1, q_lora_rank=48, n_routed_experts=4, num_experts_per_tok=2,
            n_group=2, topk_group=1, norm_topk_prob=True, n_shared_experts=1, moe_intermediate_size=32))
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(DEFAULT_MODEL).save_pretrained(folder)


def run_pair(model: Path, prefill_tp: int, decode_tp: int, prompts: list[list[int]]) -> list[dict]:
    argv = ["--model", str(model), "--kv-cache-dtype", "fp32", "--page-size", str(PAGE), "--kv-cache-memory",
            "64MiB", "--cpu-threads", "1"]
    spec = ClusterSpec(num_prefill=1, num_decode=1, router_port=free_port(), engine_argv=argv, log_level="warning",
                       echo=False, role_argv={"prefill": ["--tp-size", str(prefill_tp)],
                                              "decode": ["--tp-size", str(decode_tp)]})
    cluster = LocalCluster(spec)
    rows = []
    try:
        cluster.start()
        cluster.wait_ready(600)
        prefill = next(p.url for p in cluster.procs if p.role == "prefill")
        decode = next(p.url for p in cluster.procs if p.role == "decode")
        for ids in prompts:
            before_p, before_d = _scrape(prefill), _scrape(decode)
            r = httpx.post(cluster.router_url + "/v1/completions", timeout=600, json={
                "model": model.name, "prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True})
            r.raise_for_status()
            after_p, after_d = _scrape(prefill), _scrape(decode)
            rows.append({"tokens": len(ids), "received": prom.delta_sum(before_d, after_d, RECEIVED),
                         "pushes": prom.delta_sum(before_p, after_p, PUSHES),
                         "descs": prom.delta_sum(before_p, after_p, DESCS),
                         "token_ids": r.json()["choices"][0]["token_ids"]})
    finally:
        cluster.stop()
    return rows


def _scrape(url: str) -> prom.Scrape:
    return prom.parse(httpx.get(url + "/metrics", timeout=10).text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--pairs", nargs="+", default=["1-1", "2-2", "1-2", "2-1", "2-4"], help="PREFILL_TP-DECODE_TP")
    ap.add_argument("--models", nargs="+", default=["llama3", "deepseek-v3"], choices=["llama3", "deepseek-v3"])
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 200], help="prompt tokens")
    args = ap.parse_args(argv)
    pairs = [tuple(int(x) for x in p.split("-")) for p in args.pairs]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in args.lengths]
    print(f"# PD TP pairs: {date.today()}, {platform.machine()}, {os.cpu_count()} CPUs, fp32 KV, page {PAGE}")
    print("| model | P TP | D TP | prompt tokens | bytes received | vs same-size pair | pushes | descriptors "
          "| tokens = 1-1's |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.models:
            model = Path(tmp) / f"{kind}-tiny"
            build_model(kind, model)
            results = {pair: run_pair(model, *pair, prompts) for pair in pairs}
            base = results.get((1, 1))
            for (p, d), rows in results.items():
                same = results.get((d, d))
                for i, row in enumerate(rows):
                    ratio = f"{row['received'] / same[i]['received']:.2f}" if same and same[i]["received"] else "-"
                    equal = "-" if base is None else ("yes" if row["token_ids"] == base[i]["token_ids"] else "NO")
                    print(f"| {kind} | {p} | {d} | {row['tokens']} | {row['received']:,.0f} | {ratio} "
                          f"| {row['pushes']:.0f} | {row['descs']:.0f} | {equal} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
