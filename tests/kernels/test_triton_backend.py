"""`TritonAttentionBackend.forward` (store + attend) on mixed batches against the torch reference backend.

Both backends start from the same pool bytes and store the same step; the
pools must end byte-identical and the outputs agree within the device guide's
bound for the activation dtype (`kernel_cases.REL_ERR_BOUND`).
"""

from __future__ import annotations

import pytest
import torch

from pd_cluster.engine.attention import get_backend
from pd_cluster.engine.attention.torch_ref import TorchAttentionBackend
from pd_cluster.engine.attention.triton.decode import DecodeKernelConfig
from pd_cluster.engine.attention.triton.extend import ExtendKernelConfig
from pd_cluster.engine.attention.triton_backend import TritonAttentionBackend, TritonAttentionConfig
from pd_cluster.engine.kv.pool import KVPool
from kernel_cases import REL_ERR_BOUND, device, make_batch, make_pool, random_q, rel_err

SMALL = TritonAttentionConfig(
    decode=DecodeKernelConfig(block_n=16, max_kv_splits=4, min_tokens_per_split=16),
    extend=ExtendKernelConfig(block_m=16, block_n=16), num_sms=8)
# decodes first, then prefill chunks: (cached tokens, new tokens)
SPECS = [(40, 1), (3, 1), (70, 1), (0, 21), (35, 12)]
NUM_DECODES = 3


