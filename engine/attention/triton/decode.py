"""Paged decode attention: flash-decoding (split-KV) with grouped query heads.

Idea sources: flash-decoding (Dao et al., "Flash-Decoding for long-context
inference", 2023) splits each request's KV range over several programs and
merges the partial results by their log-sum-exp; the grouped-head variant, in
which the query heads that share one KV head are loaded together so that the
inner loop is a `tl.dot`, is the layout of SGLang's and vLLM's Triton decode
kernels.

Two launches per layer:

* stage 1, grid ``(batch, num_kv_heads, max_splits)``: program ``(b, h, s)``
  attends the ``GROUP`` query heads of KV head ``h`` over the ``s``-th slice of
  request ``b``'s context, reading K/V pages through the block table, and writes
  a normalised partial output and its log2-sum-exp (the inner step is
  `flash_decode`'s, shared with the MLA kernel);
* stage 2, grid ``(batch, num_heads)``: merges the partials of one head.

The split count of each request is a device tensor (`num_kv_splits`), so the
launches are graph-safe: the grid's third axis is a host constant that
depends only on the batch size, and programs past a request's split count
exit at once. The per-tensor FP8 scales are folded into the softmax scale (K)
and the final output (V). A request with ``seq_len == 0`` gets a zero output.

Per-layer attention types (`pd_cluster.engine.layer_attention`): a
sliding window or a chunk (Llama 4's chunked local attention: the query sees
only its own chunk of ``chunk_size`` tokens) moves the first key read; soft-capped
logits (Gemma 2) pass through ``cap * tanh(s / cap)`` in stage 1; attention sinks
(gpt-oss) join the denominator in stage 2, where the splits merge.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pd_cluster.engine.attention.triton.common import cdiv, dot_dtype, dot_precision, head_block, next_pow2
from pd_cluster.engine.attention.triton.flash_decode import (NEG_INIT, load_query, online_softmax_tile,
                                                             program_split, softmax_state, split_bounds, store_partial)
from pd_cluster.engine.attention.triton.paging import load_kv_tile

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class DecodeKernelConfig:
    """Launch parameters of the decode kernels.

    The defaults are the fastest settings measured on an H100 at Llama-3.1-8B's
    shapes over FP8 pages (docs/perf/gpu.md: a sweep of block_n, warps, stages
    and split sizing at batch 32/64/128 and context 1k to 4k): small tiles with
    2 warps, and at least 3 splits per request. With one split per request at
    batch 128 and context 4k the kernel reached 66% of the copy bandwidth, with
    three 85%.

    Attributes:
        block_n: tokens per inner-loop tile (16..128, a power of two).
        num_warps, num_stages: stage-1 launch options (ignored by the interpreter).
        max_kv_splits: the most programs one request's context is split over.
        min_tokens_per_split: a split gets at least this many tokens.
        programs_per_sm: splits are chosen so that ``batch * kv_heads * splits``
            reaches about this many programs per multiprocessor.
        min_splits: the grid's split axis is at least this (each request still
            gets no more splits than ``min_tokens_per_split`` allows).
    """

    block_n: int = 32
    num_warps: int = 2
    num_stages: int = 2
    max_kv_splits: int = 32
    min_tokens_per_split: int = 256
    programs_per_sm: int = 4
    min_splits: int = 3

    def __post_init__(self) -> None:
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n must be a power of two >= 16, got {self.block_n}")
        if min(self.max_kv_splits, self.min_tokens_per_split, self.programs_per_sm, self.min_splits) < 1:
            raise ValueError("max_kv_splits, min_tokens_per_split, programs_per_sm and min_splits must be >= 1")


def max_splits_for(batch_size: int, num_kv_heads: int, num_sms: int, cfg: DecodeKernelConfig) -> int:
    """The split axis of the stage-1 grid for a batch of `batch_size` (a host constant):
    ``clamp(ceil(programs_per_sm * SMs / (batch * kv_heads)), min_splits, max_kv_splits)``."""
    want = cdiv(cfg.programs_per_sm * num_sms, max(1, batch_size * num_kv_heads))
    return max(1, min(cfg.max_kv_splits, max(cfg.min_splits, want)))


def num_kv_splits(seq_lens: torch.Tensor, max_splits: int, cfg: DecodeKernelConfig,
                  sliding_window: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Per-request split counts, computed on the device without a host sync.

    Args:
        seq_lens: [B] int32 context lengths.
        max_splits: the host bound (`max_splits_for`).
        out: optional [B] int32 buffer to write into (CUDA-graph static buffer).

    Returns:
        [B] int32, each in ``1..max_splits`` and at most
        ``ceil(attended_tokens / min_tokens_per_split)``.
    """
    attended = seq_lens if sliding_window is None else seq_lens.clamp(max=sliding_window)
    splits = torch.clamp((attended + (cfg.min_tokens_per_split - 1)) // cfg.min_tokens_per_split, 1, max_splits)
    if out is None:
        return splits.to(torch.int32)
    out.copy_(splits)
    return out


# The block-table width and the split count (which sets the partial buffers' strides) vary per step:
# not specialised, so one compiled variant serves every step (see `variants`).
MID_STRIDES = ["stride_mo_b", "stride_mo_h", "stride_mo_s", "stride_ml_b", "stride_ml_h"]


@triton.jit(do_not_specialize=["stride_bt", *MID_STRIDES])
def _decode_stage1_kernel(
    Q, K_cache, V_cache, block_tables, seq_lens, num_splits, Mid_O, Mid_LSE,
    qk_scale,
    stride_q_t, stride_q_h,
    stride_k_p, stride_k_h, stride_k_t,
    stride_v_p, stride_v_h, stride_v_t,
    stride_bt,
    stride_mo_b, stride_mo_h, stride_mo_s,
    stride_ml_b, stride_ml_h,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_ALIGNED: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr, COMPUTE: tl.constexpr, DOT_PRECISION: tl.constexpr, CLAMP_Q: tl.constexpr,
    CHUNK: tl.constexpr = 0, SOFTCAP: tl.constexpr = False, softcap_l2=0.0,
):
    b, kv_head, split, n_splits, seq_len = program_split(num_splits, seq_lens)
    if split < n_splits:
        lo = 0
        if SLIDING_WINDOW > 0:
            lo = tl.maximum(seq_len - SLIDING_WINDOW, 0)
        if CHUNK > 0:  # the query (at seq_len - 1) sees its own chunk only
            lo = tl.maximum(seq_len - 1, 0) // CHUNK * CHUNK
        start, end = split_bounds(lo, seq_len, n_splits, split, BLOCK_N)

        g = tl.arange(0, BLOCK_H)
        heads = kv_head * GROUP + g
        h_mask = g < GROUP
        d = tl.arange(0, BLOCK_D)
        d_mask = d < HEAD_DIM
        q = load_query(Q + b * stride_q_t + heads[:, None] * stride_q_h + d[None, :],
                       h_mask[:, None] & d_mask[None, :], CLAMP_Q, COMPUTE)
        bt_row = block_tables + b * stride_bt
        m_i, l_i, acc = softmax_state(BLOCK_H, BLOCK_D)
        for start_n in range(start, end, BLOCK_N):
            k = load_kv_tile(K_cache, bt_row, start_n, end, kv_head, stride_k_p, stride_k_h, stride_k_t,
                             d, d_mask, PAGE_SIZE, BLOCK_N, PAGE_ALIGNED, BLOCK_D != HEAD_DIM).to(COMPUTE)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            if SOFTCAP:
                s = softcap_log2(s, softcap_l2)
            v = load_kv_tile(V_cache, bt_row, start_n, end, kv_head, stride_v_p, stride_v_h, stride_v_t,
                             d, d_mask, PAGE_SIZE, BLOCK_N, PAGE_ALIGNED, BLOCK_D != HEAD_DIM).to(COMPUTE)
            acc, m_i, l_i = online_softmax_tile(s, v, start_n, end, acc, m_i, l_i, COMPUTE, DOT_PRECISION, BLOCK_N)
        store_partial(Mid_O, Mid_LSE, acc, m_i, l_i, b, heads, split, d, h_mask, d_mask,
                      stride_mo_b, stride_mo_h, stride_mo_s, stride_ml_b, stride_ml_h)


@triton.jit
def softcap_log2(s, softcap_l2):
    """Soft-capped scores in log2 units: ``s`` is ``logit * log2(e)``, `softcap_l2` is ``cap * log2(e)``;
    returns ``cap * tanh(logit / cap) * log2(e)``, with ``tanh(x) = 1 - 2 / (exp(2x) + 1)``."""
    x = tl.minimum(s / softcap_l2, 20.0)  # tanh(20) is 1 in fp32; exp stays finite
    return softcap_l2 * (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0))


