"""Gemma 2 (``Gemma2ForCausalLM``): GeGLU (``hidden_activation`` gelu with the tanh approximation), the
``(1 + w)`` RMSNorm, four norms per layer (post-attention, pre- and post-feedforward), embeddings scaled by
``sqrt(hidden_size)``, softmax scale ``query_pre_attn_scalar ** -0.5`` (default 256), tied embeddings by
default, attention logits soft-capped on every layer (``attn_logit_softcapping``, default 50) and final logits
(``final_logit_softcapping``, default 30); ``layer_types``, by default sliding / full alternating from layer 0
(window 4096 when ``sliding_window`` is absent); ``attention_bias`` puts a bias on q, k, v and o.

Source: transformers 5.24 ``Gemma2Config`` / ``Gemma2ForCausalLM``.
"""

from __future__ import annotations

from typing import Any

from pd_cluster.engine.layer_attention import alternating
from pd_cluster.engine.model import config_check as rules
from pd_cluster.engine.model.family import Family


class Gemma2(Family):
    architecture = "Gemma2ForCausalLM"
    name = "gemma2"
    own_keys = ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar")
    attention_bias_built = True
    default_window = 4096
    default_final_softcap: float | None = 30.0

    def check_activation(self, cfg: dict[str, Any]) -> None:
        # Gemma's MLP reads hidden_activation only
        rules.check_activation(cfg, ("hidden_activation",), rules.GELU_TANH,
                               f"{self.architecture}: {', '.join(rules.GELU_TANH)}")

    def layer_kinds(self, cfg: dict[str, Any]) -> tuple[list[str], int | None, int | None]:
        return alternating(cfg, int(cfg["num_hidden_layers"]), 2), cfg.get("sliding_window", self.default_window), None

    def attention_softcap(self, cfg: dict[str, Any]) -> float | None:
        return cfg.get("attn_logit_softcapping", 50.0)

    def fields(self, cfg: dict[str, Any]) -> dict[str, Any]:
        softcap = cfg.get("final_logit_softcapping", self.default_final_softcap)
        return dict(tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
                    attention_bias=bool(cfg.get("attention_bias")), o_proj_bias=bool(cfg.get("attention_bias")),
                    hidden_act="gelu_pytorch_tanh", norm_style="gemma", norm_layout="sandwich",
                    embedding_scale=float(cfg["hidden_size"]) ** 0.5,
                    final_logit_softcap=float(softcap) if softcap else None,
                    attention_scale=float(cfg.get("query_pre_attn_scalar") or 256) ** -0.5)


FAMILIES = (Gemma2(),)
