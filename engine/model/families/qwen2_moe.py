"""Qwen2-MoE (``Qwen2MoeForCausalLM``, Qwen1.5-MoE / Qwen2-57B-A14B): Qwen2's attention (q/k/v biases, from
``qkv_bias``, true by default; the class never reads ``attention_bias``) and layer layout, experts on the
layers ``(i + 1) % decoder_sparse_step == 0`` not in ``mlp_only_layers`` (the others dense, of
``intermediate_size``): softmax over ``num_experts`` router logits, the top ``num_experts_per_tok``
renormalised when ``norm_topk_prob``, weights rounded to the activation dtype; and a shared expert of
``shared_expert_intermediate_size`` that every token goes through, scaled by ``sigmoid(x @ shared_expert_gate)``.
Its ``shared_expert`` is the model's ``shared_experts``.

Source: transformers 5.25 ``Qwen2MoeConfig``, ``Qwen2MoeAttention``, ``Qwen2MoeTopKRouter``,
``Qwen2MoeSparseMoeBlock``.
"""

from __future__ import annotations

from typing import Any

from pd_cluster.engine.model.families.qwen2 import qwen_window_layers
from pd_cluster.engine.model.families.qwen3_moe import sparse_step_layers
from pd_cluster.engine.model.family import Family
from pd_cluster.engine.model.moe_config import MoEConfig, RoutingConfig


def gated_shared_expert_moe(cfg: dict[str, Any], default_top_k: int, default_renormalize: bool) -> MoEConfig | None:
    """The MoE of the Qwen MoE classes with a gated shared expert (Qwen2-MoE, Qwen3-Next), None without
    ``num_experts``: softmax top ``num_experts_per_tok`` (`default_top_k`), renormalised when ``norm_topk_prob``
    (`default_renormalize`), weights rounded to the activation dtype; a shared expert of
    ``shared_expert_intermediate_size`` scaled by its sigmoid gate; on `sparse_step_layers`."""
    experts = int(cfg.get("num_experts") or 0)
    if not experts:
        return None
    routing = RoutingConfig(experts, int(cfg.get("num_experts_per_tok") or default_top_k), "softmax",
                            renormalize=bool(cfg.get("norm_topk_prob", default_renormalize)),
                            weights_in_activation_dtype=True)
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    return MoEConfig(experts, int(cfg["moe_intermediate_size"]), routing, sparse_step_layers(cfg),
                     shared_intermediate_size=shared, shared_expert_gate=shared > 0,
                     activation=str(cfg.get("hidden_act", "silu")))


class Qwen2Moe(Family):
    architecture = "Qwen2MoeForCausalLM"
    name = "qwen2_moe"
    ignored_keys = ("attention_bias",)
    weight_renames = ((".mlp.shared_expert.", ".mlp.shared_experts."),)
    expert_projections = ("gate_proj", "up_proj", "down_proj")

    def layer_kinds(self, cfg: dict[str, Any]) -> tuple[list[str], int | None, int | None]:
        return qwen_window_layers(cfg)

    def moe(self, cfg: dict[str, Any]) -> MoEConfig | None:
        return gated_shared_expert_moe(cfg, default_top_k=4, default_renormalize=False)

    def fields(self, cfg: dict[str, Any]) -> dict[str, Any]:
        return {**super().fields(cfg), "attention_bias": bool(cfg.get("qkv_bias", True))}


FAMILIES = (Qwen2Moe(),)
