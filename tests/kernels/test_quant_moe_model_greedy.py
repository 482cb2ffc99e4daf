"""Greedy generation on tiny checkpoints with quantised experts: the Triton path (attention kernels, fused layer
ops, the fused MoE kernel reading the experts as stored; the decode-graph runner) == the torch path.

* gpt-oss with MXFP4 experts: the kernel dequantises each tile next to the activations; the torch path
  dequantises one expert at a time: the same math.
* DeepSeek-V3 in FP8 blocks (MLA): the kernel runs W8A8 (activations quantised per token and block column, as
  on a GPU), so the torch path runs with the same activation quantisation (`TorchLayerOps.fp8_activations`).

On CPU the kernels run in Triton's interpreter (fp32 KV pages and activations); on a GPU the graphs are captured.
"""

from __future__ import annotations

import pytest
import torch
from greedy_driver import greedy, make_pool_for
from kernel_cases import device
from quant_models import deepseek_fp8, gpt_oss_mxfp4
from test_mla_model import _backends as mla_backends
from test_mla_model import _pool as mla_pool
from test_model_greedy import CPU_CFG, ON_GPU

from pd_cluster.engine.attention.torch_ref import TorchAttentionBackend
from pd_cluster.engine.attention.triton_backend import TritonAttentionBackend
from pd_cluster.engine.graph import CudaGraphConfig, CudaGraphRunner
from pd_cluster.engine.model.layer_ops import TORCH_OPS, TorchLayerOps, TritonLayerOps
from pd_cluster.engine.model.loader import load_model

MAX_NEW = 5 if not ON_GPU else 24


class W8A8TorchOps(TorchLayerOps):
    fp8_activations = True


def _run(loaded, ref_backend, tri_backend, pools, prompts, ref_ops):
    ref_pool, tri_pool = pools
    loaded.model.set_layer_ops(ref_ops)
    try:
        want, _ = greedy(loaded, ref_pool, ref_backend, prompts, MAX_NEW, chunk=16)
        loaded.model.set_layer_ops(TritonLayerOps())
        runner = CudaGraphRunner(loaded.model, tri_pool, tri_backend, CudaGraphConfig(max_bs=4, max_context_len=512))
        if ON_GPU:
            runner.capture()
        got, graph_steps = greedy(loaded, tri_pool, tri_backend, prompts, MAX_NEW, chunk=16, graph_runner=runner)
    finally:
        loaded.model.set_layer_ops(TORCH_OPS)
    assert graph_steps >= MAX_NEW - 2
    return got, want


@pytest.mark.slow  # the Triton interpreter on 2 cores
@pytest.mark.timeout(900)
def test_gpt_oss_mxfp4_triton_equals_reference(tmp_path):
    path, _, prompts, _ = gpt_oss_mxfp4(tmp_path)
    loaded = load_model(str(path), "float32", device=device())
    assert loaded.model.layers[0].mlp.experts.w13_weight.dtype == torch.uint8
    a = loaded.arch
    args = (a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.softmax_scale)
    backends = (TorchAttentionBackend(*args, layers=a.layer_attention),
                TritonAttentionBackend(*args, config=None if ON_GPU else CPU_CFG, layers=a.layer_attention))
    prompts = [ids[:n] for ids, n in zip(prompts, (40, 27))]
    num_pages = sum(-(-(len(p) + MAX_NEW) // 16) for p in prompts) + 1
    pools = [make_pool_for(loaded, "fp32", 16, num_pages, device()) for _ in range(2)]
    got, want = _run(loaded, *backends, pools, prompts, TORCH_OPS)
    assert got == want
    torch.testing.assert_close(pools[1].kv[1:], pools[0].kv[1:], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_deepseek_v3_fp8_experts_w8a8_triton_equals_reference(tmp_path):
    path, _, prompts, _ = deepseek_fp8(tmp_path)
    loaded = load_model(str(path), "float32", device=device())
    assert loaded.model.layers[1].mlp.experts.w13_weight.dtype == torch.float8_e4m3fn
    prompts = prompts[:2]
    num_pages = sum(-(-(len(p) + MAX_NEW) // 16) for p in prompts) + 1
    pools = [mla_pool(loaded, "fp32", 16, num_pages) for _ in range(2)]
    got, want = _run(loaded, *mla_backends(loaded), pools, prompts, W8A8TorchOps())
    assert got == want
