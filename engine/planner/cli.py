"""``pd-plan``: how much KV fits where, for a model and a deployment.

Example::

    pd-plan --model llama-3.1-8b --tp-size 1 --kv-cache-dtype fp8_e4m3 --context-length 131072
    pd-plan --model llama-4-scout --tp-size 8 --context-length 10000000
    pd-plan --model llama-4-scout --tp-size 8 --context-length 10000000 --role decode
    pd-plan --model llama-3.1-8b --enable-hierarchical-cache --hicache-ratio 2
    pd-plan --model deepseek-v3 --gpu-memory 80GiB --tp-size 16 --nnodes 2
    pd-plan --model deepseek-v3 --role decode --tp-size 16 --dp-size 16 --enable-dp-attention \
        --enable-expert-parallel --nnodes 2
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from pd_cluster.engine.args import parse_hicache_size
from pd_cluster.engine.config import parse_size
from pd_cluster.engine.model import families
from pd_cluster.engine.planner.limits import (DEFAULT_PREFILL_TFLOPS, context_limit, prefill_flops, prefill_seconds,
                                              rope_type, unsupported_reason)
from pd_cluster.engine.planner.plan import (DEFAULT_CHUNKED_PREFILL_SIZE, KV_BYTES, KV_CACHE_DTYPES, ROLES,
                                            WEIGHT_BYTES, Plan, PlanInput, make_plan, quant_note, stored_weights,
                                            suggestions)
from pd_cluster.engine.planner.spec import BUNDLED, load_spec
from pd_cluster.engine.planner.wide_ep import WideEPInput, plan_wide_ep, render_wide_ep


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pd-plan", allow_abbrev=False,
                                description="KV-cache memory planner for pd-cluster deployments.")
    p.add_argument("--model", default="llama-3.1-8b",
                   help=f"a bundled config ({', '.join(BUNDLED)}) or a model folder / config.json")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-memory", default="143771MiB",
                   help="memory of one GPU (default: H200 141 GB, which nvidia-smi shows as 143771 MiB)")
    p.add_argument("--mem-fraction-static", type=float, default=0.88)
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="as the engine's flag; auto (its default): the model's dtype")
    p.add_argument("--dtype", default="bf16", choices=sorted(WEIGHT_BYTES),
                   help="dtype of the unquantised weights in memory (a quantised checkpoint's quantised layers keep "
                        "their own); fp8 is a what-if: the engine does not quantise an unquantised checkpoint on "
                        "load (NOT SERVABLE; serve an FP8 release)")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--role", default="mixed", choices=ROLES,
                   help="the worker's role; every role frees local layers' pages behind their window, and PD "
                        "transfers move only the window (default mixed)")
    p.add_argument("--chunked-prefill-size", type=int, default=DEFAULT_CHUNKED_PREFILL_SIZE,
                   help="as the engine's flag: a local layer holds its window plus one prefill chunk")
    p.add_argument("--context-length", type=int, default=131072)
    p.add_argument("--host-memory", default="2TiB", help="DRAM per node, for the host-tier suggestion")
    p.add_argument("--enable-hierarchical-cache", action="store_true",
                   help="show the host tier (SGLang's HiCache L2) each GPU keeps in DRAM")
    p.add_argument("--hicache-ratio", type=float, default=2.0, help="host tier tokens over pool tokens (default 2)")
    p.add_argument("--hicache-size", type=parse_hicache_size, default=None,
                   help="host tier per GPU: a bare number is GB (SGLang's), or e.g. 64GiB; overrides the ratio")
    p.add_argument("--prefill-tflops", type=float, default=DEFAULT_PREFILL_TFLOPS,
                   help="sustained prefill rate per GPU (TFLOP/s) for the prefill-time estimate "
                        f"(default {DEFAULT_PREFILL_TFLOPS:g}: about 40%% of an H200's dense BF16 peak)")
    p.add_argument("--dp-size", type=int, default=1,
                   help="DP attention groups of one instance (with --enable-dp-attention; SGLang's meaning)")
    p.add_argument("--enable-dp-attention", action="store_true",
                   help="plan one instance of --tp-size ranks whose attention is data-parallel over --dp-size "
                        "groups and whose experts are spread over every rank")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="with --enable-dp-attention: whole experts a rank (else a slice of each)")
    p.add_argument("--nnodes", type=int, default=1,
                   help="nodes one instance spans: --tp-size / --nnodes ranks a node (SGLang's multi-node TP; with "
                        "--enable-dp-attention, the wide-EP instance's nodes)")
    p.add_argument("--ep-num-redundant-experts", type=int, default=0,
                   help="with --enable-dp-attention --enable-expert-parallel: EPLB's extra physical experts over the "
                        "instance (SGLang's flag), held on top of the E / --tp-size a rank")
    p.add_argument("--decode-batch-per-rank", type=int, default=128,
                   help="decode tokens per DP group per step, for the communication estimate (default 128)")
    return p


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"


def _duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1e3:,.0f} ms"
    if seconds < 120:
        return f"{seconds:,.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:,.1f} min"
    return f"{seconds / 3600:,.1f} h"


def _slots(plan: Plan, bytes_per_token: int, layers: int) -> str:
    """`` in N layer slots`` when the engine's groups pad `layers` to more slots of a page, else ''."""
    slots = bytes_per_token // (plan.kv_heads_per_gpu * plan.spec.head_dim * 2 * KV_BYTES[plan.inp.kv_dtype])
    return f" in {slots} layer slots" if slots != layers else ""


