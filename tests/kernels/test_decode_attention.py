"""Paged decode attention (flash-decoding, grouped heads) against the float64 torch reference.

Runs under Triton's interpreter on CPU (the package sets TRITON_INTERPRET=1
there) and compiled on a GPU. Grid: page sizes 1/16/64, GQA ratios 1/4/8,
fp16/fp32 activations over fp16 and FP8 pages (every combination on a GPU, every
pair of them under the interpreter: `kernel_cases.kernel_grid`), ragged batches, several splits
per request (including empty ones). Bounds: `kernel_cases.REL_ERR_BOUND`.
"""

from __future__ import annotations

import pytest
import torch

from pd_cluster.engine.attention.triton.decode import (DecodeKernelConfig, DecodeWorkspace, decode_attention, max_splits_for,
                                            num_kv_splits)
from kernel_cases import (REL_ERR_BOUND, device, kernel_grid, make_batch, make_pool, random_q,
                          reference_attention, rel_err)

NUM_KV_HEADS = 2
HEAD_DIM = 32
# small splits so that short contexts still split: grid axis = min(4, ceil(4 * 8 / (B * Hkv)))
SPLIT_CFG = dict(max_kv_splits=4, min_tokens_per_split=16, programs_per_sm=4)
NUM_SMS = 8


def _workspace(seq_lens: torch.Tensor, num_heads: int, head_dim: int, cfg: DecodeKernelConfig) -> DecodeWorkspace:
    bsz = seq_lens.shape[0]
    s = max_splits_for(bsz, NUM_KV_HEADS, NUM_SMS, cfg)
    nan = float("nan")
    return DecodeWorkspace(num_kv_splits(seq_lens, s, cfg),
                           torch.full((bsz, num_heads, s, head_dim), nan, device=seq_lens.device),
                           torch.full((bsz, num_heads, s), nan, device=seq_lens.device), s)


