"""Weight quantisation configs as released, read into `QuantScheme` s (per module), and every refusal naming its
format, key and file. The configs are the releases' own (transcribed from their ``config.json`` /
``quantize_config.json``), trimmed of calibration metadata where noted."""

from __future__ import annotations

import json

import pytest

from pd_cluster.engine.quant.scheme import (AWQ, FP8, FP8_SCALE, FP8_SCALE_INV, GPTQ, GPTQ_V2, INT4, MXFP4, PACKED,
                                            QuantConfigError, WeightScheme, module_matches, read_quant_scheme)

DEEPSEEK_V3 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
FP8_TENSOR = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
              "ignore": ["lm_head"], "kv_cache_scheme": None, "config_groups": {"group_0": {
                  "targets": ["Linear"], "output_activations": None,
                  "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor",
                              "dynamic": False, "group_size": None, "block_structure": None, "actorder": None,
                              "observer": "minmax"},
                  "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor",
                                        "dynamic": False, "observer": "minmax"}}}}
W4A16 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
         "ignore": ["lm_head"], "config_groups": {"group_0": {
             "targets": ["Linear"], "input_activations": None, "output_activations": None,
             "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128,
                         "dynamic": False, "actorder": None}}}}
GPT_OSS = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                 "model.embed_tokens", "lm_head"]}


def _ct_fp8(strategy: str, acts: dict | None, block=None) -> dict:
    cfg = json.loads(json.dumps(FP8_TENSOR))
    group = cfg["config_groups"]["group_0"]
    group["weights"].update(strategy=strategy, block_structure=block)
    group["input_activations"] = acts
    return cfg


def test_deepseek_v3_blocks_cover_every_module_that_is_stored_quantised():
    s = read_quant_scheme({"quantization_config": DEEPSEEK_V3})
    w = WeightScheme(FP8, "block", FP8_SCALE_INV, block=(128, 128), activations="group")
    assert (s.method, s.source, s.ignore) == ("fp8", "config.json", ())
    assert s.for_module("model.layers.3.mlp.experts.7.down_proj") == w
    assert s.for_module("model.layers.0.self_attn.kv_a_proj_with_mqa") == w
    assert w.bits == 8 and w.bits_per_weight() == 8 + 32 / 128 ** 2
    assert s.describe() == "fp8 (config.json): fp8 128x128 blocks, dynamic per-token-group FP8 activations"


@pytest.mark.parametrize("quant,want", [
    ({"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]},  # AutoFP8
     WeightScheme(FP8, "tensor", FP8_SCALE, activations="static")),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, WeightScheme(FP8, "tensor", FP8_SCALE, activations="token")),
    (FP8_TENSOR, WeightScheme(FP8, "tensor", FP8_SCALE, activations="static")),
    (_ct_fp8("channel", {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}),
     WeightScheme(FP8, "channel", FP8_SCALE, activations="token")),
    (_ct_fp8("block", {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128, "dynamic": True,
                       "symmetric": True}, [128, 128]),
     WeightScheme(FP8, "block", FP8_SCALE, block=(128, 128), activations="group")),
    (_ct_fp8("channel", None), WeightScheme(FP8, "channel", FP8_SCALE, activations="none")),  # FP8 W8A16
    (W4A16, WeightScheme(INT4, "group", PACKED, group_size=128)),
    ({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]},
     WeightScheme(FP8, "channel", FP8_SCALE, activations="token", activation_scale_ub=1200.0)),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
      "modules_to_not_convert": None}, WeightScheme(INT4, "group", AWQ, group_size=128, symmetric=False)),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False, "damp_percent": 0.01,
      "true_sequential": True, "checkpoint_format": "gptq_v2"},
     WeightScheme(INT4, "group", GPTQ_V2, group_size=32, symmetric=False, act_order=True)),
    ({"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": False, "sym": True},
     WeightScheme(INT4, "channel", GPTQ, group_size=0)),
], ids=["autofp8-static", "fp8-tensor-dynamic", "ct-fp8-tensor-static", "ct-fp8-channel-token", "ct-fp8-block",
        "ct-fp8-w8a16", "ct-w4a16", "fbgemm", "awq", "gptq-v2-desc-act", "gptq-channel"])
