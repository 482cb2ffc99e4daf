"""No compile stalls: the start-up warm-up launches every Triton kernel variant that serving steps can ask for.

A variant is what Triton compiles once per specialisation (constexprs, dtypes,
pointer alignment, integers equal to 1 or multiples of 16, except those marked
``do_not_specialize``): `pd_cluster.engine.attention.triton.variants`. The test
records the variants of `warm_up_kernels` (the list below), then of decode-only,
prefill-only and mixed steps whose batch sizes, request offsets (``first_req``),
block-table widths and split counts hit 1, multiples of 16 and other values, and
asserts they are all among the warmed ones. Without the ``do_not_specialize``
annotations the same steps need more variants (the check can fail).
"""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

from pd_cluster.engine.assets import DEFAULT_MODEL
from pd_cluster.engine.attention.triton.variants import VariantRecorder
from pd_cluster.engine.attention.triton.decode import DecodeKernelConfig
from pd_cluster.engine.attention.triton.extend import ExtendKernelConfig
from pd_cluster.engine.attention.triton_backend import TritonAttentionBackend, TritonAttentionConfig
from pd_cluster.engine.batch import build_forward_batch
from pd_cluster.engine.graph import warm_up_kernels
from pd_cluster.engine.kv.pool import KVLayout, KVPool
from pd_cluster.engine.model.layer_ops import TORCH_OPS, TritonLayerOps
from pd_cluster.engine.model.loader import load_model
from kernel_cases import device

# small tiles and 2 "SMs" keep the interpreter fast; split counts still vary (1 or 2 per request, grid of 1-2):
# min_splits=1 lets the grid's split axis reach 1 (the default's 3 never does, but a configuration may)
CPU_CFG = TritonAttentionConfig(decode=DecodeKernelConfig(block_n=16, min_tokens_per_split=16, min_splits=1),
                                num_sms=2,
                                extend=ExtendKernelConfig(block_m=16, block_n=16))
PAGE = 16
NUM_PAGES = 64
# The variants a stories260K worker (fp16 activations, FP8 pool whose layer 0 has scale 1.0) compiles:
# one per kernel, except the KV store (scaled and unscaled layers) and RMSNorm (with and without the residual).
WARM_VARIANTS = {"_store_kv_kernel": 2, "_decode_stage1_kernel": 1, "_decode_stage2_kernel": 1, "_extend_kernel": 1,
                 "_rms_norm_kernel": 2, "_rope_qk_kernel": 1, "_act_and_mul_kernel": 1}


@pytest.fixture(scope="module")
def setup():
    loaded = load_model(DEFAULT_MODEL, "float16", device=device())
    loaded.model.layers = loaded.model.layers[:2]  # two layers keep both store variants; the interpreter is slow
    arch = loaded.arch
    n = len(loaded.model.layers)
    scales = (1.0,) + tuple(0.05 + 0.01 * i for i in range(1, n))
    layout = KVLayout(n, arch.num_key_value_heads, arch.head_dim, PAGE, "fp8_e4m3", scales, scales)
    pool = KVPool(layout, NUM_PAGES, device(), loaded.dtype)
    backend = TritonAttentionBackend(arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim,
                                     arch.head_dim ** -0.5, config=CPU_CFG)
    loaded.model.set_layer_ops(TritonLayerOps())
    yield loaded, pool, backend
    loaded.model.set_layer_ops(TORCH_OPS)


def _step(decodes: list[int], prefills: list[tuple[int, int]], width: int):
    """A batch: decodes of the given context lengths, then prefill chunks (cached, new), block tables `width` wide."""
    gen = np.random.default_rng(len(decodes) * 100 + width)
    ids = [gen.integers(0, 500, size=1) for _ in decodes] + [gen.integers(0, 500, size=new) for _, new in prefills]
    starts = [ctx - 1 for ctx in decodes] + [cached for cached, _ in prefills]
    tables, nxt = [], 1
    for start, tok in zip(starts, ids):
        need = -(-(start + len(tok)) // PAGE)
        assert need <= width and nxt + need <= NUM_PAGES + 1
        tables.append(list(range(nxt, nxt + need)) + [0] * (width - need))
        nxt += need
    rows = [np.array([len(t) - 1]) for t in ids]
    return build_forward_batch(ids, starts, tables, rows, len(decodes), PAGE, device())


STEPS = [
    ([5], [], 1),                              # one decode, one page: block-table width 1, split axis 2
    ([17, 3, 40], [], 3),                      # width 3, split axis 1 (partial-buffer strides of 1)
    ([], [(0, 9)], 1),                         # prefill only: first_req 0
    ([8], [(0, 5), (16, 7)], 2),               # mixed: first_req 1
    ([4] * 16, [(0, 3)], 16),                  # mixed: first_req 16, block-table width 16
    ([33, 2], [(32, 17)], 4),
]


def _run(setup, steps):
    loaded, pool, backend = setup
    rec = VariantRecorder()
    with rec, torch.inference_mode():
        for decodes, prefills, width in steps:
            logits = loaded.model(_step(decodes, prefills, width), pool, backend)
            assert torch.isfinite(logits).all()
    return rec


@pytest.mark.slow  # runs long (over 5 s on a 2-core CPU): the fast tier stays under 4 minutes
@pytest.mark.timeout(600)
def test_warm_up_covers_every_variant_serving_hits(setup):
    loaded, pool, backend = setup
    warm = VariantRecorder()
    with warm:
        warm_up_kernels(loaded.model, pool, backend)
    assert collections.Counter(v.kernel for v in warm.variants) == WARM_VARIANTS
    serving = _run(setup, STEPS)
    assert serving.launches >= 6 * 2 * 6  # 6 steps, 2 layers, at least 6 launches per layer
    assert serving.variants <= warm.variants, sorted(serving.variants - warm.variants, key=str)
    # without the do_not_specialize annotations the same steps would compile more variants (1 and 16 values)
    extra = sorted({v.kernel for v in serving.unannotated - warm.unannotated})
    assert extra == ["_decode_stage1_kernel", "_decode_stage2_kernel", "_extend_kernel"], extra


def test_warm_up_writes_nothing_into_the_pool(setup):
    loaded, pool, backend = setup
    before = pool.kv.clone()
    warm_up_kernels(loaded.model, pool, backend)
    assert torch.equal(pool.kv, before)
