"""GLM-4 (``Glm4ForCausalLM``, GLM-4-0414): a norm before and after attention and before and after the MLP
(its ``post_self_attn_layernorm``, ``post_attention_layernorm`` and ``post_mlp_layernorm`` are the model's
post-attention, pre-feedforward and post-feedforward norms), RoPE over the first ``partial_rotary_factor`` of
each head (0.5) on interleaved pairs (the loader permutes those q and k rows), q/k/v biases
(``attention_bias``, true by default; no o_proj bias), and gate/up stored pre-fused (``gate_up_proj``).

Source: transformers 5.25 ``Glm4Config``, ``Glm4Attention`` (its ``apply_rotary_pos_emb``), ``Glm4DecoderLayer``.
"""

from __future__ import annotations

from typing import Any

from pd_cluster.engine.model.family import Family


class Glm4(Family):
    architecture = "Glm4ForCausalLM"
    name = "glm4"
    partial_rotary = True
    default_partial_rotary = 0.5
    default_head_dim = 128
    attention_bias_built = True
    # the order matters: post_attention_layernorm is renamed before post_self_attn_layernorm takes its name
    weight_renames = ((".post_attention_layernorm.", ".pre_feedforward_layernorm."),
                      (".post_self_attn_layernorm.", ".post_attention_layernorm."),
                      (".post_mlp_layernorm.", ".post_feedforward_layernorm."))

    def layer_kinds(self, cfg: dict[str, Any]) -> tuple[list[str], int | None, int | None]:
        return ["full"] * int(cfg["num_hidden_layers"]), None, None

    def fields(self, cfg: dict[str, Any]) -> dict[str, Any]:
        return {**super().fields(cfg), "attention_bias": bool(cfg.get("attention_bias", True)),
                "norm_layout": "sandwich", "rope_interleaved": True}


FAMILIES = (Glm4(),)
