"""4-bit integer weights (W4A16: GPTQ, AWQ, compressed-tensors ``pack-quantized``) in one layout, and their
dequantisation.

The engine holds every int4 checkpoint in GPTQ's packing, which the W4A16 kernel reads
(`pd_cluster.engine.attention.triton.int4_gemm`):

* ``qweight`` [ceil(K / 8), N] int32: nibble ``j`` (bits ``4 j .. 4 j + 3``) of row ``r`` is the unsigned value
  ``q`` in 0..15 of input column ``k = 8 r + j``;
* ``scales`` [G, N] in the checkpoint's float dtype (fp16 for GPTQ and AWQ, as stored: no rounding to the model
  dtype);
* ``zeros`` [G, N] uint8, the zero points (None when symmetric: 8 for every group);
* ``g_idx`` [K] int32, the group of each input column (GPTQ ``desc_act``, compressed-tensors ``actorder: group``),
  or None: column ``k`` is in group ``k // group_size``.

The true weight is ``w[n, k] = (q[k, n] - z[g, n]) * s[g, n]`` with ``g`` the column's group, computed in float32
and rounded once to the compute dtype. The conversions read each release's packing:

* GPTQ (AutoGPTQ): ``qweight`` is already this layout; ``qzeros`` [G, N / 8] packs 8 zeros per int32 along N and
  stores each zero minus one (``checkpoint_format: gptq``; ``gptq_v2`` stores it as is);
* AWQ (AutoAWQ GEMM): ``qweight`` [K, N / 8] and ``qzeros`` [G, N / 8] pack along N in AWQ's order: nibble ``i``
  holds column ``8 c + (0, 2, 4, 6, 1, 3, 5, 7)[i]``; ``scales`` [G, N];
* compressed-tensors: ``weight_packed`` [N, K / 8] packs along K (nibble ``i`` is column ``8 c + i``) values
  offset by 8 (``q_signed + 8``); ``weight_scale`` [N, G]; ``weight_zero_point`` [N / 8, G] packs signed zeros
  (offset by 8) along N.
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's nibble i holds column 8 c + AWQ_ORDER[i]
SYMMETRIC_ZERO = 8


def unpack_int32(packed: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """Eight 4-bit values per int32 spread along `dim`: [.., C, ..] int32 -> [.., 8 C, ..] uint8, nibble ``i`` of
    element ``c`` going to position ``8 c + order[i]``."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [..., 8]: nibble i last
    dest = torch.empty_like(nibbles)
    dest[..., list(order)] = nibbles
    moved = dest.movedim(-1, dim + 1) if dim >= 0 else dest.movedim(-1, dim)
    shape = list(packed.shape)
    shape[dim] *= 8
    return moved.reshape(shape).to(torch.uint8)


def pack_int32(values: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """The inverse of `unpack_int32`: uint8 values in 0..15 along `dim` (a multiple of 8 long) -> int32."""
    shape = list(values.shape)
    shape[dim] //= 8
    split = values.to(torch.int64).unflatten(dim, (shape[dim], 8)).movedim(dim + 1, -1)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=values.device)
    words = (split[..., list(order)] << shifts).sum(dim=-1)
    return words.to(torch.int64).where(words < 2**31, words - 2**32).to(torch.int32)


def _zeros_or_none(zeros: torch.Tensor) -> torch.Tensor | None:
    return None if bool((zeros == SYMMETRIC_ZERO).all()) else zeros.contiguous()


def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
              v2: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """GPTQ tensors -> (qweight, scales, zeros or None, g_idx or None) in the engine's layout. A `g_idx` equal to
    ``k // group_size`` for every column (AutoGPTQ writes one without ``desc_act``) is dropped by the caller."""
    zeros = unpack_int32(qzeros, 1)[:, :scales.shape[1]].to(torch.int16) + (0 if v2 else 1)
    return qweight.contiguous(), scales.contiguous(), _zeros_or_none(zeros.clamp(0, 255).to(torch.uint8)), g_idx


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, None]:
    """AWQ GEMM tensors -> the engine's layout (its nibble order undone, packed along K)."""
    values = unpack_int32(qweight, 1, AWQ_ORDER)  # [K, N]
    zeros = unpack_int32(qzeros, 1, AWQ_ORDER)[:, :scales.shape[1]]
    return pack_rows(values), scales.contiguous(), _zeros_or_none(zeros), None