@triton.jit
def add_sink(acc, m, total, sink_l2):
    """Fold a sink logit (log2 units) into a softmax's running (acc, max, sum): (acc, sum) rescaled to the new
    max, the sum gaining ``2 ** (sink - max)``."""
    m_new = tl.maximum(m, sink_l2)
    alpha = tl.math.exp2(m - m_new)
    return acc * alpha, m_new, total * alpha + tl.math.exp2(sink_l2 - m_new)


@triton.jit(do_not_specialize=MID_STRIDES)
def _decode_stage2_kernel(
    Mid_O, Mid_LSE, num_splits, O, v_scale,
    stride_mo_b, stride_mo_h, stride_mo_s,
    stride_ml_b, stride_ml_h,
    stride_o_t, stride_o_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SINKS=None, HAS_SINKS: tl.constexpr = False,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    n_splits = tl.load(num_splits + b)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    m = NEG_INIT
    total = 0.0
    acc = tl.full([BLOCK_D], 0.0, tl.float32)
    for s in range(0, n_splits):
        lse = tl.load(Mid_LSE + b * stride_ml_b + h * stride_ml_h + s)
        o = tl.load(Mid_O + b * stride_mo_b + h * stride_mo_h + s * stride_mo_s + d, mask=d_mask, other=0.0)
        m_new = tl.maximum(m, lse)
        alpha = tl.math.exp2(m - m_new)
        w = tl.math.exp2(lse - m_new)
        acc = acc * alpha + w * o
        total = total * alpha + w
        m = m_new
    if HAS_SINKS:
        acc, m, total = add_sink(acc, m, total, tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634)
    out = acc / tl.where(total > 0, total, 1.0) * v_scale
    tl.store(O + b * stride_o_t + h * stride_o_h + d, out.to(O.dtype.element_ty), mask=d_mask)


@dataclass
class DecodeWorkspace:
    """Per-step decode buffers: split counts and the partial results of stage 1.

    Attributes:
        num_splits: [B] int32 per-request split counts (device).
        mid_o: [B, num_heads, max_splits, head_dim] float32 partial outputs.
        mid_lse: [B, num_heads, max_splits] float32 partial log2-sum-exps.
        max_splits: the split axis of the grid (host constant).
    """

    num_splits: torch.Tensor
    mid_o: torch.Tensor
    mid_lse: torch.Tensor
    max_splits: int


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, out: torch.Tensor, ws: DecodeWorkspace, sm_scale: float,
                     k_scale: float, v_scale: float, cfg: DecodeKernelConfig,
                     sliding_window: int | None = None, chunk_size: int | None = None,
                     sinks: torch.Tensor | None = None, softcap: float | None = None) -> None:
    """Attention of one new token per request over its paged context; no host sync.

    Args:
        q: [B, num_heads, head_dim] float16/bfloat16/float32 queries (last dim contiguous).
        k_cache, v_cache: [num_pages + 1, num_kv_heads, page_size, head_dim] pool views
            (`KVPool.layer_cache`): float8_e4m3fn, bfloat16, float16 or float32.
        block_tables: [B, max_pages] int32 page ids (null page 0 as padding).
        seq_lens: [B] int32 context lengths including the new token (0 gives a zero row).
        out: [B, num_heads, head_dim] output in q's dtype, written in place.
        ws: split counts and partial buffers (`num_kv_splits` already filled).
        sm_scale: softmax scale; k_scale, v_scale: per-tensor FP8 scales (1.0 otherwise).
        sliding_window: attend to the last `sliding_window` tokens only, or None.
        chunk_size: attend only within the query's own chunk of `chunk_size` tokens, or None.
        sinks: [num_heads] sink logits joining each softmax denominator (gpt-oss), or None.
        softcap: scores become ``softcap * tanh(s / softcap)`` before the softmax (Gemma 2), or None.
    """
    bsz, num_heads, head_dim = q.shape
    if bsz == 0:
        return
    num_kv_heads, page_size = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_d = head_block(head_dim)
    aligned = page_size % cfg.block_n == 0 and sliding_window is None and chunk_size is None
    _decode_stage1_kernel[(bsz, num_kv_heads, ws.max_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, ws.num_splits, ws.mid_o, ws.mid_lse,
        sm_scale * k_scale * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        ws.mid_o.stride(0), ws.mid_o.stride(1), ws.mid_o.stride(2),
        ws.mid_lse.stride(0), ws.mid_lse.stride(1),
        GROUP=group, BLOCK_H=max(16, next_pow2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        PAGE_SIZE=page_size, BLOCK_N=cfg.block_n, PAGE_ALIGNED=aligned,
        SLIDING_WINDOW=sliding_window or 0, COMPUTE=dot_dtype(q.dtype, k_cache.dtype), DOT_PRECISION=dot_precision(q.dtype),
        CLAMP_Q=q.dtype == torch.bfloat16 and dot_dtype(q.dtype, k_cache.dtype) == tl.float16,
        CHUNK=chunk_size or 0, SOFTCAP=softcap is not None, softcap_l2=float(softcap or 1.0) * LOG2E,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    _decode_stage2_kernel[(bsz, num_heads)](
        ws.mid_o, ws.mid_lse, ws.num_splits, out, float(v_scale),
        ws.mid_o.stride(0), ws.mid_o.stride(1), ws.mid_o.stride(2),
        ws.mid_lse.stride(0), ws.mid_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, SINKS=sinks, HAS_SINKS=sinks is not None,
        num_warps=1 if block_d <= 64 else 2,
    )


def workspace_nbytes(batch_size: int, num_heads: int, head_dim: int, max_splits: int) -> int:
    """Bytes of the float32 partial buffers for one batch (for sizing static buffers)."""
    return batch_size * num_heads * max_splits * (head_dim + 1) * 4


__all__ = ["DecodeKernelConfig", "DecodeWorkspace", "decode_attention", "max_splits_for", "num_kv_splits",
           "workspace_nbytes"]
