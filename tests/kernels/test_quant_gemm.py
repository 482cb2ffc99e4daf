"""The quantised GEMM kernels (FP8 W8A8 / W8A16 with block or rowwise scales, int4 W4A16) and the FP8 activation
quantisation kernel against the torch references of `pd_cluster.engine.quant`, in Triton's interpreter on CPU
(fp32 and fp16 compute) and natively on a GPU.

The GEMMs take the reference's own quantised activations, so they are compared with the reference product:
each output row ``||out - ref|| / ||ref||`` within 1e-5 (float32) or 2e-3 (fp16: the output's rounding). The
activation kernel's scales and FP8 values equal the reference's exactly (it rounds to the E4M3 grid itself
before the cast, so the interpreter's cast, which loses the carry into the next binade, triton #8322, cannot
change them). `QuantLinear` through the kernels equals its reference path (weight-only) or the W8A8 reference.
"""

from __future__ import annotations

import pytest
import torch

from pd_cluster.engine.attention.triton.fp8_gemm import FP8GemmConfig, fp8_gemm, quantize_activations
from pd_cluster.engine.attention.triton.int4_gemm import Int4GemmConfig, int4_gemm
from pd_cluster.engine.quant import fp8 as ref8
from pd_cluster.engine.quant import int4 as ref4

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BOUND = {torch.float32: 1e-5, torch.float16: 2e-3}


def _rows_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == ref.shape and torch.isfinite(out).all()
    err = (out.double().cpu() - ref.double().cpu()).norm(dim=-1) / ref.double().cpu().norm(dim=-1)
    assert err.max() <= BOUND[dtype], err.max()


def _weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(8, k, generator=gen) * 3, torch.randn(n, k, generator=gen) * k ** -0.5


@pytest.mark.parametrize("group", [32, 128, 96])
def test_activation_quantisation_equals_the_reference(group):
    x, _ = _weights(8, 200, group)
    x = x * torch.logspace(-4, 3, 200)  # E4M3's subnormals, ties and every binade up to the clamp
    x[3] = 0.0  # an all-zero row: the amax floor, no NaN
    q, s = quantize_activations(x.to(DEVICE), group)
    q_ref, s_ref = ref8.quantize_activations(x, group)
    assert torch.equal(s.cpu(), s_ref)
    assert torch.equal(q.cpu().float(), q_ref.float())
    q_ub, s_ub = quantize_activations(x.to(DEVICE), group, scale_ub=1.0)  # fbgemm's cap on the amax
    assert (s_ub.cpu() <= 1.0 / 448).all() and torch.equal(s_ub.cpu(), ref8.quantize_activations(x, group, 1.0)[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m, n, k, block", [(1, 80, 96, (32, 32)), (5, 64, 128, (16, 64)), (37, 48, 160, (32, 32)),
                                            (3, 256, 256, (128, 128))])
def test_block_w8a8_equals_the_reference_product(m, n, k, block, dtype):
    x, w = _weights(n, k, m + n)
    wq, ws = ref8.quantize_weight_blocks(w, block)
    x = x[:1].repeat(m, 1) * torch.linspace(0.5, 2, m)[:, None] if m > 8 else x[:m]
    xq, xs = ref8.quantize_activations(x, block[1])
    want = ref8.w8a8_reference(x, wq, ws, block, block[1], dtype=torch.float64)
    out = fp8_gemm(xq.to(DEVICE), xs.to(DEVICE), block[1], wq.to(DEVICE), ws.to(DEVICE), block, dtype)
    _rows_close(out, want, dtype)


