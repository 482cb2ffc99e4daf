"""Mistral (``MistralForCausalLM``): Llama's layers with one sliding window on every layer when
``sliding_window`` is set (4096 when the key is absent; ``layer_types`` is never read).

Source: transformers 5.24 ``MistralConfig`` / ``MistralForCausalLM``.
"""

from __future__ import annotations

from pd_cluster.engine.model.family import Family


class Mistral(Family):
    architecture = "MistralForCausalLM"
    name = "mistral"
    default_window = 4096


FAMILIES = (Mistral(),)
