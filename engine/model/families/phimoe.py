"""Phi-3.5-MoE (``PhimoeForCausalLM``): torch LayerNorms with weight and bias (eps ``rms_norm_eps``), biases on
q, k, v and o (``attention_bias``) and on the LM head (``lm_head_bias``), experts on every layer routed by
sparsemixer (top-2; `moe_config.RoutingConfig`, ``router_jitter_noise`` its ``jitter_eps``), longrope whose
cos/sin scale is ``short_mscale`` or ``long_mscale`` with the short or long factors, one window on every layer
when ``sliding_window`` is set. Its ``block_sparse_moe`` is the model's ``mlp`` (experts ``w1``/``w3``/``w2``).
transformers 5.25's class always rotates by the short factors (it switches only the mscale past
``original_max_position_embeddings``); the engine pairs the long factors with ``long_mscale``, as for Phi-3.

Source: transformers 5.25 ``PhimoeConfig``, ``PhimoeRotaryEmbedding``, ``PhimoeTopKRouter`` (``sparsemixer``),
``PhimoeForCausalLM``.
"""

from __future__ import annotations

from typing import Any

from pd_cluster.engine.model.family import Family
from pd_cluster.engine.model.moe_config import MoEConfig, RoutingConfig


class Phimoe(Family):
    architecture = "PhimoeForCausalLM"
    name = "phimoe"
    rope_types = ("default", "longrope")
    attention_bias_built = True
    weight_renames = ((".block_sparse_moe.", ".mlp."),)
    expert_projections = ("w1", "w3", "w2")

    def moe(self, cfg: dict[str, Any]) -> MoEConfig | None:
        experts = int(cfg.get("num_local_experts") or 16)
        routing = RoutingConfig(experts, int(cfg.get("num_experts_per_tok") or 2), "sparsemixer",
                                weights_in_activation_dtype=True,
                                jitter_eps=float(cfg.get("router_jitter_noise", 0.01)))
        return MoEConfig(experts, int(cfg["intermediate_size"]), routing, tuple(range(int(cfg["num_hidden_layers"]))),
                         activation=str(cfg.get("hidden_act", "silu")))

    def fields(self, cfg: dict[str, Any]) -> dict[str, Any]:
        bias = bool(cfg.get("attention_bias"))
        return {**super().fields(cfg), "o_proj_bias": bias, "lm_head_bias": bool(cfg.get("lm_head_bias")),
                "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-5)), "norm_style": "layernorm_bias"}


FAMILIES = (Phimoe(),)
