"""Mistral 3's multimodal class (``Mistral3ForConditionalGeneration``, Mistral Small 3.1 / 3.2): its language
model, a Mistral text model (`mistral.Mistral`, ``text_config`` of ``model_type`` ``mistral``; another text
model type is refused by name) with tensors under ``language_model.``; the vision tower and the projector are
not read, and image input is refused by the server (a 400 naming the part). The top-level
``tie_word_embeddings`` decides the tie when the config sets it, else the ``text_config``'s.

Source: transformers 5.25 ``Mistral3Config`` / ``Mistral3ForConditionalGeneration``.
"""

from __future__ import annotations

from typing import Any

from pd_cluster.engine.layer_attention import refuse
from pd_cluster.engine.model.families.mistral import Mistral


class Mistral3Multimodal(Mistral):
    architecture = "Mistral3ForConditionalGeneration"
    name = "mistral3"
    language_model_prefix = "language_model."
    skipped_prefixes = ("vision_tower.", "multi_modal_projector.")

    def text_config(self, cfg: dict[str, Any]) -> dict[str, Any]:
        text = super().text_config(cfg)
        if "text_config" in cfg:
            text["tie_word_embeddings"] = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        return text

    def check_family(self, cfg: dict[str, Any]) -> None:
        if cfg.get("model_type", "mistral") != "mistral":
            raise refuse("text_config.model_type", cfg["model_type"], f"{self.architecture} over a mistral text model")


FAMILIES = (Mistral3Multimodal(),)
