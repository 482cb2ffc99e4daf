"""Routed experts' weights held quantised, and the reference math over them (one expert dequantised at a time).

`QuantizedExperts` is one stacked projection of a layer's experts (``w13`` or ``w2``) in an `ExpertQuant`
format (`pd_cluster.engine.quant.expert_format`); the fused MoE (the torch path and the Triton kernel) takes it
where it takes a plain [E, N, K] tensor. `per_token_group_quant_fp8` is the activation side of the FP8 W8A8
kernel: each token's row is cut into groups of ``group`` columns and each group gets its own float32 scale
(DeepSeek-V3's ``act_quant``, vLLM's and SGLang's ``per_token_group_quant_fp8``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pd_cluster.engine.quant.expert_format import ExpertQuant
from pd_cluster.engine.quant.mxfp4 import dequantize_mxfp4

FP8_MAX = 448.0  # the largest float8_e4m3fn value
FP8_GROUP_EPS = 1e-10  # a group of zeros gets this amax, so its scale is never 0


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
        return dequantize_fp8_blocks(self.data[e], self.scale[e], self.quant.block).to(dtype)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """Every expert's weight, [E, N, K] of `dtype` (tests and tools; the engine never holds this)."""
        return torch.stack([self.expert(e, dtype) for e in range(self.data.shape[0])])


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``weight * scale_inv`` per block: weight [N, K] FP8, scale_inv [ceil(N / bn), ceil(K / bk)] -> [N, K]
    float32 (DeepSeek-V3's ``weight_dequant``)."""
    n, k = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return weight.float() * scale


def expert_weight(w: torch.Tensor | QuantizedExperts, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert `e`'s [N, K] weight of a plain [E, N, K] tensor, or dequantised from a `QuantizedExperts`."""
    return w.expert(e, dtype) if isinstance(w, QuantizedExperts) else w[e]


def quantized_storage(quant: ExpertQuant, experts: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (values, scales) for [experts, n, k] weights in `quant`'s format, on the default device: FP8 blocks
    float8_e4m3fn with float32 scales, MXFP4 uint8 codes two a byte with uint8 E8M0 scales."""
    fp8 = quant.format == "fp8_block"
    return (torch.empty(quant.data_shape(experts, n, k), dtype=torch.float8_e4m3fn if fp8 else torch.uint8),
            torch.empty(quant.scale_shape(experts, n, k), dtype=torch.float32 if fp8 else torch.uint8))


def weight_shape(w: torch.Tensor | QuantizedExperts) -> tuple[int, int, int]:
    """The logical [E, N, K] of a plain or quantised stacked weight."""
    return tuple(w.shape)  # type: ignore[return-value]


def per_token_group_quant_fp8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise each row's groups of `group` columns to FP8 with their own scale.

    Args:
        x: [T, K] float activations (any float dtype; computed in float32).
        group: columns per scale (the weights' block columns, ``bk``).

    Returns:
        (q [T, K] float8_e4m3fn, scale [T, ceil(K / group)] float32) with ``x ~ q * scale``; each scale is the
        group's max |x| / 448 (at least 1e-10 / 448), so no value saturates.
    """
    t, k = x.shape
    groups = -(-k // group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(t, groups, group)
    scale = padded.abs().amax(dim=-1).clamp_min(FP8_GROUP_EPS) / FP8_MAX
    q = (padded / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(t, groups * group)[:, :k].contiguous(), scale


def fake_quant_fp8_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """`x` as the W8A8 kernel sees it: quantised per token group and dequantised, in x's dtype (the reference of
    the FP8 W8A8 path; exact in float32 and float64)."""
    q, scale = per_token_group_quant_fp8(x, group)
    t, k = x.shape
    groups = scale.shape[1]
    values = torch.nn.functional.pad(q.float(), (0, groups * group - k)).view(t, groups, group) * scale.unsqueeze(-1)
    return values.view(t, groups * group)[:, :k].to(x.dtype)
