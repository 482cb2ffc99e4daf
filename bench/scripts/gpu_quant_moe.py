"""Quantised-expert fused MoE on the GPU: FP8 blocks (W8A8) and MXFP4 against the bf16 kernel and the memory floor.

    python -m pd_cluster.bench.scripts.gpu_quant_moe                # on a CUDA machine (about 3 minutes, H100)
    python -m pd_cluster.bench.scripts.gpu_quant_moe --smoke        # tiny shapes anywhere (interpreter on CPU)

For each expert shape, `quant_moe_table` times `fused_experts` (`pd_cluster.engine.attention.triton.fused_moe`)
over token counts from one decode token to a prefill chunk, with random routing, three ways on the same routing:
the bf16 weights, and the shape's quantised format (DeepSeek-V3's 128 x 128 FP8 blocks, W8A8; gpt-oss's MXFP4,
dequantised next to bf16 activations). The shapes: DeepSeek-V3's experts on one rank of TP 8 (every expert,
256 wide) and of EP 8 (32 whole experts), and gpt-oss-120b's layer on one GPU (128 experts of 2880 x 2880).

Reported per row: time, the weight bytes the batch reads (each used expert once, scales included) and the
floor they set at the measured copy rate (`Ceilings.copy_gbps` counts read + write, so the floor for bytes read
once is ``2 bytes / copy_gbps``), the % of that floor reached, TFLOP/s (``2 T k 3 H I``), and the bf16 kernel's
time and floor beside it. Before timing, each quantised kernel is compared with the torch path on the same
quantised weights (float32, each expert dequantised) on 16 tokens; a shape whose median relative row error
exceeds 1e-2 (or whose max exceeds 0.1) is reported and not timed. Weights are random: FP8 values from
Gaussians with a scale per block, MXFP4 codes uniform with scales near 2^-6; the timing does not depend on them.
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


@dataclass(frozen=True)
class QuantShape:
    name: str
    hidden: int
    inter: int  # per expert, on this rank
    experts: int  # on this rank
    top_k: int
    format: str  # "fp8_block" or "mxfp4"


GPU_SHAPES = [QuantShape("DeepSeek-V3, one rank of TP 8", 7168, 2048 // 8, 256, 8, "fp8_block"),
              QuantShape("DeepSeek-V3, one rank of EP 8", 7168, 2048, 256 // 8, 8, "fp8_block"),
              QuantShape("gpt-oss-120b, one GPU", 2880, 2880, 128, 4, "mxfp4")]
SMOKE_SHAPES = [QuantShape("smoke fp8", 64, 32, 4, 2, "fp8_block"), QuantShape("smoke mxfp4", 64, 64, 4, 2, "mxfp4")]
GPU_TOKENS = (1, 8, 64, 512, 4096)
SMOKE_TOKENS = (1, 16)


def random_quantized(shape: QuantShape, n: int, k: int, device, gen: torch.Generator, smoke: bool):
    """Random [E, n, k] experts in the shape's format (`QuantizedExperts`), built on `device` in slices."""
    from pd_cluster.engine.quant.expert_format import ExpertQuant
    from pd_cluster.engine.quant.experts import QuantizedExperts

    e = shape.experts
    quant = ExpertQuant.mxfp4() if shape.format == "mxfp4" else ExpertQuant("fp8_block", (32, 32) if smoke
                                                                            else (128, 128))
    dgen = torch.Generator(device=device).manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    if shape.format == "mxfp4":
        data = torch.randint(0, 256, quant.data_shape(e, n, k), generator=dgen, device=device, dtype=torch.uint8)
        scale = torch.randint(120, 123, quant.scale_shape(e, n, k), generator=dgen, device=device, dtype=torch.uint8)
        return QuantizedExperts(data, scale, quant)
    data = torch.empty((e, n, k), dtype=torch.float8_e4m3fn, device=device)
    for i in range(e):  # one expert at a time: no float32 copy of the whole layer
        data[i] = (torch.randn((n, k), generator=dgen, device=device) * 64).clamp(-448, 448)
    scale = torch.rand(quant.scale_shape(e, n, k), generator=dgen, device=device) * (k ** -0.5 / 64) + 1e-5
    return QuantizedExperts(data, scale, quant)


def _routing(t: int, s: QuantShape, device, gen: torch.Generator):
    weights, ids = torch.randn(t, s.experts, generator=gen).softmax(-1).topk(s.top_k, dim=-1)
    return (weights / weights.sum(-1, keepdim=True)).to(device), ids.to(device)