def _run(page_size: int, group: int, act: torch.dtype, kv, block_n: int, seq_lens: list[int],
         head_dim: int = HEAD_DIM, window: int | None = None, seed: int = 0) -> tuple[float, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    num_heads = NUM_KV_HEADS * group
    num_pages = sum(-(-n // page_size) for n in seq_lens) + 2
    pool = make_pool(kv, NUM_KV_HEADS, head_dim, page_size, num_pages, act, gen)
    batch = make_batch([(n - 1, 1) for n in seq_lens], len(seq_lens), page_size, num_pages, gen)
    q = random_q(len(seq_lens), num_heads, head_dim, act, gen)
    cfg = DecodeKernelConfig(block_n=block_n, **SPLIT_CFG)
    ws = _workspace(batch.seq_lens, num_heads, head_dim, cfg)
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    layer = 1
    k_cache, v_cache = pool.layer_cache(layer)
    k_scale, v_scale = pool.layer_scales(layer)
    scale = head_dim ** -0.5
    decode_attention(q, k_cache, v_cache, batch.block_tables, batch.seq_lens, out, ws, scale, k_scale, v_scale,
                     cfg, window)
    assert not torch.isnan(out).any(), "output not fully written"
    ref = reference_attention(pool, layer, q, batch, num_heads, NUM_KV_HEADS, head_dim, scale, window)
    return rel_err(out.view(len(seq_lens), -1), ref), ws.num_splits


@pytest.mark.parametrize("page_size,block_n,group,act,kv", kernel_grid(
    {"1-32": (1, 32), "16-16": (16, 16), "64-32": (64, 32)}, {"1": 1, "4": 4, "8": 8},
    {"fp16": torch.float16, "fp32": torch.float32}, {"fp16kv": torch.float16, "fp8kv": "fp8"}))
def test_decode_matches_reference(page_size, block_n, group, act, kv):
    seq_lens = [1, 37, 130, 77]  # ragged; 37 with block_n 32 leaves an empty split
    err, splits = _run(page_size, group, act, kv, block_n, seq_lens, seed=page_size * 100 + group)
    assert err <= REL_ERR_BOUND[act], f"relative error {err:.3e}"
    assert splits.tolist() == [1, 3, 4, 4]


@pytest.mark.parametrize("page_size,block_n", [(1, 32), (16, 16), (64, 32)])
def test_decode_bf16_activations_fp8_pages(page_size, block_n):
    """bf16 queries over FP8 pages: the dots run in fp16 (FP8 and bf16 values are exact there), so this
    case runs under the interpreter too."""
    err, _ = _run(page_size, 4, torch.bfloat16, "fp8", block_n, [1, 37, 130, 77], seed=21)
    assert err <= REL_ERR_BOUND[torch.bfloat16], f"relative error {err:.3e}"


@pytest.mark.parametrize("head_dim", [8, 40])
def test_decode_padded_head_dim(head_dim):
    err, _ = _run(16, 2, torch.float16, "fp8", 16, [5, 70], head_dim=head_dim, seed=head_dim)
    assert err <= REL_ERR_BOUND[torch.float16], f"relative error {err:.3e}"


@pytest.mark.parametrize("page_size,block_n", [(1, 16), (16, 16), (64, 32)])
def test_decode_sliding_window(page_size, block_n):
    err, _ = _run(page_size, 4, torch.float32, "fp8", block_n, [3, 50, 129], window=24, seed=7)
    assert err <= REL_ERR_BOUND[torch.float32], f"relative error {err:.3e}"


def test_split_counts_on_device():
    cfg = DecodeKernelConfig(max_kv_splits=8, min_tokens_per_split=100)
    seq = torch.tensor([0, 1, 100, 101, 5000], dtype=torch.int32, device=device())
    assert num_kv_splits(seq, 8, cfg).tolist() == [1, 1, 1, 2, 8]
    assert num_kv_splits(seq, 3, cfg).tolist() == [1, 1, 1, 2, 3]
    assert num_kv_splits(seq, 8, cfg, sliding_window=150).tolist() == [1, 1, 1, 2, 2]
    buf = torch.zeros(5, dtype=torch.int32, device=device())
    assert num_kv_splits(seq, 8, cfg, out=buf) is buf and buf.tolist() == [1, 1, 1, 2, 8]


def test_zero_length_slot_gives_zero_row():
    """A padded batch slot (seq_len 0, null-page block table) must write zeros, not NaN, and read nothing."""
    gen = torch.Generator().manual_seed(3)
    pool = make_pool("fp8", NUM_KV_HEADS, HEAD_DIM, 16, 8, torch.float16, gen)
    q = random_q(3, 8, HEAD_DIM, torch.float16, gen)
    tables = torch.zeros(3, 2, dtype=torch.int32, device=device())
    tables[1] = torch.tensor([3, 5])
    seq_lens = torch.tensor([0, 20, 0], dtype=torch.int32, device=device())
    cfg = DecodeKernelConfig(block_n=16, **SPLIT_CFG)
    ws = _workspace(seq_lens, 8, HEAD_DIM, cfg)
    out = torch.full_like(q, float("nan"))
    k_cache, v_cache = pool.layer_cache(0)
    decode_attention(q, k_cache, v_cache, tables, seq_lens, out, ws, HEAD_DIM ** -0.5, *pool.layer_scales(0), cfg)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[2], torch.zeros_like(out[2]))
    assert torch.isfinite(out[1]).all() and out[1].abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv", [torch.bfloat16, "fp8"], ids=["bf16kv", "fp8kv"])
@pytest.mark.parametrize("page_size,block_n", [(1, 32), (16, 64), (64, 64)])
def test_decode_bf16_on_gpu(page_size, block_n, kv):
    """bf16 activations: the interpreter multiplies bf16 bit patterns in tl.dot (triton #11584), so GPU only."""
    err, _ = _run(page_size, 4, torch.bfloat16, kv, block_n, [1, 300, 2049, 77], seed=11)
    assert err <= REL_ERR_BOUND[torch.bfloat16], f"relative error {err:.3e}"
