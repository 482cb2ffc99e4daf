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
from pd_cluster.engine.model.families.qwen2_moe import gated_shared_expert_moe
from pd_cluster.engine.model.family import Family
from pd_cluster.engine.model.linear_config import LinearAttentionConfig
from pd_cluster.engine.model.moe_config import MoEConfig

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
        return gated_shared_expert_moe(cfg, default_top_k=10, default_renormalize=True)

    def fields(self, cfg: dict[str, Any]) -> dict[str, Any]:
        linear = LinearAttentionConfig(int(cfg.get("linear_num_key_heads", 16)),
                                       int(cfg.get("linear_num_value_heads", 32)),
                                       int(cfg.get("linear_key_head_dim", 128)),
                                       int(cfg.get("linear_value_head_dim", 128)),
                                       int(cfg.get("linear_conv_kernel_dim", 4)))
        return {**super().fields(cfg), "qk_norm": "gemma", "norm_style": "gemma", "attn_output_gate": True,
                "linear": linear}

    def check_family(self, cfg: dict[str, Any]) -> None:
        """The linear layers' convolution and gate apply ``hidden_act`` too: only SiLU is built there; quantised
        checkpoints are not built."""
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise refuse("hidden_act", act, f"{self.architecture}: silu (the linear-attention layers apply it)")
        quant = cfg.get("quantization_config")
        if quant:
            method = quant.get("quant_method") if isinstance(quant, dict) else quant
            raise refuse("quantization_config", method, f"{self.architecture}: unquantised checkpoints")


FAMILIES = (Qwen3Next(),)
