"""Paged MLA decode attention (the absorbed form): flash-decoding over one shared latent "KV head".

In the absorbed form (`pd_cluster.engine.attention.mla`) every query head attends
over the same cached latents: keys are the whole latent ``[c, k_pe]``
(``kv_lora_rank + qk_rope_head_dim`` = 512 + 64 for DeepSeek-V3), values its
first ``kv_lora_rank`` values ``c``. So this is the grouped-head decode of
`decode` with one KV head for all query heads, a key wider than the value, and
the value read from the key's own tile: each latent tile is loaded once per
program and serves both products (SGLang's and lightllm's grouped MLA decode
kernels take the same shape: a ``BLOCK_DPE`` part beside the ``BLOCK_DMODEL`` part).

Stage 1, grid ``(batch, cdiv(num_heads, BLOCK_H), max_splits)``: program
``(b, hb, s)`` takes query heads ``hb * BLOCK_H ...`` of request ``b`` over the
``s``-th slice of its context, reading latent pages through the block table, and
writes a normalised partial ``[BLOCK_H, kv_lora_rank]`` and its log2-sum-exp; after the
scores, the inner step is `flash_decode`'s, the one the K/V kernel runs. Stage 2 is `decode`'s merge kernel,
unchanged. Split counts come from the device
(`num_kv_splits`), so the launches are graph-safe. The FP8 latent scale is folded
into the softmax scale (keys) and into the merged output (values: the same
latent, the same scale).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pd_cluster.engine.attention.triton.common import cdiv, dot_dtype, dot_precision, next_pow2
from pd_cluster.engine.attention.triton.decode import (
    LOG2E, MID_STRIDES, DecodeKernelConfig, DecodeWorkspace, _decode_stage2_kernel,
)
from pd_cluster.engine.attention.triton.flash_decode import (load_query, online_softmax_tile, program_split,
                                                             softmax_state, split_bounds, store_partial)
from pd_cluster.engine.attention.triton.paging import load_kv_tile

MLA_BLOCK_H = 16  # query heads per program: the smallest `tl.dot` side (DeepSeek-V3 at TP 8 has 16 per rank)


@triton.jit(do_not_specialize=["stride_bt", *MID_STRIDES])
def _mla_decode_stage1_kernel(
    Q, Latent, block_tables, seq_lens, num_splits, Mid_O, Mid_LSE,
    qk_scale,
    stride_q_t, stride_q_h,
    stride_c_p, stride_c_t,
    stride_bt,
    stride_mo_b, stride_mo_h, stride_mo_s,
    stride_ml_b, stride_ml_h,
    NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr,
    RANK: tl.constexpr, BLOCK_R: tl.constexpr, ROPE: tl.constexpr, BLOCK_PE: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_ALIGNED: tl.constexpr,
    COMPUTE: tl.constexpr, DOT_PRECISION: tl.constexpr, CLAMP_Q: tl.constexpr,
):
    b, head_block, split, n_splits, seq_len = program_split(num_splits, seq_lens)
    if split < n_splits:
        start, end = split_bounds(0, seq_len, n_splits, split, BLOCK_N)

        heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
        h_mask = heads < NUM_HEADS
        r = tl.arange(0, BLOCK_R)
        r_mask = r < RANK
        e = tl.arange(0, BLOCK_PE)
        e_mask = e < ROPE
        q_row = Q + b * stride_q_t + heads[:, None] * stride_q_h
        q_c = load_query(q_row + r[None, :], h_mask[:, None] & r_mask[None, :], CLAMP_Q, COMPUTE)
        q_pe = load_query(q_row + RANK + e[None, :], h_mask[:, None] & e_mask[None, :], CLAMP_Q, COMPUTE)
        bt_row = block_tables + b * stride_bt
        m_i, l_i, acc = softmax_state(BLOCK_H, BLOCK_R)
        for start_n in range(start, end, BLOCK_N):
            c = load_kv_tile(Latent, bt_row, start_n, end, 0, stride_c_p, 0, stride_c_t, r, r_mask,
                             PAGE_SIZE, BLOCK_N, PAGE_ALIGNED, BLOCK_R != RANK).to(COMPUTE)
            pe = load_kv_tile(Latent + RANK, bt_row, start_n, end, 0, stride_c_p, 0, stride_c_t, e, e_mask,
                              PAGE_SIZE, BLOCK_N, PAGE_ALIGNED, BLOCK_PE != ROPE).to(COMPUTE)
            s = tl.dot(q_c, tl.trans(c), input_precision=DOT_PRECISION)
            s += tl.dot(q_pe, tl.trans(pe), input_precision=DOT_PRECISION)
            acc, m_i, l_i = online_softmax_tile(s * qk_scale, c, start_n, end, acc, m_i, l_i, COMPUTE, DOT_PRECISION,
                                                BLOCK_N)
        store_partial(Mid_O, Mid_LSE, acc, m_i, l_i, b, heads, split, r, h_mask, r_mask,
                      stride_mo_b, stride_mo_h, stride_mo_s, stride_ml_b, stride_ml_h)


def mla_head_blocks(num_heads: int) -> int:
    """Programs per request along the head axis (the stage-1 grid's second axis)."""
    return cdiv(num_heads, MLA_BLOCK_H)


def mla_decode_attention(q: torch.Tensor, latent_cache: torch.Tensor, block_tables: torch.Tensor,
                         seq_lens: torch.Tensor, out: torch.Tensor, ws: DecodeWorkspace, kv_lora_rank: int,
                         sm_scale: float, latent_scale: float, cfg: DecodeKernelConfig) -> None:
    """Absorbed MLA attention of one new token per request over its paged latents; no host sync.

    Args:
        q: [B, num_heads, kv_lora_rank + rope_dim] float16/bfloat16/float32 absorbed queries (last dim contiguous).
        latent_cache: [num_pages + 1, page_size, kv_lora_rank + rope_dim] pool view (`KVPool.latent_cache`):
            float8_e4m3fn, bfloat16, float16 or float32, contiguous inside a page.
        block_tables: [B, max_pages] int32 page ids (null page 0 as padding).
        seq_lens: [B] int32 context lengths including the new token (0 gives a zero row).
        out: [B, num_heads, kv_lora_rank] in q's dtype, written in place.
        ws: split counts and partial buffers (mid_o [B, num_heads, S, kv_lora_rank]; `num_kv_splits` filled).
        sm_scale: softmax scale; latent_scale: the FP8 per-tensor scale (1.0 otherwise).

    Raises:
        ValueError: shapes disagree or the last dimension is not contiguous.
    """
    bsz, num_heads, width = q.shape
    if latent_cache.shape[2] != width or out.shape != (bsz, num_heads, kv_lora_rank) or not 0 < kv_lora_rank < width:
        raise ValueError(f"mla_decode_attention: q {tuple(q.shape)}, cache {tuple(latent_cache.shape)}, out "
                         f"{tuple(out.shape)}, kv_lora_rank {kv_lora_rank} do not agree")
    if q.stride(-1) != 1 or latent_cache.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("mla_decode_attention needs the last dimension contiguous")
    if bsz == 0:
        return
    rope = width - kv_lora_rank
    page_size = latent_cache.shape[1]
    compute = dot_dtype(q.dtype, latent_cache.dtype)
    _mla_decode_stage1_kernel[(bsz, mla_head_blocks(num_heads), ws.max_splits)](
        q, latent_cache, block_tables, seq_lens, ws.num_splits, ws.mid_o, ws.mid_lse,
        sm_scale * latent_scale * LOG2E,
        q.stride(0), q.stride(1),
        latent_cache.stride(0), latent_cache.stride(1),
        block_tables.stride(0),
        ws.mid_o.stride(0), ws.mid_o.stride(1), ws.mid_o.stride(2),
        ws.mid_lse.stride(0), ws.mid_lse.stride(1),
        NUM_HEADS=num_heads, BLOCK_H=MLA_BLOCK_H,
        RANK=kv_lora_rank, BLOCK_R=max(16, next_pow2(kv_lora_rank)), ROPE=rope, BLOCK_PE=max(16, next_pow2(rope)),
        PAGE_SIZE=page_size, BLOCK_N=cfg.block_n, PAGE_ALIGNED=page_size % cfg.block_n == 0,
        COMPUTE=compute, DOT_PRECISION=dot_precision(q.dtype),
        CLAMP_Q=q.dtype == torch.bfloat16 and compute == tl.float16,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    block_r = max(16, next_pow2(kv_lora_rank))
    _decode_stage2_kernel[(bsz, num_heads)](
        ws.mid_o, ws.mid_lse, ws.num_splits, out, float(latent_scale),
        ws.mid_o.stride(0), ws.mid_o.stride(1), ws.mid_o.stride(2),
        ws.mid_lse.stride(0), ws.mid_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=kv_lora_rank, BLOCK_D=block_r,
        num_warps=1 if block_r <= 64 else 4,
    )


__all__ = ["MLA_BLOCK_H", "mla_decode_attention", "mla_head_blocks"]