def _check(s: QuantShape, q13, q2, device, dtype, gen) -> tuple[float, float]:
    """(median, max) relative row error of the quantised kernel against the float32 torch path on 16 tokens.

    Under W8A8 the kernel quantises its second GEMM's input after rounding it to `dtype`, the reference before:
    an element on an E4M3 rounding boundary may take the next code, which moves its row by a few percent, so
    the median is the check and the max only a bound."""
    from pd_cluster.engine.attention.triton.fused_moe import fused_experts
    from pd_cluster.engine.model.layer_ops import torch_fused_experts

    x = torch.randn(16, s.hidden, generator=gen).to(device, dtype)
    weights, ids = _routing(16, s, device, gen)
    out = fused_experts(x, q13, q2, weights, ids).float()
    ref = torch_fused_experts(x.float(), q13, q2, weights, ids, fp8_activations=s.format == "fp8_block")
    err = (out - ref).norm(dim=-1) / ref.norm(dim=-1)
    return err.median().item(), err.max().item()


def quant_moe_table(device: torch.device | str, smoke: bool, ceil: Ceilings | None = None) -> Section:
    """The fused MoE kernel on quantised experts against its bf16 run (module docstring).

    Args:
        device: a CUDA device (or CPU with `smoke`: Triton's interpreter, fp16 activations).
        smoke: tiny shapes and token counts (checks the code path; numbers mean nothing).
        ceil: the device's measured ceilings, for the floors (left empty when None).

    Returns:
        A `Section` with one row per shape and token count.
    """
    from pd_cluster.engine.attention.triton.fused_moe import fused_experts

    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16  # the interpreter has no bf16 dot
    sec = Section("Fused MoE on quantised experts (FP8 blocks W8A8, MXFP4) vs bf16",
                  ["experts (H, I, E, top-k), format", "tokens", "time (ms)", "weight MB read", "floor (ms)",
                   "% of floor", "TFLOP/s", "bf16 time (ms)", "bf16 floor (ms)", "bf16 / quantised"])
    gen = torch.Generator().manual_seed(0)
    for s in SMOKE_SHAPES if smoke else GPU_SHAPES:
        label = f"{s.name}: {s.hidden}, {s.inter}, {s.experts}, {s.top_k}, {s.format}"
        q13 = random_quantized(s, 2 * s.inter, s.hidden, device, gen, smoke)
        q2 = random_quantized(s, s.hidden, s.inter, device, gen, smoke)
        median, worst = _check(s, q13, q2, device, dtype, gen)
        if not (median <= 1e-2 and worst <= 0.1):
            sec.rows.append(Row([label, "-", f"NOT TIMED: relative row error median {median:.3g}, max {worst:.3g} "
                                 "vs the torch path"] + [""] * 7))
            continue
        sec.notes.append(f"{label}: kernel vs float32 torch path on 16 tokens: relative row error median "
                         f"{median:.2e}, max {worst:.2e}")
        w13 = torch.empty(q13.shape, dtype=dtype, device=device).normal_(0, s.hidden ** -0.5)
        w2 = torch.empty(q2.shape, dtype=dtype, device=device).normal_(0, s.inter ** -0.5)
        expert_bytes = (q13.nbytes + q2.nbytes) / s.experts
        for t in SMOKE_TOKENS if smoke else GPU_TOKENS:
            x = torch.randn(t, s.hidden, generator=gen).to(device, dtype)
            weights, ids = _routing(t, s, device, gen)
            ms = bench_ms(lambda: fused_experts(x, q13, q2, weights, ids), device)
            bf16_ms = bench_ms(lambda: fused_experts(x, w13, w2, weights, ids), device)
            used = len(set(ids.flatten().tolist()))
            read = used * expert_bytes
            bf16_read = used * 3 * s.hidden * s.inter * w13.element_size()
            floor = 2 * read / (ceil.copy_gbps * 1e9) * 1e3 if ceil else float("nan")
            bf16_floor = 2 * bf16_read / (ceil.copy_gbps * 1e9) * 1e3 if ceil else float("nan")
            tflops = 2 * t * s.top_k * 3 * s.hidden * s.inter / (ms * 1e-3) / 1e12
            sec.rows.append(Row([label, t, ms, read / 1e6, floor, pct(floor, ms) if ceil else "", tflops, bf16_ms,
                                 bf16_floor, bf16_ms / ms]))
        del q13, q2, w13, w2
    sec.notes.append("floor = weight bytes the batch reads (each used expert once, with its scales) / the read half "
                     "of the measured copy rate; bf16 columns: the same kernel on bf16 weights, same routing")
    return sec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_quant_moe", allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes: checks the script (numbers mean nothing)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():  # the kernel can only run in Triton's interpreter; set before triton loads
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device(args.device)
    if device.type != "cuda" and not args.smoke:
        ap.error("without a CUDA device only --smoke runs")
    print(f"machine: {platform.node()} {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, "
          f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}\n")
    ceil = measure_ceilings(device, args.smoke) if device.type == "cuda" else None
    if ceil:
        print(f"ceilings: copy {ceil.copy_gbps:.0f} GB/s, bf16 matmul {ceil.matmul_tflops:.0f} TFLOP/s\n")
    print(quant_moe_table(device, args.smoke, ceil).markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
