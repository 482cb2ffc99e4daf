"""``pd-plan``: how much KV fits where, for a model and a deployment.

Example::

    pd-plan --model llama-3.1-8b --tp-size 1 --kv-cache-dtype fp8_e4m3 --context-length 131072
    pd-plan --model llama-4-scout --tp-size 8 --context-length 10000000
"""

from __future__ import annotations

import argparse
import sys

from pd_cluster.engine.config import parse_size
from pd_cluster.engine.planner.plan import KV_BYTES, WEIGHT_BYTES, Plan, PlanInput, make_plan, suggestions
from pd_cluster.engine.planner.spec import BUNDLED, load_spec


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False,
                                prog="pd-plan", description="KV-cache memory planner for pd-cluster deployments.")
    p.add_argument("--model", default="llama-3.1-8b",
                   help=f"a bundled config ({', '.join(BUNDLED)}) or a model folder / config.json")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-memory", default="143771MiB",
                   help="memory of one GPU (default: H200 141 GB, which nvidia-smi shows as 143771 MiB)")
    p.add_argument("--mem-fraction-static", type=float, default=0.88)
    p.add_argument("--kv-cache-dtype", default="fp8_e4m3", choices=sorted(KV_BYTES))
    p.add_argument("--dtype", default="bf16", choices=sorted(WEIGHT_BYTES), help="weights dtype")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--context-length", type=int, default=131072)
    p.add_argument("--host-memory", default="2TiB", help="DRAM per node, for the host-tier suggestion")
    return p


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"


def render(plan: Plan) -> str:
    s, inp = plan.spec, plan.inp
    rows = [
        ("model", f"{s.name}: {s.num_layers} layers ({s.global_layers} global, {s.local_layers} chunked), "
                  f"{s.num_kv_heads} KV heads x {s.head_dim}, {s.num_params() / 1e9:.2f}B params"),
        ("deployment", f"TP {inp.tp_size}, {inp.gpus_per_node} GPUs/node x {_gib(inp.gpu_memory)}, "
                       f"mem_fraction_static {inp.mem_fraction_static}, kv_cache_dtype {inp.kv_cache_dtype}, "
                       f"weights {inp.weight_dtype}, page_size {inp.page_size}"),
        ("KV bytes/token (model)", f"{plan.kv_bytes_per_token:,} B"),
        ("KV bytes/token (per GPU)", f"{plan.kv_bytes_per_token_per_gpu:,} B ({plan.kv_heads_per_gpu} KV head(s)"
                                     f" x {s.global_layers} global layers)"),
        ("weights per GPU", _gib(plan.weights_per_gpu)),
        ("KV pool per GPU", _gib(plan.pool_per_gpu)),
        ("pool tokens per GPU / instance", f"{plan.tokens_per_instance:,}"),
        ("pool tokens per node", f"{plan.tokens_per_node:,} ({plan.instances_per_node} instance(s))"),
        ("longest single request", f"{plan.tokens_per_instance:,} tokens"),
        ("asked context", f"{inp.context_length:,} tokens: "
                          f"{'fits' if plan.fits else 'does NOT fit'} one TP-{inp.tp_size} instance"),
    ]
    if s.local_layers:
        rows.insert(4, ("chunked-attention KV per GPU", f"{_gib(plan.local_kv_bytes_per_gpu)} "
                                                         f"(capped at {s.attention_chunk_size:,} tokens)"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    for tip in suggestions(plan):
        lines.append(f"{'to make it fit':<{width}}  {tip}")
    lines.append(f"{'start-up':<{width}}  the pool is sized from the memory budget, not --context-length: "
                 f"a server with --context-length {inp.context_length:,} starts with the same "
                 f"{_gib(plan.pool_per_gpu)} pool per GPU as one with 4,096; pages are taken as sequences grow")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        spec = load_spec(args.model)
        inp = PlanInput(tp_size=args.tp_size, gpus_per_node=args.gpus_per_node, gpu_memory=parse_size(args.gpu_memory),
                        mem_fraction_static=args.mem_fraction_static, kv_cache_dtype=args.kv_cache_dtype,
                        weight_dtype=args.dtype, page_size=args.page_size, context_length=args.context_length,
                        host_memory_per_node=parse_size(args.host_memory))
    except (ValueError, FileNotFoundError) as e:
        print(f"pd-plan: {e}", file=sys.stderr)
        return 2
    print(render(make_plan(spec, inp)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
