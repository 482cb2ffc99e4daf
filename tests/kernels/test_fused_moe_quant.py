"""The fused MoE Triton kernel on quantised experts against the torch path, in Triton's interpreter on CPU.

FP8 blocks (DeepSeek-V3's format, 32 x 32 blocks at these sizes, partial ones included) run both ways: W8A8
(each GEMM's input quantised per token and 32-column group, FP8 x FP8 products; vLLM's ``use_fp8_w8a8`` with a
block shape) against the torch path with the same activation quantisation, and W8A16 (weight tiles dequantised
next to the activations) against the torch path without it. MXFP4 (gpt-oss's) dequantises its tiles inside the
kernel, with biases and the clamped SwiGLU. The reference runs in float64 on the same quantised weights (each
expert dequantised when it runs); rows are checked as in `test_fused_moe` (float32 1e-5, fp16 2e-3).
"""

from __future__ import annotations

import pytest
import torch
from test_fused_moe import BOUND, DEVICE, _case, _check

from pd_cluster.engine.attention.triton.fused_moe import FusedMoEKernelConfig, fp8_block_k, fused_experts
from pd_cluster.engine.model.layer_ops import torch_fused_experts
from pd_cluster.engine.quant.expert_format import ExpertQuant
from pd_cluster.engine.quant.experts import QuantizedExperts, fake_quant_fp8_groups
from pd_cluster.engine.quant.fp8 import quantize_weight_blocks
from pd_cluster.engine.quant.mxfp4 import quantize_mxfp4


def fp8_experts(w: torch.Tensor, block: tuple[int, int]) -> QuantizedExperts:
    """`w` [E, N, K] in FP8 blocks, each block's scale its max |w| / 448 (partial blocks at the edges)."""
    parts = [quantize_weight_blocks(w[e].float(), block) for e in range(w.shape[0])]
    return QuantizedExperts(torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts]),
                            ExpertQuant("fp8_block", block))


def mxfp4_experts(w: torch.Tensor) -> QuantizedExperts:
    """`w` [E, N, K] in MXFP4, the release's [E, N, K / 32, 16] bytes viewed as [E, N, K / 2]."""
    blocks, scales = quantize_mxfp4(w.float().cpu())
    return QuantizedExperts(blocks.reshape(*w.shape[:2], -1).to(w.device), scales.to(w.device), ExpertQuant.mxfp4())


def _ref(x, w13, w2, weights, ids, **kw):
    return torch_fused_experts(x.double(), w13, w2, weights.double(), ids, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t, e, k, h, i", [(1, 4, 2, 64, 32), (37, 8, 3, 80, 64)])
def test_fp8_block_experts_w8a8_and_w8a16(t, e, k, h, i, dtype):
    x, w13, w2, weights, ids = _case(t, e, k, h, i, dtype, seed=t + e)
    q13, q2 = fp8_experts(w13, (32, 32)), fp8_experts(w2, (32, 32))  # h = 80: a partial column block
    w8a8 = _ref(x, q13, q2, weights, ids, fp8_activations=True)
    w8a16 = _ref(x, q13, q2, weights, ids)
    out = fused_experts(x, q13, q2, weights, ids)
    gap = ((w8a8 - w8a16).norm(dim=-1) / w8a16.norm(dim=-1)).max()
    assert gap > 10 * BOUND[dtype]  # the activations really are quantised
    if dtype == torch.float32:
        _check(out, w8a8, dtype)
    else:  # the kernel quantises the fp16-rounded activation output, the reference its float64 value: an element
        # near a rounding boundary of E4M3 may take the neighbouring code (one 3-bit-mantissa step)
        err = (out.double() - w8a8).norm(dim=-1) / w8a8.norm(dim=-1)
        assert torch.isfinite(out).all() and err.median() <= BOUND[dtype] and err.max() < gap / 2, (err, gap)
    _check(fused_experts(x, q13, q2, weights, ids, fp8_activations=False), w8a16, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mxfp4_experts_with_biases_clamped_swiglu_and_other_ranks(dtype):
    x, w13, w2, weights, ids = _case(37, 4, 2, 64, 64, dtype, seed=5, drop=0.3)
    ids[0] = -1
    gen = torch.Generator().manual_seed(9)
    b13 = torch.randn(4, 128, generator=gen).to(DEVICE, dtype)
    b2 = torch.randn(4, 64, generator=gen).to(DEVICE, dtype)
    q13, q2 = mxfp4_experts(w13), mxfp4_experts(w2)
    act = ("swiglu_clamped", 1.702, 1.5)
    ref = _ref(x, q13, q2, weights, ids, b13=b13.double(), b2=b2.double(), activation=act)
    out = fused_experts(x, q13, q2, weights, ids, b13=b13, b2=b2, activation=act)
    assert (out[0] == 0).all()
    _check(out, ref, dtype)
    # the reference path on the quantised weights is the same math as on their dequantised values
    plain = _ref(x, q13.dequantize(torch.float64), q2.dequantize(torch.float64), weights, ids, b13=b13.double(),
                 b2=b2.double(), activation=act)
    assert torch.equal(plain, ref)


def test_large_tiles_and_deepseek_sized_blocks():
    """64-row tiles with 128 x 128 FP8 blocks (the release's): the K step shrinks to stay inside one block."""
    x, w13, w2, weights, ids = _case(33, 4, 2, 256, 128, torch.float32, seed=3)
    q13, q2 = fp8_experts(w13, (128, 128)), fp8_experts(w2, (128, 128))
    big = FusedMoEKernelConfig(block_m=64, block_n=128, block_k=256)
    assert fp8_block_k(256, 128) == 128 and fp8_block_k(64, 48) == 16
    _check(fused_experts(x, q13, q2, weights, ids, cfg=big), _ref(x, q13, q2, weights, ids, fp8_activations=True),
           torch.float32)
    m13, m2 = mxfp4_experts(w13), mxfp4_experts(w2)
    _check(fused_experts(x, m13, m2, weights, ids, cfg=big), _ref(x, m13, m2, weights, ids), torch.float32)


def test_fake_quant_is_per_token_and_group():
    """Each row's groups get their own scale: a row of small values next to a huge one keeps its precision."""
    x = torch.tensor([[1e-3, 2e-3, 500.0, 1.0], [3.0, -3.0, 1e-3, 2e-3]])
    q = fake_quant_fp8_groups(x, 2)
    assert torch.allclose(q, x, rtol=0.07)  # E4M3 keeps 3 mantissa bits in every group
    assert q[0, 3] != x[0, 3] or q[0, 2] == x[0, 2]
    assert torch.equal(fake_quant_fp8_groups(torch.zeros(2, 4), 2), torch.zeros(2, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("t, e, k, h, i", [(1, 8, 2, 2048, 512), (300, 64, 8, 1024, 768)])
def test_bf16_on_the_gpu(t, e, k, h, i):
    """bf16 activations at real widths with 128 x 128 FP8 blocks (W8A8 on FP8 tensor cores) and MXFP4."""
    x, w13, w2, weights, ids = _case(t, e, k, h, i, torch.bfloat16, seed=5)
    q13, q2 = fp8_experts(w13, (128, 128)), fp8_experts(w2, (128, 128))
    _check(fused_experts(x, q13, q2, weights, ids), _ref(x, q13, q2, weights, ids, fp8_activations=True),
           torch.bfloat16)
    m13, m2 = mxfp4_experts(w13), mxfp4_experts(w2)
    _check(fused_experts(x, m13, m2, weights, ids), _ref(x, m13, m2, weights, ids), torch.bfloat16)
