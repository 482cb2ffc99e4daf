"""The fused MoE Triton kernel on FP8-per-row and int4 experts against the torch path, in Triton's interpreter.

FP8 per channel (compressed-tensors' FP8-dynamic, fbgemm) runs W8A8, each GEMM's input quantised per token as
the kernel does, against the torch path with the same activation quantisation, and W8A16 against the torch path
without it. int4 (W4A16: GPTQ's symmetric groups, AWQ's asymmetric zero points, act order's ``g_idx``) dequantises
its tiles inside the kernel with the W4A16 GEMM's own tile (`primitives.int4_tile`). The reference runs in float64
on the same quantised weights; rows are checked as in `test_fused_moe`.
"""

from __future__ import annotations

import pytest
import torch
from test_fused_moe import BOUND, DEVICE, _case, _check

from pd_cluster.engine.attention.triton.fused_moe import fused_experts
from pd_cluster.engine.model.layer_ops import torch_fused_experts
from pd_cluster.engine.quant.expert_format import ExpertQuant
from pd_cluster.engine.quant.experts import QuantizedExperts
from pd_cluster.engine.quant.fp8 import quantize_weight_rows
from pd_cluster.engine.quant.int4 import pack_rows, quantize_int4
from pd_cluster.engine.quant.weight_scheme import FP8, FP8_SCALE, GPTQ, INT4, WeightScheme

TOKEN_FP8 = WeightScheme(FP8, "channel", FP8_SCALE, activations="token")


def fp8_row_experts(w: torch.Tensor) -> QuantizedExperts:
    parts = [quantize_weight_rows(w[e].float().cpu()) for e in range(w.shape[0])]
    return QuantizedExperts(torch.stack([q for q, _ in parts]).to(w.device),
                            torch.stack([s.reshape(-1) for _, s in parts]).to(w.device),
                            ExpertQuant("fp8_rows", (1, 0), TOKEN_FP8))


def int4_experts(w: torch.Tensor, group: int, symmetric: bool, act_order: bool) -> QuantizedExperts:
    """`w` [E, N, K] as int4 in groups of `group` input columns (`act_order`: each expert's columns in a random
    group order, as GPTQ's desc_act), in the engine's layout: [E, K / 8, N] words, [E, G, N] scales."""
    e, n, k = w.shape
    gen = torch.Generator().manual_seed(k)
    words, scales, zeros, g_idx = [], [], [], []
    for i in range(e):
        g = torch.randperm(k, generator=gen) // group if act_order else None
        values, s, z = quantize_int4(w[i].float().cpu(), group, symmetric, g)
        words.append(pack_rows(values))
        scales.append(s.to(torch.float16))
        zeros.append(z)
        g_idx.append(g)
    scheme = WeightScheme(INT4, "group", GPTQ, group_size=group, symmetric=symmetric, act_order=act_order)
    return QuantizedExperts(torch.stack(words).to(w.device), torch.stack(scales).to(w.device),
                            ExpertQuant("int4", (1, group), scheme),
                            None if symmetric else torch.stack(zeros).to(w.device),
                            torch.stack(g_idx).to(w.device, torch.int32) if act_order else None)


def _ref(x, w13, w2, weights, ids, **kw):
    return torch_fused_experts(x.double(), w13, w2, weights.double(), ids, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_channel_experts_w8a8_and_w8a16(dtype):
    x, w13, w2, weights, ids = _case(21, 4, 2, 80, 32, dtype, seed=11)
    q13, q2 = fp8_row_experts(w13), fp8_row_experts(w2)
    w8a8 = _ref(x, q13, q2, weights, ids, fp8_activations=True)
    w8a16 = _ref(x, q13, q2, weights, ids)
    gap = ((w8a8 - w8a16).norm(dim=-1) / w8a16.norm(dim=-1)).max()
    assert gap > 10 * BOUND[dtype]  # the activations really are quantised
    out = fused_experts(x, q13, q2, weights, ids)
    if dtype == torch.float32:
        _check(out, w8a8, dtype)
    else:  # fp16-rounded activations may take a neighbouring E4M3 code (as in test_fused_moe_quant)
        err = (out.double() - w8a8).norm(dim=-1) / w8a8.norm(dim=-1)
        assert torch.isfinite(out).all() and err.median() <= BOUND[dtype] and err.max() < gap / 2, (err, gap)
    _check(fused_experts(x, q13, q2, weights, ids, fp8_activations=False), w8a16, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("symmetric, act_order, group", [(True, False, 32), (False, False, 16), (False, True, 32)])
def test_int4_experts(dtype, symmetric, act_order, group):
    x, w13, w2, weights, ids = _case(19, 4, 2, 64, 64, dtype, seed=7, drop=0.2)
    ids[0] = -1
    q13, q2 = (int4_experts(w, group, symmetric, act_order) for w in (w13, w2))
    ref = _ref(x, q13, q2, weights, ids)
    out = fused_experts(x, q13, q2, weights, ids)
    assert (out[0] == 0).all()
    _check(out, ref, dtype)
    plain = _ref(x, q13.dequantize(torch.float64), q2.dequantize(torch.float64), weights, ids)
    assert torch.equal(plain, ref)  # the reference on the quantised weights is the math of their values
