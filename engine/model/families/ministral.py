"""Ministral (``MinistralForCausalLM``, Ministral-8B): Mistral's layers with a sliding window per ``layer_types``
(by default every layer sliding when ``sliding_window`` is set, 4096 when the key is absent); no biases (the
class never reads ``attention_bias``).

Source: transformers 5.25 ``MinistralConfig`` / ``MinistralAttention``.
"""

from __future__ import annotations

from typing import Any

from pd_cluster.engine.layer_attention import FULL_SLIDING, kinds_from_layer_types
from pd_cluster.engine.model.family import Family


class Ministral(Family):
    architecture = "MinistralForCausalLM"
    name = "ministral"
    default_window = 4096
    ignored_keys = ("attention_bias",)

    def layer_kinds(self, cfg: dict[str, Any]) -> tuple[list[str], int | None, int | None]:
        layers = int(cfg["num_hidden_layers"])
        window = cfg.get("sliding_window", self.default_window)
        kinds = kinds_from_layer_types(cfg, layers, FULL_SLIDING)
        return kinds or ["sliding" if window is not None else "full"] * layers, window, None


FAMILIES = (Ministral(),)
