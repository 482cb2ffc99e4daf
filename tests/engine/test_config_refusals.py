"""Nothing silently wrong: a config.json key that changes the math, with a value the engine does not compute,
is refused with an error naming it, for every supported family; keys transformers ignores for a family are
ignored here too, and values that are implemented load."""

from __future__ import annotations

import json

import pytest
from random_models import build, hf_config

from pd_cluster.engine import LLM
from pd_cluster.engine.model.arch import ArchConfig

FAMILY_OF = {"llama": "llama-gqa4", "qwen2": "qwen2-bias-tied", "qwen3": "qwen3-qknorm", "mistral": "mistral",
             "mixtral": "mixtral", "qwen3-moe": "qwen3-moe", "phi3": "phi3"}
REFUSED = [
    ("hidden_act", "gelu_pytorch_tanh", "hidden_act"),
    ("hidden_act", "relu", "hidden_act"),
    ("mlp_bias", True, "mlp_bias"),
    ("rope_parameters", {"rope_type": "mrope-new", "rope_theta": 10000.0}, "rope_type"),
    ("quantization_config", {"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method"),
    ("quantization_config", {"quant_method": "awq", "bits": 4, "version": "gemv"}, "version"),
    ("quantization_config", {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
     "activation_scheme"),
    ("final_logit_softcapping", 30.0, "final_logit_softcapping"),
]


def _config(family: str, **overrides) -> dict:
    cfg = hf_config(FAMILY_OF[family]).to_dict()
    cfg["architectures"] = [type(hf_config(FAMILY_OF[family])).__name__.replace("Config", "ForCausalLM")]
    cfg.update(overrides)
    return cfg


@pytest.mark.parametrize("family", sorted(FAMILY_OF))
def test_the_unmodified_config_loads(family):
    arch = ArchConfig.from_dict(_config(family))
    assert arch.architecture == _config(family)["architectures"][0]


@pytest.mark.parametrize("key, value, named", REFUSED)
@pytest.mark.parametrize("family", sorted(FAMILY_OF))
def test_unimplemented_values_are_refused_by_name(family, key, value, named):
    with pytest.raises(ValueError, match=named):
        ArchConfig.from_dict(_config(family, **{key: value}))


@pytest.mark.parametrize("family", ["llama", "mistral", "mixtral", "qwen3", "qwen3-moe"])
def test_attention_bias_with_its_o_proj_bias_is_refused(family):
    with pytest.raises(ValueError, match="attention_bias"):
        ArchConfig.from_dict(_config(family, attention_bias=True))


def test_qwen2_attention_bias_is_its_qkv_bias():
    assert ArchConfig.from_dict(_config("qwen2", attention_bias=True)).attention_bias


@pytest.mark.parametrize("family", ["llama", "qwen3", "mixtral"])
def test_partial_rotary_is_phi3s_only(family):
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        ArchConfig.from_dict(_config(family, partial_rotary_factor=0.5))
    # Phi-4-mini's config.json has it at the top level; transformers 5 writes it into rope_parameters
    phi3 = ArchConfig.from_dict(_config("phi3", partial_rotary_factor=0.75, rope_parameters={"rope_theta": 1e4}))
    assert phi3.partial_rotary_factor == 0.75 and phi3.rotary_dim == 6
    phi3 = ArchConfig.from_dict(_config("phi3", rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.5}))
    assert phi3.rotary_dim == 4


def test_phi3_refuses_rope_types_its_transformers_class_refuses():
    for kind in ("dynamic", "llama3", "linear"):
        with pytest.raises(ValueError, match="rope_type"):
            ArchConfig.from_dict(_config("phi3", rope_parameters={"rope_type": kind, "factor": 2.0}))
    su = {"type": "su", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}  # Phi-3's first name for longrope
    assert ArchConfig.from_dict(_config("phi3", rope_scaling=su, rope_parameters=None)).rope_scaling["rope_type"] \
        == "longrope"


def _windows(cfg: dict) -> list[int | None]:
    return [a.window for a in ArchConfig.from_dict(cfg).layer_attention]


def test_sliding_windows_follow_each_familys_transformers_class():
    qwen_full = _config("qwen2", use_sliding_window=True, sliding_window=32, max_window_layers=3)
    assert _windows({**qwen_full, "layer_types": None}) == [None] * 3  # windows from layer 3 on: none of 3 layers
    assert _windows({**qwen_full, "layer_types": None, "max_window_layers": 1}) == [None, 32, 32]
    assert _windows({**qwen_full, "layer_types": None, "max_window_layers": 0}) == [32] * 3
    assert _windows(_config("qwen3", use_sliding_window=False, sliding_window=32)) == [None] * 3
    assert _windows(_config("mistral", sliding_window=32)) == [32] * 3
    assert _windows(_config("phi3", sliding_window=32)) == [32] * 3
    assert _windows(_config("llama", sliding_window=32)) == [None] * 3  # LlamaConfig has none


def test_per_layer_windows_follow_layer_types_where_transformers_reads_them():
    mixed = ["full_attention", "sliding_attention", "full_attention"]
    for family in ("qwen2", "qwen3"):
        cfg = _config(family, use_sliding_window=True, sliding_window=32)
        assert _windows({**cfg, "layer_types": mixed}) == [None, 32, None]
        with pytest.raises(ValueError, match="layer_types"):
            ArchConfig.from_dict({**cfg, "layer_types": ["chunked_attention"] * 3})
        assert _windows({**cfg, "layer_types": ["sliding_attention"] * 3}) == [32] * 3
        assert _windows({**cfg, "use_sliding_window": False, "layer_types": mixed}) == [None] * 3
    # Llama, Mistral, Mixtral, Qwen3-MoE and Phi-3 never read layer_types: neither does the engine
    assert _windows(_config("mistral", sliding_window=32, layer_types=mixed)) == [32] * 3


def test_kv_cache_scales_alone_load():
    quant = {"quant_method": "compressed-tensors", "config_groups": {}, "kv_cache_scheme": {"num_bits": 8}}
    assert ArchConfig.from_dict(_config("llama", quantization_config=quant))
    with pytest.raises(ValueError, match=r"config_groups\.g\.weights"):
        ArchConfig.from_dict(_config("llama", quantization_config={**quant, "config_groups": {"g": {}}}))


def test_a_refused_checkpoint_fails_to_load_with_the_key_named(tmp_path):
    build("qwen3-moe", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "hidden_act": "gelu"}))
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        LLM(str(tmp_path))