def from_packed(weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_zero_point: torch.Tensor | None,
                g_idx: torch.Tensor | None, shape: tuple[int, int]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """compressed-tensors ``pack-quantized`` tensors -> the engine's layout."""
    n, k = shape
    values = unpack_int32(weight_packed, 1)[:, :k]  # [N, K], q_signed + 8
    zeros = None
    if weight_zero_point is not None:
        zeros = _zeros_or_none(unpack_int32(weight_zero_point, 0)[:n].t().contiguous())
    return pack_rows(values.t()), weight_scale.t().contiguous(), zeros, g_idx


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """[K, N] uint8 values -> the engine's ``qweight`` [ceil(K / 8), N] int32 (K padded with zeros)."""
    k = values.shape[0]
    padded = torch.nn.functional.pad(values, (0, 0, 0, -(-k // 8) * 8 - k))
    return pack_int32(padded, 0)


def group_of_columns(k: int, group_size: int, g_idx: torch.Tensor | None, device=None) -> torch.Tensor:
    """[K] int64: each input column's group."""
    if g_idx is not None:
        return g_idx.to(torch.int64)
    cols = torch.arange(k, device=device)
    return cols // group_size if group_size else torch.zeros_like(cols)


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    g_idx: torch.Tensor | None, group_size: int, k: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The true values of int4 weight columns ``[n0, n1)`` given their slices, as nn.Linear rows.

    Args:
        qweight: [ceil(K / 8), n] int32; scales [G, n]; zeros [G, n] uint8 or None; g_idx [K] or None.
        group_size: input columns per group (0: one group per row).
        k: the input width K.
        dtype: the result's dtype (float32 math, one rounding).

    Returns:
        [n, K] `dtype` (contiguous).
    """
    q = unpack_int32(qweight, 0)[:k].float()  # [K, n]
    g = group_of_columns(k, group_size, g_idx, qweight.device)
    z = zeros[g].float() if zeros is not None else float(SYMMETRIC_ZERO)
    w = (q - z) * scales[g].float()
    return w.t().to(dtype).contiguous()


def quantize_int4(w: torch.Tensor, group_size: int, symmetric: bool, g_idx: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest int4 quantisation of [N, K] float weights per group of input columns (`g_idx` assigns
    the columns to groups; default ``k // group_size``). Builds the test checkpoints and the benchmark's weights.

    Returns:
        (values [K, N] uint8 in 0..15, scales [G, N] float32, zeros [G, N] uint8: 8 when `symmetric`).
    """
    n, k = w.shape
    g = group_of_columns(k, group_size, g_idx)
    groups = int(g.max()) + 1
    wt = w.float().t()  # [K, N]
    index = g[:, None].expand(k, n)
    lo = torch.full((groups, n), float("inf")).scatter_reduce_(0, index, wt, "amin")
    hi = torch.full((groups, n), float("-inf")).scatter_reduce_(0, index, wt, "amax")
    if symmetric:
        scales = torch.maximum(hi.abs(), lo.abs()).clamp(min=1e-8) / 7.5
        zeros = torch.full((groups, n), SYMMETRIC_ZERO, dtype=torch.uint8)
    else:
        scales = ((hi - lo) / 15).clamp(min=1e-8)
        zeros = (-lo / scales).round().clamp(0, 15).to(torch.uint8)
    values = (wt / scales[g] + zeros[g].float()).round().clamp(0, 15).to(torch.uint8)
    return values, scales, zeros