@pytest.mark.parametrize("per_tensor", [False, True])
def test_rowwise_w8a8_with_dynamic_and_static_activation_scales(per_tensor):
    x, w = _weights(48, 96, 7)
    wq, ws = ref8.quantize_weight_rows(w, per_tensor)
    rows = ws.reshape(-1).expand(48).contiguous()  # a per-tensor scale is held once per row
    bias = torch.randn(48) * 0.1
    xq, xs = ref8.quantize_activations(x, 96)
    want = ref8.w8a8_reference(x, wq, rows, None, 96, dtype=torch.float64)
    out = fp8_gemm(xq.to(DEVICE), xs.to(DEVICE), 96, wq.to(DEVICE), rows.to(DEVICE), None, torch.float32,
                   bias.to(DEVICE), cfg=FP8GemmConfig(block_m=16, block_n=32, block_k=32))
    _rows_close(out, want + bias.double(), torch.float32)
    static = (x.abs().max() / 448 * 0.8).float()  # a calibrated scale that clips the largest values
    want = ref8.w8a8_reference(x, wq, rows, None, None, act_scale=static, dtype=torch.float64)
    out = fp8_gemm(ref8.quantize_fp8(x, static).to(DEVICE), static.to(DEVICE), 96, wq.to(DEVICE), rows.to(DEVICE),
                   None, torch.float32)
    _rows_close(out, want, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block", [(32, 32), None])
def test_weight_only_fp8_dequantises_in_the_tile(block, dtype):
    x, w = _weights(72, 96, 3)
    wq, ws = ref8.quantize_weight_blocks(w, block) if block else ref8.quantize_weight_rows(w)
    ws = ws if block else ws.view(-1)
    x = x.to(dtype)
    want = x.double() @ ref8.dequantize_fp8(wq, ws, block, torch.float64).t()
    _rows_close(fp8_gemm(x.to(DEVICE), None, 96, wq.to(DEVICE), ws.to(DEVICE), block, dtype), want, dtype)


def test_fp8_gemm_refuses_a_k_tile_that_splits_the_scale_groups():
    x, w = _weights(32, 96, 1)
    wq, ws = ref8.quantize_weight_blocks(w, (32, 48))
    with pytest.raises(ValueError, match="K tile 32 must divide the scale groups"):
        fp8_gemm(x, None, 96, wq, ws, (32, 48), torch.float32, cfg=FP8GemmConfig(block_k=32))


def _int4_case(n: int, k: int, group: int, symmetric: bool, act_order: bool, seed: int):
    x, w = _weights(n, k, seed)
    g_idx = None
    if act_order:  # GPTQ desc_act: groups assigned in a permuted column order
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // group).to(torch.int32)
    values, scales, zeros = ref4.quantize_int4(w, group, symmetric, g_idx)
    return x, ref4.pack_rows(values), scales.half().float(), None if symmetric else zeros, g_idx


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n, k, group, symmetric, act_order", [
    (80, 96, 32, False, False),   # groups narrower than the K tile: gathered per column
    (64, 128, 64, True, False),   # one scale row per tile
    (48, 96, 32, False, True),    # g_idx (act order)
    (40, 72, 0, True, False),     # one group per row; K not a multiple of 8 x the tile
])
def test_int4_gemm_equals_the_dequantised_product(n, k, group, symmetric, act_order, dtype):
    x, qw, scales, zeros, g_idx = _int4_case(n, k, group, symmetric, act_order, n + k)
    want = x.to(dtype).double() @ ref4.dequantize_int4(qw, scales, zeros, g_idx, group, k, torch.float64).t()
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(dtype)
    for m in (1, 8):
        a = x[:m].to(dtype)
        out = int4_gemm(a.to(DEVICE), qw.to(DEVICE), scales.to(DEVICE), None if zeros is None else zeros.to(DEVICE),
                        None if g_idx is None else g_idx.to(DEVICE), group, cfg=Int4GemmConfig(block_k=64))
        _rows_close(out, want[:m], dtype)
    out = int4_gemm(x.to(dtype).to(DEVICE), qw.to(DEVICE), scales.to(DEVICE),
                    None if zeros is None else zeros.to(DEVICE), None if g_idx is None else g_idx.to(DEVICE), group,
                    bias.to(DEVICE))
    _rows_close(out, want + bias.double(), dtype)


def _layer(scheme, n: int, k: int, seed: int):
    from pd_cluster.engine.quant.linear import QuantLinear

    _, w = _weights(n, k, seed)
    layer = QuantLinear(k, n, True, scheme, "model.layers.0.mlp.down_proj", torch.float32)
    if scheme.kind == "int4":
        values, scales, zeros = ref4.quantize_int4(w, scheme.group_size, scheme.symmetric)
        layer.load_part((0, n), {"qweight": ref4.pack_rows(values), "scales": scales.half(),
                                 "zeros": None if scheme.symmetric else zeros})
    elif scheme.block:
        q, s = ref8.quantize_weight_blocks(w, scheme.block)
        layer.load_part((0, n), {"weight": q, "scale": s})
    else:
        q, s = ref8.quantize_weight_rows(w)
        layer.load_part((0, n), {"weight": q, "scale": s})
    layer.finish_loading()
    layer.bias.data.normal_(generator=torch.Generator().manual_seed(seed))
    return layer.to(DEVICE)


def _schemes():
    from pd_cluster.engine.quant.weight_scheme import FP8, FP8_SCALE, FP8_SCALE_INV, GPTQ, INT4, WeightScheme

    return {"int4": WeightScheme(INT4, "group", GPTQ, group_size=32, symmetric=False),
            "fp8-w8a16": WeightScheme(FP8, "block", FP8_SCALE_INV, block=(32, 32), activations="none"),
            "fp8-block-w8a8": WeightScheme(FP8, "block", FP8_SCALE_INV, block=(32, 32), activations="group"),
            "fp8-channel-w8a8": WeightScheme(FP8, "channel", FP8_SCALE, activations="token")}


@pytest.mark.parametrize("name", ["int4", "fp8-w8a16", "fp8-block-w8a8", "fp8-channel-w8a8"])
def test_quant_linear_kernel_path_against_its_references(name):
    """Weight-only kernels equal the reference path, W8A8 the W8A8 reference (float32: 1e-5)."""
    scheme = _schemes()[name]
    layer = _layer(scheme, 80, 96, 5)
    x = _weights(80, 96, 6)[0].to(DEVICE)
    ref = layer.reference(x)
    if scheme.activations != "none":
        group = scheme.block[1] if scheme.block else 96
        scale = layer.weight_scale
        ref = ref8.w8a8_reference(x, layer.weight, scale, scheme.block, group, dtype=torch.float64) + layer.bias
    layer.set_kernels(True)
    _rows_close(layer(x), ref, torch.float32)
