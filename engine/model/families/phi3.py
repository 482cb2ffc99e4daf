"""Phi-3 / Phi-4-mini (``Phi3ForCausalLM``): q/k/v and gate/up stored pre-fused (``qkv_proj``,
``gate_up_proj``, split by `weight_map`), RoPE over the first ``partial_rotary_factor`` of each head, longrope
(``su`` and ``yarn`` are its earlier names; ``original_max_position_embeddings`` 4096 when absent), one
window on every layer when ``sliding_window`` is set.

Source: transformers 5.24 ``Phi3Config`` (its RoPE validation and renaming) / ``Phi3ForCausalLM``.
"""

from __future__ import annotations

from pd_cluster.engine.model.family import Family


class Phi3(Family):
    architecture = "Phi3ForCausalLM"
    name = "phi3"
    rope_types = ("default", "longrope", "su", "yarn")
    rope_aliases = {"su": "longrope", "yarn": "longrope"}
    default_original_max_position = 4096
    partial_rotary = True


FAMILIES = (Phi3(),)
