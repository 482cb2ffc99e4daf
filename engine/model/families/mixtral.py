"""Mixtral (``MixtralForCausalLM``): Mistral's attention (one window on every layer when ``sliding_window`` is
set) and a mixture of experts on every layer: softmax over ``num_local_experts`` router logits, the top
``num_experts_per_tok`` renormalised, weights kept in float32. Its ``block_sparse_moe`` is the model's ``mlp``
(experts ``w1``/``w3``/``w2``: gate, up, down).

Source: transformers 5.24 ``MixtralConfig``, ``MixtralTopKRouter``, ``MixtralForCausalLM``.
"""

from __future__ import annotations

from typing import Any

from pd_cluster.engine.model.family import Family
from pd_cluster.engine.model.moe_config import MoEConfig, RoutingConfig


class Mixtral(Family):
    architecture = "MixtralForCausalLM"
    name = "mixtral"
    weight_renames = ((".block_sparse_moe.", ".mlp."),)
    expert_projections = ("w1", "w3", "w2")

    def moe(self, cfg: dict[str, Any]) -> MoEConfig | None:
        experts = int(cfg.get("num_local_experts") or 8)
        routing = RoutingConfig(experts, int(cfg.get("num_experts_per_tok") or 2), "softmax", renormalize=True)
        return MoEConfig(experts, int(cfg["intermediate_size"]), routing, tuple(range(int(cfg["num_hidden_layers"]))),
                         activation=str(cfg.get("hidden_act", "silu")))


FAMILIES = (Mixtral(),)