def _kv_layers(plan: Plan) -> str:
    s = plan.spec
    if plan.window_kv:
        pad = _slots(plan, plan.kv_bytes_per_token_per_gpu, s.global_layers)
        return (f"{s.global_layers} global layers{pad}; the {s.local_layers} {s.local_kind} layers hold only "
                f"their window (KV groups of {plan.page_layers} layers a page)")
    if s.local_layers:
        why = ("the hierarchical cache keeps one KV group" if plan.inp.enable_hierarchical_cache
               else f"a {plan.inp.role} worker keeps one KV group" if plan.inp.role != "mixed" else "one KV group")
        return (f"all {s.num_layers} layers: {why}, every token's KV in its {s.local_layers} "
                f"{s.local_kind} layers too")
    if s.state_layers:
        return (f"{s.num_layers - s.state_layers} attention layers; the {s.state_layers} linear-attention layers "
                f"hold a recurrent state of {plan.state_bytes_per_gpu:,} B per request per GPU (whole pages)")
    return f"{s.num_layers} layers"


def render(plan: Plan, prefill_tflops: float = DEFAULT_PREFILL_TFLOPS) -> str:
    s, inp = plan.spec, plan.inp
    refused = unsupported_reason(s)
    if inp.weight_dtype == "fp8":  # a what-if: the engine does not quantise weights on load
        refused = ((refused + "; ") if refused else "") + (
            "--dtype fp8: the engine does not quantise unquantised weights on load (it keeps an FP8 release's "
            "quantised layers in FP8, its other weights in bf16, fp16 or fp32), so this sizes a deployment it cannot "
            "run")
    limit = context_limit(s)
    n = inp.context_length
    beyond = n > limit.tokens
    verdict = f"{'fits' if plan.fits else 'does NOT fit'} one TP-{inp.tp_size} instance"
    if beyond:
        verdict = f"BEYOND the model's {limit.tokens:,}-token context limit (memory: {verdict})"
    if refused:
        verdict += "; NOT SERVABLE by this engine"
    flops = prefill_flops(s, n)
    served = families.find(s.architectures)
    served_arch = served.architecture if served is not None else ""
    kv_shape = (f"MLA latent {s.mla_latent_dim} (kv_lora_rank {s.kv_lora_rank} + qk_rope_head_dim "
                f"{s.qk_rope_head_dim})" if s.is_mla else f"{s.num_kv_heads} KV heads x {s.head_dim}")
    params = f"{s.num_params() / 1e9:.2f}B params"
    if s.num_experts:
        params += (f" ({s.active_params() / 1e9:.2f}B active: {s.experts_per_token} of {s.num_experts} experts"
                   f"{f' + {s.shared_experts} shared' if s.shared_experts else ''} in {s.moe_layers} MoE layers)")
    rows = [
        ("model", f"{s.name}: {s.num_layers} layers ({s.global_layers} global, {s.local_layers} "
                  f"{s.local_kind or 'local'}), "
                  f"{kv_shape}, {params}"),
        ("deployment", f"TP {inp.tp_size}"
                       + (f" over {inp.nnodes} nodes ({inp.ranks_per_node} ranks a node)" if inp.nnodes > 1 else "")
                       + f", {inp.gpus_per_node} GPUs/node x {_gib(inp.gpu_memory)}, "
                       f"mem_fraction_static {inp.mem_fraction_static}, kv_cache_dtype {inp.kv_cache_dtype}"
                       + (f" ({inp.kv_dtype})" if inp.kv_cache_dtype == "auto" else "")
                       + f", weights {stored_weights(s, inp.weight_dtype)}, page_size {inp.page_size}, role {inp.role}"),
        ("engine support", f"NO: {refused}" if refused else
         f"yes ({served_arch}, rope {rope_type(s)}" + (f"; weights {quant_note(s)}" if quant_note(s) else "") + ")"),
        ("model context limit", f"{limit.tokens:,} tokens ({limit.derivation})"),
        ("KV bytes/token (model)", f"{plan.kv_bytes_per_token:,} B"),
        ("KV bytes/token (per GPU)", f"{plan.kv_bytes_per_token_per_gpu:,} B ("
                                     + (f"one latent x {s.global_layers} layers, the same on every GPU)" if s.is_mla
                                        else f"{plan.kv_heads_per_gpu} KV head(s) x {_kv_layers(plan)})")),
        ("weights per GPU", _gib(plan.weights_per_gpu)),
        ("KV pool per GPU", _gib(plan.pool_per_gpu) if plan.weights_fit else
         f"none: the weights ({_gib(plan.weights_per_gpu)}) exceed the static budget "
         f"({_gib(plan.static_budget_per_gpu)}: mem_fraction_static {inp.mem_fraction_static} x "
         f"{_gib(inp.gpu_memory)}) by {_gib(-plan.pool_per_gpu)}"),
        ("pool tokens per GPU / instance", f"{plan.tokens_per_instance:,}"),
        ("pool tokens per node", f"{plan.tokens_per_node:,} " + (
            f"({plan.instances_per_node} instance(s))" if inp.nnodes == 1 else
            f"(a 1/{inp.nnodes} share of each of {plan.instances_per_node} instance(s) over {inp.nnodes} nodes)")),
        ("longest single request", f"{plan.tokens_per_instance:,} tokens"),
        ("asked context", f"{n:,} tokens: {verdict}"),
        (f"prefill of one {n:,}-token request", f"~{_duration(prefill_seconds(s, n, inp.tp_size, prefill_tflops))} "
                                                 f"({flops:.3g} FLOPs at --prefill-tflops {prefill_tflops:g} per GPU "
                                                 f"x TP {inp.tp_size}; no prefix-cache hits)"),
        (f"{n:,}-token requests at once", f"{plan.requests_at_once(n):,} per instance, "
                                           f"{plan.requests_at_once(n) * plan.instances_per_node:,} per "
                                           f"{'node' if inp.nnodes == 1 else f'{inp.nnodes} nodes'} (KV pool only)"),
    ]
    if inp.enable_hierarchical_cache:
        per_node = plan.host_bytes_per_gpu * inp.gpus_per_node
        source = (f"--hicache-size {_gib(inp.hicache_size)} per GPU" if inp.hicache_size is not None
                  else f"--hicache-ratio {inp.hicache_ratio:g} x the pool")
        rows.insert(10, ("host tier tokens per instance", f"{plan.host_tokens_per_instance:,} ({source}; "
                                                          f"{_gib(plan.host_bytes_per_gpu)} of DRAM per GPU"
                                                          f"{'; the engine builds it at TP 1 only so far' if inp.tp_size > 1 else ''})"))
        rows.insert(11, ("host tier DRAM per node", f"{_gib(per_node)}: "
                                                    f"{'within' if per_node <= inp.host_memory_per_node else 'BEYOND'}"
                                                    f" the node's {_gib(inp.host_memory_per_node)}"))
    if s.local_layers and plan.window_kv:
        rows.insert(6, (f"{s.local_kind} KV per GPU", f"{_gib(plan.local_kv_bytes_per_gpu)} per request at most "
                                                       f"({s.local_layers} {s.local_kind} layers"
                                                       + _slots(plan, plan.local_bytes_per_token_per_gpu,
                                                                s.local_layers) + " x "
                                                       f"{plan.local_tokens:,} tokens: the {s.local_span:,}-token "
                                                       f"{'window' if s.local_kind == 'sliding' else 'chunk'} plus a "
                                                       f"{inp.chunked_prefill_size:,}-token prefill chunk, in pages)"))
    elif s.local_layers and not s.is_mla:
        w = make_plan(s, replace(inp, role="mixed", enable_hierarchical_cache=False))
        rows.insert(6, ("a mixed-role worker", (
            f"{w.kv_bytes_per_token_per_gpu:,} B/token per GPU ({s.global_layers} global layers) + "
            f"{_gib(w.local_kv_bytes_per_gpu)} per request for the {s.local_layers} {s.local_kind} layers: "
            f"{w.tokens_per_instance:,} tokens per instance, asked context {'fits' if w.fits else 'does NOT fit'} "
            "(it frees local layers' pages behind their window)")))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    if beyond:
        lines.append(f"{'context':<{width}}  positions past {limit.tokens:,} were never trained: quality degrades "
                     f"there; serve --context-length {limit.tokens:,} or less, or a model (or RoPE scaling its card "
                     "documents) made for the longer context")
    for tip in suggestions(plan):
        lines.append(f"{'to make it fit':<{width}}  {tip}")
    if not plan.weights_fit:
        lines.append(f"{'start-up':<{width}}  refused: the weights leave no KV pool in the static budget, so the "
                     "engine does not start with this deployment, whatever --context-length")
    else:
        lines.append(f"{'start-up':<{width}}  the pool is sized from the memory budget, not --context-length: "
                     f"a server with --context-length {inp.context_length:,} starts with the same "
                     f"{_gib(plan.pool_per_gpu)} pool per GPU as one with 4,096; pages are taken as sequences grow")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        spec = load_spec(args.model)
        wide = args.enable_dp_attention
        if not wide and args.ep_num_redundant_experts:
            raise ValueError("--ep-num-redundant-experts is planned for a wide-EP instance: add --enable-dp-attention "
                             "--enable-expert-parallel")
        if not wide and args.dp_size != 1:
            raise ValueError(f"--dp-size {args.dp_size} without --enable-dp-attention is {args.dp_size} replicas: "
                             "plan one (the table gives the instances per node)")
        inp = PlanInput(tp_size=1 if wide else args.tp_size, nnodes=1 if wide else args.nnodes,
                        gpus_per_node=args.gpus_per_node,
                        gpu_memory=parse_size(args.gpu_memory),
                        mem_fraction_static=args.mem_fraction_static, kv_cache_dtype=args.kv_cache_dtype,
                        weight_dtype=args.dtype, page_size=args.page_size, context_length=args.context_length,
                        host_memory_per_node=parse_size(args.host_memory),
                        enable_hierarchical_cache=args.enable_hierarchical_cache, hicache_ratio=args.hicache_ratio,
                        hicache_size=args.hicache_size, role=args.role, chunked_prefill_size=args.chunked_prefill_size)
        if args.prefill_tflops <= 0:
            raise ValueError(f"--prefill-tflops must be > 0, got {args.prefill_tflops}")
        if wide:
            plan = plan_wide_ep(spec, WideEPInput(inp, args.tp_size, args.dp_size, args.enable_expert_parallel,
                                                  args.nnodes, args.decode_batch_per_rank,
                                                  args.ep_num_redundant_experts))
    except (ValueError, FileNotFoundError) as e:
        print(f"pd-plan: {e}", file=sys.stderr)
        return 2
    print(render_wide_ep(spec, plan) if wide else render(make_plan(spec, inp), args.prefill_tflops))
    return 0


if __name__ == "__main__":
    sys.exit(main())
