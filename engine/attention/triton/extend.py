"""Paged prefill / extend attention: a chunk's queries over the cached prefix plus, causally, the chunk.

This is the kernel chunked prefill needs (SGLang calls it "extend"): request
``r`` has ``q_len`` new tokens at positions ``[seq_len - q_len, seq_len)``, and
their K/V are already stored in the pool (the backend stores before it
attends, like the torch reference), so one loop over the request's pages
covers both the cached prefix and the chunk itself. The online softmax is
FlashAttention's (Dao et al. 2022; FlashAttention-2, Dao 2023).

Grid ``(ceil(max_q_len / BLOCK_M), num_heads, num_prefill_reqs)``: one program
per block of ``BLOCK_M`` queries of one head of one request. Its keys come in
two loops: tiles wholly before the block's first query position need no mask;
the rest (the diagonal) are masked causally and at ``seq_len``. A sliding
window or a chunk (Llama 4's chunked local attention: a query sees only its
own chunk of ``chunk_size`` tokens) adds a lower bound and its own mask.
Soft-capped logits (Gemma 2) pass through ``cap * tanh(s / cap)``; attention
sinks (gpt-oss) join each row's denominator at the end. Per-tensor FP8 scales
are folded into the softmax scale (K) and the output (V).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pd_cluster.engine.attention.triton.common import cdiv, dot_dtype, dot_precision, head_block
from pd_cluster.engine.attention.triton.decode import LOG2E, softcap_log2
from pd_cluster.engine.attention.triton.flash_decode import FP16_LIMIT, NEG_INIT
from pd_cluster.engine.attention.triton.paging import load_kv_tile
from pd_cluster.engine.attention.triton.primitives import row_max, row_sum


@dataclass(frozen=True)
class ExtendKernelConfig:
    """Launch parameters of the extend kernel.

    The defaults are the fastest of six settings measured on an H100 on one
    8k-token chunk at Llama-3.1-8B's shapes over FP8 pages (docs/perf/gpu.md):
    128 x 128 tiles with 8 warps took 1.70 ms, 128 x 64 2.17 ms.

    Attributes:
        block_m: queries per program (>= 16, a power of two).
        block_n: keys per inner-loop tile (>= 16, a power of two).
        num_warps, num_stages: launch options (ignored by the interpreter).
    """

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            val = getattr(self, name)
            if val < 16 or val & (val - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {val}")


@triton.jit
def _attend_tile(acc, m_i, l_i, q, K_cache, V_cache, bt_row, start_n, kv_end, kv_head, q_pos,
                 qk_scale, stride_k_p, stride_k_h, stride_k_t, stride_v_p, stride_v_h, stride_v_t,
                 d, d_mask, MASKED: tl.constexpr, SLIDING_WINDOW: tl.constexpr,
                 PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_ALIGNED: tl.constexpr,
                 COMPUTE: tl.constexpr, DOT_PRECISION: tl.constexpr, PAD_D: tl.constexpr,
                 CHUNK: tl.constexpr, SOFTCAP: tl.constexpr, softcap_l2):
    k = load_kv_tile(K_cache, bt_row, start_n, kv_end, kv_head, stride_k_p, stride_k_h, stride_k_t,
                     d, d_mask, PAGE_SIZE, BLOCK_N, PAGE_ALIGNED, PAD_D).to(COMPUTE)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if SOFTCAP:
        s = softcap_log2(s, softcap_l2)
    k_pos = start_n + tl.arange(0, BLOCK_N)
    if MASKED:
        ok = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < kv_end)
        if SLIDING_WINDOW > 0:
            ok = ok & (k_pos[None, :] > q_pos[:, None] - SLIDING_WINDOW)
        if CHUNK > 0:
            ok = ok & (k_pos[None, :] >= q_pos[:, None] // CHUNK * CHUNK)
        s = tl.where(ok, s, float("-inf"))
    elif SLIDING_WINDOW > 0:
        s = tl.where(k_pos[None, :] > q_pos[:, None] - SLIDING_WINDOW, s, float("-inf"))
    elif CHUNK > 0:
        s = tl.where(k_pos[None, :] >= q_pos[:, None] // CHUNK * CHUNK, s, float("-inf"))
    m_new = tl.maximum(m_i, row_max(s))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + row_sum(p)
    v = load_kv_tile(V_cache, bt_row, start_n, kv_end, kv_head, stride_v_p, stride_v_h, stride_v_t,
                     d, d_mask, PAGE_SIZE, BLOCK_N, PAGE_ALIGNED, PAD_D).to(COMPUTE)
    acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["first_req", "stride_bt"])  # both vary per step (see `variants`)
def _extend_kernel(
    Q, K_cache, V_cache, O, block_tables, seq_lens, query_start_loc, first_req,
    qk_scale, v_scale,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_k_p, stride_k_h, stride_k_t,
    stride_v_p, stride_v_h, stride_v_t,
    stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_ALIGNED: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr, COMPUTE: tl.constexpr, DOT_PRECISION: tl.constexpr, CLAMP_Q: tl.constexpr,
    CHUNK: tl.constexpr = 0, SOFTCAP: tl.constexpr = False, softcap_l2=0.0, SINKS=None,
    HAS_SINKS: tl.constexpr = False,
):
    m_block = tl.program_id(0)
    head = tl.program_id(1)
    req = (tl.program_id(2) + first_req).to(tl.int64)
    q_start = tl.load(query_start_loc + req).to(tl.int64)
    q_len = (tl.load(query_start_loc + req + 1) - q_start).to(tl.int32)
    if m_block * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens + req)
        prefix = seq_len - q_len
        kv_head = head // GROUP
        rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < q_len
        q_pos = prefix + rows
        d = tl.arange(0, BLOCK_D)
        d_mask = d < HEAD_DIM
        q_rows = (q_start + rows).to(tl.int64)
        q = tl.load(Q + q_rows[:, None] * stride_q_t + head * stride_q_h + d[None, :],
                    mask=row_mask[:, None] & d_mask[None, :], other=0.0)
        if CLAMP_Q:
            q = tl.minimum(tl.maximum(q.to(tl.float32), -FP16_LIMIT), FP16_LIMIT)
        q = q.to(COMPUTE)
        bt_row = block_tables + req * stride_bt

        first_pos = prefix + m_block * BLOCK_M
        kv_end = tl.minimum(seq_len, first_pos + BLOCK_M)
        kv_lo = 0
        if SLIDING_WINDOW > 0:
            kv_lo = tl.maximum(first_pos - SLIDING_WINDOW + 1, 0) // BLOCK_N * BLOCK_N
        if CHUNK > 0:
            kv_lo = first_pos // CHUNK * CHUNK // BLOCK_N * BLOCK_N
        full_end = tl.maximum(first_pos // BLOCK_N * BLOCK_N, kv_lo)

        m_i = tl.full([BLOCK_M], NEG_INIT, tl.float32)
        l_i = tl.full([BLOCK_M], 0.0, tl.float32)
        acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
        for start_n in range(kv_lo, full_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, K_cache, V_cache, bt_row, start_n, kv_end, kv_head,
                                         q_pos, qk_scale, stride_k_p, stride_k_h, stride_k_t,
                                         stride_v_p, stride_v_h, stride_v_t, d, d_mask, False, SLIDING_WINDOW,
                                         PAGE_SIZE, BLOCK_N, PAGE_ALIGNED, COMPUTE, DOT_PRECISION,
                                         BLOCK_D != HEAD_DIM, CHUNK, SOFTCAP, softcap_l2)
        for start_n in range(full_end, kv_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, K_cache, V_cache, bt_row, start_n, kv_end, kv_head,
                                         q_pos, qk_scale, stride_k_p, stride_k_h, stride_k_t,
                                         stride_v_p, stride_v_h, stride_v_t, d, d_mask, True, SLIDING_WINDOW,
                                         PAGE_SIZE, BLOCK_N, PAGE_ALIGNED, COMPUTE, DOT_PRECISION,
                                         BLOCK_D != HEAD_DIM, CHUNK, SOFTCAP, softcap_l2)

        if HAS_SINKS:  # the head's sink logit joins every row's denominator
            sink = tl.load(SINKS + head).to(tl.float32) * 1.4426950408889634
            m_new = tl.maximum(m_i, sink)
            alpha = tl.math.exp2(m_i - m_new)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha + tl.math.exp2(sink - m_new)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * v_scale
        o_ptrs = O + q_rows[:, None] * stride_o_t + head * stride_o_h + d[None, :]
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, query_start_loc: torch.Tensor, out: torch.Tensor,
                     first_req: int, num_reqs: int, max_q_len: int, sm_scale: float, k_scale: float,
                     v_scale: float, cfg: ExtendKernelConfig, sliding_window: int | None = None,
                     chunk_size: int | None = None, sinks: torch.Tensor | None = None,
                     softcap: float | None = None) -> None:
    """Causal attention of requests ``[first_req, first_req + num_reqs)`` over their pages.

    Args:
        q: [T, num_heads, head_dim] queries of the whole step (float16/bfloat16/float32).
        k_cache, v_cache: [num_pages + 1, num_kv_heads, page_size, head_dim] pool views
            (`KVPool.layer_cache`), the chunk's own K/V already stored.
        block_tables: [B, max_pages] int32; seq_lens: [B] int32 (cached + new tokens);
            query_start_loc: [B + 1] int32 offsets of each request's rows in `q`.
        out: [T, num_heads, head_dim], rows of those requests written in place.
        first_req, num_reqs: which requests (the step's prefill chunks).
        max_q_len: the longest chunk among them (host value; sizes the grid).
        sm_scale: softmax scale; k_scale, v_scale: per-tensor FP8 scales (1.0 otherwise).
        sliding_window: attend to the last `sliding_window` positions only, or None.
        chunk_size: attend only within each query's own chunk of `chunk_size` positions, or None.
        sinks: [num_heads] sink logits joining each softmax denominator (gpt-oss), or None.
        softcap: scores become ``softcap * tanh(s / softcap)`` before the softmax (Gemma 2), or None.
    """
    if num_reqs == 0 or max_q_len == 0:
        return
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, page_size = k_cache.shape[1], k_cache.shape[2]
    grid = (cdiv(max_q_len, cfg.block_m), num_heads, num_reqs)
    _extend_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, first_req,
        sm_scale * k_scale * LOG2E, float(v_scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=head_block(head_dim),
        PAGE_SIZE=page_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        PAGE_ALIGNED=page_size % cfg.block_n == 0,
        SLIDING_WINDOW=sliding_window or 0, COMPUTE=dot_dtype(q.dtype, k_cache.dtype), DOT_PRECISION=dot_precision(q.dtype),
        CLAMP_Q=q.dtype == torch.bfloat16 and dot_dtype(q.dtype, k_cache.dtype) == tl.float16,
        CHUNK=chunk_size or 0, SOFTCAP=softcap is not None, softcap_l2=float(softcap or 1.0) * LOG2E,
        SINKS=sinks, HAS_SINKS=sinks is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
