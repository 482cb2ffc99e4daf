"""The families added one file each read their configs as transformers' classes do: the engine's parameter count
(what ``pd-plan`` sizes weights by) equals transformers' for each tiny checkpoint's language model; keys a class
never reads are ignored, and values the engine does not build are refused by name."""

from __future__ import annotations

import pytest
from family_models import NEW_FAMILIES
from random_models import FAMILIES, hf_config

from pd_cluster.engine.model.arch import ArchConfig
from pd_cluster.engine.planner.limits import unsupported_reason
from pd_cluster.engine.planner.spec import spec_from_config

NOT_TEXT = ("model.vision_tower.", "model.multi_modal_projector.")


def _config(family: str, text: dict | None = None, **overrides) -> dict:
    """`family`'s config.json as transformers writes it; `text` replaces keys of a multimodal one's text_config."""
    cfg = hf_config(family).to_dict()
    if text:
        cfg["text_config"] = {**cfg["text_config"], **text}
    return {**cfg, "architectures": [FAMILIES[family][0].__name__], **overrides}


@pytest.mark.parametrize("family", sorted(NEW_FAMILIES))
def test_parameter_counts_and_planner_agree_with_transformers(family):
    model = FAMILIES[family][0](hf_config(family))
    params = sum(p.numel() for name, p in model.named_parameters() if not name.startswith(NOT_TEXT))
    params += sum(b.numel() for name, b in model.named_buffers() if name.endswith("e_score_correction_bias"))
    cfg = _config(family)
    assert ArchConfig.from_dict(cfg).num_params() == params
    spec = spec_from_config(cfg, family)
    assert unsupported_reason(spec) is None and spec.num_params() == params


@pytest.mark.parametrize("family, text, overrides, named", [
    ("cohere", None, {"use_qk_norm": True}, "use_qk_norm"),
    ("gemma3-multimodal", {"final_logit_softcapping": 30.0}, {}, "final_logit_softcapping"),
    ("mistral3-multimodal", {"model_type": "ministral3"}, {}, "model_type"),
    ("phimoe", None, {"num_experts_per_tok": 1}, "num_experts_per_tok"),
    ("starcoder2", None, {"hidden_act": "gelu"}, "hidden_act"),
    ("olmo2", None, {"mlp_bias": True}, "mlp_bias"),
    ("exaone4", None, {"clip_qkv": 8.0}, "clip_qkv"),
    ("glm4", None, {"rope_parameters": {"rope_type": "llama4", "rope_theta": 1e4}}, "rope_type"),
])
def test_values_outside_the_build_are_refused_by_name(family, text, overrides, named):
    with pytest.raises(ValueError, match=named):
        ArchConfig.from_dict(_config(family, text, **overrides))


def test_keys_a_class_never_reads_are_ignored_and_its_own_are_read():
    assert not ArchConfig.from_dict(_config("ministral", attention_bias=True)).attention_bias
    qwen = _config("qwen2-moe", attention_bias=True)
    assert ArchConfig.from_dict(qwen).attention_bias and not ArchConfig.from_dict({**qwen, "qkv_bias": False}).attention_bias
    granite = ArchConfig.from_dict(_config("granite"))
    assert (granite.embedding_scale, granite.residual_multiplier, granite.softmax_scale, granite.logit_divisor) == \
        (3.0, 0.5, 0.25, 2.5)
    glm = ArchConfig.from_dict(_config("glm4"))
    assert glm.rotary_dim == 8 and glm.rope_interleaved and glm.norm_layout == "sandwich"
    assert ArchConfig.from_dict(_config("cohere")).logit_scale == 0.5
    # the multimodal classes: the text model's keys, the top level's tie
    mistral3 = ArchConfig.from_dict(_config("mistral3-multimodal"))
    assert not mistral3.tie_word_embeddings and {a.window for a in mistral3.layer_attention} == {16}
    assert ArchConfig.from_dict(_config("mistral3-multimodal", tie_word_embeddings=True)).tie_word_embeddings
