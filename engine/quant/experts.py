"""Routed experts' weights held quantised, and the reference math over them (one expert dequantised at a time).

`QuantizedExperts` is one stacked projection of a layer's experts (``w13`` or ``w2``) in an `ExpertQuant`
format (`pd_cluster.engine.quant.expert_format`); the fused MoE (the torch path and the Triton kernel) takes it
where it takes a plain [E, N, K] tensor. `fake_quant_fp8_groups` is what the FP8 W8A8 kernel does to its inputs
(`pd_cluster.engine.quant.fp8.quantize_activations`: per token and group of the blocks' columns), for the
reference path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pd_cluster.engine.quant.expert_format import ExpertQuant
from pd_cluster.engine.quant.fp8 import dequantize_fp8, quantize_activations
from pd_cluster.engine.quant.int4 import dequantize_int4
from pd_cluster.engine.quant.mxfp4 import dequantize_mxfp4


@dataclass(frozen=True)
class QuantizedExperts:
    """One projection of a layer's experts, quantised.

    Attributes:
        data: FP8: [E, N, K] float8_e4m3fn. MXFP4: [E, N, K / 2] uint8, two E2M1 codes a byte (low nibble first).
            int4: [E, K / 8, N] int32 (`pd_cluster.engine.quant.int4`'s ``qweight`` per expert).
        scale: FP8 blocks: [E, ceil(N / bn), ceil(K / bk)] float32, multiplied in (``weight_scale_inv``). FP8
            rows: [E, N] float32. MXFP4: [E, N, K / 32] uint8 E8M0 codes. int4: [E, G, N] float16/bfloat16/float32.
        quant: the format and its block.
        zeros: int4: [E, G, N] uint8 zero points (asymmetric schemes), else None (8).
        g_idx: int4 with act order: [E, K] int32, each input column's group; else None (``k // group``).
        input_scale: FP8 rows with static activations: [1] float32, the largest of the experts' ``input_scale``.
    """

    data: torch.Tensor
    scale: torch.Tensor
    quant: ExpertQuant
    zeros: torch.Tensor | None = None
    g_idx: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        """The logical [E, N, K] of the weights."""
        e, n, k = self.data.shape
        if self.quant.format == "int4":
            return (e, k, n * 8)
        return (e, n, k * 2) if self.quant.format == "mxfp4" else (e, n, k)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()

    def expert(self, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert `e`'s weight [N, K] dequantised into `dtype` (computed in float32, rounded once)."""
        fmt = self.quant.format
        if fmt == "mxfp4":
            k = self.data.shape[2] * 2
            return dequantize_mxfp4(self.data[e], self.scale[e], torch.float32).view(-1, k).to(dtype)
        if fmt == "int4":
            return dequantize_int4(self.data[e], self.scale[e], None if self.zeros is None else self.zeros[e],
                                   None if self.g_idx is None else self.g_idx[e], self.quant.group,
                                   self.data.shape[1] * 8, dtype)
        return dequantize_fp8(self.data[e], self.scale[e], self.quant.block if fmt == "fp8_block" else None, dtype)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """Every expert's weight, [E, N, K] of `dtype` (tests and tools; the engine never holds this)."""
        return torch.stack([self.expert(e, dtype) for e in range(self.data.shape[0])])


def expert_weight(w: torch.Tensor | QuantizedExperts, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert `e`'s [N, K] weight of a plain [E, N, K] tensor, or dequantised from a `QuantizedExperts`."""
    return w.expert(e, dtype) if isinstance(w, QuantizedExperts) else w[e]


def quantized_storage(quant: ExpertQuant, experts: int, n: int, k: int, scale_k: int | None = None
                      ) -> dict[str, torch.Tensor]:
    """Empty tensors for [experts, n, k] weights in `quant`'s format, on the default device, by the suffix of
    their parameter name: ``""`` the values (FP8 float8_e4m3fn, MXFP4 uint8 codes two a byte, int4 int32 words),
    `ExpertQuant.scale_suffix` the scales (float32; MXFP4 uint8 E8M0; int4 float16 until the checkpoint's are
    read); int4 ``_zeros`` (asymmetric: uint8, 8) and ``_g_idx`` (act order: int32); FP8 rows with static
    activations ``_input_scale`` [1] float32 (0). `scale_k` sizes int4's groups (act order: the whole width)."""
    fmt = quant.format
    values = {"fp8_block": torch.float8_e4m3fn, "fp8_rows": torch.float8_e4m3fn, "int4": torch.int32}
    scales = {"mxfp4": torch.uint8, "int4": torch.float16}
    out = {"": torch.empty(quant.data_shape(experts, n, k), dtype=values.get(fmt, torch.uint8)),
           quant.scale_suffix: torch.empty(quant.scale_shape(experts, n, scale_k or k),
                                           dtype=scales.get(fmt, torch.float32))}
    if fmt == "int4" and not quant.scheme.symmetric:
        out["_zeros"] = torch.full(out[quant.scale_suffix].shape, 8, dtype=torch.uint8)
    if fmt == "int4" and quant.scheme.act_order:
        out["_g_idx"] = torch.empty((experts, k), dtype=torch.int32)
    if fmt == "fp8_rows" and quant.scheme.activations == "static":
        out["_input_scale"] = torch.zeros(1, dtype=torch.float32)
    return out


def fake_quant_fp8_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """`x` as the W8A8 kernel sees it: quantised per token group and dequantised, in x's dtype (the reference of
    the FP8 W8A8 path; exact in float32 and float64)."""
    q, scale = quantize_activations(x, group)
    g = min(group, x.shape[1])
    return (q.float() * scale.repeat_interleave(g, dim=1)[:, :x.shape[1]]).to(x.dtype)
