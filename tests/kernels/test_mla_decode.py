"""The paged MLA decode kernel (absorbed form) and the latent store against the float64 torch reference.

Runs under Triton's interpreter on CPU (fp16 and fp32 compute; the interpreter
has no bf16 `tl.dot`) and compiled on a GPU. Grid: page sizes 1/16/64, 4, 16 and
20 query heads (20: a partial head block), fp16/fp32 activations over fp16, fp32
and FP8 latent pages (FP8 with a scale other than 1; the main grid's every combination on a GPU, every pair under
the interpreter: `kernel_cases.kernel_grid`), ragged batches with several
splits per request, a request of length 0, and DeepSeek-V3's own latent (512 + 64).
Bounds: `kernel_cases.REL_ERR_BOUND`, per request row.
"""

from __future__ import annotations

import pytest
import torch

from pd_cluster.engine.attention.mla import TorchMLABackend
from pd_cluster.engine.attention.triton.decode import DecodeKernelConfig, DecodeWorkspace, max_splits_for, num_kv_splits
from pd_cluster.engine.attention.triton.mla_decode import mla_decode_attention, mla_head_blocks
from pd_cluster.engine.attention.triton.store import store_kv
from pd_cluster.engine.kv.pool import KVLayout, KVPool
from kernel_cases import KV_DTYPE_NAME, REL_ERR_BOUND, device, kernel_grid, make_batch, rel_err

NUM_SMS = 8
SPLIT_CFG = dict(max_kv_splits=4, min_tokens_per_split=16, programs_per_sm=4)
LATENT_SCALE = 0.75  # FP8 pages: the latent's per-layer scale is not 1, so its folding is exercised


def _pool(kv, rank: int, rope: int, page_size: int, num_pages: int, act: torch.dtype,
          gen: torch.Generator) -> KVPool:
    """An MLA pool (2 layers) whose every page, the null page included, holds random latents; the null page's
    are large (8.0), so a kernel that attends to padding is visibly wrong."""
    name = KV_DTYPE_NAME[kv]
    scales = (LATENT_SCALE, LATENT_SCALE) if name == "fp8_e4m3" else (1.0, 1.0)
    layout = KVLayout(2, 1, rank + rope, page_size, name, scales, (1.0, 1.0), kv_format="mla")
    pool = KVPool(layout, num_pages, device(), act)
    slots = torch.arange(page_size, (num_pages + 1) * page_size, device=pool.device)
    for layer in range(2):
        lat = torch.randn(slots.numel(), rank + rope, generator=gen).to(pool.device)
        pool.store_latent(layer, lat, slots)
        pool.store_latent(layer, torch.full((page_size, rank + rope), 8.0, device=pool.device),
                          torch.arange(page_size, device=pool.device))
    return pool


def _reference(pool: KVPool, layer: int, q: torch.Tensor, batch, rank: int, scale: float) -> torch.Tensor:
    """`TorchMLABackend.decode` over the same pool bytes in float64: [B, H, rank]."""
    ref_pool = KVPool(pool.layout, pool.num_pages, pool.device, torch.float64)
    ref_pool.kv.copy_(pool.kv)
    backend = TorchMLABackend(q.shape[1], rank, 8, pool.layout.head_dim - rank, 8, scale)
    return backend.decode(layer, q.double(), ref_pool, batch)


