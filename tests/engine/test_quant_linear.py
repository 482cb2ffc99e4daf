"""Quantised weights kept quantised: FP8 and int4 dequantisation against per-element formulas, each release's int4
packing (written by the tests' own packer, `quant_checkpoints.pack_nibbles`) read into the engine's layout, and
`QuantLinear`'s reference path: bit-identical to ``F.linear`` on the dequantised weight when one tile covers the
layer, the same values tile by tile otherwise, with its quantised bytes."""

from __future__ import annotations

import pytest
import torch
from quant_checkpoints import AWQ_ORDER, pack_nibbles
from torch.nn import functional as F

from pd_cluster.engine.quant import fp8 as q8
from pd_cluster.engine.quant import int4 as q4
from pd_cluster.engine.quant import linear as qlinear
from pd_cluster.engine.quant.linear import QuantLinear
from pd_cluster.engine.quant.weight_scheme import AWQ, FP8, FP8_SCALE, FP8_SCALE_INV, GPTQ, INT4, WeightScheme

GEN = torch.Generator().manual_seed(0)
BLOCKS = WeightScheme(FP8, "block", FP8_SCALE_INV, block=(32, 32), activations="group")
ROWS = WeightScheme(FP8, "channel", FP8_SCALE, activations="token")


def test_fp8_dequantisation_matches_a_per_element_loop_with_partial_blocks():
    w = (torch.randn(48, 70, generator=GEN) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 3, generator=GEN) + 0.5
    want = torch.empty(48, 70)
    for i in range(48):
        for j in range(70):
            want[i, j] = w[i, j].float() * scale[i // 32, j // 32]
    assert torch.equal(q8.dequantize_fp8(w, scale, (32, 32)), want)
    rows = torch.rand(48, generator=GEN)
    assert torch.equal(q8.dequantize_fp8(w, rows, None), w.float() * rows[:, None])
    with pytest.raises(ValueError, match=r"does not tile a 48x70 weight in 32x32 blocks \(expected \(2, 3\)\)"):
        q8.dequantize_fp8(w, scale[:1], (32, 32))


def _int4_values(k: int, n: int, groups: int):
    q = torch.randint(0, 16, (k, n), generator=GEN, dtype=torch.uint8)
    scales = (torch.rand(groups, n, generator=GEN) * 0.1 + 0.01).half()
    zeros = torch.randint(1, 16, (groups, n), generator=GEN, dtype=torch.uint8)
    return q, scales, zeros


def _per_element(q, scales, zeros, g):
    k, n = q.shape
    want = torch.empty(n, k)
    for kk in range(k):
        want[:, kk] = (q[kk].float() - zeros[g[kk]].float()) * scales[g[kk]].float()
    return want


def test_each_int4_release_packing_reads_into_the_same_weights():
    k, n, group = 64, 24, 16
    q, scales, zeros = _int4_values(k, n, k // group)
    g = torch.arange(k) // group
    want = _per_element(q, scales, zeros, g)
    layouts = {
        "gptq": q4.from_gptq(pack_nibbles(q, 0), pack_nibbles((zeros - 1) & 0xF, 1), scales, None, v2=False),
        "gptq_v2": q4.from_gptq(pack_nibbles(q, 0), pack_nibbles(zeros, 1), scales, None, v2=True),
        "awq": q4.from_awq(pack_nibbles(q, 1, AWQ_ORDER), pack_nibbles(zeros, 1, AWQ_ORDER), scales),
        "compressed": q4.from_packed(pack_nibbles(q.t(), 1), scales.t(), pack_nibbles(zeros.t(), 0), None, (n, k)),
    }
    for name, (qweight, s, z, g_idx) in layouts.items():
        assert qweight.shape == (k // 8, n) and qweight.dtype == torch.int32, name
        assert torch.equal(q4.dequantize_int4(qweight, s.float(), z, g_idx, group, k), want), name
    # symmetric checkpoints: GPTQ's sym stores zeros of 8 (7 + 1); compressed-tensors stores none
    sym = _per_element(q, scales, torch.full_like(zeros, 8), g)
    qweight, s, z, _ = q4.from_gptq(pack_nibbles(q, 0), pack_nibbles(torch.full_like(zeros, 7), 1), scales, None,
                                    v2=False)
    assert z is None and torch.equal(q4.dequantize_int4(qweight, s.float(), z, None, group, k), sym)
    qweight, s, z, _ = q4.from_packed(pack_nibbles(q.t(), 1), scales.t(), None, None, (n, k))
    assert z is None and torch.equal(q4.dequantize_int4(qweight, s.float(), z, None, group, k), sym)


def test_act_order_groups_follow_g_idx():
    k, n = 40, 16  # K not a multiple of 16: a partial packed row at the end
    q, scales, zeros = _int4_values(k, n, 5)
    g_idx = torch.randint(0, 5, (k,), generator=GEN, dtype=torch.int32)
    qweight = q4.pack_rows(q)
    got = q4.dequantize_int4(qweight, scales.float(), zeros, g_idx, 8, k)
    assert torch.equal(got, _per_element(q, scales, zeros, g_idx.long()))


def _fp8_layer(scheme: WeightScheme, n: int = 96, k: int = 64, bias: bool = True) -> tuple[QuantLinear, torch.Tensor]:
    w = torch.randn(n, k, generator=GEN) * k ** -0.5
    layer = QuantLinear(k, n, bias, scheme, "model.layers.0.mlp.down_proj", torch.float32)
    if scheme.block:
        q, s = q8.quantize_weight_blocks(w, scheme.block)
    else:
        q, s = q8.quantize_weight_rows(w)
    layer.load_part((0, n), {"weight": q, "scale": s})
    if bias:
        layer.bias.data.normal_(generator=GEN)
    return layer, layer.dequantized()


@pytest.mark.parametrize("scheme", [BLOCKS, ROWS], ids=["blocks", "rows"])
def test_the_reference_path_is_the_twins_linear_and_tiles_agree(scheme, monkeypatch):
    layer, w = _fp8_layer(scheme)
    x = torch.randn(5, 64, generator=GEN)
    one_tile = layer(x)
    assert torch.equal(one_tile, F.linear(x, w, layer.bias))  # what the twin's nn.Linear computes
    monkeypatch.setattr(qlinear, "TILE_BYTES", 40 * 64 * 4)  # 40 rows a tile: 32 (block-aligned) or 40
    tiled = layer(x)
    assert layer._tile_rows() == (32 if scheme.block else 40)
    torch.testing.assert_close(tiled, one_tile, rtol=1e-6, atol=1e-6)
    assert layer.nbytes == 96 * 64 + layer.weight_scale.numel() * 4 + 96 * 4


def test_int4_layer_holds_packed_weights_and_computes_the_dequantised_product(monkeypatch):
    k, n, group = 64, 40, 16
    scheme = WeightScheme(INT4, "group", GPTQ, group_size=group, symmetric=False)
    q, scales, zeros = _int4_values(k, n, k // group)
    layer = QuantLinear(k, n, False, scheme, "model.layers.0.self_attn.o_proj", torch.float32)
    layer.load_part((0, 24), {"qweight": q4.pack_rows(q[:, :24]), "scales": scales[:, :24], "zeros": zeros[:, :24]})
    layer.load_part((24, 40), {"qweight": q4.pack_rows(q[:, 24:]), "scales": scales[:, 24:], "zeros": None})
    layer.finish_loading()
    assert layer.scales.dtype == torch.float16 and layer.qweight.dtype == torch.int32
    zeros[:, 24:] = 8  # the symmetric part
    want = _per_element(q, scales, zeros, torch.arange(k) // group)
    assert torch.equal(layer.dequantized(), want)
    x = torch.randn(3, k, generator=GEN)
    assert torch.equal(layer(x), F.linear(x, want))
    monkeypatch.setattr(qlinear, "TILE_BYTES", 16 * k * 4)
    torch.testing.assert_close(layer(x), F.linear(x, want), rtol=1e-6, atol=1e-6)
    assert layer.nbytes == k // 8 * n * 4 + scales.numel() * 2 + zeros.numel()


def test_fused_parts_must_not_split_blocks_or_disagree_on_g_idx():
    layer = QuantLinear(64, 80, False, BLOCKS, "model.layers.0.self_attn.qkv_proj")
    w, s = q8.quantize_weight_blocks(torch.randn(48, 64, generator=GEN), (32, 32))
    with pytest.raises(ValueError, match=r"qkv_proj: a fused part at rows \[0, 48\) splits its 32x32 FP8 blocks"):
        layer.load_part((0, 48), {"weight": w, "scale": s})
    scheme = WeightScheme(INT4, "group", AWQ, group_size=16, act_order=True)
    layer = QuantLinear(64, 32, False, scheme, "model.layers.0.mlp.gate_up_proj")
    q, scales, _ = _int4_values(64, 16, 4)
    part = {"qweight": q4.pack_rows(q), "scales": scales, "g_idx": torch.arange(64, dtype=torch.int32) % 4}
    layer.load_part((0, 16), part)
    with pytest.raises(ValueError, match="gate_up_proj: its fused parts have different g_idx"):
        layer.load_part((16, 32), {**part, "g_idx": torch.arange(64, dtype=torch.int32) // 16})
