"""Cohere (``CohereForCausalLM``, Command R): one LayerNorm per layer (mean removed, a weight and no bias, in
float32; eps ``layer_norm_eps``) read by attention and the MLP in parallel, both outputs joining the residual;
RoPE on interleaved pairs (the loader permutes q and k rows); ``attention_bias`` on q, k, v and o; logits
multiplied by ``logit_scale``; tied embeddings by default. ``use_qk_norm`` (a LayerNorm per q and k head, with
a weight per head) is not built and is refused.

Source: transformers 5.25 ``CohereConfig``, ``CohereLayerNorm``, ``CohereAttention`` (its ``rotate_half``),
``CohereDecoderLayer``, ``CohereForCausalLM``.
"""

from __future__ import annotations

from typing import Any

from pd_cluster.engine.layer_attention import refuse
from pd_cluster.engine.model.families.llama import Llama


class Cohere(Llama):
    architecture = "CohereForCausalLM"
    name = "cohere"
    own_keys = ("logit_scale",)
    attention_bias_built = True

    def check_family(self, cfg: dict[str, Any]) -> None:
        if cfg.get("use_qk_norm"):
            raise refuse("use_qk_norm", cfg["use_qk_norm"], f"{self.architecture} without q/k LayerNorms")

    def fields(self, cfg: dict[str, Any]) -> dict[str, Any]:
        scale = cfg.get("logit_scale", 0.0625)
        return {**super().fields(cfg), "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
                "o_proj_bias": bool(cfg.get("attention_bias")), "rms_norm_eps": float(cfg.get("layer_norm_eps", 1e-5)),
                "norm_style": "layernorm", "norm_layout": "parallel", "rope_interleaved": True,
                "logit_scale": float(scale) if scale is not None else None}


FAMILIES = (Cohere(),)
