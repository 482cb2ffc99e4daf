"""Greedy generation on tiny random Gemma 2, Gemma 3, gpt-oss and Llama 4 checkpoints: the Triton path (the
attention kernels with each layer's window, chunk, sinks and softcap; the fused norms in each family's style,
RoPE, GeGLU and the fused MoE kernel with gpt-oss's biases and clamped SwiGLU; the decode-graph runner) == the
torch reference path, with prompts longer than the 16-token windows and chunks.

On CPU the kernels run in Triton's interpreter (fp32 KV pages and activations) and the graph runner runs its
padded static batch eagerly; on a GPU the graphs are captured and replayed.
"""

from __future__ import annotations

import pytest
import torch
from greedy_driver import greedy, make_pool_for
from kernel_cases import device
from random_models import build, long_prompt_ids
from test_model_greedy import CPU_CFG, ON_GPU, fused_layer_ops

from pd_cluster.engine.attention.torch_ref import TorchAttentionBackend
from pd_cluster.engine.attention.triton_backend import TritonAttentionBackend
from pd_cluster.engine.graph import CudaGraphConfig, CudaGraphRunner
from pd_cluster.engine.model.loader import load_model


@pytest.mark.slow  # runs long (over 5 s on a 2-core CPU in the Triton interpreter): the fast tier stays under 4 min
@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", ["gemma2", "gemma3", "gpt-oss", "llama4"])
def test_hybrid_greedy_triton_equals_reference(family, tmp_path):
    build(family, tmp_path)
    loaded = load_model(str(tmp_path), "float32", device=device())
    a = loaded.arch
    assert a.is_hybrid
    args = (a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.softmax_scale)
    ref_backend = TorchAttentionBackend(*args, layers=a.layer_attention)
    tri_backend = TritonAttentionBackend(*args, config=None if ON_GPU else CPU_CFG, layers=a.layer_attention)
    prompts = [ids[:n] for ids, n in zip(long_prompt_ids(2), (40, 27))]
    max_new, page_size = (5, 16) if not ON_GPU else (24, 16)
    num_pages = sum(-(-(len(p) + max_new) // page_size) for p in prompts) + 1
    ref_pool = make_pool_for(loaded, "fp32", page_size, num_pages, device())
    want, _ = greedy(loaded, ref_pool, ref_backend, prompts, max_new, chunk=16)
    tri_pool = make_pool_for(loaded, "fp32", page_size, num_pages, device())
    with fused_layer_ops(loaded):
        runner = CudaGraphRunner(loaded.model, tri_pool, tri_backend, CudaGraphConfig(max_bs=4, max_context_len=512))
        if ON_GPU:
            runner.capture()
        got, graph_steps = greedy(loaded, tri_pool, tri_backend, prompts, max_new, chunk=16, graph_runner=runner)
    assert graph_steps >= max_new - 2
    assert got == want
    torch.testing.assert_close(tri_pool.kv[1:].float(), ref_pool.kv[1:].float(), rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # ~30 s in the Triton interpreter on 2 cores
@pytest.mark.timeout(900)
def test_triton_engine_reads_each_kv_groups_table(tmp_path):
    """The engine with the hybrid KV manager (Llama 4: a full and a chunked KV group, chunk pages freed behind
    the chunk) on the Triton backend, eager and through the decode-graph runner: each layer reads its group's
    block table and slots; transformers' tokens, no page held at the end."""
    from random_models import hf_greedy_batch

    from pd_cluster.engine import LLM, SamplingParams

    hf = build("llama4", tmp_path)
    prompts = [ids[:n] for ids, n in zip(long_prompt_ids(2), (40, 27))]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    llm = LLM(str(tmp_path), kv_cache_dtype="fp32", dtype="float32", page_size=16, chunked_prefill_size=16,
              attention_backend="triton", device=str(device()))
    engine = llm.engine
    assert engine.kv_groups.num_groups == 2
    want = hf_greedy_batch(hf, prompts, params.max_tokens)
    outs = llm.generate(prompts, params)
    assert [list(o.token_ids) for o in outs] == want
    assert engine.pages.num_trimmed_total > 0
    assert engine.num_free_pages() == engine.allocator.num_pages
    # the decode-graph runner's static buffers hold each group's table and slots (captured on a GPU; off it the
    # padded static batch runs eagerly, the same inputs a replay reads)
    if not ON_GPU:
        engine.shard.capture_decode_graphs(CudaGraphConfig(max_bs=4, eager_stand_in=True))
    runner = engine.shard.graph_runner
    assert runner is not None and len(runner.buffers.group_tables) == 1
    outs = llm.generate(prompts, params)
    assert runner.replays > 0 and [list(o.token_ids) for o in outs] == want
    assert engine.num_free_pages() == engine.allocator.num_pages
