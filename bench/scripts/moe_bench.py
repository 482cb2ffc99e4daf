"""MoE benchmark: a MoE layer against the dense layer of the same active parameters (CPU), and the fused MoE
Triton kernel's rate (GPU).

    python -m pd_cluster.bench.scripts.moe_bench                  # CPU table; the kernel table too on CUDA
    python -m pd_cluster.bench.scripts.moe_bench --smoke          # checks the script anywhere (tiny shapes)

`cpu_layer_table` times `SparseMoE` (router, routed experts through the torch path, one thread) against a
SwiGLU MLP whose width is ``top_k x`` the expert width: the same multiply-adds per token. `fused_moe_table`
(callable from the GPU benchmark) times `fused_experts` alone at the expert shapes of Mixtral-8x7B,
Qwen3-30B-A3B and DeepSeek-V3 (one rank of TP 8) over token counts from one decode token to a prefill chunk,
with random routing; before timing, each shape is run on a few tokens and compared with the torch path in
float32. Reported: time, TFLOP/s (``2 T k 3 H I`` FLOPs), and GB/s of the expert weights the batch touches
(each used expert's ``3 H I`` weights read once), with % of the device's ceilings when given (`Ceilings`).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from dataclasses import dataclass

import torch

from pd_cluster.bench.scripts.gpu_common import Ceilings, Row, Section, bench_ms, measure_ceilings, pct
from pd_cluster.engine.model.arch import ArchConfig
from pd_cluster.engine.model.layer_ops import torch_fused_experts
from pd_cluster.engine.model.layers import MLP
from pd_cluster.engine.model.moe import SparseMoE
from pd_cluster.engine.model.moe_config import MoEConfig, RoutingConfig


@dataclass(frozen=True)
class ExpertShape:
    name: str
    hidden: int
    inter: int  # per expert, on this rank
    experts: int
    top_k: int


GPU_SHAPES = [ExpertShape("Mixtral-8x7B (TP 1)", 4096, 14336, 8, 2),
              ExpertShape("Qwen3-30B-A3B (TP 1)", 2048, 768, 128, 8),
              ExpertShape("DeepSeek-V3 (one rank of TP 8)", 7168, 2048 // 8, 256, 8)]
SMOKE_SHAPES = [ExpertShape("smoke", 64, 32, 8, 2)]
CPU_SHAPES = [ExpertShape("Mixtral-like, 8 experts x 1024, top-2", 1024, 1024, 8, 2),
              ExpertShape("Qwen3-MoE-like, 64 experts x 128, top-8", 1024, 128, 64, 8)]
CPU_SMOKE = [ExpertShape("smoke, 4 experts x 32, top-2", 64, 32, 4, 2)]


def _best_ms(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, (time.perf_counter() - t) * 1e3)
    return best


def cpu_layer_table(smoke: bool) -> Section:
    """`SparseMoE` (torch path) against the dense SwiGLU MLP of ``top_k x`` the expert width, one torch thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    sec = Section("MoE layer vs dense layer of the same active parameters (CPU, float32, 1 thread)",
                  ["layer", "tokens", "MoE (ms)", "dense (ms)", "MoE / dense", "unique experts used"])
    try:
        for s in CPU_SMOKE if smoke else CPU_SHAPES:
            moe_cfg = MoEConfig(s.experts, s.inter, RoutingConfig(s.experts, s.top_k, renormalize=True), (0,))
            dense_cfg = ArchConfig.from_dict({
                "architectures": ["LlamaForCausalLM"], "hidden_size": s.hidden, "intermediate_size": s.top_k * s.inter,
                "num_hidden_layers": 1, "num_attention_heads": 8, "vocab_size": 32})
            gen = torch.Generator().manual_seed(0)
            moe, dense = SparseMoE(s.hidden, moe_cfg), MLP(dense_cfg)
            with torch.no_grad():
                for p in list(moe.parameters()) + list(dense.parameters()):
                    p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
            for t in (1, 16) if smoke else (1, 16, 256):
                x = torch.randn(t, s.hidden, generator=gen)
                with torch.inference_mode():
                    used = len(set(moe.gate(x)[1].flatten().tolist()))
                    m = _best_ms(lambda: moe(x), 3 if smoke else 20)
                    d = _best_ms(lambda: dense(x), 3 if smoke else 20)
                sec.rows.append(Row([s.name, t, m, d, m / d, f"{used} of {s.experts}"]))
    finally:
        torch.set_num_threads(threads)
    sec.notes.append("dense = SwiGLU MLP of width top_k x expert width (the same multiply-adds per token); MoE adds "
                     "the router, the sort by expert and one GEMM pair per used expert; best of 20 calls (3 with --smoke)")
    return sec


