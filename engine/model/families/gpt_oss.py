"""gpt-oss (``GptOssForCausalLM``): attention sinks on every layer, biases on q, k, v and o (``attention_bias``,
true by default), RMSNorms that multiply in float32, ``layer_types`` by default sliding / full alternating
(window 128 when absent), and experts on every layer: top ``num_experts_per_tok`` of the biased router logits,
softmax over those k, a clamped SwiGLU (``swiglu_limit``, alpha 1.702) with biases. Its experts are stored
stacked, gate and up columns interleaved; its ``router`` is the model's ``gate``. ``hidden_act`` is not read
(the experts' activation is fixed).

Source: transformers 5.24 ``GptOssConfig``, ``GptOssTopKRouter``, ``GptOssExperts``, ``GptOssForCausalLM``.
"""

from __future__ import annotations

from typing import Any

from pd_cluster.engine.layer_attention import alternating
from pd_cluster.engine.model.family import Family
from pd_cluster.engine.model.moe_config import MoEConfig, RoutingConfig


class GptOss(Family):
    architecture = "GptOssForCausalLM"
    name = "gpt_oss"
    own_keys = ("swiglu_limit",)
    attention_bias_built = True
    default_window = 128
    sinks = True
    weight_renames = ((".mlp.router.", ".mlp.gate."),)
    expert_projections = None

    def check_activation(self, cfg: dict[str, Any]) -> None:
        """Its experts' clamped SwiGLU does not read hidden_act."""

    def layer_kinds(self, cfg: dict[str, Any]) -> tuple[list[str], int | None, int | None]:
        return alternating(cfg, int(cfg["num_hidden_layers"]), 2), cfg.get("sliding_window", self.default_window), None

    def moe(self, cfg: dict[str, Any]) -> MoEConfig | None:
        experts = int(cfg.get("num_local_experts") or 128)
        routing = RoutingConfig(experts, int(cfg.get("num_experts_per_tok") or 4), "softmax",
                                score_before_topk=False, router_bias=True)
        return MoEConfig(experts, int(cfg["intermediate_size"]), routing, tuple(range(int(cfg["num_hidden_layers"]))),
                         activation="swiglu_clamped", expert_bias=True,
                         swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                         swiglu_limit=float(cfg.get("swiglu_limit", 7.0)))

    def fields(self, cfg: dict[str, Any]) -> dict[str, Any]:
        bias = cfg.get("attention_bias")
        bias = True if bias is None else bool(bias)
        return {**super().fields(cfg), "attention_bias": bias, "o_proj_bias": bias, "norm_style": "float"}

    def split_gate_up(self, t: Any) -> tuple[Any, Any]:
        return t[..., 0::2], t[..., 1::2]  # interleaved gate and up columns


FAMILIES = (GptOss(),)