def _step(act: torch.dtype, kv, page_size: int, group: int, exact_fp8: bool = False, window: int | None = None):
    gen = torch.Generator().manual_seed(page_size * 10 + group)
    hkv, d = 2, 32
    num_heads = hkv * group
    num_pages = sum(-(-(c + n) // page_size) for c, n in SPECS) + 2
    scales = ((0.5, 2.0), (0.25, 4.0)) if exact_fp8 else None
    pool = make_pool(kv, hkv, d, page_size, num_pages, act, gen, fp8_scales=scales)
    ref_pool = KVPool(pool.layout, pool.num_pages, pool.device, torch.float64)
    ref_pool.kv.copy_(pool.kv)
    batch = make_batch(SPECS, NUM_DECODES, page_size, num_pages, gen)
    t = batch.num_tokens
    q = random_q(t, num_heads, d, act, gen)
    k = random_q(t, hkv, d, act, gen)
    v = random_q(t, hkv, d, act, gen)
    if exact_fp8:  # FP8 codes times the layer-1 scales: the interpreter's cast is then exact too
        k = (k.float().to(torch.float8_e4m3fn).float() * 2.0).to(act)
        v = (v.float().to(torch.float8_e4m3fn).float() * 4.0).to(act)
    tri = TritonAttentionBackend(num_heads, hkv, d, d ** -0.5, window, config=SMALL)
    ref = TorchAttentionBackend(num_heads, hkv, d, d ** -0.5, window)
    layer = 1
    tri.prepare(batch, pool)
    out = tri.forward(layer, q, k, v, pool, batch)
    want = ref.forward(layer, q.double(), k.double(), v.double(), ref_pool, batch)
    return out, want, pool, ref_pool


@pytest.mark.parametrize("act,kv", [(torch.float16, torch.float16), (torch.float32, torch.float16)],
                         ids=["fp16-fp16kv", "fp32-fp16kv"])
@pytest.mark.parametrize("page_size,group", [(1, 4), (16, 1), (64, 8)])
def test_forward_mixed_batch(act, kv, page_size, group):
    out, want, pool, ref_pool = _step(act, kv, page_size, group)
    assert out.shape == (sum(n for _, n in SPECS), 2 * group * 32) and out.dtype == act
    assert torch.equal(pool.kv, ref_pool.kv), "stored K/V differ from KVPool.store_kv"
    err = rel_err(out, want)
    assert err <= REL_ERR_BOUND[act], f"relative error {err:.3e}"


@pytest.mark.parametrize("act", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_forward_fp8_pages_exact_codes(act):
    out, want, pool, ref_pool = _step(act, "fp8", 16, 4, exact_fp8=True)
    assert torch.equal(pool.kv, ref_pool.kv)
    err = rel_err(out, want)
    assert err <= REL_ERR_BOUND[act], f"relative error {err:.3e}"


def test_forward_sliding_window():
    out, want, pool, ref_pool = _step(torch.float32, torch.float32, 16, 2, window=9)
    assert torch.equal(pool.kv, ref_pool.kv)
    assert rel_err(out, want) <= REL_ERR_BOUND[torch.float32]


def test_registered_and_validates():
    backend = get_backend("triton", device(), num_heads=8, num_kv_heads=2, head_dim=32, scale=0.1)
    assert isinstance(backend, TritonAttentionBackend) and backend.supports_cuda_graph
    with pytest.raises(ValueError):
        TritonAttentionBackend(8, 3, 32, 0.1)
    with pytest.raises(ValueError):
        TritonAttentionBackend(8, 2, 32, 0.1, sliding_window=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("act", [torch.bfloat16, torch.float16])
def test_forward_fp8_random_on_gpu(act):
    """On a GPU the FP8 store is bit-exact with KVPool.store_kv for any input."""
    out, want, pool, ref_pool = _step(act, "fp8", 64, 4)
    assert torch.equal(pool.kv, ref_pool.kv)
    assert rel_err(out, want) <= REL_ERR_BOUND[act]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter path of machines without CUDA")
@pytest.mark.timeout(300)
def test_kernels_run_when_triton_was_imported_first():
    """In a process that imported triton before TRITON_INTERPRET was set (transformers does, through
    torch._dynamo), loading the kernels must still give a working interpreter path (store and decode,
    whose reductions must not be Triton's own jit-defined library functions)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = """
import triton, torch
from pd_cluster.launch.interpreter import use_triton_interpreter_without_cuda; use_triton_interpreter_without_cuda()
from pd_cluster.engine.kv.pool import KVLayout, KVPool
from pd_cluster.engine.attention.triton.store import store_kv
layout = KVLayout(1, 2, 16, 4, "fp16", (1.0,), (1.0,))
pool, ref = KVPool(layout, 3, "cpu", torch.float16), KVPool(layout, 3, "cpu", torch.float16)
k, v = torch.randn(5, 2, 16).half(), torch.randn(5, 2, 16).half()
slots = torch.tensor([4, 7, -1, 9, 11])
store_kv(k, v, *pool.layer_cache(0), slots, 1.0, 1.0)
ref.store_kv(0, k, v, slots)
assert torch.equal(pool.kv[1:], ref.kv[1:]), "store differs"
from pd_cluster.engine.attention.triton.decode import DecodeKernelConfig, DecodeWorkspace, decode_attention, num_kv_splits
q, bt = torch.randn(2, 4, 16).half(), torch.tensor([[1, 2, 3], [3, 1, 0]], dtype=torch.int32)
seq, cfg = torch.tensor([12, 6], dtype=torch.int32), DecodeKernelConfig(block_n=16, min_tokens_per_split=4)
ws = DecodeWorkspace(num_kv_splits(seq, 2, cfg), torch.empty(2, 4, 2, 16), torch.empty(2, 4, 2), 2)
out = torch.full_like(q, float("nan"))
decode_attention(q, *pool.layer_cache(0), bt, seq, out, ws, 0.25, 1.0, 1.0, cfg)
k, v = pool.gather(0, bt)
for b in range(2):
    s = torch.einsum("hgd,hld->hgl", q[b].view(2, 2, 16).float(), k[b, :, :int(seq[b])].float()) * 0.25
    want = torch.einsum("hgl,hld->hgd", s.softmax(-1), v[b, :, :int(seq[b])].float()).reshape(4, 16)
    assert torch.allclose(out[b].float(), want, atol=2e-3, rtol=2e-3), (out[b], want)
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]
