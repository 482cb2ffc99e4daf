"""Per-layer attention types in the Triton kernels, against the float64 torch reference on the same pool bytes:
chunked local attention (a query sees only its own chunk), attention sinks (gpt-oss) and soft-capped logits
(Gemma 2), alone and together, in the decode kernel (both stages: sinks join at the split merge), the extend
kernel (query blocks that straddle a chunk boundary, chunks after a cached prefix) and the backend's forward with
a different type on every layer. fp16 and fp32 activations (every combination with the types on a GPU, every pair under the interpreter:
`kernel_cases.kernel_grid`); bounds `REL_ERR_BOUND`."""

from __future__ import annotations

import pytest
import torch

from pd_cluster.engine.attention.torch_ref import TorchAttentionBackend
from pd_cluster.engine.attention.triton.decode import DecodeKernelConfig, DecodeWorkspace, decode_attention, \
    max_splits_for, num_kv_splits
from pd_cluster.engine.attention.triton.extend import ExtendKernelConfig, extend_attention
from pd_cluster.engine.attention.triton_backend import TritonAttentionBackend, TritonAttentionConfig
from pd_cluster.engine.kv.pool import KVPool
from pd_cluster.engine.layer_attention import LayerAttention
from kernel_cases import REL_ERR_BOUND, device, kernel_grid, make_batch, make_pool, random_q, reference_attention, \
    rel_err

HKV, D = 2, 32
CHUNK = LayerAttention("chunked", chunk_size=24)
SINKS = LayerAttention("full", sinks=True)
SOFTCAP = LayerAttention("full", logit_softcap=2.0)
ALL = LayerAttention("chunked", chunk_size=16, sinks=True, logit_softcap=3.0)
WINDOW_SINKS = LayerAttention("sliding", window=20, sinks=True)
SPECS = {"chunk": CHUNK, "sinks": SINKS, "softcap": SOFTCAP, "chunk+sinks+softcap": ALL,
         "window+sinks": WINDOW_SINKS}
SPLIT_CFG = DecodeKernelConfig(block_n=16, max_kv_splits=4, min_tokens_per_split=16, programs_per_sm=4)


def _sinks(num_heads: int, gen: torch.Generator) -> torch.Tensor:
    return (2.0 * torch.randn(num_heads, generator=gen)).to(device())


def _kw(spec: LayerAttention, sinks: torch.Tensor) -> dict:
    return dict(sliding_window=spec.window, chunk_size=spec.chunk_size, sinks=sinks if spec.sinks else None,
                softcap=spec.logit_softcap)


@pytest.mark.parametrize("name,page_size,act", kernel_grid(
    {n: n for n in sorted(SPECS)}, {"1": 1, "16": 16}, {"fp16": torch.float16, "fp32": torch.float32}))
