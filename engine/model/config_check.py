"""Refuse, by name, every ``config.json`` key whose value would change the math in a way the engine does not
implement. Torch-free.

A key is in one of three sets:

* read and honoured (sizes, ``rope_*``, the per-layer attention keys of
  `pd_cluster.engine.layer_attention` (``sliding_window``, ``layer_types``, ``max_window_layers``,
  ``attention_chunk_size``, ``no_rope_layers``, ...), ``tie_word_embeddings``, the MoE keys of
  `pd_cluster.engine.model.moe_config`, each family's own keys in `FAMILY_KEYS`, ...): its value is used;
* without effect at inference (``*_dropout``, ``*_pdrop``, ``initializer_range``,
  ``router_aux_loss_coef``, ``router_jitter_noise``, ``use_cache``, ...): ignored;
* changing the math, with values the engine does not compute: refused here with a `ValueError` naming the
  key, its value and what is supported. The rules are below, one function per rule.

transformers decides what a key means per model class; the rules follow its classes (5.24): e.g. Qwen2 and
Qwen3 apply ``sliding_window`` only to layers ``>= max_window_layers``, while Mistral applies it to every layer;
Gemma 3's class never applies ``attn_logit_softcapping`` (Gemma 2's does), so a Gemma 3 config that sets it is
refused rather than guessed at.
"""

from __future__ import annotations

from typing import Any

from pd_cluster.engine.model.family_config import GEMMA, LLAMA4
from pd_cluster.engine.layer_attention import gemma3_rope, layer_attention_from_hf, refuse

ACTIVATIONS = ("silu", "swish")  # transformers' ACT2FN: both are x * sigmoid(x)
GELU_TANH = ("gelu_pytorch_tanh",)  # Gemma's GeGLU: gelu with the tanh approximation
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
PHI3_ROPE_TYPES = ("default", "longrope", "su", "yarn")  # Phi3Config renames su and yarn to longrope
# Weight quantisation schemes the loader dequantises: block-FP8 (DeepSeek-V3's format; `fp8_weights`)
QUANT_METHODS: tuple[str, ...] = ("fp8", "mxfp4")  # mxfp4: gpt-oss's experts, kept quantised (`moe`)

# Keys of other model families that change the math: refused when set (not None), when true, or when a
# multiplier other than 1, unless the family reads them (`FAMILY_KEYS`).
FOREIGN_VALUES = ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar", "clip_qkv",
                  "swiglu_limit")
FOREIGN_FLAGS = ("use_qk_norm", "alibi", "parallel_attn", "use_parallel_residual", "use_bidirectional_attention")
FOREIGN_SCALES = ("logit_scale", "logits_scaling", "embedding_multiplier", "residual_multiplier",
                  "attention_multiplier")
# The foreign keys each family's transformers class reads, and the engine honours for it.
FAMILY_KEYS = {
    "Gemma2ForCausalLM": ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"),
    "Gemma3ForCausalLM": ("final_logit_softcapping", "query_pre_attn_scalar"),
    "GptOssForCausalLM": ("swiglu_limit",),
    "Llama4ForCausalLM": ("use_qk_norm",),
    "Llama4ForConditionalGeneration": ("use_qk_norm",),
}
# Families whose every attention projection (q, k, v and o) carries a bias when attention_bias is set.
O_BIAS_FAMILIES = GEMMA + LLAMA4 + ("GptOssForCausalLM",)


def check_config(cfg: dict[str, Any], architecture: str) -> None:
    """Raise if `cfg` (an HF config of `architecture`) sets a key the engine would not honour.

    Raises:
        ValueError: naming the key and its value.
    """
    _activation(cfg, architecture)
    _biases(cfg, architecture)
    _rope(cfg, architecture)
    layer_attention_from_hf(cfg, architecture, 10000.0, None)  # an unknown layer type is refused by name
    _quantization(cfg)
    _family(cfg, architecture)
    own = FAMILY_KEYS.get(architecture, ())
    for key in FOREIGN_VALUES + FOREIGN_FLAGS + FOREIGN_SCALES:
        value = cfg.get(key)
        if key not in own and (value is not None if key in FOREIGN_VALUES else bool(value) if key in FOREIGN_FLAGS
                               else value not in (None, 1, 1.0)):
            why = (f"{architecture} as the engine builds it has no such key" if architecture != "Gemma3ForCausalLM"
                   else "transformers' Gemma3ForCausalLM does not apply it")
            raise refuse(key, value, why)


