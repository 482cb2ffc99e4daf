"""The planner's weight bytes of quantised checkpoints (`pd_cluster.engine.planner.weights`): each layer at its
scheme's bits where the engine keeps it quantised, else at the model dtype, split or replicated as the engine
holds it; the bundled DeepSeek-V3 and gpt-oss-120b configs as released."""

from __future__ import annotations

import json

import pytest

from pd_cluster.engine.model.arch import ArchConfig
from pd_cluster.engine.planner.spec import CONFIG_DIR
from pd_cluster.engine.planner.weights import weight_bytes
from pd_cluster.engine.quant.scheme import read_quant_scheme

GIB = 2**30
MOE_KEPT = frozenset({"fp8", "mxfp4"})  # the experts as the MoE kernel keeps them


def _model(name: str):
    cfg = json.loads((CONFIG_DIR / f"{name}.json").read_text())
    arch = ArchConfig.from_dict({k: v for k, v in cfg.items() if k not in ("quantization_config", "_source")})
    return arch, read_quant_scheme(cfg)


def test_deepseek_v3_fp8_at_tp8_fits_an_h200_once_its_experts_stay_fp8():
    arch, scheme = _model("deepseek-v3")
    kept = weight_bytes(arch, scheme, 2, 8, MOE_KEPT)
    # every linear layer but the router and kv_b_proj (dequantised for the absorbed attention) in 128x128 FP8
    # blocks: 1 byte + 4 / 16384 per weight; embeddings and LM head (2 x 129280 x 7168) replicated in bf16
    assert kept.quantized_params == pytest.approx(668.0e9, rel=1e-3) and kept.params == pytest.approx(671.0e9, rel=1e-3)
    assert kept.total / GIB == pytest.approx(82.43, abs=0.01)
    assert kept.replicated >= 2 * 129280 * 7168 * 2
    assert kept.total < 143771 * 2**20 * 0.88  # an H200's static budget at --mem-fraction-static 0.88
    dequantized = weight_bytes(arch, scheme, 2, 8, frozenset())  # experts dequantised to bf16 on load
    assert dequantized.total / GIB == pytest.approx(158.54, abs=0.01)


def test_gpt_oss_mxfp4_experts_take_4_25_bits():
    arch, scheme = _model("gpt-oss-120b")
    wb = weight_bytes(arch, scheme, 2, 1, MOE_KEPT)
    experts = 36 * 128 * 3 * 2880 * 2880
    assert wb.quantized_params == experts and wb.quantized == int(experts * 4.25 / 8)
    assert wb.total / GIB == pytest.approx(60.77, abs=0.01)


def test_dense_fp8_and_int4_layers_split_over_ranks_and_the_rest_replicated():
    arch, _ = _model("llama-3.1-8b")
    fp8 = read_quant_scheme({"quantization_config": {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                                                     "modules_to_not_convert": ["lm_head"]}})
    gptq = read_quant_scheme({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}})
    linear = 32 * (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336)
    rest = arch.num_params() - linear
    for scheme, bits in ((fp8, 8.0), (gptq, 4 + 16 / 128)):
        for tp in (1, 4):
            wb = weight_bytes(arch, scheme, 2, tp)
            assert wb.quantized == int(linear / tp * bits / 8) and wb.quantized_params == linear
            assert wb.replicated == rest * 2 and wb.plain == 0
    assert weight_bytes(arch, None, 2, 2).total == linear * 2 // 2 + rest * 2


def _render(*argv: str, capsys) -> str:
    from pd_cluster.engine.planner.cli import main

    assert main(list(argv)) == 0
    return capsys.readouterr().out


def _row(text: str, name: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(name + " "))


def test_pd_plan_deepseek_v3_tp8_is_servable_with_fp8_experts(capsys):
    """`pd-plan --model deepseek-v3 --tp-size 8` on 8 x H200: the fused MoE keeps the FP8 experts, so the weights
    take 82.43 GiB a GPU (158.54 GiB were they dequantised: above) and the pool gets the rest of the static
    budget."""
    text = _render("--model", "deepseek-v3", "--tp-size", "8", capsys=capsys)
    assert _row(text, "weights per GPU").endswith("82.43 GiB") and "NOT" not in _row(text, "engine support")
    assert _row(text, "KV pool per GPU").endswith(f"{123.55 - 82.43:.2f} GiB")
    assert "668.0B of 671.0B parameters kept quantised" in _row(text, "engine support")
    pool = int(143771 * 2**20 * 0.88) - 88_511_366_000  # the static budget less the weights, bytes
    assert _row(text, "pool tokens per GPU / instance").endswith(f"{pool // 70_272 // 64 * 64:,}")  # 628,288
    assert _row(text, "asked context").endswith("fits one TP-8 instance")
    # the stored formats, not the model dtype alone: 668.0B of 671.0B parameters are FP8
    assert ", weights FP8 128x128 blocks (bf16 for the other 0.4% of parameters), " in _row(text, "deployment")


def test_pd_plan_gpt_oss_120b_sizes_its_mxfp4_experts_at_4_25_bits(capsys):
    text = _render("--model", "gpt-oss-120b", capsys=capsys)
    assert _row(text, "weights per GPU").endswith("60.77 GiB") and "NOT SERVABLE" not in text
    assert _row(text, "asked context").endswith("fits one TP-1 instance")
    assert ", weights MXFP4 (bf16 for the other 1.9% of parameters), " in _row(text, "deployment")
    assert ", weights bf16, " in _row(_render("--model", "llama-3.1-8b", capsys=capsys), "deployment")
