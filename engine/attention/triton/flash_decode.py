"""The flash-decoding inner step shared by the paged decode kernels: K/V per head (`decode`) and MLA's latent
(`mla_decode`).

Flash-decoding (Dao et al., "Flash-Decoding for long-context inference", 2023) splits each request's KV range
over several programs; each program runs FlashAttention's online softmax (Dao et al. 2022) over its slice, one
tile of ``BLOCK_N`` keys at a time, and writes a normalised partial output with its log2-sum-exp, which stage 2
merges (`decode._decode_stage2_kernel`). The kernels differ only in how they load a tile and score it (grouped
query heads over one KV head, or every head over the latent's two parts); what follows the scores is here:

* `load_query`: a program's query rows, clamped to the fp16 range when the products run in fp16 over bf16
  queries, in the compute dtype; `softmax_state`: the running (max, sum, output) of its rows;
* `program_split`: which request, head block and split a stage-1 program takes, its split count and context;
* `split_bounds`: the slice ``[start, end)`` of program ``split`` of ``n_splits`` over keys ``[lo, seq_len)``;
* `online_softmax_tile`: mask the tile's keys past ``end``, update the running max, sum and output;
* `store_partial`: the normalised partial output and its log2-sum-exp (``-inf`` for an empty slice).

Scores are in log2 units (the softmax scale carries ``log2(e)``), so the exponentials are ``exp2``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pd_cluster.engine.attention.triton.common import FP16_MAX
from pd_cluster.engine.attention.triton.primitives import row_max, row_sum

FP16_LIMIT = tl.constexpr(FP16_MAX)
NEG_INIT = tl.constexpr(-1.0e30)  # finite start for the running max: a fully masked tile then gives p = 0, not NaN


@triton.jit
def load_query(ptrs, mask, CLAMP_Q: tl.constexpr, COMPUTE: tl.constexpr):
    """The query tile at `ptrs` (0 where not `mask`), clamped to +-65504 with `CLAMP_Q`, as `COMPUTE`."""
    q = tl.load(ptrs, mask=mask, other=0.0)
    if CLAMP_Q:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -FP16_LIMIT), FP16_LIMIT)
    return q.to(COMPUTE)


@triton.jit
def softmax_state(ROWS: tl.constexpr, COLS: tl.constexpr):
    """The online softmax's start for `ROWS` query rows: (running max, running sum, output [ROWS, COLS])."""
    return (tl.full([ROWS], NEG_INIT, tl.float32), tl.full([ROWS], 0.0, tl.float32),
            tl.full([ROWS, COLS], 0.0, tl.float32))


@triton.jit
def program_split(num_splits, seq_lens):
    """A stage-1 program's (request b, its second grid index, split, the request's split count, its context
    length): grid ``(batch, heads or head blocks, max_splits)``; a split at or past the count has no work."""
    b = tl.program_id(0).to(tl.int64)
    return b, tl.program_id(1), tl.program_id(2), tl.load(num_splits + b), tl.load(seq_lens + b)


@triton.jit
def split_bounds(lo, seq_len, n_splits, split, BLOCK_N: tl.constexpr):
    """Program `split`'s keys ``[start, end)``: whole tiles of ``[lo, seq_len)`` in equal runs per split."""
    num_blocks = (seq_len - lo + BLOCK_N - 1) // BLOCK_N
    blocks_per_split = (num_blocks + n_splits - 1) // n_splits
    start = lo + split * blocks_per_split * BLOCK_N
    return start, tl.minimum(start + blocks_per_split * BLOCK_N, seq_len)


@triton.jit
def online_softmax_tile(s, v, start_n, end, acc, m_i, l_i, COMPUTE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    """One tile: scores `s` [rows, BLOCK_N] (log2 units) of keys ``start_n ...`` (those at or past `end`
    masked), values `v` [BLOCK_N, D]; returns the updated (acc [rows, D], running max, running sum)."""
    valid = (start_n + tl.arange(0, BLOCK_N)) < end
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, row_max(s))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + row_sum(p)
    acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def store_partial(Mid_O, Mid_LSE, acc, m_i, l_i, b, heads, split, cols, row_mask, col_mask,
                  stride_mo_b, stride_mo_h, stride_mo_s, stride_ml_b, stride_ml_h):
    """Write rows `heads` of the partial output ``acc / l`` (columns `cols`) and their log2-sum-exp."""
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.math.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    mo = Mid_O + b * stride_mo_b + heads[:, None] * stride_mo_h + split * stride_mo_s + cols[None, :]
    tl.store(mo, out, mask=row_mask[:, None] & col_mask[None, :])
    tl.store(Mid_LSE + b * stride_ml_b + heads * stride_ml_h + split, lse, mask=row_mask)
