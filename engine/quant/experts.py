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
from pd_cluster.engine.quant.mxfp4 import dequantize_mxfp4


@dataclass(frozen=True)
class QuantizedExperts:
    """One projection of a layer's experts, quantised.

    Attributes:
        data: FP8: [E, N, K] float8_e4m3fn. MXFP4: [E, N, K / 2] uint8, two E2M1 codes a byte (low nibble first).
        scale: FP8: [E, ceil(N / bn), ceil(K / bk)] float32, multiplied in (``weight_scale_inv``). MXFP4:
            [E, N, K / 32] uint8 E8M0 codes.
        quant: the format and its block.
    """

    data: torch.Tensor
    scale: torch.Tensor
    quant: ExpertQuant

    @property
    def shape(self) -> tuple[int, int, int]:
        """The logical [E, N, K] of the weights."""
        e, n, k = self.data.shape
        return (e, n, k * 2) if self.quant.format == "mxfp4" else (e, n, k)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()

    def expert(self, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert `e`'s weight [N, K] dequantised into `dtype` (computed in float32, rounded once)."""
        if self.quant.format == "mxfp4":
            k = self.data.shape[2] * 2
            return dequantize_mxfp4(self.data[e], self.scale[e], torch.float32).view(-1, k).to(dtype)
        return dequantize_fp8(self.data[e], self.scale[e], self.quant.block, dtype)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """Every expert's weight, [E, N, K] of `dtype` (tests and tools; the engine never holds this)."""
        return torch.stack([self.expert(e, dtype) for e in range(self.data.shape[0])])


def expert_weight(w: torch.Tensor | QuantizedExperts, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert `e`'s [N, K] weight of a plain [E, N, K] tensor, or dequantised from a `QuantizedExperts`."""
    return w.expert(e, dtype) if isinstance(w, QuantizedExperts) else w[e]


def quantized_storage(quant: ExpertQuant, experts: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (values, scales) for [experts, n, k] weights in `quant`'s format, on the default device: FP8 blocks
    float8_e4m3fn with float32 scales, MXFP4 uint8 codes two a byte with uint8 E8M0 scales."""
    fp8 = quant.format == "fp8_block"
    return (torch.empty(quant.data_shape(experts, n, k), dtype=torch.float8_e4m3fn if fp8 else torch.uint8),
            torch.empty(quant.scale_shape(experts, n, k), dtype=torch.float32 if fp8 else torch.uint8))


def fake_quant_fp8_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """`x` as the W8A8 kernel sees it: quantised per token group and dequantised, in x's dtype (the reference of
    the FP8 W8A8 path; exact in float32 and float64)."""
    q, scale = quantize_activations(x, group)
    g = min(group, x.shape[1])
    return (q.float() * scale.repeat_interleave(g, dim=1)[:, :x.shape[1]]).to(x.dtype)
