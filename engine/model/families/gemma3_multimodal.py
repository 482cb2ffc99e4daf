"""Gemma 3's multimodal class (``Gemma3ForConditionalGeneration``, Gemma 3 4B to 27B): its language model, a
Gemma 3 text model (`gemma3.Gemma3`) read from ``text_config``, with tensors under ``language_model.``; the
vision tower and the projector are not read, and image input is refused by the server (a 400 naming the part).
The top-level ``tie_word_embeddings`` (true by default) decides the tie, as in transformers. The class does not
soft-cap its logits: a ``final_logit_softcapping`` it would ignore is refused.

Source: transformers 5.25 ``Gemma3Config`` / ``Gemma3ForConditionalGeneration``.
"""

from __future__ import annotations

from typing import Any

from pd_cluster.engine.model.families.gemma3 import Gemma3


class Gemma3Multimodal(Gemma3):
    architecture = "Gemma3ForConditionalGeneration"
    language_model_prefix = "language_model."
    skipped_prefixes = ("vision_tower.", "multi_modal_projector.")
    own_keys = ("query_pre_attn_scalar",)

    def text_config(self, cfg: dict[str, Any]) -> dict[str, Any]:
        text = super().text_config(cfg)
        if "text_config" in cfg:
            text["tie_word_embeddings"] = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
        return text

    def fields(self, cfg: dict[str, Any]) -> dict[str, Any]:
        return {**super().fields(cfg), "final_logit_softcap": None}


FAMILIES = (Gemma3Multimodal(),)
