"""Qwen3-Next (``Qwen3NextForCausalLM``, Qwen3-Next-80B-A3B): ``layer_types`` of ``linear_attention`` (Gated
DeltaNet, `pd_cluster.engine.model.gated_deltanet`: a recurrent state per request, the pool's state group) and
``full_attention`` (by default every ``full_attention_interval``-th layer, 4); the full layers are gated
attention: q/k ``(1 + w)`` RMSNorms per head, RoPE on the first ``partial_rotary_factor`` (0.25) of each head,
and q_proj giving each head's q and then its output gate (``sigmoid(gate) * out`` before o_proj). Every norm is
the ``(1 + w)`` RMSNorm but the linear layers' gated output norm (``w * x``). Experts as Qwen2-MoE's: softmax
over ``num_experts``, top ``num_experts_per_tok`` renormalised when ``norm_topk_prob``, on the layers
``(i + 1) % decoder_sparse_step == 0`` not in ``mlp_only_layers``, with a shared expert scaled by
``sigmoid(x @ shared_expert_gate)``.

The prefix cache is off for this family (`pd_cluster.engine.llm_engine`): a cached prefix's pages would lack the
linear layers' states at that prefix's end. Quantised checkpoints are refused.

Source: transformers 5.25 ``Qwen3NextConfig``, ``Qwen3NextAttention``, ``Qwen3NextGatedDeltaNet``,
``Qwen3NextSparseMoeBlock``, ``Qwen3NextRMSNorm``.
"""

from __future__ import annotations

from typing import Any

from pd_cluster.engine.layer_attention import kinds_from_layer_types, refuse
from pd_cluster.engine.model.families.qwen3_moe import sparse_step_layers
from pd_cluster.engine.model.family import Family
from pd_cluster.engine.model.linear_config import LinearAttentionConfig
from pd_cluster.engine.model.moe_config import MoEConfig, RoutingConfig

LAYER_TYPES = ("full_attention", "linear_attention")


class Qwen3Next(Family):
    architecture = "Qwen3NextForCausalLM"
    name = "qwen3_next"
    partial_rotary = True
    default_partial_rotary = 0.25
    weight_renames = ((".mlp.shared_expert.", ".mlp.shared_experts."),)

    def layer_kinds(self, cfg: dict[str, Any]) -> tuple[list[str], int | None, int | None]:
        layers = int(cfg["num_hidden_layers"])
        kinds = kinds_from_layer_types(cfg, layers, LAYER_TYPES)
        if kinds is None:
            interval = int(cfg.get("full_attention_interval") or 4)
            kinds = ["linear" if (i + 1) % interval else "full" for i in range(layers)]
        return kinds, None, None

    def moe(self, cfg: dict[str, Any]) -> MoEConfig | None:
        experts = int(cfg.get("num_experts") or 0)
        if not experts:
            return None
        routing = RoutingConfig(experts, int(cfg.get("num_experts_per_tok") or 10), "softmax",
                                renormalize=bool(cfg.get("norm_topk_prob", True)), weights_in_activation_dtype=True)
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)
        return MoEConfig(experts, int(cfg["moe_intermediate_size"]), routing, sparse_step_layers(cfg),
                         shared_intermediate_size=shared, shared_expert_gate=shared > 0,
                         activation=str(cfg.get("hidden_act", "silu")))

    def fields(self, cfg: dict[str, Any]) -> dict[str, Any]:
        linear = LinearAttentionConfig(int(cfg.get("linear_num_key_heads", 16)),
                                       int(cfg.get("linear_num_value_heads", 32)),
                                       int(cfg.get("linear_key_head_dim", 128)),
                                       int(cfg.get("linear_value_head_dim", 128)),
                                       int(cfg.get("linear_conv_kernel_dim", 4)))
        return {**super().fields(cfg), "attention_bias": False, "qk_norm": "gemma", "norm_style": "gemma",
                "attn_output_gate": True, "linear": linear}

    def check_family(self, cfg: dict[str, Any]) -> None:
        if cfg.get("quantization_config"):
            raise refuse("quantization_config", cfg["quantization_config"].get("quant_method"),
                         f"{self.architecture}: unquantised checkpoints")


FAMILIES = (Qwen3Next(),)
