"""The compiled CPU decode kernel equals the torch reference; the reference itself is exact end to end."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_reference import PROMPTS, hf_greedy

from pd_cluster.engine import LLM, SamplingParams
from pd_cluster.engine.attention import cpu_backend
from pd_cluster.engine.attention.cpu_backend import CpuAttentionBackend
from pd_cluster.engine.attention.torch_ref import TorchAttentionBackend
from pd_cluster.engine.batch import build_forward_batch
from pd_cluster.engine.kv.pool import KVLayout, KVPool

needs_kernel = pytest.mark.skipif(not cpu_backend.available(), reason="no C compiler for the CPU kernel")


def _decode_batch(page_size: int, kv_dtype: str, num_kv_heads: int, group: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    layers, head_dim = 3, 16
    layout = KVLayout(layers, num_kv_heads, head_dim, page_size, kv_dtype, (0.5, 1.5, 2.0), (2.0, 0.75, 1.0))
    lens = np.random.RandomState(seed).randint(1, 150, 37)  # ragged, includes length-1 requests
    lens[0] = 1
    need = sum(-(-int(n) // page_size) for n in lens)
    pool = KVPool(layout, need + 8, "cpu", torch.float32)
    raw = torch.randn(pool.kv.shape, generator=gen) * 3
    pool.kv.copy_(raw.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8) if kv_dtype == "fp8_e4m3"
                  else raw.to(pool.kv.dtype))
    perm = (torch.randperm(need, generator=gen) + 1).tolist()  # pages scattered over the pool
    tables, at = [], 0
    for n in lens:
        k = -(-int(n) // page_size)
        tables.append(perm[at:at + k])
        at += k
    batch = build_forward_batch([np.array([7]) for _ in lens], [int(n) - 1 for n in lens], tables,
                                [np.array([0])] * len(lens), len(lens), page_size, torch.device("cpu"))
    hq = num_kv_heads * group
    q = torch.randn(len(lens), hq, head_dim, generator=gen)
    k = torch.randn(len(lens), num_kv_heads, head_dim, generator=gen)
    v = torch.randn(len(lens), num_kv_heads, head_dim, generator=gen)
    return pool, batch, q, k, v, hq, head_dim


@needs_kernel
@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "fp16", "fp8_e4m3"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("num_kv_heads, group", [(4, 1), (2, 4), (1, 8)])
def test_cpu_kernel_equals_torch_reference(kv_dtype, page_size, num_kv_heads, group):
    pool, batch, q, k, v, hq, d = _decode_batch(page_size, kv_dtype, num_kv_heads, group, seed=page_size + group)
    ref_pool = KVPool(pool.layout, pool.num_pages, "cpu", torch.float32)
    ref_pool.kv.copy_(pool.kv)
    for layer in range(3):
        ref = TorchAttentionBackend(hq, num_kv_heads, d, d ** -0.5).forward(layer, q, k, v, ref_pool, batch)
        out = torch.full_like(ref, float("nan"))  # poisoned: every row must be written
        out.copy_(CpuAttentionBackend(hq, num_kv_heads, d, d ** -0.5).forward(layer, q, k, v, pool, batch))
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(pool.kv, ref_pool.kv)  # both stored the step's K/V identically


@pytest.mark.parametrize("kv", ["fp32", "fp8_e4m3"])
def test_torch_reference_backend_exact_end_to_end(kv):
    llm = LLM(attention_backend="torch", kv_cache_dtype=kv, page_size=16, chunked_prefill_size=7)
    assert llm.engine.backend.name == "torch"
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        assert tuple(out.token_ids) == hf_greedy(prompt, 64, kv), prompt


@needs_kernel
def test_auto_backend_is_the_kernel_on_cpu():
    assert LLM().engine.backend.name == "cpu"


@needs_kernel
@pytest.mark.parametrize("kv_dtype", ["fp32", "fp8_e4m3"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_cpu_kernel_mixed_decode_and_prefill_chunks_equal_reference(kv_dtype, page_size):
    gen = torch.Generator().manual_seed(3)
    layout = KVLayout(2, 2, 16, page_size, kv_dtype, (0.5, 2.0), (1.5, 0.75))
    pool = KVPool(layout, 400, "cpu", torch.float32)
    ref_pool = KVPool(layout, 400, "cpu", torch.float32)
    # two decodes (cached 30 and 5 tokens) and two prefill chunks (a fresh 20-token prompt, and tokens 40..52)
    starts, qlens = [30, 5, 0, 40], [1, 1, 20, 13]
    tables, nxt = [], 1
    for s, n in zip(starts, qlens):
        k = -(-(s + n) // page_size)
        tables.append(list(range(nxt, nxt + k)))
        nxt += k
    raw = torch.randn(pool.kv.shape, generator=gen)  # the cached tokens already in the pool
    pool.kv.copy_(raw.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8) if kv_dtype == "fp8_e4m3"
                  else raw.to(pool.kv.dtype))
    ref_pool.kv.copy_(pool.kv)
    batch = build_forward_batch([np.arange(n) + 3 for n in qlens], starts, tables,
                                [np.arange(n) for n in qlens], 2, page_size, torch.device("cpu"))
    t = sum(qlens)
    q, k, v = (torch.randn(t, h, 16, generator=gen) for h in (8, 2, 2))
    for layer in range(2):
        ref = TorchAttentionBackend(8, 2, 16, 0.25).forward(layer, q, k, v, ref_pool, batch)
        out = CpuAttentionBackend(8, 2, 16, 0.25).forward(layer, q, k, v, pool, batch)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# --- per-layer attention types: windows, chunks, sinks, softcapping ---------------------------------------

def _types():
    from pd_cluster.engine.layer_attention import LayerAttention

    return {"window": LayerAttention("sliding", window=11), "chunk": LayerAttention("chunked", chunk_size=16),
            "sinks": LayerAttention("full", sinks=True), "softcap": LayerAttention("full", logit_softcap=1.5),
            "chunk+sinks+softcap": LayerAttention("chunked", chunk_size=8, sinks=True, logit_softcap=2.5)}


def _mixed_step(page_size: int, seed: int):
    """A step of two decodes (cached 30 and 5) and two prefill chunks (a fresh 40-token prompt, tokens 40..72),
    over random cached KV; returns (pool, reference pool, batch, q, k, v, sinks)."""
    gen = torch.Generator().manual_seed(seed)
    layout = KVLayout(5, 2, 16, page_size, "fp32", (1.0,) * 5, (1.0,) * 5)
    pool, ref_pool = (KVPool(layout, 400, "cpu", torch.float32) for _ in range(2))
    starts, qlens = [30, 5, 0, 40], [1, 1, 40, 33]
    tables, nxt = [], 1
    for s, n in zip(starts, qlens):
        k = -(-(s + n) // page_size)
        tables.append(list(range(nxt, nxt + k)))
        nxt += k
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen))
    ref_pool.kv.copy_(pool.kv)
    batch = build_forward_batch([np.arange(n) + 3 for n in qlens], starts, tables,
                                [np.arange(n) for n in qlens], 2, page_size, torch.device("cpu"))
    t = sum(qlens)
    q, k, v = (torch.randn(t, h, 16, generator=gen) for h in (8, 2, 2))
    return pool, ref_pool, batch, q, k, v, 2 * torch.randn(8, generator=gen)


def _dense(spec, q, pool, batch, layer, sinks, scale):
    """Attention written out per query token in float64 from the pool's K and V by position: the mask from
    `LayerAttention.first_visible`, softcapping, and the sink as one more softmax column."""
    out = torch.empty(q.shape[0], 8, 16, dtype=torch.float64)
    k_all, v_all = pool.gather(layer, batch.block_tables)  # [B, Hkv, L, D]
    row = 0
    for i, (n, seq) in enumerate(zip(batch.query_lens_cpu, batch.seq_lens_cpu)):
        for p in range(seq - n, seq):
            lo = spec.first_visible(p)
            k, v = k_all[i, :, lo:p + 1].double(), v_all[i, :, lo:p + 1].double()  # [Hkv, keys, D]
            qh = q[row].double().view(2, 4, 16)
            s = torch.einsum("hgd,hkd->hgk", qh, k) * scale
            if spec.logit_softcap:
                s = torch.tanh(s / spec.logit_softcap) * spec.logit_softcap
            if spec.sinks:
                s = torch.cat((s, sinks.double().view(2, 4, 1)), dim=-1)
            p_ = torch.softmax(s, dim=-1)[..., :k.shape[1]]
            out[row] = torch.einsum("hgk,hkd->hgd", p_, v).reshape(8, 16)
            row += 1
    return out.view(q.shape[0], -1)


@pytest.mark.parametrize("name", sorted(_types()))
def test_torch_reference_equals_attention_written_out(name):
    spec = _types()[name]
    pool, _, batch, q, k, v, sinks = _mixed_step(16, seed=len(name))
    backend = TorchAttentionBackend(8, 2, 16, 0.25, layers=(spec,) * 5)
    out = backend.forward(2, q, k, v, pool, batch, sinks=sinks)
    torch.testing.assert_close(out.double(), _dense(spec, q, pool, batch, 2, sinks, 0.25), rtol=1e-5, atol=1e-5)


def test_torch_reference_prefill_blocks_are_bounded(monkeypatch):
    """A chunk's queries run in blocks whose scores fit the budget: with a budget of one 16-row block over a
    window, the result is the same as with one block for the whole chunk."""
    from pd_cluster.engine.attention import torch_ref

    spec = _types()["window"]
    pool, ref_pool, batch, q, k, v, _ = _mixed_step(16, seed=5)
    whole = TorchAttentionBackend(8, 2, 16, 0.25, layers=(spec,) * 5).forward(1, q, k, v, ref_pool, batch)
    monkeypatch.setattr(torch_ref, "PREFILL_SCORE_BUDGET", 4 * 8 * 16 * (11 + 16))
    blocked = TorchAttentionBackend(8, 2, 16, 0.25, layers=(spec,) * 5).forward(1, q, k, v, pool, batch)
    torch.testing.assert_close(blocked, whole, rtol=1e-6, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("page_size", [1, 16])
def test_cpu_kernel_every_attention_type_equals_reference(page_size):
    types = tuple(_types().values())
    pool, ref_pool, batch, q, k, v, sinks = _mixed_step(page_size, seed=page_size)
    cpu = CpuAttentionBackend(8, 2, 16, 0.25, layers=types)
    ref = TorchAttentionBackend(8, 2, 16, 0.25, layers=types)
    for layer, spec in enumerate(types):
        want = ref.forward(layer, q, k, v, ref_pool, batch, sinks=sinks)
        got = cpu.forward(layer, q, k, v, pool, batch, sinks=sinks)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m, s=spec: f"{s}: {m}")
    assert torch.equal(pool.kv, ref_pool.kv)
