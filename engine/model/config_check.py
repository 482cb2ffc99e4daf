"""Refuse, by name, every ``config.json`` key whose value would change the math in a way the engine does not
implement. Torch-free.

A key is in one of three sets:

* read and honoured (sizes, ``rope_*``, each layer's attention keys (``sliding_window``, ``layer_types``,
  ``attention_chunk_size``, ...), ``tie_word_embeddings``, the MoE keys, each family's own keys
  (`Family.own_keys`), ...): its value is used;
* without effect at inference (``*_dropout``, ``*_pdrop``, ``initializer_range``,
  ``router_aux_loss_coef``, ``router_jitter_noise``, ``use_cache``, ...): ignored;
* changing the math, with values the engine does not compute: refused with a `ValueError` naming the key, its
  value and what is supported. The rules are below, one function per rule; each family
  (`pd_cluster.engine.model.families`) applies them with its own settings (`Family.check`), since
  transformers decides what a key means per model class.

The weights' quantisation (``quantization_config``) is read, and refused where the engine does not compute it,
by `pd_cluster.engine.quant.scheme` (called by `ArchConfig.from_dict`), which also reads the side files.
"""

from __future__ import annotations

from typing import Any

from pd_cluster.engine.layer_attention import refuse

ACTIVATIONS = ("silu", "swish")  # transformers' ACT2FN: both are x * sigmoid(x)
GELU_TANH = ("gelu_pytorch_tanh",)  # Gemma's GeGLU: gelu with the tanh approximation
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")

# Keys of other model families that change the math: refused when set (not None), when true, or when a
# multiplier other than 1, unless the family reads them (`Family.own_keys`).
FOREIGN_VALUES = ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar", "clip_qkv",
                  "swiglu_limit")
FOREIGN_FLAGS = ("use_qk_norm", "alibi", "parallel_attn", "use_parallel_residual", "use_bidirectional_attention")
FOREIGN_SCALES = ("logit_scale", "logits_scaling", "embedding_multiplier", "residual_multiplier",
                  "attention_multiplier")


def check_activation(cfg: dict[str, Any], keys: tuple[str, ...], allowed: tuple[str, ...], what: str) -> None:
    """Refuse a `keys` value outside `allowed` (`what` names the computed activation in the message)."""
    for key in keys:
        if key in cfg and cfg[key] not in allowed:
            raise refuse(key, cfg[key], what)


def check_biases(cfg: dict[str, Any], architecture: str, attention_bias_built: bool,
                 mlp_bias_built: bool = False) -> None:
    """``attention_bias`` and ``mlp_bias`` only where the family builds them."""
    if cfg.get("mlp_bias") and not mlp_bias_built:
        raise refuse("mlp_bias", cfg["mlp_bias"], "MLP projections without bias")
    if cfg.get("attention_bias") and not attention_bias_built:
        raise refuse("attention_bias", cfg["attention_bias"], f"{architecture} without attention biases")


def rope_dict(cfg: dict[str, Any]) -> dict[str, Any]:
    """``rope_scaling`` or ``rope_parameters`` (transformers 5 writes the latter), {} when absent."""
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    return dict(scaling) if isinstance(scaling, dict) else {}


def check_rope(cfg: dict[str, Any], architecture: str, allowed: tuple[str, ...], partial_rotary: bool) -> None:
    """The RoPE type is one `allowed`; longrope has both factor lists; partial rotary only where the family
    rotates part of a head; no multimodal (``mrope``) sections."""
    scaling = rope_dict(cfg)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in allowed:
        raise refuse("rope_type", kind, f"{architecture}: {', '.join(allowed)}")
    if kind == "longrope" and not {"short_factor", "long_factor"} <= set(scaling):
        raise refuse("rope_scaling", scaling, "longrope needs short_factor and long_factor")
    factor = scaling.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if factor not in (None, 1, 1.0) and not partial_rotary:
        raise refuse("partial_rotary_factor", factor, f"rotary over the whole head for {architecture}")
    if "mrope_section" in scaling or scaling.get("mrope_interleaved"):
        raise refuse("rope_scaling.mrope_section", scaling.get("mrope_section"), "1-D positions only")


def check_foreign_keys(cfg: dict[str, Any], own: tuple[str, ...], why: str) -> None:
    """Refuse another family's key (`FOREIGN_VALUES`, `FOREIGN_FLAGS`, `FOREIGN_SCALES`) that is set, unless
    it is one of the family's `own` keys; `why` says why the family does not honour it."""
    for key in FOREIGN_VALUES + FOREIGN_FLAGS + FOREIGN_SCALES:
        value = cfg.get(key)
        if key not in own and (value is not None if key in FOREIGN_VALUES else bool(value) if key in FOREIGN_FLAGS
                               else value not in (None, 1, 1.0)):
            raise refuse(key, value, why)
