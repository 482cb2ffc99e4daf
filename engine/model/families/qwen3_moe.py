"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (q/k RMSNorm; one window on every layer when
``use_sliding_window``), and experts on the layers ``(i + 1) % decoder_sparse_step == 0`` not in
``mlp_only_layers``: softmax over ``num_experts`` router logits, the top ``num_experts_per_tok`` renormalised
when ``norm_topk_prob``, weights rounded to the activation dtype.

Source: transformers 5.24 ``Qwen3MoeConfig``, ``Qwen3MoeTopKRouter``, ``Qwen3MoeSparseMoeBlock``.
"""

from __future__ import annotations

from typing import Any

from pd_cluster.engine.model.families.qwen3 import Qwen3
from pd_cluster.engine.model.moe_config import MoEConfig, RoutingConfig


def sparse_step_layers(cfg: dict[str, Any]) -> tuple[int, ...]:
    """The MoE layers of the Qwen MoE classes: ``(i + 1) % decoder_sparse_step == 0`` and not in
    ``mlp_only_layers``."""
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = {int(i) for i in cfg.get("mlp_only_layers") or ()}
    return tuple(i for i in range(int(cfg["num_hidden_layers"])) if i not in dense and (i + 1) % step == 0)


class Qwen3Moe(Qwen3):
    architecture = "Qwen3MoeForCausalLM"
    name = "qwen3_moe"

    def layer_kinds(self, cfg: dict[str, Any]) -> tuple[list[str], int | None, int | None]:
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
        return ["sliding" if window is not None else "full"] * int(cfg["num_hidden_layers"]), window, None

    def moe(self, cfg: dict[str, Any]) -> MoEConfig | None:
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        if not experts:
            return None
        routing = RoutingConfig(experts, int(cfg.get("num_experts_per_tok") or 8), "softmax",
                                renormalize=bool(cfg.get("norm_topk_prob", False)),
                                weights_in_activation_dtype=True)
        return MoEConfig(experts, int(cfg["moe_intermediate_size"]), routing, sparse_step_layers(cfg),
                         activation=str(cfg.get("hidden_act", "silu")))


FAMILIES = (Qwen3Moe(),)