def _activation(cfg: dict[str, Any], architecture: str) -> None:
    if architecture == "GptOssForCausalLM":
        return  # its experts' clamped SwiGLU does not read hidden_act (`moe_config.swiglu_clamped`)
    if architecture in GEMMA:  # Gemma's MLP reads hidden_activation only
        if cfg.get("hidden_activation", GELU_TANH[0]) not in GELU_TANH:
            raise refuse("hidden_activation", cfg["hidden_activation"], f"{architecture}: {', '.join(GELU_TANH)}")
        return
    for key in ("hidden_act", "hidden_activation"):
        if key in cfg and cfg[key] not in ACTIVATIONS:
            raise refuse(key, cfg[key], f"the engine computes SwiGLU with {' / '.join(ACTIVATIONS)}")


def _biases(cfg: dict[str, Any], architecture: str) -> None:
    if cfg.get("mlp_bias"):
        raise refuse("mlp_bias", cfg["mlp_bias"], "MLP projections without bias")
    # Llama, Mistral, Mixtral and Qwen3 put attention_bias on o_proj too; Qwen2's q/k/v bias and the o_proj bias
    # of the families in O_BIAS_FAMILIES are built
    if cfg.get("attention_bias") and architecture not in ("Qwen2ForCausalLM",) + O_BIAS_FAMILIES:
        raise refuse("attention_bias", cfg["attention_bias"], f"{architecture} without attention biases")


def rope_dict(cfg: dict[str, Any]) -> dict[str, Any]:
    """``rope_scaling`` or ``rope_parameters`` (transformers 5 writes the latter), {} when absent."""
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    return dict(scaling) if isinstance(scaling, dict) else {}


def _rope(cfg: dict[str, Any], architecture: str) -> None:
    scaling = rope_dict(cfg)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    allowed = PHI3_ROPE_TYPES if architecture == "Phi3ForCausalLM" else ROPE_TYPES
    if architecture == "Gemma3ForCausalLM":  # a RoPE per layer type
        for layer_kind in ("full", "sliding"):
            per_layer = gemma3_rope(cfg, layer_kind)[1] or {}
            if per_layer.get("rope_type", "default") not in ROPE_TYPES:
                raise refuse("rope_type", per_layer["rope_type"], f"{architecture}: {', '.join(ROPE_TYPES)}")
        return
    if kind not in allowed:
        raise refuse("rope_type", kind, f"{architecture}: {', '.join(allowed)}")
    if kind == "longrope" and not {"short_factor", "long_factor"} <= set(scaling):
        raise refuse("rope_scaling", scaling, "longrope needs short_factor and long_factor")
    factor = scaling.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if factor not in (None, 1, 1.0) and architecture != "Phi3ForCausalLM":
        raise refuse("partial_rotary_factor", factor, f"rotary over the whole head for {architecture}")
    if "mrope_section" in scaling or scaling.get("mrope_interleaved"):
        raise refuse("rope_scaling.mrope_section", scaling.get("mrope_section"), "1-D positions only")


def _quantization(cfg: dict[str, Any]) -> None:
    quant = cfg.get("quantization_config")
    if not quant:
        return
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    kv_only = (isinstance(quant, dict) and method == "compressed-tensors" and not quant.get("config_groups")
               and quant.get("kv_cache_scheme"))  # llm-compressor's FP8 KV scales alone: weights unquantised
    if method not in QUANT_METHODS and not kv_only:
        raise refuse("quantization_config.quant_method", method,
                     "unquantised weights" + (f" or {', '.join(QUANT_METHODS)}" if QUANT_METHODS else ""))
    if method == "fp8":
        fp8_weight_block(quant)


def fp8_weight_block(quant: dict[str, Any]) -> tuple[int, int]:
    """The ``weight_block_size`` of a ``quant_method: fp8`` config (block-quantised E4M3 weights with
    ``weight_scale_inv``, dequantised on load by `pd_cluster.engine.model.fp8_weights`).

    Raises:
        ValueError: a per-tensor FP8 config (no ``weight_block_size``), another ``fmt`` than e4m3, or static
            activation scales, named.
    """
    block = quant.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0
                                                                        for b in block)):
        raise refuse("quantization_config.weight_block_size", block,
                     "fp8 weights in blocks, [rows, columns] with a weight_scale_inv per block (DeepSeek-V3's)")
    if quant.get("fmt", "e4m3") != "e4m3":
        raise refuse("quantization_config.fmt", quant.get("fmt"), "e4m3 FP8 weights")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise refuse("quantization_config.activation_scheme", quant.get("activation_scheme"),
                     "dynamic (the weights are dequantised; no static activation scales are applied)")
    return int(block[0]), int(block[1])


def _family(cfg: dict[str, Any], architecture: str) -> None:
    """Family keys with values outside what the engine builds."""
    if architecture in LLAMA4:
        top_k = int(cfg.get("num_experts_per_tok") or 1)
        if top_k != 1 and int(cfg.get("num_local_experts") or 0):
            raise refuse("num_experts_per_tok", top_k, "Llama 4's routed experts scale their input by the router "
                                                       "score, which the engine builds for top-1 routing only")
