"""Qwen3 (``Qwen3ForCausalLM``): Qwen2's layer layout without its biases, and an RMSNorm over each q and k head
before RoPE (``q_norm`` / ``k_norm``).

Source: transformers 5.24 ``Qwen3Config`` / ``Qwen3Attention``.
"""

from __future__ import annotations

from typing import Any

from pd_cluster.engine.model.families.qwen2 import qwen_window_layers
from pd_cluster.engine.model.family import Family


class Qwen3(Family):
    architecture = "Qwen3ForCausalLM"
    name = "qwen3"

    def layer_kinds(self, cfg: dict[str, Any]) -> tuple[list[str], int | None, int | None]:
        return qwen_window_layers(cfg)

    def fields(self, cfg: dict[str, Any]) -> dict[str, Any]:
        return {**super().fields(cfg), "qk_norm": "rms"}


FAMILIES = (Qwen3(),)
