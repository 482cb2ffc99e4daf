"""Granite (``GraniteForCausalLM``, Granite 3.x dense): Llama's layers with four multipliers: the embeddings
(``embedding_multiplier``), each block's output before its residual add (``residual_multiplier``), the softmax
scale (``attention_multiplier``, replacing ``head_dim ** -0.5``) and the logits, divided by
``logits_scaling``; ``attention_bias`` on q, k, v and o, ``mlp_bias``.

Source: transformers 5.25 ``GraniteConfig`` / ``GraniteForCausalLM``.
"""

from __future__ import annotations

from typing import Any

from pd_cluster.engine.model.family import Family


class Granite(Family):
    architecture = "GraniteForCausalLM"
    name = "granite"
    own_keys = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
    attention_bias_built = True
    mlp_bias_built = True

    def layer_kinds(self, cfg: dict[str, Any]) -> tuple[list[str], int | None, int | None]:
        return ["full"] * int(cfg["num_hidden_layers"]), None, None

    def fields(self, cfg: dict[str, Any]) -> dict[str, Any]:
        return {**super().fields(cfg), "o_proj_bias": bool(cfg.get("attention_bias")),
                "embedding_scale": float(cfg.get("embedding_multiplier", 1.0)),
                "residual_multiplier": float(cfg.get("residual_multiplier", 1.0)),
                "attention_scale": float(cfg.get("attention_multiplier", 1.0)),
                "logit_divisor": float(cfg.get("logits_scaling", 1.0))}


FAMILIES = (Granite(),)
