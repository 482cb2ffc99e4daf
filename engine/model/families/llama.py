"""Llama 2 / 3 (``LlamaForCausalLM``): pre-norm RMSNorm, RoPE (with Llama 3.1's ``llama3`` scaling and the
other `ROPE_TYPES`), grouped-query attention, SwiGLU; every layer full (``LlamaConfig`` has no window).

Source: transformers 5.24 ``LlamaConfig`` / ``LlamaForCausalLM``.
"""

from __future__ import annotations

from typing import Any

from pd_cluster.engine.model.family import Family


class Llama(Family):
    architecture = "LlamaForCausalLM"
    name = "llama"

    def layer_kinds(self, cfg: dict[str, Any]) -> tuple[list[str], int | None, int | None]:
        return ["full"] * int(cfg["num_hidden_layers"]), None, None


FAMILIES = (Llama(),)
