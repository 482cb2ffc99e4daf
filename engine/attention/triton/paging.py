"""Reading one tile of K or V through a block table (shared by the decode and extend kernels).

A pool page holds, per KV head, a contiguous ``page_size x head_dim`` tile
(`pd_cluster.engine.kv.pool`). A tile of ``BLOCK_N`` tokens starting at position
``start`` is found in one of two ways:

* ``PAGE_ALIGNED`` (``page_size % BLOCK_N == 0`` and ``start % BLOCK_N == 0``):
  the whole tile lies in one page, so one block-table entry is read and the
  tile is one contiguous ``BLOCK_N x head_dim`` run of memory;
* otherwise each token's page is looked up (page sizes 1 and 16, or unaligned
  sliding-window starts).

Page ids are widened to int64 before they are multiplied by the page stride
(a pool can exceed 2**31 elements).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_kv_tile(cache, bt_row, start, end, kv_head, stride_p, stride_h, stride_t, d, d_mask,
                 PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_ALIGNED: tl.constexpr,
                 PAD_D: tl.constexpr):
    """Load K or V of tokens ``[start, start + BLOCK_N)`` (those ``< end``) as [BLOCK_N, BLOCK_D].

    Tokens at or past `end` and padded head dimensions read as 0. Without head
    padding (`PAD_D` false) the mask is constant along the head dimension, so
    the loads stay vectorised.
    """
    pos = start + tl.arange(0, BLOCK_N)
    valid = pos < end
    if PAGE_ALIGNED:
        page = tl.load(bt_row + start // PAGE_SIZE).to(tl.int64)
        tok = (start % PAGE_SIZE + tl.arange(0, BLOCK_N)).to(tl.int64)
        base = cache + page * stride_p + kv_head * stride_h
        ptrs = base + tok[:, None] * stride_t + d[None, :]
    else:
        page = tl.load(bt_row + pos // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
        row = page * stride_p + kv_head * stride_h + (pos % PAGE_SIZE).to(tl.int64) * stride_t
        ptrs = cache + row[:, None] + d[None, :]
    if PAD_D:
        mask = valid[:, None] & d_mask[None, :]
    else:
        mask = valid[:, None]
    return tl.load(ptrs, mask=mask, other=0.0)