def test_each_release_format_reads_into_its_scheme(quant, want):
    s = read_quant_scheme({"quantization_config": quant})
    assert s.for_module("model.layers.1.self_attn.o_proj") == want
    assert s.weight_schemes == (want,)


def test_ignore_lists_and_targets_decide_per_module():
    s = read_quant_scheme({"quantization_config": FP8_TENSOR})
    assert s.for_module("lm_head") is None and s.for_module("model.layers.0.mlp.down_proj") is not None
    mixed = json.loads(json.dumps(W4A16))  # attention in FP8, the MLPs in int4, the router and layer 0 kept
    mixed["format"] = "mixed-precision"
    mixed["ignore"] = ["lm_head", "re:.*mlp.gate$", "model.layers.0.mlp"]
    mixed["config_groups"]["group_0"].update(targets=[r"re:.*mlp\.(gate|up|down)_proj$"], format="pack-quantized")
    mixed["config_groups"]["group_1"] = {**_ct_fp8("channel", None)["config_groups"]["group_0"],
                                         "targets": ["re:.*self_attn.*"], "format": "float-quantized"}
    s = read_quant_scheme({"quantization_config": mixed})
    assert s.for_module("model.layers.1.mlp.gate_proj").kind == INT4
    assert s.for_module("model.layers.1.self_attn.qkv_proj").kind == FP8
    assert s.for_module("model.layers.1.mlp.gate") is None  # the router
    assert s.for_module("model.layers.0.mlp.down_proj") is None and s.for_module("model.layers.10.mlp.up_proj")
    assert s.for_module("model.embed_tokens") is None  # targeted by no group
    oss = read_quant_scheme({"quantization_config": GPT_OSS})
    assert oss.for_module("model.layers.5.mlp.experts").kind == MXFP4
    assert oss.for_module("model.layers.5.mlp.experts.gate_up_proj").bits_per_weight() == 4.25
    assert oss.for_module("model.layers.5.self_attn.q_proj") is None
    assert oss.for_module("model.layers.5.mlp.router") is None and oss.for_module("lm_head") is None


def test_module_matching_is_by_whole_name_parts():
    assert module_matches("lm_head", "lm_head") and module_matches("mlp.gate", "model.layers.3.mlp.gate")
    assert not module_matches("gate", "model.layers.3.mlp.gate_proj")
    assert not module_matches("model.layers.1.mlp", "model.layers.11.mlp.down_proj")
    assert module_matches("model.layers.*.self_attn", "model.layers.7.self_attn.o_proj")
    assert module_matches("re:.*self_attn", "model.layers.7.self_attn.o_proj")
    assert not module_matches("re:self_attn", "model.layers.7.self_attn.o_proj")  # re.match: from the start


def test_gptq_and_awq_side_files_are_read_beside_config_json(tmp_path):
    (tmp_path / "quantize_config.json").write_text(json.dumps(  # AutoGPTQ's file: no quant_method
        {"bits": 4, "group_size": 64, "damp_percent": 0.01, "desc_act": True, "static_groups": False, "sym": True,
         "true_sequential": True, "model_name_or_path": None, "model_file_base_name": "model"}))
    s = read_quant_scheme({"architectures": ["LlamaForCausalLM"]}, tmp_path)
    assert (s.method, s.source) == ("gptq", str(tmp_path / "quantize_config.json"))
    assert s.for_module("model.layers.0.mlp.up_proj") == WeightScheme(INT4, "group", GPTQ, group_size=64,
                                                                         act_order=True)
    assert s.for_module("lm_head") is None
    (tmp_path / "quantize_config.json").unlink()
    (tmp_path / "quant_config.json").write_text(json.dumps(  # AutoAWQ's file
        {"zero_point": True, "q_group_size": 128, "w_bit": 4, "version": "GEMM"}))
    s = read_quant_scheme({}, tmp_path)
    assert s.method == "awq" and s.for_module("model.layers.0.mlp.up_proj").layout == AWQ
    assert read_quant_scheme({"quantization_config": DEEPSEEK_V3}, tmp_path).source == str(tmp_path / "config.json")


def test_llm_compressor_compression_config_key_is_the_quantization_config():
    s = read_quant_scheme({"compression_config": {**FP8_TENSOR, "quantization_status": "frozen",
                                                  "format": "naive-quantized"}})
    assert s.method == "compressed-tensors" and s.for_module("model.layers.0.mlp.up_proj").kind == FP8


