"""KV store kernel: write one step's K and V into their pool slots, quantising to FP8.

One program per token writes all KV heads of K and V for that token (one launch
for both; K alone for an MLA pool's latents, ``v=None``). A negative slot (``-1``: a padded batch slot) is skipped, as in
nano-vllm's store kernel, so padding never touches the pool. For FP8 E4M3 pages
the value is divided by the layer's per-tensor scale, clamped to +-448 and
then cast (round to nearest even), matching `KVPool.store_kv` bit for bit on a
GPU; PyTorch's cast does not saturate, hence the clamp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pd_cluster.engine.attention.triton.common import FP8_E4M3_MAX, head_block, next_pow2

FP8_MAX = tl.constexpr(FP8_E4M3_MAX)


@triton.jit
def _quantize(x, scale, IS_FP8: tl.constexpr, APPLY_SCALE: tl.constexpr, OUT_DTYPE: tl.constexpr):
    if IS_FP8:
        x = x.to(tl.float32)
        if APPLY_SCALE:
            x = tl.math.div_rn(x, scale)
        x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
    return x.to(OUT_DTYPE)


@triton.jit
def _store_kv_kernel(
    K, V, K_cache, V_cache, slot_mapping,
    k_scale, v_scale,
    stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_kc_p, stride_kc_h, stride_kc_t,
    stride_vc_p, stride_vc_h, stride_vc_t,
    NUM_KV_HEADS: tl.constexpr, BLOCK_HKV: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    IS_FP8: tl.constexpr, APPLY_K_SCALE: tl.constexpr, APPLY_V_SCALE: tl.constexpr, HAS_V: tl.constexpr = True,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    if slot >= 0:
        page = slot // PAGE_SIZE
        off = slot % PAGE_SIZE
        h = tl.arange(0, BLOCK_HKV)
        d = tl.arange(0, BLOCK_D)
        mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
        k = tl.load(K + t * stride_k_t + h[:, None] * stride_k_h + d[None, :], mask=mask)
        k = _quantize(k, k_scale, IS_FP8, APPLY_K_SCALE, K_cache.dtype.element_ty)
        kc = K_cache + page * stride_kc_p + off * stride_kc_t + h[:, None] * stride_kc_h + d[None, :]
        tl.store(kc, k, mask=mask)
        if HAS_V:
            v = tl.load(V + t * stride_v_t + h[:, None] * stride_v_h + d[None, :], mask=mask)
            v = _quantize(v, v_scale, IS_FP8, APPLY_V_SCALE, V_cache.dtype.element_ty)
            vc = V_cache + page * stride_vc_p + off * stride_vc_t + h[:, None] * stride_vc_h + d[None, :]
            tl.store(vc, v, mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor | None,
             slot_mapping: torch.Tensor, k_scale: float, v_scale: float, num_warps: int = 4) -> None:
    """Write K and V of one layer into the paged pool (K only when `v` and `v_cache` are None: MLA latents).

    Args:
        k, v: [T, num_kv_heads, head_dim] float16/bfloat16/float32, last dim contiguous.
        k_cache, v_cache: [num_pages + 1, num_kv_heads, page_size, head_dim] in the
            storage dtype (`KVPool.layer_cache`): float8_e4m3fn, bfloat16, float16 or
            float32; strided over the page axis, contiguous inside a page (the token stride is free).
        slot_mapping: [T] int64, ``page * page_size + offset``; negative = skip.
        k_scale, v_scale: FP8 per-tensor scales (ignored for other dtypes).

    Raises:
        ValueError: shapes disagree or the last dimension is not contiguous.
    """
    t, hkv, d = k.shape
    has_v = v is not None
    if not has_v:
        v, v_cache, v_scale = k, k_cache, 1.0  # never read: HAS_V is off
    if v.shape != k.shape or k_cache.shape[1] != hkv or k_cache.shape[3] != d or slot_mapping.shape[0] != t:
        raise ValueError(f"store_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, cache {tuple(k_cache.shape)}, "
                         f"slots {tuple(slot_mapping.shape)} do not agree")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("store_kv needs the head dimension contiguous")
    if t == 0:
        return
    is_fp8 = k_cache.dtype == torch.float8_e4m3fn
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping, float(k_scale), float(v_scale),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=hkv, BLOCK_HKV=next_pow2(hkv), HEAD_DIM=d, BLOCK_D=head_block(d),
        PAGE_SIZE=k_cache.shape[2], IS_FP8=is_fp8,
        APPLY_K_SCALE=is_fp8 and k_scale != 1.0, APPLY_V_SCALE=is_fp8 and v_scale != 1.0, HAS_V=has_v,
        num_warps=num_warps,
    )
