"""The pool-layout question: does the page-major pool (one page holds every layer) slow decode attention?

The pool is ``[pages, layers, 2, kv_heads, page_size, head_dim]`` (`engine/kv/pool.py`). A layer's K of one
page is a contiguous tile, but consecutive pages of one layer lie ``layers * 2 * kv_heads * page_size *
head_dim`` bytes apart, so a 32-layer pool of ~50 GiB spreads one layer's reads over the whole allocation
(more TLB misses, less DRAM page locality) where a 1-layer pool packs them. This part times the FP8 decode
kernel on the middle layer of a 32-layer ~50 GiB pool and on a 1-layer pool with the same number of pages,
at page sizes 16 and 64, Llama-3.1-8B's per-layer shape, the same scattered pages.
"""

from __future__ import annotations

import torch

from pd_cluster.bench.scripts.gpu_attention import K_SCALE, V_SCALE, Shape
from pd_cluster.bench.scripts.gpu_common import Ceilings, Row, Section, bench_ms, pct
from pd_cluster.engine.attention.triton.decode import (DecodeKernelConfig, DecodeWorkspace, decode_attention,
                                                       max_splits_for, num_kv_splits)
from pd_cluster.engine.kv.pool import KVLayout, KVPool

POOL_GIB = 50


def _pool(shape: Shape, layers: int, page: int, num_pages: int, device: torch.device) -> KVPool:
    scales = (K_SCALE,) * layers
    layout = KVLayout(layers, shape.num_kv_heads, shape.head_dim, page, "fp8_e4m3", scales, scales)
    return KVPool(layout, num_pages, device, torch.bfloat16)


def _fill(pool: KVPool, pages: torch.Tensor) -> None:
    """Random FP8 codes in the pages the batch reads (the rest of the pool stays as allocated)."""
    for lo in range(0, pages.numel(), 256):
        idx = pages[lo:lo + 256].to(pool.device, torch.long)
        shape = (idx.numel(), *pool.kv.shape[1:])
        pool.kv[idx] = torch.randn(shape, device=pool.device).to(torch.float8_e4m3fn).view(torch.uint8)


def _time(pool: KVPool, layer: int, shape: Shape, bsz: int, ctx: int, cfg: DecodeKernelConfig, num_sms: int,
          device: torch.device, gen: torch.Generator) -> float:
    page = pool.page_size
    per = -(-ctx // page)
    tables = (torch.randperm(pool.num_pages, generator=gen)[:bsz * per] + 1).view(bsz, per).to(torch.int32)
    _fill(pool, tables.flatten())
    tables, seq = tables.to(device), torch.full((bsz,), ctx, dtype=torch.int32, device=device)
    s = max_splits_for(bsz, shape.num_kv_heads, num_sms, cfg)
    mid_o = torch.empty(bsz, shape.num_heads, s, shape.head_dim, device=device)
    ws = DecodeWorkspace(num_kv_splits(seq, s, cfg), mid_o, torch.empty(bsz, shape.num_heads, s, device=device), s)
    q = torch.randn(bsz, shape.num_heads, shape.head_dim, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    k_cache, v_cache = pool.layer_cache(layer)
    return bench_ms(lambda: decode_attention(q, k_cache, v_cache, tables, seq, out, ws, shape.head_dim ** -0.5,
                                             K_SCALE, V_SCALE, cfg), device)


def layout_table(device, ceil: Ceilings, cfg: DecodeKernelConfig, num_sms: int, smoke: bool) -> Section:
    shape = Shape() if not smoke else Shape(4, 2, 32)
    bsz, ctx = (64, 2048) if not smoke else (2, 64)
    budget = POOL_GIB * 2**30 if not smoke else 4 * 2**20
    sec = Section(f"Pool layout: decode attention on a 32-layer ~{POOL_GIB} GiB pool vs a 1-layer pool "
                  f"(batch {bsz}, context {ctx}, FP8)",
                  ["page size", "layers in pool", "pool GiB", "time (us)", "GB/s", "% of copy BW", "vs 1 layer"])
    gen = torch.Generator().manual_seed(3)
    kv_bytes = 2 * bsz * ctx * shape.num_kv_heads * shape.head_dim
    for page in (16, 64):
        page_bytes_32 = 32 * 2 * shape.num_kv_heads * page * shape.head_dim
        num_pages = max(budget // page_bytes_32, bsz * -(-ctx // page) + 1)
        times = {}
        for layers in (1, 32):
            pool = _pool(shape, layers, page, num_pages, device)
            ms = _time(pool, layers // 2, shape, bsz, ctx, cfg, num_sms, device, gen)
            times[layers] = ms
            gbps = kv_bytes / (ms * 1e-3) / 1e9
            sec.rows.append(Row([page, layers, pool.kv.numel() / 2**30, ms * 1e3, gbps, pct(gbps, ceil.copy_gbps),
                                 ms / times[1]]))
            del pool
            if device.type == "cuda":
                torch.cuda.empty_cache()
    sec.notes += [
        "Both pools have the same number of pages (the 32-layer one sized to the budget); the decode reads the "
        "middle layer of the 32-layer pool. GB/s counts each K/V byte once (FP8: 1 byte).",
        "A 'vs 1 layer' well above 1.0 at page 16 but not at 64 would favour page 64 (or a layer-major pool) for "
        "long-context decode; near 1.0 everywhere keeps the one-region page-major layout NIXL transfers rely on.",
    ]
    return sec