def test_kv_cache_scales_alone_are_not_weight_quantisation():
    kv_only = {"quant_method": "compressed-tensors", "config_groups": {},
               "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"}}
    assert read_quant_scheme({"quantization_config": kv_only}) is None
    assert read_quant_scheme({"architectures": ["LlamaForCausalLM"]}) is None


@pytest.mark.parametrize("quant,key", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
     "bitsandbytes quantization_config.quant_method='bitsandbytes'"),
    ({"load_in_8bit": True}, "bitsandbytes quantization_config.quant_method"),
    ({"quant_method": "hqq"}, "hqq quantization_config.quant_method='hqq'"),
    ({**DEEPSEEK_V3, "fmt": "e5m2"}, "fp8 quantization_config.fmt='e5m2'"),
    ({**DEEPSEEK_V3, "activation_scheme": "static"}, "fp8 quantization_config.activation_scheme='static'"),
    ({**DEEPSEEK_V3, "weight_block_size": [128]}, "quantization_config.weight_block_size=[128]"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "awq quantization_config.version='gemv'"),
    ({"quant_method": "gptq", "bits": 8}, "gptq quantization_config.bits=8"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
    ({"quant_method": "gptq", "bits": 4, "dynamic": {"-:.*layers.0.*": {}}}, "quantization_config.dynamic"),
    ({**W4A16, "format": "marlin-24"}, "compressed-tensors quantization_config.format='marlin-24'"),
    ({**W4A16, "sparsity_config": {"format": "sparse-24-bitmask"}}, "quantization_config.sparsity_config"),
    ({**FP8_TENSOR, "quantization_status": "initialized"}, "quantization_status='initialized'"),
    ({**W4A16, "config_groups": {"group_0": {**W4A16["config_groups"]["group_0"], "weights": {
        "num_bits": 8, "type": "int", "strategy": "channel"}}}},  # INT8 W8A8 (SmoothQuant)
     "quantization_config.config_groups.group_0.weights={'type': 'int', 'num_bits': 8}"),
    ({**W4A16, "format": "nvfp4-pack-quantized", "config_groups": {"group_0": {
        **W4A16["config_groups"]["group_0"], "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                                         "group_size": 16}}}}, "'type': 'float', 'num_bits': 4"),
    (_ct_fp8("block", {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 64, "dynamic": True},
             [128, 128]), "input_activations.group_size=64"),
    ({"quant_method": "compressed-tensors", "config_groups": {}}, "config_groups={}"),
])
def test_refusals_name_the_format_the_key_and_the_file(quant, key, tmp_path):
    with pytest.raises(QuantConfigError) as e:
        read_quant_scheme({"quantization_config": quant}, tmp_path)
    assert str(e.value).startswith(f"{tmp_path / 'config.json'}: ") and key in str(e.value)


def test_refusals_of_a_side_file_name_that_file(tmp_path):
    (tmp_path / "quantize_config.json").write_text(json.dumps({"bits": 3, "group_size": 128, "desc_act": False}))
    with pytest.raises(QuantConfigError, match=r"quantize_config\.json: gptq bits=3 is not supported \(4-bit"):
        read_quant_scheme({}, tmp_path)


def test_a_multimodal_checkpoints_language_model_names_match_with_or_without_their_prefix():
    """Llama 4's multimodal FP8 release names its dense layers under ``language_model.`` in its ignore list; a
    rule written without the prefix matches those modules too."""
    from pd_cluster.engine.quant.weight_scheme import QuantRule, QuantScheme, WeightScheme

    w = WeightScheme("fp8", "channel", "fp8_scale", activations="token")
    s = QuantScheme("fbgemm_fp8", "config.json", (QuantRule(("Linear",), w),),
                    ("language_model.model.layers.0.feed_forward.router", "re:model.layers.1.self_attn.*",
                     "vision_model"))
    prefix = "language_model."
    assert s.for_module("language_model.model.layers.0.feed_forward.router", prefix) is None
    assert s.for_module("language_model.model.layers.1.self_attn.q_proj", prefix) is None  # re: on the short name
    assert s.for_module("language_model.model.layers.1.self_attn.q_proj") == w  # no prefix given: full name only
    assert s.for_module("language_model.model.layers.0.self_attn.q_proj", prefix) == w
