"""Greedy generation on a tiny DeepSeek-V3 checkpoint: the Triton MLA backend with the fused layer ops (and the
decode-graph runner) == the torch MLA reference == transformers' own greedy loop.

On CPU the kernels run in Triton's interpreter and the graph runner runs its
padded static batch eagerly; on a GPU the graphs are captured and replayed.
Steps mix chunked prefill (expanded MLA) and decodes (absorbed MLA, the paged
kernel) (`greedy_driver`).
"""

from __future__ import annotations

import pytest
import torch

from pd_cluster.engine.attention.mla import TorchMLABackend
from pd_cluster.engine.attention.mla_triton import TritonMLABackend
from pd_cluster.engine.attention.triton.decode import DecodeKernelConfig
from pd_cluster.engine.graph import CudaGraphConfig, CudaGraphRunner
from pd_cluster.engine.kv.pool import KVLayout, KVPool
from pd_cluster.engine.model.layer_ops import TORCH_OPS, TritonLayerOps
from pd_cluster.engine.model.loader import load_model
from deepseek_models import PROMPTS, build, hf_greedy_recompute, prompt_ids
from greedy_driver import greedy
from kernel_cases import device

ON_GPU = torch.cuda.is_available()
MAX_NEW = 8 if not ON_GPU else 32
# FP8 pages on a GPU only: the interpreter's fp32->fp8 cast rounds differently from torch's (triton #8322; it can
# drop the carry and halve a value), so on CPU the two pools would differ (the kernel itself is checked over FP8
# pages in test_mla_decode.py, with the pool stored by torch)
CASES = [("fp32", 16), ("fp16", 1)] + ([("fp8_e4m3", 64), ("bf16", 16)] if ON_GPU else [])


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsv3")
    hf = build("deepseek-v3", path)
    return hf, load_model(str(path), "float32", device=device())


def _pool(loaded, kv_dtype: str, page_size: int, num_pages: int) -> KVPool:
    a = loaded.arch
    n = a.num_hidden_layers
    scales = tuple(0.05 + 0.01 * i for i in range(n)) if kv_dtype == "fp8_e4m3" else (1.0,) * n
    layout = KVLayout(n, 1, a.mla.latent_dim, page_size, kv_dtype, scales, (1.0,) * n, kv_format="mla")
    return KVPool(layout, num_pages, device(), loaded.dtype)


def _backends(loaded):
    a, m = loaded.arch, loaded.arch.mla
    args = (a.num_attention_heads, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim,
            m.softmax_scale)
    cfg = None if ON_GPU else DecodeKernelConfig(block_n=16, min_tokens_per_split=16)
    return TorchMLABackend(*args), TritonMLABackend(*args, decode=cfg)


@pytest.mark.slow  # runs long (over 5 s on a 2-core CPU in the Triton interpreter): the fast tier stays under 4 min
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kv_dtype,page_size", CASES)
def test_triton_mla_greedy_equals_reference_and_transformers(deepseek_v3, kv_dtype, page_size):
    hf, loaded = deepseek_v3
    prompts = [prompt_ids(p) for p in PROMPTS]
    num_pages = sum(-(-(len(p) + MAX_NEW) // page_size) for p in prompts) + 1
    ref_backend, tri_backend = _backends(loaded)
    ref_pool = _pool(loaded, kv_dtype, page_size, num_pages)
    want, _ = greedy(loaded, ref_pool, ref_backend, prompts, MAX_NEW, chunk=5)
    tri_pool = _pool(loaded, kv_dtype, page_size, num_pages)
    loaded.model.set_layer_ops(TritonLayerOps())  # the server's Triton path: fused norm/RoPE/activation too
    try:
        runner = CudaGraphRunner(loaded.model, tri_pool, tri_backend, CudaGraphConfig(max_bs=8, max_context_len=256))
        if ON_GPU:
            runner.capture()
        got, graph_steps = greedy(loaded, tri_pool, tri_backend, prompts, MAX_NEW, chunk=5, graph_runner=runner)
    finally:
        loaded.model.set_layer_ops(TORCH_OPS)
    assert graph_steps >= MAX_NEW - 3  # the last steps are decode-only: 5 requests padded to the bucket of 8
    assert got == want
    assert not tri_pool.kv[0].any(), "a padded slot wrote into the null page"
    if kv_dtype == "fp32":  # rounded latents are not expected to give transformers' tokens
        assert got == [hf_greedy_recompute(hf, p, MAX_NEW) for p in prompts]
        torch.testing.assert_close(tri_pool.kv[1:], ref_pool.kv[1:], rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(600)
def test_warm_up_covers_every_mla_variant_serving_hits(deepseek_v3):
    """No compile stalls for MLA either: the start-up warm-up step launches every variant that decode-only,
    prefill-only and mixed steps of other sizes, widths and split counts ask for; it writes nothing."""
    from test_kernel_variants import _step

    from pd_cluster.engine.attention.triton.variants import VariantRecorder
    from pd_cluster.engine.graph import warm_up_kernels

    _, loaded = deepseek_v3
    pool = _pool(loaded, "fp8_e4m3", 16, 64)
    backend = _backends(loaded)[1]
    loaded.model.set_layer_ops(TritonLayerOps())
    try:
        before = pool.kv.clone()
        warm = VariantRecorder()
        with warm:
            warm_up_kernels(loaded.model, pool, backend)
        assert torch.equal(pool.kv, before)
        kernels = {v.kernel for v in warm.variants}
        assert {"_store_kv_kernel", "_mla_decode_stage1_kernel", "_decode_stage2_kernel"} <= kernels
        serving = VariantRecorder()
        with serving, torch.inference_mode():
            for decodes, prefills, width in [([5], [], 1), ([17, 3, 40], [], 3), ([], [(0, 9)], 1),
                                             ([4] * 16, [(0, 3)], 16), ([33, 2], [(32, 17)], 4)]:
                assert torch.isfinite(loaded.model(_step(decodes, prefills, width), pool, backend)).all()
        assert serving.variants <= warm.variants, sorted(serving.variants - warm.variants, key=str)
    finally:
        loaded.model.set_layer_ops(TORCH_OPS)