def test_decode_attention_types(name, page_size, act):
    spec = SPECS[name]
    gen = torch.Generator().manual_seed(page_size + len(name))
    group = 4
    num_heads = HKV * group
    seq_lens = [1, 23, 24, 25, 77, 130]  # a chunk's last and first token, several chunks, empty splits
    num_pages = sum(-(-n // page_size) for n in seq_lens) + 2
    pool = make_pool("fp8", HKV, D, page_size, num_pages, act, gen)
    batch = make_batch([(n - 1, 1) for n in seq_lens], len(seq_lens), page_size, num_pages, gen)
    q = random_q(len(seq_lens), num_heads, D, act, gen)
    sinks = _sinks(num_heads, gen)
    s = max_splits_for(len(seq_lens), HKV, 8, SPLIT_CFG)
    ws = DecodeWorkspace(num_kv_splits(batch.seq_lens, s, SPLIT_CFG),
                         torch.full((len(seq_lens), num_heads, s, D), float("nan"), device=device()),
                         torch.full((len(seq_lens), num_heads, s), float("nan"), device=device()), s)
    out = torch.full_like(q, float("nan"))
    k_cache, v_cache = pool.layer_cache(1)
    k_scale, v_scale = pool.layer_scales(1)
    decode_attention(q, k_cache, v_cache, batch.block_tables, batch.seq_lens, out, ws, D ** -0.5, k_scale, v_scale,
                     SPLIT_CFG, **_kw(spec, sinks))
    assert not torch.isnan(out).any()
    ref = reference_attention(pool, 1, q, batch, num_heads, HKV, D, D ** -0.5, spec=spec, sinks=sinks)
    err = rel_err(out.view(len(seq_lens), -1), ref)
    assert err <= REL_ERR_BOUND[act], f"relative error {err:.3e}"


@pytest.mark.parametrize("name,page_size,block_m,block_n,act", kernel_grid(
    {n: n for n in sorted(SPECS)}, {"1-16-16": (1, 16, 16), "16-32-16": (16, 32, 16)}, {"fp16": torch.float16, "fp32": torch.float32}))
def test_extend_attention_types(name, page_size, block_m, block_n, act):
    spec = SPECS[name]
    gen = torch.Generator().manual_seed(page_size + block_m + len(name))
    group = 2
    num_heads = HKV * group
    # (cached, new): a fresh prompt over several chunks, a chunk from a chunk's middle, one token on a chunk
    # boundary, a long chunk after a long prefix
    specs = [(0, 50), (10, 30), (48, 1), (70, 33)]
    num_pages = sum(-(-(c + n) // page_size) for c, n in specs) + 2
    pool = make_pool("fp8", HKV, D, page_size, num_pages, act, gen)
    batch = make_batch(specs, 0, page_size, num_pages, gen)
    q = random_q(batch.num_tokens, num_heads, D, act, gen)
    sinks = _sinks(num_heads, gen)
    out = torch.full_like(q, float("nan"))
    k_cache, v_cache = pool.layer_cache(0)
    k_scale, v_scale = pool.layer_scales(0)
    cfg = ExtendKernelConfig(block_m=block_m, block_n=block_n)
    extend_attention(q, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, out, 0,
                     batch.num_reqs, max(batch.query_lens_cpu), D ** -0.5, k_scale, v_scale, cfg, **_kw(spec, sinks))
    assert not torch.isnan(out).any()
    ref = reference_attention(pool, 0, q, batch, num_heads, HKV, D, D ** -0.5, spec=spec, sinks=sinks)
    err = rel_err(out.reshape(batch.num_tokens, -1), ref)
    assert err <= REL_ERR_BOUND[act], f"relative error {err:.3e}"


def test_backend_forward_a_different_type_per_layer():
    """One step (decodes and prefill chunks) through four layers of four types: each layer's output matches the
    reference backend given the same layer description, and the pools end byte-identical."""
    layers = (CHUNK, SINKS, SOFTCAP, WINDOW_SINKS)
    gen = torch.Generator().manual_seed(11)
    group, page_size = 4, 16
    num_heads = HKV * group
    specs = [(40, 1), (23, 1), (0, 37), (30, 19)]
    num_pages = sum(-(-(c + n) // page_size) for c, n in specs) + 2
    pool = make_pool(torch.float32, HKV, D, page_size, num_pages, torch.float32, gen, num_layers=len(layers))
    ref_pool = KVPool(pool.layout, pool.num_pages, pool.device, torch.float64)
    ref_pool.kv.copy_(pool.kv)
    batch = make_batch(specs, 2, page_size, num_pages, gen)
    config = TritonAttentionConfig(decode=SPLIT_CFG, extend=ExtendKernelConfig(block_m=16, block_n=16), num_sms=8)
    tri = TritonAttentionBackend(num_heads, HKV, D, D ** -0.5, config=config, layers=layers)
    ref = TorchAttentionBackend(num_heads, HKV, D, D ** -0.5, layers=layers)
    sinks = _sinks(num_heads, gen)
    for layer in range(len(layers)):
        q, k, v = (random_q(batch.num_tokens, h, D, torch.float32, gen) for h in (num_heads, HKV, HKV))
        out = tri.forward(layer, q, k, v, pool, batch, sinks=sinks)
        want = ref.forward(layer, q.double(), k.double(), v.double(), ref_pool, batch, sinks=sinks.double())
        assert rel_err(out, want) <= REL_ERR_BOUND[torch.float32], layers[layer]
    assert torch.equal(pool.kv, ref_pool.kv.to(pool.kv.dtype))
