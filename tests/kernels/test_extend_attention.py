"""Prefill / extend attention (chunk over cached pages plus itself, causally) against the float64 reference.

Grid: page sizes 1/16/64, GQA ratios 1/4/8, fp16/fp32 activations over fp16
and FP8 pages (every combination on a GPU, every pair of them under the interpreter:
`kernel_cases.kernel_grid`), ragged chunks (fresh prompts, chunks after a cached prefix,
one-token chunks), a sliding window. Bounds: `kernel_cases.REL_ERR_BOUND`.
"""

from __future__ import annotations

import pytest
import torch

from pd_cluster.engine.attention.triton.extend import ExtendKernelConfig, extend_attention
from kernel_cases import REL_ERR_BOUND, kernel_grid, make_batch, make_pool, random_q, reference_attention, rel_err

HEAD_DIM = 32
# (cached tokens, new tokens) per request: a fresh prompt over two query blocks, chunks after a
# cached prefix, a one-token chunk
SPECS = [(0, 24), (40, 17), (5, 1), (64, 20)]


def _kv_heads(group: int) -> int:
    return 1 if group >= 8 else 2  # keeps the interpreter's program count down


def _run(page_size: int, group: int, act: torch.dtype, kv, cfg: ExtendKernelConfig, specs=SPECS,
         num_decodes: int = 0, head_dim: int = HEAD_DIM, window: int | None = None, seed: int = 0) -> float:
    gen = torch.Generator().manual_seed(seed)
    num_kv_heads = _kv_heads(group)
    num_heads = num_kv_heads * group
    num_pages = sum(-(-(c + n) // page_size) for c, n in specs) + 2
    pool = make_pool(kv, num_kv_heads, head_dim, page_size, num_pages, act, gen)
    batch = make_batch(specs, num_decodes, page_size, num_pages, gen)
    q = random_q(batch.num_tokens, num_heads, head_dim, act, gen)
    out = torch.full_like(q, float("nan"))
    layer = 0
    k_cache, v_cache = pool.layer_cache(layer)
    k_scale, v_scale = pool.layer_scales(layer)
    scale = head_dim ** -0.5
    nd = num_decodes
    max_q = max(batch.query_lens_cpu[nd:])
    extend_attention(q, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, out,
                     nd, batch.num_reqs - nd, max_q, scale, k_scale, v_scale, cfg, window)
    first_row = batch.query_start_loc_cpu[nd]
    assert torch.isnan(out[:first_row]).all(), "wrote rows of requests it was not given"
    assert not torch.isnan(out[first_row:]).any(), "output not fully written"
    ref = reference_attention(pool, layer, q, batch, num_heads, num_kv_heads, head_dim, scale, window)
    return rel_err(out[first_row:].reshape(-1, num_heads * head_dim), ref[first_row:])


@pytest.mark.parametrize("page_size,block_m,block_n,group,act,kv", kernel_grid(
    {"1-16-32": (1, 16, 32), "16-16-32": (16, 16, 32), "64-32-16": (64, 32, 16)}, {"1": 1, "4": 4, "8": 8},
    {"fp16": torch.float16, "fp32": torch.float32}, {"fp16kv": torch.float16, "fp8kv": "fp8"}))
def test_extend_matches_reference(page_size, block_m, block_n, group, act, kv):
    cfg = ExtendKernelConfig(block_m=block_m, block_n=block_n)
    err = _run(page_size, group, act, kv, cfg, seed=page_size + group)
    assert err <= REL_ERR_BOUND[act], f"relative error {err:.3e}"


def test_extend_after_decodes_in_mixed_batch():
    """Requests [:num_decodes] belong to the decode kernel: the extend kernel must leave their rows alone."""
    cfg = ExtendKernelConfig(block_m=16, block_n=16)
    specs = [(30, 1), (9, 1), (0, 20), (17, 35)]
    err = _run(16, 4, torch.float16, "fp8", cfg, specs=specs, num_decodes=2, seed=5)
    assert err <= REL_ERR_BOUND[torch.float16], f"relative error {err:.3e}"


@pytest.mark.parametrize("page_size,block_n", [(1, 16), (16, 16), (64, 32)])
def test_extend_sliding_window(page_size, block_n):
    cfg = ExtendKernelConfig(block_m=16, block_n=block_n)
    err = _run(page_size, 4, torch.float32, "fp8", cfg, window=20, seed=9)
    assert err <= REL_ERR_BOUND[torch.float32], f"relative error {err:.3e}"


@pytest.mark.parametrize("page_size,block_m,block_n", [(1, 16, 32), (16, 16, 32), (64, 32, 16)])
def test_extend_bf16_activations_fp8_pages(page_size, block_m, block_n):
    """bf16 queries over FP8 pages run their dots in fp16, so the interpreter can check them too."""
    err = _run(page_size, 4, torch.bfloat16, "fp8", ExtendKernelConfig(block_m=block_m, block_n=block_n), seed=23)
    assert err <= REL_ERR_BOUND[torch.bfloat16], f"relative error {err:.3e}"


@pytest.mark.parametrize("head_dim", [8, 40])
def test_extend_padded_head_dim(head_dim):
    cfg = ExtendKernelConfig(block_m=16, block_n=16)
    err = _run(16, 2, torch.float16, "fp8", cfg, specs=[(0, 19), (23, 9)], head_dim=head_dim, seed=head_dim)
    assert err <= REL_ERR_BOUND[torch.float16], f"relative error {err:.3e}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv", [torch.bfloat16, "fp8"], ids=["bf16kv", "fp8kv"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_extend_bf16_on_gpu(page_size, kv):
    """bf16 activations, at the GPU launch settings (interpreter: no bf16 tl.dot, triton #11584)."""
    specs = [(0, 300), (1000, 129), (64, 1), (7, 517)]
    err = _run(page_size, 4, torch.bfloat16, kv, ExtendKernelConfig(), specs=specs, head_dim=128, seed=13)
    assert err <= REL_ERR_BOUND[torch.bfloat16], f"relative error {err:.3e}"
