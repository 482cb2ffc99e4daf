"""Gemma 3's text model (``Gemma3ForCausalLM``): Gemma 2's layers (GeGLU, ``(1 + w)`` norms, four per layer,
scaled embeddings, ``query_pre_attn_scalar``, optional ``final_logit_softcapping``) with ``(1 + w)`` RMSNorms
over each q and k head, no attention logit softcapping (a config that sets ``attn_logit_softcapping`` is
refused: transformers' class does not apply it), ``layer_types`` by default 5 sliding to 1 full
(``sliding_window_pattern`` 6), and a RoPE per layer type: the sliding layers rotate with their own base
``rope_local_base_freq`` (10,000) and without ``rope_scaling``, which applies to the full layers only.

Source: transformers 5.24 ``Gemma3TextConfig`` (``convert_rope_params_to_dict``) / ``Gemma3ForCausalLM``.
"""

from __future__ import annotations

from typing import Any

from pd_cluster.engine.layer_attention import alternating, refuse
from pd_cluster.engine.model import config_check as rules
from pd_cluster.engine.model.families.gemma2 import Gemma2


def gemma3_rope(cfg: dict[str, Any], kind: str) -> tuple[float, dict[str, Any] | None]:
    """Gemma 3's RoPE of a ``full`` or ``sliding`` layer: (base, scaling dict or None).

    transformers 5 writes ``rope_parameters`` keyed by layer type; earlier configs (those on the Hub) have
    ``rope_theta`` (global, default 1e6), ``rope_local_base_freq`` (local, default 1e4) and a ``rope_scaling``
    that applies to the global layers only (``Gemma3TextConfig.convert_rope_params_to_dict``).
    """
    params = cfg.get("rope_parameters")
    hf_type = "sliding_attention" if kind == "sliding" else "full_attention"
    if isinstance(params, dict) and isinstance(params.get(hf_type), dict):
        p = dict(params[hf_type])
    elif kind == "sliding":
        p = {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    else:
        p = dict(cfg.get("rope_scaling") or {"rope_type": "default"})
        p.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    theta = float(p.pop("rope_theta"))
    kind_name = p.get("rope_type", p.get("type", "default"))
    return theta, (None if kind_name == "default" else {**p, "rope_type": kind_name})


class Gemma3(Gemma2):
    architecture = "Gemma3ForCausalLM"
    name = "gemma3"
    own_keys = ("final_logit_softcapping", "query_pre_attn_scalar")
    default_final_softcap = None

    @property
    def foreign_key_reason(self) -> str:
        return f"transformers' {self.architecture} does not apply it"

    def check_rope(self, cfg: dict[str, Any]) -> None:
        for layer_kind in ("full", "sliding"):  # a RoPE per layer type
            per_layer = gemma3_rope(cfg, layer_kind)[1] or {}
            if per_layer.get("rope_type", "default") not in rules.ROPE_TYPES:
                raise refuse("rope_type", per_layer["rope_type"], f"{self.architecture}: {', '.join(rules.ROPE_TYPES)}")

    def rope(self, cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
        partial = super().rope(cfg)[2]
        theta, scaling = gemma3_rope(cfg, "full")  # the model-wide RoPE is the global layers'
        return theta, scaling, partial

    def layer_kinds(self, cfg: dict[str, Any]) -> tuple[list[str], int | None, int | None]:
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        return alternating(cfg, int(cfg["num_hidden_layers"]), pattern), cfg.get("sliding_window", self.default_window), None

    def layer_rope(self, cfg: dict[str, Any], kind: str, layer: int, theta: float,
                   scaling: dict[str, Any] | None) -> tuple[bool, float, dict[str, Any] | None]:
        return (True, *gemma3_rope(cfg, kind))

    def attention_softcap(self, cfg: dict[str, Any]) -> float | None:
        return None

    def fields(self, cfg: dict[str, Any]) -> dict[str, Any]:
        return {**super().fields(cfg), "qk_norm": "gemma"}


FAMILIES = (Gemma3(),)
