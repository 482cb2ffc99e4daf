"""MXFP4 encoding (E2M1 codes, two a byte, E8M0 block scales) against transformers' reading of gpt-oss's release
tensors, and the rounding rules of `quantize_mxfp4`."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from pd_cluster.engine.quant.experts import QuantizedExperts
from pd_cluster.engine.quant.expert_format import ExpertQuant
from pd_cluster.engine.quant.mxfp4 import (E2M1_VALUES, dequantize_mxfp4, e8m0_to_float, pack_e2m1, quantize_mxfp4,
                                           unpack_e2m1)


def test_dequantize_reads_release_bytes_as_transformers_does():
    """Random bytes and scales in the release's [E, N, K / 32, 16] layout: the values equal transformers'
    ``convert_moe_packed_tensors`` (which also transposes to its x @ W form [E, K, N])."""
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 5, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 140, (3, 5, 4), generator=g, dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales, torch.float32)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert ours.shape == (3, 5, 128) and torch.equal(ours.transpose(1, 2), theirs)
    flat = dequantize_mxfp4(blocks.reshape(3, 5, 64), scales)  # the same bytes as [E, N, K / 2]
    assert torch.equal(flat, ours)
    experts = QuantizedExperts(blocks.reshape(3, 5, 64), scales, ExpertQuant.mxfp4())
    assert experts.shape == (3, 5, 128) and torch.equal(experts.expert(1, torch.float32), ours[1])
    assert experts.nbytes == 3 * 5 * 64 + 3 * 5 * 4


def test_quantize_then_dequantize_round_trips_every_code_and_scale():
    values = torch.tensor(E2M1_VALUES).repeat(2)
    for exponent in (-127, -20, 0, 5, 125):  # 6 * 2 ** 125 is near float32's largest
        w = torch.ldexp(values, torch.tensor(exponent)).view(1, 32)
        blocks, scales = quantize_mxfp4(w)
        assert int(scales) == exponent + 127 and torch.equal(dequantize_mxfp4(blocks, scales), w)
    codes = torch.arange(16, dtype=torch.uint8).repeat(2)
    assert torch.equal(unpack_e2m1(pack_e2m1(codes)), codes)
    assert pack_e2m1(torch.tensor([1, 2], dtype=torch.uint8)).item() == 0x21  # even element in the low nibble
    assert e8m0_to_float(torch.tensor([0, 127, 254], dtype=torch.uint8)).tolist() == [2.0 ** -127, 1.0, 2.0 ** 127]


def test_scale_keeps_the_largest_value_and_ties_round_to_even():
    # the block's max 5.9 fits scale 1 (6 is the top code); 6.1 needs scale 2
    assert int(quantize_mxfp4(torch.full((1, 32), 5.9))[1]) == 127
    assert int(quantize_mxfp4(torch.full((1, 32), 6.1))[1]) == 128
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, 6.0] + [0.0] * 23).view(1, 32)
    blocks, scales = quantize_mxfp4(mids)
    got = dequantize_mxfp4(blocks, scales)[0, :9].tolist()
    assert got == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, 6.0]  # each tie to the code with mantissa bit 0
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 64, generator=g)
    blocks, scales = quantize_mxfp4(w)
    half_gap = torch.ldexp(torch.ones(8, 2), scales.int() - 127).repeat_interleave(32, 1)  # half of 4 -> 6, scaled
    assert ((dequantize_mxfp4(blocks, scales) - w).abs() <= half_gap).all()


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="blocks of 32; it has 40"):
        quantize_mxfp4(torch.ones(2, 40))
    with pytest.raises(ValueError, match="do not match scales"):
        dequantize_mxfp4(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))
