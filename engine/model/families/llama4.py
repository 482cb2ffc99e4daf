"""Llama 4's text model (``Llama4ForCausalLM``), and the language model of ``Llama4ForConditionalGeneration``
(its ``text_config``; text input only, the vision tower is not read).

Chunked local attention on the RoPE layers (``attention_chunk_size``, default 8192) and NoPE global layers
(``no_rope_layers[i] == 0``, default every ``no_rope_layer_interval``-th, 4) with attention temperature tuning
(``attn_scale``, ``floor_scale``; ``attn_temperature_tuning``), an L2 norm of q and k after RoPE on RoPE layers
(``use_qk_norm``), RoPE on interleaved pairs (the loader permutes q and k rows), ``attention_bias`` on q, k, v
and o, dense MLPs of ``intermediate_size_mlp``, and a top-1 sigmoid MoE with a shared expert of the experts'
width on ``moe_layers`` (default every ``interleave_moe_layer_step``-th from step - 1) whose router score
scales the expert's input. Its ``feed_forward`` is the model's ``mlp``, ``router`` the ``gate``,
``shared_expert`` the ``shared_experts``; experts are stored stacked (gate then up columns).

Source: transformers 5.24 ``Llama4TextConfig``, ``Llama4TextAttention``, ``Llama4TextMoe``, ``Llama4Router``,
``Llama4ForCausalLM``, ``Llama4ForConditionalGeneration``.
"""

from __future__ import annotations

from typing import Any

from pd_cluster.engine.layer_attention import kinds_from_layer_types, refuse, rope_layers
from pd_cluster.engine.model.family import Family
from pd_cluster.engine.model.moe_config import MoEConfig, RoutingConfig

class Llama4(Family):
    architecture = "Llama4ForCausalLM"
    name = "llama4"
    own_keys = ("use_qk_norm",)
    attention_bias_built = True
    weight_renames = ((".feed_forward.", ".mlp."), (".mlp.router.", ".mlp.gate."),
                      (".mlp.shared_expert.", ".mlp.shared_experts."))
    expert_projections = None

    def check_family(self, cfg: dict[str, Any]) -> None:
        top_k = int(cfg.get("num_experts_per_tok") or 1)
        if top_k != 1 and int(cfg.get("num_local_experts") or 0):
            raise refuse("num_experts_per_tok", top_k, "Llama 4's routed experts scale their input by the router "
                                                       "score, which the engine builds for top-1 routing only")

    def layer_kinds(self, cfg: dict[str, Any]) -> tuple[list[str], int | None, int | None]:
        chunk = cfg.get("attention_chunk_size", 8192)  # Llama4TextConfig's default
        kinds = kinds_from_layer_types(cfg, int(cfg["num_hidden_layers"]), ("full_attention", "chunked_attention"))
        if kinds is None:
            kinds = ["chunked" if use_rope and chunk is not None else "full" for use_rope in rope_layers(cfg)]
        return kinds, None, chunk

    def layer_rope(self, cfg: dict[str, Any], kind: str, layer: int, theta: float,
                   scaling: dict[str, Any] | None) -> tuple[bool, float, dict[str, Any] | None]:
        return rope_layers(cfg)[layer], theta, scaling

    def moe(self, cfg: dict[str, Any]) -> MoEConfig | None:
        experts = int(cfg.get("num_local_experts") or 16)
        given = cfg.get("moe_layers")
        step = int(cfg.get("interleave_moe_layer_step") or 1)
        layers = int(cfg["num_hidden_layers"])
        moe_layers = tuple(int(i) for i in given) if given is not None else tuple(range(step - 1, layers, step))
        inter = int(cfg["intermediate_size"])
        routing = RoutingConfig(experts, int(cfg.get("num_experts_per_tok") or 1), "sigmoid",
                                score_before_topk=False, apply_weights_on_input=True, weights_in_activation_dtype=True)
        return MoEConfig(experts, inter, routing, moe_layers, shared_intermediate_size=inter,
                         activation=str(cfg.get("hidden_act", "silu")))

    def fields(self, cfg: dict[str, Any]) -> dict[str, Any]:
        tuning = cfg.get("attn_temperature_tuning", True)
        return {**super().fields(cfg), "o_proj_bias": bool(cfg.get("attention_bias")),
                "intermediate_size": int(cfg.get("intermediate_size_mlp") or cfg["intermediate_size"]),
                "qk_norm": "l2" if cfg.get("use_qk_norm", True) else "",
                "attn_temperature": ((float(cfg.get("attn_scale", 0.1)), float(cfg.get("floor_scale", 8192)))
                                     if tuning else None),
                "rope_interleaved": True}


class Llama4Multimodal(Llama4):
    architecture = "Llama4ForConditionalGeneration"
    language_model_prefix = "language_model."
    skipped_prefixes = ("vision_model.", "multi_modal_projector.")


FAMILIES = (Llama4(), Llama4Multimodal())
