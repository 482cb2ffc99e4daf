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
from pd_cluster.engine.attention.triton.common import compute_dtype, dot_precision


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


@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])  # both vary with the batch
def _grouped_gemm_kernel(A, B, C, WEIGHTS, BIAS, SORTED_IDS, EXPERT_IDS, NUM_PADDED, num_pairs, num_m_blocks,
                         stride_am, stride_be, stride_bn, stride_cm, stride_bias_e,
                         N: tl.constexpr, K: tl.constexpr, TOP_K: tl.constexpr,
                         MUL_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, COMPUTE: tl.constexpr,
                         DOT_PRECISION: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr):
    # C[p] = (A[p // TOP_K] @ B[e].T (+ BIAS[e])) (x WEIGHTS[p]) for the pairs p of each expert's M-blocks
    pid = tl.program_id(0)
    num_n = (N + BLOCK_N - 1) // BLOCK_N
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    group_size = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_size
    pid_n = (pid % in_group) // group_size
    if pid_m * BLOCK_M < tl.load(NUM_PADDED):
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(SORTED_IDS + rows).to(tl.int64)
        valid = pair < num_pairs
        expert = tl.load(EXPERT_IDS + pid_m).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = A + (pair // TOP_K)[:, None] * stride_am + ks[None, :]
        b_ptrs = B + tl.maximum(expert, 0) * stride_be + cols[None, :].to(tl.int64) * stride_bn + ks[:, None]
        acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
        k_end = tl.where(expert >= 0, K, 0)  # the -1 run: no products, zeros stored
        for k0 in range(0, k_end, BLOCK_K):
            k_mask = ks < K - k0
            a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            acc += tl.dot(a.to(COMPUTE), b.to(COMPUTE), input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        if HAS_BIAS:  # rounded to the activation dtype first, as the reference's x @ W + b
            bias = tl.load(BIAS + tl.maximum(expert, 0) * stride_bias_e + cols, mask=col_mask, other=0.0)
            bias = tl.where(expert >= 0, bias.to(tl.float32), 0.0)  # the -1 run stays zero
            acc = acc.to(C.dtype.element_ty).to(tl.float32) + bias[None, :]
        if MUL_WEIGHT:
            acc = acc * tl.load(WEIGHTS + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
        tl.store(C + pair[:, None] * stride_cm + cols[None, :], acc.to(C.dtype.element_ty),
                 mask=valid[:, None] & col_mask[None, :])


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, weights: torch.Tensor,
                  sorted_ids: torch.Tensor, expert_ids: torch.Tensor, num_padded: torch.Tensor, top_k: int,
                  mul_weight: bool, bias: torch.Tensor | None, cfg: FusedMoEKernelConfig) -> None:
    _, n, k = w.shape
    num_m = sorted_ids.numel() // cfg.block_m
    grid = (num_m * triton.cdiv(n, cfg.block_n),)
    _grouped_gemm_kernel[grid](
        a, w, out, weights, w if bias is None else bias, sorted_ids, expert_ids, num_padded, out.shape[0], num_m,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0), 0 if bias is None else bias.stride(0),
        N=n, K=k, TOP_K=top_k, MUL_WEIGHT=mul_weight, HAS_BIAS=bias is not None, COMPUTE=compute_dtype(a.dtype),
        DOT_PRECISION=dot_precision(a.dtype), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  apply_weights_on_input: bool = False, cfg: FusedMoEKernelConfig | None = None,
                  b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                  activation: tuple = ("silu",)) -> torch.Tensor:
    """The routed experts' output, ``sum_j weights[t, j] * down_e(act(gate_e(x_t), up_e(x_t)))``.

    Args:
        x: [T, H] float16/bfloat16/float32, rows contiguous.
        w13: [E, 2 I, H] gate rows then up rows per expert, x's dtype, contiguous.
        w2: [E, H, I], contiguous.
        weights: [T, k] routing weights (float32 or x's dtype).
        ids: [T, k] expert indices in ``[0, E)``, or -1 for a choice computed elsewhere (contributes 0).
        apply_weights_on_input: scale the expert's input (first GEMM) instead of its output (Llama 4).
        cfg: tiles; `default_config` by the pair count when None.
        b13, b2: [E, 2 I] and [E, H] contiguous biases of the two projections (gpt-oss), or None.
        activation: ``("silu",)`` (SwiGLU) or ``("swiglu_clamped", alpha, limit)`` (gpt-oss).

    Returns:
        [T, H] in x's dtype.

    Raises:
        ValueError: shapes that disagree, or a non-contiguous weight.
    """
    t, h = x.shape
    e, two_i, h1 = w13.shape
    if h1 != h or w2.shape != (e, h, two_i // 2) or ids.shape != weights.shape or ids.shape[0] != t:
        raise ValueError(f"fused_experts: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}, "
                         f"ids {tuple(ids.shape)}, weights {tuple(weights.shape)} disagree")
    if not (w13.is_contiguous() and w2.is_contiguous()):
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
    _grouped_gemm(x, w13, gate_up, flat_weights, sorted_ids, expert_ids, num_padded, k, apply_weights_on_input, b13,
                  cfg)
    act = (fused.swiglu_clamped(gate_up, activation[1], activation[2]) if activation[0] == "swiglu_clamped"
           else fused.silu_and_mul(gate_up))
    _grouped_gemm(act, w2, out, flat_weights, sorted_ids, expert_ids, num_padded, 1, not apply_weights_on_input, b2,
                  cfg)
    return out.view(t, k, h).sum(dim=1)
