"""W4A16 GEMM: 16-bit (or float32) activations times 4-bit integer weights dequantised inside the kernel (GPTQ,
AWQ and compressed-tensors ``pack-quantized`` checkpoints, all held in GPTQ's packing:
`pd_cluster.engine.quant.int4`).

The design of vLLM's Triton AWQ / GPTQ kernels: each program computes a ``BLOCK_M x BLOCK_N`` tile; per K tile
it loads ``BLOCK_K / 8`` packed int32 rows of ``qweight`` [K / 8, N], shifts each column's nibble out
(``k % 8`` selects it), and dequantises ``(q - z[g]) * s[g]`` in float32 with ``g`` the column's group
(``k // GROUP_SIZE``, or ``g_idx[k]`` for act-order checkpoints), then multiplies in the activation dtype with a
float32 accumulator. Without ``g_idx`` and with groups a multiple of ``BLOCK_K`` wide, one row of scales and zeros
serves the whole tile (``SCALE_ROW``); otherwise they are gathered per column. Under Triton's interpreter the
product runs in float32 (no bf16 ``tl.dot`` there). M only sizes the grid (``do_not_specialize``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pd_cluster.engine.attention.triton.fp8_gemm import interpreting
from pd_cluster.engine.attention.triton.primitives import gemm_tile, int4_tile

WHOLE_ROW = 1 << 30  # GROUP_SIZE of a checkpoint with one group per row


@dataclass(frozen=True)
class Int4GemmConfig:
    """Tiles and launch options (16-row tiles for decode-sized batches, 64 above)."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


def default_config(m: int) -> Int4GemmConfig:
    return Int4GemmConfig() if m <= 16 else Int4GemmConfig(block_m=64, block_n=128, block_k=64, num_warps=8)


@triton.jit(do_not_specialize=["M"])
def _int4_gemm_kernel(A, QW, SC, ZR, GIDX, C, BIAS, M, N, K,
                      stride_am, stride_qk, stride_sg, stride_zg, stride_cm,
                      GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr,
                      SCALE_ROW: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    rows, cols, row_mask, col_mask = gemm_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    ks = tl.arange(0, BLOCK_K)
    shifts = ((ks % 8) * 4)[:, None]
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_mask = k < K
        a = tl.load(A + rows[:, None] * stride_am + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        mask = k_mask[:, None] & col_mask[None, :]
        if SCALE_ROW:  # one group for the whole tile
            packed = tl.load(QW + (k // 8)[:, None].to(tl.int64) * stride_qk + cols[None, :], mask=mask, other=0)
            q = ((packed >> shifts) & 0xF).to(tl.float32)
            g = k0 // GROUP_SIZE
            s = tl.load(SC + g * stride_sg + cols, mask=col_mask, other=0.0)[None, :]
            if HAS_ZEROS:
                z = tl.load(ZR + g * stride_zg + cols, mask=col_mask, other=8).to(tl.float32)[None, :]
            else:
                z = 8.0
            w = (q - z) * s
        else:  # scales and zeros gathered per column's group (zeros share the scales' contiguous [G, N] layout)
            w = int4_tile(QW, SC, ZR, GIDX, stride_qk, stride_sg, k, k_mask, cols, mask, GROUP_SIZE, HAS_ZEROS,
                          HAS_GIDX)
        if DOT_FP32:
            acc += tl.dot(a.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(a, w.to(a.dtype))
    if HAS_BIAS:  # rounded to the output dtype first, as x @ W + b in the activation dtype
        bias = tl.load(BIAS + cols, mask=col_mask, other=0.0).to(tl.float32)
        acc = acc.to(C.dtype.element_ty).to(tl.float32) + bias[None, :]
    tl.store(C + rows[:, None] * stride_cm + cols[None, :], acc.to(C.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


def int4_gemm(a: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
              g_idx: torch.Tensor | None, group_size: int, bias: torch.Tensor | None = None,
              cfg: Int4GemmConfig | None = None) -> torch.Tensor:
    """``a @ W.T`` for int4 ``W`` in the engine's layout (`pd_cluster.engine.quant.int4`).

    Args:
        a: [M, K] float16/bfloat16/float32, rows contiguous.
        qweight: [ceil(K / 8), N] int32; scales: [G, N] float32; zeros: [G, N] uint8 or None (8);
            g_idx: [K] int32 or None; all contiguous.
        group_size: input columns per group (0: one group per row).
        bias: [N] or None.
        cfg: tiles; `default_config` when None.

    Returns:
        [M, N] in a's dtype.

    Raises:
        ValueError: shapes that disagree.
    """
    m, k = a.shape
    n = qweight.shape[1]
    if qweight.shape[0] != -(-k // 8) or scales.shape[1] != n or (g_idx is not None and g_idx.shape[0] != k):
        raise ValueError(f"int4_gemm: a {tuple(a.shape)}, qweight {tuple(qweight.shape)}, scales "
                         f"{tuple(scales.shape)} disagree")
    cfg = cfg or default_config(m)
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    if m == 0:
        return out
    a = a if a.stride(1) == 1 else a.contiguous()
    group = group_size or WHOLE_ROW
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _int4_gemm_kernel[grid](
        a, qweight, scales, zeros if zeros is not None else scales, g_idx if g_idx is not None else qweight, out,
        bias if bias is not None else scales, m, n, k, a.stride(0), qweight.stride(0), scales.stride(0),
        zeros.stride(0) if zeros is not None else 0, out.stride(0),
        GROUP_SIZE=group, HAS_ZEROS=zeros is not None, HAS_GIDX=g_idx is not None,
        SCALE_ROW=g_idx is None and group % cfg.block_k == 0, HAS_BIAS=bias is not None,
        DOT_FP32=interpreting() or a.dtype == torch.float32, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