def _routing(t: int, s: ExpertShape, device, gen: torch.Generator):
    logits = torch.randn(t, s.experts, generator=gen).to(device)
    weights, ids = logits.softmax(-1).topk(s.top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def _check(s: ExpertShape, device, dtype, fused_experts) -> float:
    """Max relative row error of the kernel against the float32 torch path on 7 tokens of shape `s`."""
    gen = torch.Generator().manual_seed(1)
    h, i = s.hidden, s.inter
    x = torch.randn(7, h, generator=gen).to(device, dtype)
    w13 = (torch.randn(s.experts, 2 * i, h, generator=gen) * h ** -0.5).to(device, dtype)
    w2 = (torch.randn(s.experts, h, i, generator=gen) * i ** -0.5).to(device, dtype)
    weights, ids = _routing(7, s, device, gen)
    out = fused_experts(x, w13, w2, weights, ids).float()
    ref = torch_fused_experts(x.float(), w13.float(), w2.float(), weights, ids)
    return ((out - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()


def fused_moe_table(device: torch.device | str, smoke: bool, ceil: Ceilings | None = None) -> Section:
    """The fused MoE kernel (`pd_cluster.engine.attention.triton.fused_moe.fused_experts`) at real expert shapes.

    Args:
        device: a CUDA device (or CPU with `smoke`: Triton's interpreter, fp16).
        smoke: tiny shapes and token counts (checks the code path; numbers mean nothing).
        ceil: the device's measured ceilings, for the % columns (left empty when None).

    Returns:
        A `Section`: per shape and token count, time (ms), TFLOP/s, weight GB/s, % of ceilings, and the torch
        path's time; a shape whose kernel output does not match the torch path (relative row error above 2e-2
        in bf16/fp16) is reported and not timed.
    """
    from pd_cluster.engine.attention.triton.fused_moe import fused_experts

    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16  # the interpreter has no bf16 dot
    sec = Section("Fused MoE kernel (sorted by expert, grouped GEMM), routed experts only",
                  ["experts (H, I per rank, E, top-k)", "tokens", "time (ms)", "TFLOP/s", "% of bf16 matmul",
                   "weight GB/s", "% of copy", "torch path (ms)"])
    gen = torch.Generator().manual_seed(0)
    for s in SMOKE_SHAPES if smoke else GPU_SHAPES:
        label = f"{s.name}: {s.hidden}, {s.inter}, {s.experts}, {s.top_k}"
        err = _check(s, device, dtype, fused_experts)
        if not err <= 2e-2:
            sec.rows.append(Row([label, "-", f"NOT TIMED: relative error {err:.3g} vs the torch path", "", "", "",
                                 "", ""]))
            continue
        w13 = (torch.randn(s.experts, 2 * s.inter, s.hidden, generator=gen) * s.hidden ** -0.5).to(device, dtype)
        w2 = (torch.randn(s.experts, s.hidden, s.inter, generator=gen) * s.inter ** -0.5).to(device, dtype)
        for t in (1, 16) if smoke else (1, 8, 64, 512, 4096):
            x = torch.randn(t, s.hidden, generator=gen).to(device, dtype)
            weights, ids = _routing(t, s, device, gen)
            ms = bench_ms(lambda: fused_experts(x, w13, w2, weights, ids), device)
            ref_ms = bench_ms(lambda: torch_fused_experts(x, w13, w2, weights, ids), device) if t <= 512 else None
            used = len(set(ids.flatten().tolist()))
            tflops = 2 * t * s.top_k * 3 * s.hidden * s.inter / (ms * 1e-3) / 1e12
            gbps = used * 3 * s.hidden * s.inter * w13.element_size() / (ms * 1e-3) / 1e9
            sec.rows.append(Row([label, t, ms, tflops, pct(tflops, ceil.matmul_tflops) if ceil else "",
                                 gbps, pct(gbps, ceil.copy_gbps) if ceil else "",
                                 ref_ms if ref_ms is not None else "-"]))
        sec.notes.append(f"{label}: kernel vs float32 torch path on 7 tokens: max relative row error {err:.2e}")
        del w13, w2
    sec.notes.append("random routing (softmax of Gaussian logits, top-k, renormalised); weight GB/s counts each "
                     "expert the batch uses once (3 H I values); the torch path loops over the used experts")
    return sec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="moe_bench", allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes: checks the script (numbers mean nothing)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():  # the kernel can only run in Triton's interpreter; set before triton loads
        os.environ.setdefault("TRITON_INTERPRET", "1")
    print(f"machine: {platform.node()} {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}\n")
    print(cpu_layer_table(args.smoke).markdown())
    if args.device.startswith("cuda") or args.smoke:
        device = torch.device(args.device)
        ceil = measure_ceilings(device, args.smoke) if device.type == "cuda" else None
        if ceil:
            print(f"ceilings: copy {ceil.copy_gbps:.0f} GB/s, bf16 matmul {ceil.matmul_tflops:.0f} TFLOP/s\n")
        print(fused_moe_table(device, args.smoke, ceil).markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
