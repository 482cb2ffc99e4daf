"""Fused mixture-of-experts: tokens sorted by expert, then one grouped GEMM launch per projection.

The design of vLLM's ``fused_moe`` and SGLang's (itself from the Triton
grouped-GEMM tutorial): the T x k (token, choice) pairs are sorted by expert
and each expert's run is padded to a multiple of ``BLOCK_M`` (`moe_align`), so
every M-block of the sorted order belongs to one expert. One program computes
a ``BLOCK_M x BLOCK_N`` tile: it gathers its rows of the activations and
multiplies them by that expert's weight tile. So a layer is

1. `moe_align` (torch ops on the device, no host sync: safe in a CUDA graph);
2. ``[T k, 2I] = x[rows] @ w13[e].T (+ b13[e])`` (kernel);
3. SiLU-and-mul (`fused.silu_and_mul`; gpt-oss: `fused.swiglu_clamped`);
4. ``[T k, H] = h @ w2[e].T * weight`` (the same kernel, ``MUL_WEIGHT``);
5. the k products of each token summed (torch).

Quantised experts (`pd_cluster.engine.quant.experts.QuantizedExperts`: ``data``, ``scale``, ``quant``,
``zeros``, ``g_idx``, ``input_scale``; taken by those attributes, so the kernels do not import the
quantisation package) run through the same kernel (``W_FORMAT``): FP8 blocks either W8A8, each
GEMM's input quantised per token and group of the block's columns and the FP8 x FP8 products scaled per row group and column block (vLLM's and SGLang's
``use_fp8_w8a8`` with a block shape; FP8 dots from compute capability 8.9), or W8A16, each weight tile
dequantised; MXFP4 tiles are decoded from their E2M1 codes and E8M0 scales next to the activations (vLLM's
bf16-activation path on Hopper). FP8 per channel or per tensor (one scale per row) takes the block path with
blocks of one row by the whole K, its input quantised as the scheme says (`fp8_input`); int4 (W4A16) tiles are
dequantised by `primitives.int4_tile`, the W4A16 GEMM's own (vLLM's ``use_int4_w4a16``).

Expert id -1 (a choice that another expert-parallel rank computes) gets its
own padded run whose tiles are stored as zeros. Products accumulate in
float32 (IEEE dots for float32 activations); each GEMM's output is rounded to
the activation dtype, as the torch reference (`pd_cluster.engine.model.layer_ops.torch_fused_experts`) does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pd_cluster.engine.attention.triton import fused
from pd_cluster.engine.attention.triton.common import FP8_E4M3_MAX, compute_dtype, dot_precision
from pd_cluster.engine.attention.triton.fp8_gemm import quantize_activations
from pd_cluster.engine.attention.triton.primitives import grouped_tile, int4_tile


@dataclass(frozen=True)
class FusedMoEKernelConfig:
    """Tile sizes and launch options (vLLM's defaults for small batches; a tuned table would replace them).

    Attributes:
        block_m: rows (token choices) per tile; each expert's run is padded to a multiple of it.
        block_n, block_k: output columns and reduction depth per tile step.
        group_m: M-tiles that share one pass over the N tiles (L2 reuse of the weight tiles).
        num_warps, num_stages: launch options (ignored by the interpreter).
    """

    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


LARGE_BATCH_PAIRS = 1024  # above this many (token, choice) pairs the larger tiles are used


def default_config(num_pairs: int) -> FusedMoEKernelConfig:
    """Tiles for `num_pairs` (token, choice) pairs: 16-row tiles for decode-sized batches, 64 above 1,024."""
    if num_pairs <= LARGE_BATCH_PAIRS:
        return FusedMoEKernelConfig()
    return FusedMoEKernelConfig(block_m=64, block_n=128, block_k=64, num_warps=8)


def warm_up(w13: torch.Tensor, w2: torch.Tensor, top_k: int, dtype: torch.dtype, b13: torch.Tensor | None = None,
            b2: torch.Tensor | None = None, activation: tuple = ("silu",)) -> None:
    """Compile the large-batch tile variant at start-up (a small step compiles the other): one call with
    ``LARGE_BATCH_PAIRS / top_k + 1`` zero tokens, weights (and biases, activation) of the layer."""
    t = LARGE_BATCH_PAIRS // top_k + 1
    x = torch.zeros((t, w13.shape[2]), dtype=dtype, device=w13.device)
    ids = torch.arange(t * top_k, device=w13.device).remainder(w13.shape[0]).view(t, top_k)
    fused_experts(x, w13, w2, torch.ones((t, top_k), device=w13.device), ids, b13=b13, b2=b2, activation=activation)


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort (token, choice) pairs by expert, each expert's run padded to a multiple of `block_m`.

    Args:
        ids: [T, k] int expert indices in ``[0, num_experts)`` or -1 (computed as zeros).
        num_experts: experts held here.
        block_m: the kernel's M tile.

    Returns:
        sorted_ids [P] int32: flat pair indices (``t * k + j``) in expert order, ``T * k`` in padding slots;
        expert_ids [P // block_m] int32: each M-block's expert, -1 for the -1 run and past the end;
        num_padded [1] int32: the used length of sorted_ids. ``P = min(T k + (E + 1)(block_m - 1), T k block_m)``
        rounded up to `block_m` is a bound fixed by the shapes, so nothing is read back to the host.
    """
    flat = ids.reshape(-1).long()
    n = flat.numel()
    dev = flat.device
    bucket = torch.where(flat >= 0, flat, num_experts)  # -1 gets the last bucket
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev).scatter_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(bucket, stable=True)
    sorted_bucket = bucket[order]
    rank = torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[sorted_bucket]
    dest = (ends - padded)[sorted_bucket] + rank
    bound = min(n + (num_experts + 1) * (block_m - 1), n * block_m)
    bound = max(block_m, -(-bound // block_m) * block_m)
    sorted_ids = torch.full((bound,), n, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, bound, block_m, device=dev)
    expert_ids = torch.searchsorted(ends, block_starts, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    return sorted_ids, expert_ids, ends[-1:].to(torch.int32)


W_PLAIN, W_FP8_BLOCK, W_MXFP4, W_INT4 = 0, 1, 2, 3  # the weights' storage (`W_FORMAT`; FP8 rows are blocks of
WHOLE_ROW = 1 << 30                                   # one row by WHOLE_ROW columns, as int4 groups of a whole row)


@triton.jit
def _mxfp4_tile(B, B_SCALE, base, scale_base, stride_bn, stride_bsn, cols, kk, mask):
    # [BLOCK_K, BLOCK_N] float32 values of MXFP4 weights: byte kk // 2 of each column row holds codes 2j (low
    # nibble) and 2j + 1; the E2M1 code s e1 e0 m and the E8M0 scale are assembled as float32 bits (exact)
    byte = tl.load(B + base + cols[None, :] * stride_bn + (kk // 2)[:, None], mask=mask, other=0).to(tl.int32)
    code = (byte >> ((kk % 2) * 4)[:, None]) & 0xF
    exp = (code >> 1) & 3
    man = code & 1
    bits = tl.where(exp == 0, man * (126 << 23), ((exp + 126) << 23) | (man << 22)) | ((code >> 3) << 31)
    value = bits.to(tl.float32, bitcast=True)
    s = tl.load(B_SCALE + scale_base + cols[None, :] * stride_bsn + (kk // 32)[:, None], mask=mask,
                other=127).to(tl.int32)
    scale = tl.where(s == 0, 1 << 22, s << 23).to(tl.float32, bitcast=True)  # 2 ** (s - 127); code 0 subnormal
    return value * scale


@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])  # both vary with the batch
def _grouped_gemm_kernel(A, B, C, WEIGHTS, BIAS, SORTED_IDS, EXPERT_IDS, NUM_PADDED, A_SCALE, B_SCALE, ZEROS, GIDX,
                         num_pairs, num_m_blocks,
                         stride_am, stride_be, stride_bn, stride_cm, stride_bias_e, stride_asm, stride_bse,
                         stride_bsn,
                         N: tl.constexpr, K: tl.constexpr, TOP_K: tl.constexpr,
                         MUL_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, COMPUTE: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, W_FORMAT: tl.constexpr, A_FP8: tl.constexpr,
                         FP8_DOT: tl.constexpr, FP8_PRECISION: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
                         HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr):
    # C[p] = (A[p // TOP_K] @ B[e].T (+ BIAS[e])) (x WEIGHTS[p]) for the pairs p of each expert's M-blocks.
    # FP8 blocks: each K step lies in one GROUP_K block (BLOCK_K divides it) and is scaled per column's block
    # (and, with A_FP8, per row's activation group); MXFP4 and int4 (B [E, K / 8, N] words, stride_bn their
    # row stride; scales and zeros [E, G, N], stride_bsn the group stride; GROUP_K columns a group): each tile is
    # dequantised before the dot.
    pid = tl.program_id(0)
    num_n = (N + BLOCK_N - 1) // BLOCK_N
    pid_m, pid_n = grouped_tile(pid, num_m_blocks, num_n, GROUP_M)
    if pid_m * BLOCK_M < tl.load(NUM_PADDED):
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(SORTED_IDS + rows).to(tl.int64)
        valid = pair < num_pairs
        expert = tl.load(EXPERT_IDS + pid_m).to(tl.int64)
        e = tl.maximum(expert, 0)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        cols64 = cols.to(tl.int64)
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = A + (pair // TOP_K)[:, None] * stride_am + ks[None, :]
        b_ptrs = B + e * stride_be + cols64[None, :] * stride_bn + ks[:, None]
        acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
        k_end = tl.where(expert >= 0, K, 0)  # the -1 run: no products, zeros stored
        for k0 in range(0, k_end, BLOCK_K):
            k_mask = ks < K - k0
            a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
            b_mask = k_mask[:, None] & col_mask[None, :]
            if W_FORMAT == 3:
                b = int4_tile(B + e * stride_be, B_SCALE + e * stride_bse, ZEROS + e * stride_bse, GIDX + e * K,
                              stride_bn, stride_bsn, k0 + ks, k_mask, cols64, b_mask, GROUP_K, HAS_ZEROS, HAS_GIDX)
                acc += tl.dot(a.to(COMPUTE), b.to(COMPUTE), input_precision=DOT_PRECISION)
            elif W_FORMAT == 2:
                b = _mxfp4_tile(B, B_SCALE, e * stride_be, e * stride_bse, stride_bn, stride_bsn, cols64, k0 + ks,
                                b_mask)
                acc += tl.dot(a.to(COMPUTE), b.to(COMPUTE), input_precision=DOT_PRECISION)
            elif W_FORMAT == 1:
                b = tl.load(b_ptrs, mask=b_mask, other=0.0)
                b_scale = tl.load(B_SCALE + e * stride_bse + (cols64 // GROUP_N) * stride_bsn + k0 // GROUP_K,
                                  mask=col_mask, other=0.0)
                if A_FP8:  # W8A8: FP8 x FP8 products, scaled by the row's group and the column's block
                    a_scale = tl.load(A_SCALE + (pair // TOP_K) * stride_asm + k0 // GROUP_K, mask=valid, other=0.0)
                    acc += tl.dot(a.to(FP8_DOT), b.to(FP8_DOT), input_precision=FP8_PRECISION) \
                        * a_scale[:, None] * b_scale[None, :]
                else:
                    b = (b.to(tl.float32) * b_scale[None, :]).to(COMPUTE)
                    acc += tl.dot(a.to(COMPUTE), b, input_precision=DOT_PRECISION)
            else:
                b = tl.load(b_ptrs, mask=b_mask, other=0.0)
                acc += tl.dot(a.to(COMPUTE), b.to(COMPUTE), input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        if HAS_BIAS:  # rounded to the activation dtype first, as the reference's x @ W + b
            bias = tl.load(BIAS + e * stride_bias_e + cols, mask=col_mask, other=0.0)
            bias = tl.where(expert >= 0, bias.to(tl.float32), 0.0)  # the -1 run stays zero
            acc = acc.to(C.dtype.element_ty).to(tl.float32) + bias[None, :]
        if MUL_WEIGHT:
            acc = acc * tl.load(WEIGHTS + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
        tl.store(C + pair[:, None] * stride_cm + cols[None, :], acc.to(C.dtype.element_ty),
                 mask=valid[:, None] & col_mask[None, :])


def fp8_dot_dtype(device: torch.device):
    """The operand dtype of the W8A8 dots: FP8 itself where the GPU multiplies FP8 (compute capability 8.9 and
    up), else float16 (every E4M3 value is exact in it) on older GPUs, and float32 in the interpreter."""
    if device.type != "cuda":
        return tl.float32
    return tl.float8e4nv if torch.cuda.get_device_capability(device) >= (8, 9) else tl.float16


def _grouped_gemm(a: torch.Tensor, w, out: torch.Tensor, weights: torch.Tensor,
                  sorted_ids: torch.Tensor, expert_ids: torch.Tensor, num_padded: torch.Tensor, top_k: int,
                  mul_weight: bool, bias: torch.Tensor | None, cfg: FusedMoEKernelConfig, act_dtype: torch.dtype,
                  a_scale: torch.Tensor | None = None) -> None:
    _, n, k = w.shape
    num_m = sorted_ids.numel() // cfg.block_m
    grid = (num_m * triton.cdiv(n, cfg.block_n),)
    data, scale, fmt, group = w, None, W_PLAIN, (1, 1)
    zeros = g_idx = None
    block_k = cfg.block_k
    fp8_dot = fp8_dot_dtype(a.device)
    if _quantized(w):
        data, scale, group, zeros, g_idx = w.data, w.scale, w.quant.block, w.zeros, w.g_idx
        fmt = {"fp8_block": W_FP8_BLOCK, "fp8_rows": W_FP8_BLOCK, "int4": W_INT4}.get(w.quant.format, W_MXFP4)
        if w.quant.format in ("fp8_rows", "int4") and not group[1]:
            group = (1, WHOLE_ROW)
        if w.quant.format == "fp8_block":
            block_k = fp8_block_k(cfg.block_k, group[1])
    _grouped_gemm_kernel[grid](
        a, data, out, weights, data if bias is None else bias, sorted_ids, expert_ids, num_padded,
        data if a_scale is None else a_scale, data if scale is None else scale, data if zeros is None else zeros,
        data if g_idx is None else g_idx, out.shape[0], num_m,
        a.stride(0), data.stride(0), data.stride(1), out.stride(0), 0 if bias is None else bias.stride(0),
        0 if a_scale is None else a_scale.stride(0), 0 if scale is None else scale.stride(0),
        0 if scale is None else scale.stride(1),
        N=n, K=k, TOP_K=top_k, MUL_WEIGHT=mul_weight, HAS_BIAS=bias is not None, COMPUTE=compute_dtype(act_dtype),
        DOT_PRECISION=dot_precision(act_dtype), W_FORMAT=fmt, A_FP8=a_scale is not None,
        FP8_DOT=fp8_dot, FP8_PRECISION="ieee" if fp8_dot == tl.float32 else "tf32", GROUP_N=group[0], GROUP_K=group[1],
        HAS_ZEROS=zeros is not None, HAS_GIDX=g_idx is not None, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=block_k, GROUP_M=cfg.group_m, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)


def fp8_block_k(block_k: int, group_k: int) -> int:
    """The K step for FP8 block weights: a power of two at most `block_k` that divides the block's columns, so
    each step lies in one block (vLLM takes ``min(BLOCK_SIZE_K, block_k)`` for 128-wide blocks).

    Raises:
        ValueError: a block narrower than 16 columns or not a multiple of 16 (the smallest dot).
    """
    step = block_k
    while step >= 16 and group_k % step:
        step //= 2
    if step < 16:
        raise ValueError(f"FP8 expert weight blocks of {group_k} columns: the kernel needs a multiple of 16")
    return step


def fused_experts(x: torch.Tensor, w13, w2,
                  weights: torch.Tensor, ids: torch.Tensor, apply_weights_on_input: bool = False,
                  cfg: FusedMoEKernelConfig | None = None, b13: torch.Tensor | None = None,
                  b2: torch.Tensor | None = None, activation: tuple = ("silu",), fp8_activations: bool = True
                  ) -> torch.Tensor:
    """The routed experts' output, ``sum_j weights[t, j] * down_e(act(gate_e(x_t), up_e(x_t)))``.

    Args:
        x: [T, H] float16/bfloat16/float32, rows contiguous.
        w13: [E, 2 I, H] gate rows then up rows per expert, x's dtype, contiguous; or `QuantizedExperts` of
            that logical shape (FP8 blocks or MXFP4).
        w2: [E, H, I], contiguous, or `QuantizedExperts` (in the same format as w13).
        weights: [T, k] routing weights (float32 or x's dtype).
        ids: [T, k] expert indices in ``[0, E)``, or -1 for a choice computed elsewhere (contributes 0).
        apply_weights_on_input: scale the expert's input (first GEMM) instead of its output (Llama 4).
        cfg: tiles; `default_config` by the pair count when None.
        b13, b2: [E, 2 I] and [E, H] contiguous biases of the two projections (gpt-oss), or None.
        activation: ``("silu",)`` (SwiGLU) or ``("swiglu_clamped", alpha, limit)`` (gpt-oss).
        fp8_activations: with FP8 block weights, quantise each GEMM's input per token and group of the blocks'
            columns (`fp8_gemm.quantize_activations`) and multiply FP8 by FP8 (W8A8, vLLM's ``use_fp8_w8a8``);
            False dequantises the weight tiles next to the activations instead (W8A16). MXFP4 weights are
            always dequantised next to the activations.

    Returns:
        [T, H] in x's dtype.

    Raises:
        ValueError: shapes that disagree, or a non-contiguous weight.
    """
    t, h = x.shape
    e, two_i, h1 = w13.shape
    if h1 != h or tuple(w2.shape) != (e, h, two_i // 2) or ids.shape != weights.shape or ids.shape[0] != t:
        raise ValueError(f"fused_experts: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}, "
                         f"ids {tuple(ids.shape)}, weights {tuple(weights.shape)} disagree")
    if not all(_data(w).is_contiguous() for w in (w13, w2)):
        raise ValueError("fused_experts needs contiguous expert weights")
    k = ids.shape[1]
    out = torch.empty((t * k, h), dtype=x.dtype, device=x.device)
    if t == 0:
        return out.view(t, k, h).sum(dim=1)
    x = x if x.stride(1) == 1 else x.contiguous()
    cfg = cfg or default_config(t * k)
    sorted_ids, expert_ids, num_padded = moe_align(ids, e, cfg.block_m)
    flat_weights = weights.reshape(-1).contiguous()
    gate_up = torch.empty((t * k, two_i), dtype=x.dtype, device=x.device)
    _gemm_maybe_fp8(x, w13, gate_up, flat_weights, sorted_ids, expert_ids, num_padded, k, apply_weights_on_input,
                    b13, cfg, fp8_activations)
    act = (fused.swiglu_clamped(gate_up, activation[1], activation[2]) if activation[0] == "swiglu_clamped"
           else fused.silu_and_mul(gate_up))
    _gemm_maybe_fp8(act, w2, out, flat_weights, sorted_ids, expert_ids, num_padded, 1, not apply_weights_on_input,
                    b2, cfg, fp8_activations)
    return out.view(t, k, h).sum(dim=1)


def _quantized(w) -> bool:
    return not isinstance(w, torch.Tensor)  # a QuantizedExperts


def _data(w) -> torch.Tensor:
    return w.data if _quantized(w) else w


def _gemm_maybe_fp8(a: torch.Tensor, w, out: torch.Tensor, weights: torch.Tensor, sorted_ids: torch.Tensor,
                    expert_ids: torch.Tensor, num_padded: torch.Tensor, top_k: int, mul_weight: bool,
                    bias: torch.Tensor | None, cfg: FusedMoEKernelConfig, fp8_activations: bool) -> None:
    """One grouped GEMM; under W8A8 its input is first quantised (`fp8_input`)."""
    if _quantized(w) and fp8_activations:
        quantized = fp8_input(a, w)
        if quantized is not None:
            _grouped_gemm(quantized[0], w, out, weights, sorted_ids, expert_ids, num_padded, top_k, mul_weight, bias,
                          cfg, a.dtype, quantized[1])
            return
    _grouped_gemm(a, w, out, weights, sorted_ids, expert_ids, num_padded, top_k, mul_weight, bias, cfg, a.dtype)


def fp8_input(a: torch.Tensor, w) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A W8A8 GEMM's input for FP8 experts `w`: (a [M, K] float8_e4m3fn, its scales [M, groups] float32, rows
    of stride 0 for one scale): FP8 blocks per token and group of the blocks' columns; FP8 rows as the scheme
    says: per token (capped by ``activation_scale_ub``), per step (``tensor``) or the static ``input_scale``.
    None for weight-only schemes and other formats (the weight tiles are dequantised next to `a`)."""
    fmt = w.quant.format
    if fmt == "fp8_block":
        return quantize_activations(a, w.quant.block[1])
    if fmt != "fp8_rows" or w.quant.scheme.activations == "none":
        return None
    scheme = w.quant.scheme
    if scheme.activations in ("token", "group"):
        return quantize_activations(a, a.shape[1], scheme.activation_scale_ub)
    scale = w.input_scale if scheme.activations == "static" else \
        (a.abs().amax().float().clamp(min=1e-10) / FP8_E4M3_MAX).reshape(1)  # vLLM's floor on the amax
    q = (a.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale.reshape(1, 1).expand(a.shape[0], 1)
