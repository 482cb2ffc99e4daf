"""One quantised module read from a safetensors file as each format releases it (`quant_checkpoints`), whole and
as each rank's slice at TP 2 (output rows or input columns, with their scales, zeros and g_idx), into
`QuantLinear`: its dequantised weight is exactly the slice of the release's dequantised weight. Splits that cut
an FP8 block, an int4 group or a packed word are refused by name."""

from __future__ import annotations

import pytest
import torch
from quant_checkpoints import GPTQ_SIDE_FILE, quantization_config, quantize_tensor
from safetensors import safe_open
from safetensors.torch import save_file

from pd_cluster.engine.quant.linear import QuantLinear
from pd_cluster.engine.quant.loading import Split, is_quantized, read_module
from pd_cluster.engine.quant.scheme import read_quant_scheme

FORMATS = ["fp8-block", "fp8-tensor", "ct-fp8-channel", "ct-fp8-block", "fbgemm", "ct-w4a16", "awq"]
MODULE = "model.layers.0.mlp.down_proj"


def _checkpoint(fmt: str, tmp_path, n: int = 64, k: int = 128):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1)) * k ** -0.5
    tensors, deq = quantize_tensor(fmt, f"{MODULE}.weight", w, input_amax=3.0)
    save_file(tensors, str(tmp_path / "m.safetensors"))
    quant = quantization_config(fmt) or {**GPTQ_SIDE_FILE, "quant_method": "gptq"}  # gptq: quantize_config.json's
    scheme = read_quant_scheme({"quantization_config": quant}).for_module(MODULE)
    return scheme, deq


def _load(scheme, path, split: Split, n: int, k: int) -> QuantLinear:
    with safe_open(str(path), framework="pt") as f:
        get = lambda name: f.get_slice(name) if name in f.keys() else None  # noqa: E731
        assert is_quantized(MODULE, scheme, get)
        parts = read_module(MODULE, scheme, get, split)
    layer = QuantLinear(k, n, False, scheme, MODULE)
    layer.load_part((0, n), parts)
    layer.finish_loading()
    return layer


@pytest.mark.parametrize("fmt", FORMATS + ["gptq"])
def test_whole_and_tp2_slices_dequantise_to_the_release_values(fmt, tmp_path):
    scheme, deq = _checkpoint(fmt, tmp_path)
    path = tmp_path / "m.safetensors"
    assert torch.equal(_load(scheme, path, Split(), 64, 128).dequantized(), deq)
    for rank in (0, 1):
        rows = _load(scheme, path, Split("rows", rank, 2), 32, 128).dequantized()
        assert torch.equal(rows, deq[rank * 32:(rank + 1) * 32]), (fmt, rank)
        cols = _load(scheme, path, Split("cols", rank, 2), 64, 64).dequantized()
        assert torch.equal(cols, deq[:, rank * 64:(rank + 1) * 64]), (fmt, rank)


@pytest.mark.parametrize("fmt, split, match", [
    ("fp8-block", Split("rows", 0, 8), r"--tp-size 8 splits model.layers.0.mlp.down_proj's 16x32 FP8 blocks "
                                       r"\(output rows\): 64 / 8 = 8 per rank is not a multiple of 16"),
    ("ct-fp8-block", Split("cols", 1, 8), r"16x32 FP8 blocks \(input columns\): 128 / 8 = 16 per rank"),
    ("awq", Split("cols", 0, 8), r"int4 input columns \(groups of 32\): 128 / 8 = 16 per rank"),
    ("ct-w4a16", Split("rows", 0, 16), r"int4 output rows \(8 per packed word\): 64 / 16 = 4 per rank"),
])
def test_splits_that_cut_a_block_a_group_or_a_word_are_refused(fmt, split, match, tmp_path):
    scheme, _ = _checkpoint(fmt, tmp_path)
    with pytest.raises(ValueError, match=match):
        _load(scheme, tmp_path / "m.safetensors", split, 8, 128)


def test_a_plain_weight_is_not_quantised_and_a_missing_scale_is_named(tmp_path):
    scheme, _ = _checkpoint("fp8-block", tmp_path)
    save_file({f"{MODULE}.weight": torch.randn(4, 4)}, str(tmp_path / "plain.safetensors"))
    with safe_open(str(tmp_path / "plain.safetensors"), framework="pt") as f:
        assert not is_quantized(MODULE, scheme, lambda n: f.get_slice(n) if n in f.keys() else None)
    save_file({f"{MODULE}.weight": torch.randn(4, 4).to(torch.float8_e4m3fn)}, str(tmp_path / "bare.safetensors"))
    with safe_open(str(tmp_path / "bare.safetensors"), framework="pt") as f:
        get = lambda n: f.get_slice(n) if n in f.keys() else None  # noqa: E731
        assert is_quantized(MODULE, None, get)  # FP8 values without a scheme: the loader refuses them
        with pytest.raises(ValueError, match=r"need model.layers.0.mlp.down_proj.weight_scale_inv, which the "
                                             r"checkpoint lacks"):
            read_module(MODULE, scheme, get)


def test_deferred_linears_become_quantised_or_plain_layers_and_keep_a_tied_weight():
    from torch import nn

    from pd_cluster.engine.quant.modules import DeferredLinear, deferred_linears, linear_no_bias, make_linear, materialize

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(16, 32)
            self.proj = make_linear(32, 64, bias=True)
            self.head = make_linear(32, 16, bias=False)
            self.head.weight = self.embed.weight  # tied

    assert isinstance(Tiny().proj, nn.Linear)  # built on its own: plain layers
    with deferred_linears():
        model = Tiny()
    assert isinstance(model.proj, DeferredLinear) and isinstance(make_linear(2, 2), nn.Linear)
    scheme = read_quant_scheme({"quantization_config": quantization_config("fp8-block")}).for_module("proj")
    assert materialize(model, {"proj": scheme}, torch.device("cpu"), torch.float32) == ["proj"]
    assert isinstance(model.proj, QuantLinear) and model.proj.bias.shape == (64,)
    assert isinstance(model.head, nn.Linear) and model.head.weight is model.embed.weight
    w, s = quantize_tensor("fp8-block", "proj.weight", torch.randn(64, 32))[0].values()
    model.proj.load_part((0, 64), {"weight": w, "scale": s})
    model.proj.bias.data.fill_(0.5)
    x = torch.randn(3, 32)
    assert torch.equal(linear_no_bias(model.proj, x) + 0.5, model.proj(x))
    assert torch.equal(linear_no_bias(model.head, x), x @ model.embed.weight.t())


@pytest.mark.parametrize("fmt", ["ct-fp8-channel", "gptq"])
def test_a_dequantized_slice_reads_the_release_values(fmt, tmp_path):
    from pd_cluster.engine.quant.modules import DequantizedSlice

    scheme, deq = _checkpoint(fmt, tmp_path)
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as f:
        sl = DequantizedSlice(MODULE, scheme, lambda n: f.get_slice(n) if n in f.keys() else None)
        assert sl.get_shape() == [64, 128] and torch.equal(sl[:, 8:40], deq[:, 8:40])
