"""Quantised GEMMs against the bf16 matmul at real layer shapes: FP8 in 128 x 128 blocks (W8A8, the activation
quantisation included), FP8 per tensor (W8A8 with per-token scales: ``torch._scaled_mm`` on Hopper) and int4
W4A16 (groups of 128), the kernels `QuantLinear` runs on CUDA (`pd_cluster.engine.quant.kernels`).

    python -m pd_cluster.bench.scripts.gpu_quant_gemm                 # on a CUDA machine
    python -m pd_cluster.bench.scripts.gpu_quant_gemm --smoke         # tiny shapes anywhere (checks the script)

Shapes: the linear layers of Llama-3.1-8B (TP 1) and one rank of DeepSeek-V3 at TP 8 (its FP8 release's
dense layers: q_b_proj, the replicated kv_a_proj_with_mqa, o_proj, the dense MLP and the shared expert), from
one decode token to a prefill chunk. Before timing, each kernel runs on 7 tokens and is compared with its torch
reference (the W8A8 reference for FP8, the dequantised product for int4): relative row error above 2e-2 is
reported and the shape is not timed. Reported per row: bf16 ``F.linear`` time, each quantised GEMM's time and
its speed-up over bf16, and the weight bytes each reads per call over its time (GB/s; decode is bound by it),
with % of the device's copy bandwidth and bf16 matmul rate when measured (`gpu_common.measure_ceilings`).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from pd_cluster.bench.scripts.gpu_common import Ceilings, Row, Section, bench_ms, measure_ceilings, pct
from pd_cluster.engine.quant import fp8 as ref8
from pd_cluster.engine.quant import int4 as ref4
from pd_cluster.engine.quant.weight_scheme import FP8, FP8_SCALE, FP8_SCALE_INV, GPTQ, INT4, WeightScheme


@dataclass(frozen=True)
class GemmShape:
    name: str
    n: int  # output rows on this rank
    k: int  # input columns on this rank


GPU_SHAPES = [GemmShape("Llama-3.1-8B qkv_proj", 6144, 4096), GemmShape("Llama-3.1-8B o_proj", 4096, 4096),
              GemmShape("Llama-3.1-8B gate_up_proj", 28672, 4096), GemmShape("Llama-3.1-8B down_proj", 4096, 14336),
              GemmShape("DeepSeek-V3 q_b_proj (TP 8)", 3072, 1536),
              GemmShape("DeepSeek-V3 kv_a_proj_with_mqa", 576, 7168),
              GemmShape("DeepSeek-V3 o_proj (TP 8)", 7168, 2048),
              GemmShape("DeepSeek-V3 dense gate_up_proj (TP 8)", 4608, 7168),
              GemmShape("DeepSeek-V3 dense down_proj (TP 8)", 7168, 2304),
              GemmShape("DeepSeek-V3 shared expert gate_up (TP 8)", 512, 7168)]
SMOKE_SHAPES = [GemmShape("smoke", 96, 128)]
GPU_TOKENS = (1, 16, 128, 1024, 8192)
SMOKE_TOKENS = (1, 16)
BLOCK, GROUP = (128, 128), 128
SCHEMES = {
    "fp8 block W8A8": WeightScheme(FP8, "block", FP8_SCALE_INV, block=BLOCK, activations="group"),
    "fp8 per-tensor W8A8": WeightScheme(FP8, "tensor", FP8_SCALE, activations="token"),
    "int4 W4A16": WeightScheme(INT4, "group", GPTQ, group_size=GROUP),
}


def _layer(name: str, shape: GemmShape, w: torch.Tensor, device: torch.device):
    """A `QuantLinear` holding `w` quantised as `SCHEMES[name]`, on `device`, computing through the kernels."""
    from pd_cluster.engine.quant.linear import QuantLinear

    scheme = SCHEMES[name]
    layer = QuantLinear(shape.k, shape.n, False, scheme, shape.name)
    if scheme.kind == INT4:
        values, scales, _ = ref4.quantize_int4(w, GROUP, symmetric=True)
        layer.load_part((0, shape.n), {"qweight": ref4.pack_rows(values), "scales": scales.half()})
    elif scheme.block:
        q, s = ref8.quantize_weight_blocks(w, BLOCK)
        layer.load_part((0, shape.n), {"weight": q, "scale": s})
    else:
        q, s = ref8.quantize_weight_rows(w, per_tensor=True)
        layer.load_part((0, shape.n), {"weight": q, "scale": s})
    layer.finish_loading()
    layer.set_kernels(True)
    return layer.to(device)


def _error(layer, x: torch.Tensor) -> float:
    """Max relative row error of the kernels against the layer's torch reference (W8A8 for FP8 with activations)."""
    s = layer.scheme
    if s.kind == FP8:
        ref = ref8.w8a8_reference(x.float(), layer.weight, layer.weight_scale, s.block,
                                  s.block[1] if s.block else x.shape[1], dtype=torch.float32)
    else:
        ref = layer.reference(x.float())
    out = layer(x).float()
    return ((out - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()


def quant_gemm_table(device: torch.device | str, smoke: bool, ceil: Ceilings | None = None) -> Section:
    """The quantised GEMMs against bf16 ``F.linear`` (module docstring).

    Args:
        device: a CUDA device (or CPU with `smoke`: Triton's interpreter, fp16 activations, no bf16 baseline).
        smoke: tiny shapes and token counts (checks the code path; numbers mean nothing).
        ceil: the device's ceilings, for the % columns (empty when None).
    """
    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16  # the interpreter has no bf16 dot
    cols = ["layer (N x K)", "tokens", "bf16 (ms)"]
    for name in SCHEMES:
        cols += [f"{name} (ms)", "x bf16", "weight GB/s"]
    sec = Section("Quantised GEMMs vs the bf16 matmul (one layer, this rank's shape)", cols)
    gen = torch.Generator().manual_seed(0)
    for shape in SMOKE_SHAPES if smoke else GPU_SHAPES:
        label = f"{shape.name} ({shape.n} x {shape.k})"
        w = torch.randn(shape.n, shape.k, generator=gen) * shape.k ** -0.5
        layers = {name: _layer(name, shape, w, device) for name in SCHEMES}
        probe = torch.randn(7, shape.k, generator=gen).to(device, dtype)
        errors = {name: _error(layer, probe) for name, layer in layers.items()}
        bad = {n: e for n, e in errors.items() if not e <= 2e-2}
        if bad:
            sec.rows.append(Row([label, "-", f"NOT TIMED: relative errors {bad}"] + [""] * (len(cols) - 3)))
            continue
        w_bf16 = w.to(device, dtype)
        for t in SMOKE_TOKENS if smoke else GPU_TOKENS:
            x = torch.randn(t, shape.k, generator=gen).to(device, dtype)
            base = bench_ms(lambda: F.linear(x, w_bf16), device)
            cells: list = [label, t, base]
            for name, layer in layers.items():
                ms = bench_ms(lambda: layer(x), device)
                gbps = layer.nbytes / (ms * 1e-3) / 1e9
                cells += [ms, base / ms, f"{gbps:.0f}" + (f" ({pct(gbps, ceil.copy_gbps):.0f}%)" if ceil else "")]
            sec.rows.append(Row(cells))
        sec.notes.append(f"{label}: max relative row error vs the torch reference on 7 tokens: "
                         + ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))
        del layers, w_bf16
    sec.notes.append("each quantised time includes the activations' FP8 quantisation (W8A8); FP8 per tensor runs "
                     "torch._scaled_mm (rowwise scales) on sm_89+ with bf16, the Triton kernel otherwise; weight GB/s "
                     "counts the bytes the layer holds (values and scales) once per call")
    if device.type != "cuda":
        sec.notes.append("--smoke on CPU: fp16 activations (the bf16 column is fp16), kernels in Triton's interpreter")
    if ceil:
        sec.notes.append(f"device ceilings: copy {ceil.copy_gbps:.0f} GB/s, bf16 matmul {ceil.matmul_tflops:.0f} "
                         "TFLOP/s")
    return sec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_quant_gemm", allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes: checks the script (numbers mean nothing)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():  # the kernels can only run in Triton's interpreter; set before triton loads
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device(args.device)
    if device.type != "cuda" and not args.smoke:
        print("gpu_quant_gemm: no CUDA device; run with --smoke to check the script on CPU", file=sys.stderr)
        return 2
    print(f"machine: {platform.node()} {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}"
          + (f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else "") + "\n")
    ceil = measure_ceilings(device, args.smoke) if device.type == "cuda" else None
    print(quant_gemm_table(device, args.smoke, ceil).markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
