"""SmolLM3 (``SmolLM3ForCausalLM``): Llama's layers with NoPE layers (``no_rope_layers[i] == 0``; by default every
``no_rope_layer_interval``-th, 4), a sliding window on the ``layer_types`` layers marked sliding only when
``use_sliding_window`` (by default the NoPE layers), ``attention_bias`` on q, k, v and o, ``mlp_bias``, tied
embeddings by default.

Source: transformers 5.25 ``SmolLM3Config`` / ``SmolLM3Attention``.
"""

from __future__ import annotations

from typing import Any

from pd_cluster.engine.layer_attention import FULL_SLIDING, kinds_from_layer_types, rope_layers
from pd_cluster.engine.model.family import Family


class SmolLM3(Family):
    architecture = "SmolLM3ForCausalLM"
    name = "smollm3"
    attention_bias_built = True
    mlp_bias_built = True

    def layer_kinds(self, cfg: dict[str, Any]) -> tuple[list[str], int | None, int | None]:
        layers = int(cfg["num_hidden_layers"])
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
        kinds = kinds_from_layer_types(cfg, layers, FULL_SLIDING)
        if kinds is None:
            kinds = ["sliding" if window is not None and not rope else "full" for rope in rope_layers(cfg)]
        return kinds, window, None

    def layer_rope(self, cfg: dict[str, Any], kind: str, layer: int, theta: float,
                   scaling: dict[str, Any] | None) -> tuple[bool, float, dict[str, Any] | None]:
        return rope_layers(cfg)[layer], theta, scaling

    def fields(self, cfg: dict[str, Any]) -> dict[str, Any]:
        bias = bool(cfg.get("attention_bias"))
        return {**super().fields(cfg), "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
                "o_proj_bias": bias}


FAMILIES = (SmolLM3(),)