def _run(page_size: int, heads: int, act: torch.dtype, kv, seq_lens: list[int], rank: int = 64, rope: int = 16,
         block_n: int = 16, seed: int = 0) -> tuple[float, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-n // page_size) for n in seq_lens) + 2
    pool = _pool(kv, rank, rope, page_size, num_pages, act, gen)
    batch = make_batch([(max(n - 1, 0), 1) for n in seq_lens], len(seq_lens), page_size, num_pages, gen)
    if 0 in seq_lens:  # a request with nothing to attend to
        batch.seq_lens[torch.tensor(seq_lens) == 0] = 0
    q = torch.randn(len(seq_lens), heads, rank + rope, generator=gen).to(device=device(), dtype=act)
    cfg = DecodeKernelConfig(block_n=block_n, **SPLIT_CFG)
    s = max_splits_for(len(seq_lens), mla_head_blocks(heads), NUM_SMS, cfg)
    nan = float("nan")
    ws = DecodeWorkspace(num_kv_splits(batch.seq_lens, s, cfg),
                         torch.full((len(seq_lens), heads, s, rank), nan, device=q.device),
                         torch.full((len(seq_lens), heads, s), nan, device=q.device), s)
    out = torch.full((len(seq_lens), heads, rank), nan, dtype=act, device=q.device)  # poisoned
    layer, scale = 1, (rank + rope) ** -0.5
    mla_decode_attention(q, pool.latent_cache(layer), batch.block_tables, batch.seq_lens, out, ws, rank, scale,
                         pool.layer_scales(layer)[0], cfg)
    assert not torch.isnan(out).any(), "output not fully written"
    return rel_err(out, _reference(pool, layer, q, batch, rank, scale)), ws.num_splits


@pytest.mark.parametrize("page_size,block_n,heads,act,kv", kernel_grid(
    {"1-16": (1, 16), "16-16": (16, 16), "64-32": (64, 32)}, {"4": 4, "20": 20}, {"fp16": torch.float16, "fp32": torch.float32}, {"fp16kv": torch.float16, "fp8kv": "fp8"}))
def test_mla_decode_matches_reference(page_size, block_n, heads, act, kv):
    err, splits = _run(page_size, heads, act, kv, [1, 17, 100, 64], block_n=block_n)
    assert err <= REL_ERR_BOUND[act], err
    assert int(splits.max()) > 1  # some request's context is split over several programs


def test_fp32_pages_and_a_request_with_no_context():
    err, _ = _run(16, 16, torch.float32, torch.float32, [0, 33, 5])
    assert err <= REL_ERR_BOUND[torch.float32], err


@pytest.mark.parametrize("act", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_deepseek_v3_latent_shape(act):
    """kv_lora_rank 512 + qk_rope_head_dim 64 over FP8 pages, 16 heads (V3 at TP 8)."""
    err, _ = _run(64, 16, act, "fp8", [70, 129], rank=512, rope=64, block_n=32)
    assert err <= REL_ERR_BOUND[act], err


def test_kernel_error_is_visible():
    """The check can fail: a wrong scale is far outside every bound."""
    gen = torch.Generator().manual_seed(3)
    pool = _pool(torch.float32, 64, 16, 16, 8, torch.float32, gen)
    batch = make_batch([(40, 1)], 1, 16, 8, gen)
    q = torch.randn(1, 4, 80, generator=gen).to(device())
    cfg = DecodeKernelConfig(block_n=16, **SPLIT_CFG)
    s = max_splits_for(1, 1, NUM_SMS, cfg)
    ws = DecodeWorkspace(num_kv_splits(batch.seq_lens, s, cfg), torch.empty(1, 4, s, 64, device=q.device),
                         torch.empty(1, 4, s, device=q.device), s)
    out = torch.empty(1, 4, 64, device=q.device)
    mla_decode_attention(q, pool.latent_cache(1), batch.block_tables, batch.seq_lens, out, ws, 64, 0.2, 1.0, cfg)
    assert rel_err(out, _reference(pool, 1, q, batch, 64, 0.1)) > 1e-2


@pytest.mark.parametrize("kv", [torch.float16, torch.float32, "fp8"], ids=["fp16", "fp32", "fp8"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_latent_store_equals_pool_store(kv, page_size):
    """The store kernel with one plane (``v=None``) writes what `KVPool.store_latent` writes, bit for bit.
    FP8 inputs are exact FP8 codes times the scale (the interpreter's fp8 cast rounds differently: triton #8322)."""
    gen = torch.Generator().manual_seed(1)
    name = KV_DTYPE_NAME[kv]
    fp8 = name == "fp8_e4m3"
    scale = LATENT_SCALE if fp8 else 1.0
    layout = KVLayout(2, 1, 80, page_size, name, (scale, scale), (1.0, 1.0), kv_format="mla")
    pools = [KVPool(layout, 24, device(), torch.float32) for _ in range(2)]
    slots = torch.randperm(24 * page_size, generator=gen)[:20].to(device()) + page_size
    slots[3] = -1  # padding: skipped
    lat = torch.randn(20, 80, generator=gen).to(device())
    if fp8:
        lat = lat.clamp(-400, 400).to(torch.float8_e4m3fn).float() * scale
    pools[0].store_latent(1, lat, slots)
    store_kv(lat.unsqueeze(1), None, pools[1].latent_cache(1).unsqueeze(1), None, slots, scale, 1.0)
    assert torch.equal(pools[0].kv[1:], pools[1].kv[1:])  # (the torch store drops padding into the null page)
    assert not pools[1].kv[0].any(), "the padded slot wrote into the null page"
    assert pools[1].kv[:, 1].any() and not pools[1].kv[:, 0].any()  # layer 1 only
