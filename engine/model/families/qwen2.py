"""Qwen2 (``Qwen2ForCausalLM``): Llama's layers with q/k/v biases (``attention_bias``, true by default; no o_proj
bias), and sliding windows per ``layer_types``, or without it from layer ``max_window_layers`` on, only when
``use_sliding_window`` is true (``Qwen2Config.__post_init__`` drops the window otherwise).

Source: transformers 5.24 ``Qwen2Config`` / ``Qwen2Attention``.
"""

from __future__ import annotations

from typing import Any

from pd_cluster.engine.layer_attention import FULL_SLIDING, kinds_from_layer_types
from pd_cluster.engine.model.family import Family


def qwen_window_layers(cfg: dict[str, Any]) -> tuple[list[str], int | None, int | None]:
    """Qwen2 and Qwen3's layers: ``layer_types``, else sliding from ``max_window_layers`` (default 28) on; no
    window unless ``use_sliding_window``."""
    layers = int(cfg["num_hidden_layers"])
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
    kinds = kinds_from_layer_types(cfg, layers, FULL_SLIDING)
    if kinds is None:
        first = int(cfg.get("max_window_layers", 28))
        kinds = ["sliding" if window is not None and i >= first else "full" for i in range(layers)]
    return kinds, window, None


class Qwen2(Family):
    architecture = "Qwen2ForCausalLM"
    name = "qwen2"
    attention_bias_built = True

    def layer_kinds(self, cfg: dict[str, Any]) -> tuple[list[str], int | None, int | None]:
        return qwen_window_layers(cfg)

    def fields(self, cfg: dict[str, Any]) -> dict[str, Any]:
        bias = cfg.get("attention_bias")
        return {**super().fields(cfg), "attention_bias": bool(bias if bias is not None else True)}


FAMILIES = (Qwen2(),)
