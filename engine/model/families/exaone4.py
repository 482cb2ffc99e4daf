"""EXAONE 4 (``Exaone4ForCausalLM``): norms after attention and after the MLP only, an RMSNorm over each q and k
head before RoPE, ``layer_types`` (by default ``sliding_window_pattern`` - 1 sliding layers to 1 full); with a
``sliding_window`` the full layers take no RoPE (global NoPE), without one every layer rotates. No biases.

Source: transformers 5.25 ``Exaone4Config``, ``Exaone4Attention``, ``Exaone4DecoderLayer``.
"""

from __future__ import annotations

from typing import Any

from pd_cluster.engine.layer_attention import FULL_SLIDING, alternating, kinds_from_layer_types
from pd_cluster.engine.model.family import Family


class Exaone4(Family):
    architecture = "Exaone4ForCausalLM"
    name = "exaone4"
    default_window = 4096
    ignored_keys = ("attention_bias",)

    def layer_kinds(self, cfg: dict[str, Any]) -> tuple[list[str], int | None, int | None]:
        window = cfg.get("sliding_window", self.default_window)
        pattern = cfg.get("sliding_window_pattern", 4)
        pattern = len(pattern) if isinstance(pattern, str) else int(pattern or 0)  # "LLLG" is 4
        layers = int(cfg["num_hidden_layers"])
        kinds = kinds_from_layer_types(cfg, layers, FULL_SLIDING)
        if kinds is None:
            kinds = ["full"] * layers if window is None or not pattern else alternating(cfg, layers, pattern)
        return kinds, window, None

    def layer_rope(self, cfg: dict[str, Any], kind: str, layer: int, theta: float,
                   scaling: dict[str, Any] | None) -> tuple[bool, float, dict[str, Any] | None]:
        nope = cfg.get("sliding_window", self.default_window) is not None and kind != "sliding"
        return not nope, theta, scaling

    def fields(self, cfg: dict[str, Any]) -> dict[str, Any]:
        return {**super().fields(cfg), "qk_norm": "rms", "norm_layout": "post"}


FAMILIES = (Exaone4(),)
