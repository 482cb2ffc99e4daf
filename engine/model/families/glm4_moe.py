"""GLM-4-MoE (``Glm4MoeForCausalLM``, GLM-4.5 / 4.6): Llama's layer layout, RoPE over the first
``partial_rotary_factor`` of each head (0.5; rotate-half order), q/k/v biases (``attention_bias``; no o_proj
bias), an RMSNorm over each q and k head with ``use_qk_norm``, dense MLPs before ``first_k_dense_replace`` and
then DeepSeek-V3's mixture of experts: sigmoid scores with ``e_score_correction_bias`` choosing, grouped top-k
(``n_group``, ``topk_group``, groups scored by their best two), ``norm_topk_prob``, ``routed_scaling_factor``,
and ``n_shared_experts`` shared experts. The multi-token-prediction layers past ``num_hidden_layers``
(``num_nextn_predict_layers``) are not read, as transformers does.

Source: transformers 5.25 ``Glm4MoeConfig``, ``Glm4MoeAttention``, ``Glm4MoeTopkRouter``, ``Glm4MoeMoE``.
"""

from __future__ import annotations

from typing import Any

from pd_cluster.engine.model.families.deepseek import deepseek_moe
from pd_cluster.engine.model.family import Family
from pd_cluster.engine.model.moe_config import MoEConfig


class Glm4Moe(Family):
    architecture = "Glm4MoeForCausalLM"
    name = "glm4_moe"
    own_keys = ("use_qk_norm",)
    partial_rotary = True
    default_partial_rotary = 0.5
    default_head_dim = 128
    attention_bias_built = True
    expert_projections = ("gate_proj", "up_proj", "down_proj")

    def layer_kinds(self, cfg: dict[str, Any]) -> tuple[list[str], int | None, int | None]:
        return ["full"] * int(cfg["num_hidden_layers"]), None, None

    def moe(self, cfg: dict[str, Any]) -> MoEConfig | None:
        defaults = {"first_k_dense_replace": 1, "norm_topk_prob": True, "n_shared_experts": 1}  # Glm4MoeConfig's
        return deepseek_moe({**defaults, **cfg, "moe_layer_freq": 1, "topk_method": "noaux_tc",
                             "scoring_func": "sigmoid"}, v3=True)

    def fields(self, cfg: dict[str, Any]) -> dict[str, Any]:
        return {**super().fields(cfg), "qk_norm": "rms" if cfg.get("use_qk_norm") else ""}


FAMILIES = (Glm4Moe(),)
