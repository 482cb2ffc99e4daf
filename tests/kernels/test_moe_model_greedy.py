"""Greedy generation on tiny random Mixtral and Qwen3-MoE checkpoints: the Triton path (attention kernels, fused
layer ops and the fused MoE kernel, through the decode-graph runner) == the torch reference path.

On CPU the kernels run in Triton's interpreter (fp16 KV pages, float32 activations) and the graph runner runs
its padded static batch eagerly; on a GPU the graphs are captured and replayed, so the MoE kernels' routing sort
is checked to run inside a captured graph. The loop mixes chunked prefill and decode in one step.
"""

from __future__ import annotations

import pytest
import torch
from greedy_driver import greedy, make_pool_for
from kernel_cases import device
from random_models import build, prompt_ids
from test_model_greedy import CPU_CFG, ON_GPU, _backends, fused_layer_ops

from pd_cluster.engine.graph import CudaGraphConfig, CudaGraphRunner
from pd_cluster.engine.model.loader import load_model
from pd_cluster.engine.model.moe import SparseMoE


@pytest.mark.slow  # runs long (over 5 s on a 2-core CPU in the Triton interpreter): the fast tier stays under 4 min
@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", ["mixtral", "qwen3-moe"])
def test_moe_greedy_triton_equals_reference(family, tmp_path):
    build(family, tmp_path)
    loaded = load_model(str(tmp_path), "float32", device=device())
    assert any(isinstance(layer.mlp, SparseMoE) for layer in loaded.model.layers)
    prompts = [ids[:12] for ids in prompt_ids(3)]
    max_new, page_size = (5, 16) if not ON_GPU else (24, 16)
    ref_backend, tri_backend = _backends(loaded, None if ON_GPU else CPU_CFG)
    num_pages = sum(-(-(len(p) + max_new) // page_size) for p in prompts) + 1
    ref_pool = make_pool_for(loaded, "fp16", page_size, num_pages, device())
    want, _ = greedy(loaded, ref_pool, ref_backend, prompts, max_new, chunk=5)
    tri_pool = make_pool_for(loaded, "fp16", page_size, num_pages, device())
    with fused_layer_ops(loaded):
        runner = CudaGraphRunner(loaded.model, tri_pool, tri_backend, CudaGraphConfig(max_bs=4, max_context_len=512))
        if ON_GPU:
            runner.capture()
        got, graph_steps = greedy(loaded, tri_pool, tri_backend, prompts, max_new, chunk=5, graph_runner=runner)
    assert graph_steps >= max_new - 2
    assert got == want
    torch.testing.assert_close(tri_pool.kv[1:].float(), ref_pool.kv[1:].float(), rtol=1e-3, atol=1e-3)
