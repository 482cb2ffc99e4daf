"""FP8 GEMM with scales: W8A8 with block or rowwise scales (DeepSeek-V3's 128x128 blocks with per-token-group
activation scales), and W8A16, plus the dynamic FP8 quantisation of activations.

The design of vLLM's and SGLang's ``w8a8_block_fp8_matmul`` and ``per_token_group_quant_fp8`` (DeepSeek-V3's
``fp8_gemm`` / ``act_quant``): activations are quantised per token and group of ``bk`` columns (the weight block's
width), so within one K tile both operands have one scale per row: the tile's product is accumulated in float32
times ``a_scale[m] * b_scale[n]``. One kernel covers every scale layout through strides:

* weight scales ``BS`` per (``GROUP_N`` rows, ``GROUP_K`` columns): a block ``(bn, bk)``, or one per row
  (``GROUP_N = 1``, ``GROUP_K >= K``: per channel, and per tensor repeated on its rows);
* activation scales ``AS`` per (row, ``A_GROUP_K`` columns): per token group (``bk``), per token
  (``A_GROUP_K >= K``), or one static scale (strides 0);
* ``A_FP8`` False: W8A16, the activations unquantised and the weight tile converted to their dtype.

``BLOCK_K`` divides ``GROUP_K`` and ``A_GROUP_K`` (the launcher checks), so each tile reads one scale per row.
The activation kernel rounds to the E4M3 grid itself before the cast (`_round_to_e4m3`), so its values equal
the torch reference's on the GPU and in the interpreter alike.
Hopper multiplies E4M3 tiles natively; under Triton's interpreter (no FP8 ``tl.dot``) the tiles are converted to
float32 first (``DOT_FP32``), exactly (every E4M3 value is a float32). M only sizes the grid and the masks
(``do_not_specialize``), so a model compiles one variant per layer shape and tile choice
(`pd_cluster.engine.attention.triton.variants`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pd_cluster.engine.attention.triton.common import FP8_E4M3_MAX, next_pow2
from pd_cluster.engine.attention.triton.primitives import gemm_tile, row_max

FP8_MAX = tl.constexpr(FP8_E4M3_MAX)
WHOLE_ROW = 1 << 30  # a GROUP_K / A_GROUP_K for a scale that spans every column


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (no FP8 or bf16 ``tl.dot`` there)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _round_to_e4m3(v):
    """`v` (float32, within +-448) rounded to the nearest E4M3 value, ties to even, in float32 arithmetic: the
    grid step at |v| is 2^(max(e, -6) - 3) (e = |v|'s exponent, read from its bits; -6 is E4M3's smallest normal
    exponent), and ``(|v| + c) - c`` with ``c = step * 2^23`` rounds to it (IEEE round to nearest even). The cast
    that follows is then exact on any implementation (Triton's interpreter drops the carry into the next binade
    when it rounds itself, triton #8322; the GPU's cvt.rn gives these same values)."""
    a = tl.abs(v)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6)
    c = ((e + 20 + 127) << 23).to(tl.float32, bitcast=True)
    r = (a + c) - c
    return tl.where(v < 0, -r, r)


@triton.jit(do_not_specialize=["M"])
def _group_quant_kernel(X, Q, S, M, K, stride_x, stride_q, stride_s, eps, scale_ub,
                        GROUP: tl.constexpr, BLOCK: tl.constexpr, HAS_UB: tl.constexpr):
    # one program per (token, group): amax over the group, then x / scale clamped to +-448 as E4M3
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    start = g * GROUP
    amax = tl.full([1], 0.0, tl.float32)
    for c0 in range(0, GROUP, BLOCK):
        cols = start + c0 + tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_x + cols, mask=(cols < K) & (cols < start + GROUP), other=0.0)
        xa = tl.abs(x.to(tl.float32))[None, :]
        amax = tl.maximum(amax, row_max(xa))
    amax = tl.maximum(amax, eps)
    if HAS_UB:
        amax = tl.minimum(amax, scale_ub)
    scale = amax / FP8_MAX
    tl.store(S + row * stride_s + g + tl.arange(0, 1), scale)
    for c0 in range(0, GROUP, BLOCK):
        cols = start + c0 + tl.arange(0, BLOCK)
        mask = (cols < K) & (cols < start + GROUP)
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        q = tl.math.div_rn(x, scale)
        q = _round_to_e4m3(tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX))
        tl.store(Q + row * stride_q + cols, q.to(Q.dtype.element_ty), mask=mask)


def quantize_activations(x: torch.Tensor, group: int, scale_ub: float | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 quantisation per token and `group` columns (``group >= K``: per token), one launch.

    Args:
        x: [M, K] float16/bfloat16/float32, rows contiguous.
        group: columns per scale.
        scale_ub: cap on each group's amax (fbgemm_fp8's ``activation_scale_ub``), None for none.

    Returns:
        (q [M, K] float8_e4m3fn, scales [M, ceil(K / group)] float32), as `pd_cluster.engine.quant.fp8.
        quantize_activations`.
    """
    m, k = x.shape
    group = min(group, k)
    groups = -(-k // group)
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m:
        x = x if x.stride(1) == 1 else x.contiguous()
        _group_quant_kernel[(m, groups)](x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0), 1e-10,
                                         float(scale_ub or 0.0), GROUP=group, BLOCK=min(next_pow2(group), 1024),
                                         HAS_UB=scale_ub is not None)
    return q, s


@dataclass(frozen=True)
class FP8GemmConfig:
    """Tiles and launch options (vLLM's defaults for block FP8 on Hopper: 64 x 128 x 128, groups of 8 M-tiles;
    16-row tiles for decode-sized batches)."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 128
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


