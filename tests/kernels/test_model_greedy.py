"""Greedy generation on the embedded stories260K: Triton backend with the fused layer ops (and the decode-graph
runner) == torch reference.

On CPU the Triton kernels run in the interpreter and the graph runner runs its
padded static batch eagerly; on a GPU the graphs are captured and replayed.
The loop mixes chunked prefill and decode in one step (`greedy_driver`).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from pd_cluster.engine.assets import DEFAULT_MODEL
from pd_cluster.engine.attention.torch_ref import TorchAttentionBackend
from pd_cluster.engine.attention.triton.decode import DecodeKernelConfig
from pd_cluster.engine.attention.triton.extend import ExtendKernelConfig
from pd_cluster.engine.attention.triton_backend import TritonAttentionBackend, TritonAttentionConfig
from pd_cluster.engine.graph import CudaGraphConfig, CudaGraphRunner
from pd_cluster.engine.model.layer_ops import TORCH_OPS, TritonLayerOps
from pd_cluster.engine.model.loader import load_model
from greedy_driver import greedy, make_pool_for
from kernel_cases import device

KV_TORCH = {"fp16": torch.float16, "fp32": torch.float32, "bf16": torch.bfloat16}
PROMPTS_TEXT = ["Once upon a time, there was a little girl named Lily.", "The cat sat", "Tom and his dog went to"]
ON_GPU = torch.cuda.is_available()
CPU_CFG = TritonAttentionConfig(decode=DecodeKernelConfig(block_n=16, min_tokens_per_split=16),
                                extend=ExtendKernelConfig(block_m=16, block_n=16))


@pytest.fixture(scope="module")
def model_and_prompts():
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    loaded = load_model(DEFAULT_MODEL, "float32", device=device())
    return loaded, [tok(t).input_ids for t in PROMPTS_TEXT]


def _backends(loaded, cfg=None):
    a = loaded.arch
    args = (a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.head_dim ** -0.5)
    return TorchAttentionBackend(*args), TritonAttentionBackend(*args, config=cfg)


@contextlib.contextmanager
def fused_layer_ops(loaded):
    loaded.model.set_layer_ops(TritonLayerOps())
    try:
        yield
    finally:
        loaded.model.set_layer_ops(TORCH_OPS)


CASES = [("fp16", 16)] if not ON_GPU else [("fp16", 16), ("fp32", 1), ("bf16", 64)]


@pytest.mark.slow  # runs long (over 5 s on a 2-core CPU): the fast tier stays under 4 minutes
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kv_dtype,page_size", CASES)
def test_greedy_triton_equals_reference(model_and_prompts, kv_dtype, page_size):
    loaded, prompts = model_and_prompts
    max_new = 5 if not ON_GPU else 24
    ref_backend, tri_backend = _backends(loaded, None if ON_GPU else CPU_CFG)
    num_pages = sum(-(-(len(p) + max_new) // page_size) for p in prompts) + 1
    ref_pool = make_pool_for(loaded, kv_dtype, page_size, num_pages, device())
    want, _ = greedy(loaded, ref_pool, ref_backend, prompts, max_new, chunk=5)
    tri_pool = make_pool_for(loaded, kv_dtype, page_size, num_pages, device())
    with fused_layer_ops(loaded):  # the server's Triton path: fused norm/RoPE/activation kernels too
        runner = CudaGraphRunner(loaded.model, tri_pool, tri_backend, CudaGraphConfig(max_bs=4, max_context_len=512))
        if ON_GPU:
            runner.capture()
        got, graph_steps = greedy(loaded, tri_pool, tri_backend, prompts, max_new, chunk=5, graph_runner=runner)
    assert graph_steps >= max_new - 2  # the last steps are decode-only: 3 requests padded to the bucket of 4
    assert got == want
    assert not tri_pool.kv[0].any(), "a padded slot wrote into the null page"
    # layers past the first see attention outputs that differ in the last float32 bits, so compare closely, not
    # exactly: rounded into the pool's dtype such a difference can flip the rounding, one unit in the last place
    # of that dtype (bf16: 2**-7 relative)
    rtol = max(1e-3, torch.finfo(KV_TORCH[kv_dtype]).eps)
    torch.testing.assert_close(tri_pool.kv[1:].float(), ref_pool.kv[1:].float(), rtol=rtol, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.timeout(900)
@pytest.mark.parametrize("page_size", [16, 64])
def test_greedy_fp8_kv_with_graphs_on_gpu(model_and_prompts, page_size):
    """FP8 KV with CUDA graphs: greedy tokens equal the reference backend's."""
    loaded, prompts = model_and_prompts
    max_new = 32
    ref_backend, tri_backend = _backends(loaded)
    num_pages = sum(-(-(len(p) + max_new) // page_size) for p in prompts) + 1
    ref_pool = make_pool_for(loaded, "fp8_e4m3", page_size, num_pages, device())
    want, _ = greedy(loaded, ref_pool, ref_backend, prompts, max_new, chunk=7)
    tri_pool = make_pool_for(loaded, "fp8_e4m3", page_size, num_pages, device())
    with fused_layer_ops(loaded):
        runner = CudaGraphRunner(loaded.model, tri_pool, tri_backend, CudaGraphConfig(max_bs=8, max_context_len=512))
        runner.capture()
        assert sorted(runner.graphs) == [1, 2, 4, 8]
        got, graph_steps = greedy(loaded, tri_pool, tri_backend, prompts, max_new, chunk=7, graph_runner=runner)
    assert graph_steps > 0 and got == want
    assert not tri_pool.kv[0].any(), "a padded slot wrote into the null page"


@pytest.mark.slow  # runs long (over 5 s on a 2-core CPU): the fast tier stays under 4 minutes
@pytest.mark.timeout(900)
def test_engine_with_triton_backend_keeps_the_greedy_output():
    """The whole engine with --attention-backend triton (fused layer ops on, chunked prefill mixed with decode)
    generates the torch engine's greedy tokens, which tests/engine/test_exact_greedy.py pins to transformers'."""
    from engine_reference import PROMPTS  # tests/support is on the path (tests/conftest.py)
    from pd_cluster.engine import LLM, SamplingParams

    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = ["Once upon a time", PROMPTS[0]]
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(attention_backend=backend, page_size=16, kv_cache_memory="4MiB", chunked_prefill_size=7,
                  disable_cuda_graph=not ON_GPU)
        try:
            assert llm.engine.loaded.model.layer_ops.name == backend
            outs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
        finally:
            llm.engine.close()
    assert outs["triton"] == outs["torch"]
    assert outs["torch"][0][:8] == [432, 383, 286, 261, 376, 298, 315, 421]  # README of stories260K