# --- the hybrid-attention families ---------------------------------------------------------------------

HYBRID_ARCH = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "gpt-oss": "GptOssForCausalLM",
               "llama4": "Llama4ForCausalLM"}


def _hybrid(family: str, **overrides) -> dict:
    cfg = hf_config(family).to_dict()
    return {**cfg, "architectures": [HYBRID_ARCH[family]], **overrides}


@pytest.mark.parametrize("family", sorted(HYBRID_ARCH))
def test_hybrid_configs_load_and_foreign_keys_are_refused(family):
    assert ArchConfig.from_dict(_hybrid(family)).architecture == HYBRID_ARCH[family]
    with pytest.raises(ValueError, match="clip_qkv"):
        ArchConfig.from_dict(_hybrid(family, clip_qkv=8.0))
    with pytest.raises(ValueError, match="layer_types"):
        ArchConfig.from_dict(_hybrid(family, layer_types=["mamba"] * 6))
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        ArchConfig.from_dict(_hybrid(family, use_bidirectional_attention=True))


@pytest.mark.parametrize("key, value, family", [
    ("attn_logit_softcapping", 50.0, "gemma3"),  # transformers' Gemma3ForCausalLM does not apply it
    ("hidden_activation", "gelu", "gemma2"),
    ("hidden_activation", "silu", "gemma3"),
    ("num_experts_per_tok", 2, "llama4"),        # Llama 4's experts scale their input: top-1 only
    ("attn_logit_softcapping", 30.0, "llama4"),
    ("query_pre_attn_scalar", 64, "gpt-oss"),
    ("use_qk_norm", True, "gemma2"),
    ("quantization_config", {"quant_method": "bitsandbytes", "load_in_4bit": True}, "gpt-oss"),
])
def test_hybrid_family_values_outside_the_build_are_refused_by_name(key, value, family):
    with pytest.raises(ValueError, match=key if key != "quantization_config" else "quant_method"):
        ArchConfig.from_dict(_hybrid(family, **{key: value}))


def test_experts_in_a_format_the_fused_moe_does_not_take_are_refused_by_name():
    """gpt-oss's MXFP4 release is served; GPTQ would quantise its stacked experts to int4, which the fused MoE
    does not read (int4 experts one tensor per expert load: `tests/engine/test_quantized_experts_rows_int4.py`)."""
    with pytest.raises(ValueError, match=r"config\.json: routed experts stored stacked per layer in int4 groups of "
                                         r"128 \(gptq\).* not computed by the fused MoE kernel"):
        ArchConfig.from_dict(_hybrid("gpt-oss", quantization_config={"quant_method": "gptq", "bits": 4}))


def test_each_familys_keys_reach_the_layer_description():
    g2 = ArchConfig.from_dict(_hybrid("gemma2", attn_logit_softcapping=25.0))
    assert {a.logit_softcap for a in g2.layer_attention} == {25.0} and g2.final_logit_softcap == 30.0
    assert g2.softmax_scale == 32 ** -0.5 and g2.embedding_scale == 8.0
    g3 = ArchConfig.from_dict(_hybrid("gemma3"))
    assert [(a.rope_theta, (a.rope_scaling or {}).get("factor")) for a in g3.layer_attention] == \
        [(10000.0, None)] * 5 + [(1e6, 2.0)]
    # a Hub-style Gemma 3 config (transformers 4): rope_theta, rope_local_base_freq, rope_scaling, a pattern
    old = {k: v for k, v in _hybrid("gemma3").items() if k not in ("rope_parameters", "layer_types")}
    old.update(rope_theta=5e5, rope_local_base_freq=2e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
               sliding_window_pattern=3)
    layers = ArchConfig.from_dict(old).layer_attention
    assert [a.kind for a in layers] == ["sliding", "sliding", "full"] * 2
    assert [a.rope_theta for a in layers[:3]] == [2e4, 2e4, 5e5] and layers[2].rope_scaling["factor"] == 8.0
    oss = ArchConfig.from_dict(_hybrid("gpt-oss"))
    assert all(a.sinks for a in oss.layer_attention) and oss.o_proj_bias and oss.moe.expert_bias
    assert (oss.moe.swiglu_alpha, oss.moe.swiglu_limit) == (1.702, 1.5)
    l4 = ArchConfig.from_dict(_hybrid("llama4", no_rope_layers=[1, 1, 1, 0], layer_types=None))
    assert [(a.kind, a.rope) for a in l4.layer_attention] == [("chunked", True)] * 3 + [("full", False)]
    assert l4.attn_temperature == (0.1, 8.0) and l4.qk_norm == "l2" and l4.intermediate_size == 128
    assert ArchConfig.from_dict(_hybrid("llama4", attn_temperature_tuning=False)).attn_temperature is None
    no_chunk = ArchConfig.from_dict(_hybrid("llama4", attention_chunk_size=None, layer_types=None))
    assert {a.kind for a in no_chunk.layer_attention} == {"full"}