def default_config(m: int, group_k: int) -> FP8GemmConfig:
    """Tiles for `m` rows whose K tile must divide `group_k` (the scales' column group)."""
    block_k = min(128, group_k & -group_k)  # the largest power of two dividing group_k, at most 128
    return FP8GemmConfig(block_m=16 if m <= 16 else 64, block_k=max(block_k, 16))


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(A, B, C, AS, BS, BIAS, M, N, K,
                     stride_am, stride_bn, stride_cm, stride_asm, stride_asg, stride_bsn, stride_bsk,
                     GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, A_GROUP_K: tl.constexpr,
                     A_FP8: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # C = sum over K tiles of (A_tile @ B_tile^T) * a_scale[m] * b_scale[n], then + bias
    rows, cols, row_mask, col_mask = gemm_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = A + rows[:, None] * stride_am + ks[None, :]
    b_ptrs = B + cols[None, :] * stride_bn + ks[:, None]
    bs_ptrs = BS + (cols // GROUP_N) * stride_bsn
    as_ptrs = AS + rows * stride_asm
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = ks < K - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        b_scale = tl.load(bs_ptrs + (k0 // GROUP_K) * stride_bsk, mask=col_mask, other=0.0)
        if DOT_FP32:
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        elif A_FP8:
            part = tl.dot(a, b)
        else:
            part = tl.dot(a, b.to(a.dtype))
        if A_FP8:
            a_scale = tl.load(as_ptrs + (k0 // A_GROUP_K) * stride_asg, mask=row_mask, other=0.0)
            acc += part * a_scale[:, None] * b_scale[None, :]
        else:
            acc += part * b_scale[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if HAS_BIAS:  # rounded to the output dtype first, as x @ W + b in the activation dtype
        bias = tl.load(BIAS + cols, mask=col_mask, other=0.0).to(tl.float32)
        acc = acc.to(C.dtype.element_ty).to(tl.float32) + bias[None, :]
    tl.store(C + rows[:, None] * stride_cm + cols[None, :], acc.to(C.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


def fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor | None, a_group: int, weight: torch.Tensor,
             weight_scale: torch.Tensor, block: tuple[int, int] | None, out_dtype: torch.dtype,
             bias: torch.Tensor | None = None, cfg: FP8GemmConfig | None = None) -> torch.Tensor:
    """``a @ weight.T`` with FP8 weights and scales (module docstring).

    Args:
        a: [M, K] float8_e4m3fn (W8A8, with `a_scale`) or float16/bfloat16/float32 (W8A16), rows contiguous.
        a_scale: [M, ceil(K / a_group)] float32 (dynamic), a [] or [1] float32 (static, every row), or None (W8A16).
        a_group: columns per activation scale (>= K: one per row).
        weight: [N, K] float8_e4m3fn, contiguous.
        weight_scale: [ceil(N / bn), ceil(K / bk)] float32 for a `block`, or [N] float32 (one per row).
        block: (bn, bk) or None.
        out_dtype: the result's dtype.
        bias: [N] or None.
        cfg: tiles; `default_config` when None.

    Returns:
        [M, N] `out_dtype`.

    Raises:
        ValueError: shapes that disagree, or scale groups the K tile cannot divide.
    """
    m, k = a.shape
    n = weight.shape[0]
    if weight.shape[1] != k or not weight.is_contiguous():
        raise ValueError(f"fp8_gemm: a {tuple(a.shape)} and weight {tuple(weight.shape)} disagree or the weight is "
                         "not contiguous")
    group_n, group_k = block if block is not None else (1, WHOLE_ROW)
    a_group = WHOLE_ROW if a_group >= k else a_group
    cfg = cfg or default_config(m, min(group_k, a_group) if a_scale is not None else group_k)
    if group_k % cfg.block_k or (a_scale is not None and a_group % cfg.block_k):
        raise ValueError(f"fp8_gemm: K tile {cfg.block_k} must divide the scale groups ({group_k}, {a_group})")
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    a = a if a.stride(1) == 1 else a.contiguous()
    bs = weight_scale if block is not None else weight_scale.view(n, 1)
    if a_scale is None:
        a_s, s_m, s_g = bs, 0, 0
    elif a_scale.numel() == 1 and a_scale.dim() < 2:
        a_s, s_m, s_g = a_scale.reshape(1), 0, 0
    else:
        a_s, s_m, s_g = a_scale, a_scale.stride(0), a_scale.stride(1)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _fp8_gemm_kernel[grid](
        a, weight, out, a_s, bs, bias if bias is not None else bs, m, n, k,
        a.stride(0), weight.stride(0), out.stride(0), s_m, s_g, bs.stride(0), bs.stride(1),
        GROUP_N=group_n, GROUP_K=group_k, A_GROUP_K=a_group, A_FP8=a_scale is not None, HAS_BIAS=bias is not None,
        DOT_FP32=interpreting() or a.dtype == torch.float32, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
