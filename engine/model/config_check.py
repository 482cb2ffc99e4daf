"""Refuse, by name, every ``config.json`` key whose value would change the math in a way the engine does not
implement. Torch-free.

A key is in one of three sets:

* read and honoured (sizes, ``rope_*``, ``sliding_window``, ``tie_word_embeddings``, the MoE keys of
  `pd_cluster.engine.model.moe_config`, ...): its value is used;
* without effect at inference (``*_dropout``, ``*_pdrop``, ``initializer_range``,
  ``router_aux_loss_coef``, ``router_jitter_noise``, ``use_cache``, ...): ignored;
* changing the math, with values the engine does not compute: refused here with a `ValueError` naming the
  key, its value and what is supported. The rules are below, one function per rule.

transformers decides what a key means per model class; the rules follow its classes (5.24): e.g. Qwen2 and
Qwen3 apply ``sliding_window`` only to layers ``>= max_window_layers``, while Mistral applies it to every layer.
"""

from __future__ import annotations

from typing import Any

ACTIVATIONS = ("silu", "swish")  # transformers' ACT2FN: both are x * sigmoid(x)
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
PHI3_ROPE_TYPES = ("default", "longrope", "su", "yarn")  # Phi3Config renames su and yarn to longrope
# Weight quantisation schemes the loader dequantises: block-FP8 (DeepSeek-V3's format; `fp8_weights`)
QUANT_METHODS: tuple[str, ...] = ("fp8",)

# Keys of other model families that change the math, none implemented: refused when set (not None),
# when true, or when a multiplier other than 1.
FOREIGN_VALUES = ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar", "clip_qkv",
                  "swiglu_limit")
FOREIGN_FLAGS = ("use_qk_norm", "alibi", "parallel_attn", "use_parallel_residual")
FOREIGN_SCALES = ("logit_scale", "logits_scaling", "embedding_multiplier", "residual_multiplier",
                  "attention_multiplier")


def refuse(key: str, value: Any, supported: str) -> ValueError:
    return ValueError(f"config.json: {key}={value!r} is not implemented ({supported}); refusing to load a model "
                      f"that would run with different math")


def check_config(cfg: dict[str, Any], architecture: str) -> None:
    """Raise if `cfg` (an HF config of `architecture`) sets a key the engine would not honour.

    Raises:
        ValueError: naming the key and its value.
    """
    _activation(cfg)
    _biases(cfg, architecture)
    _rope(cfg, architecture)
    _layer_types(cfg, architecture)
    _quantization(cfg)
    for key in FOREIGN_VALUES + FOREIGN_FLAGS + FOREIGN_SCALES:
        value = cfg.get(key)
        if (value is not None if key in FOREIGN_VALUES else bool(value) if key in FOREIGN_FLAGS
                else value not in (None, 1, 1.0)):
            raise refuse(key, value, f"{architecture} as the engine builds it has no such key")


def _activation(cfg: dict[str, Any]) -> None:
    for key in ("hidden_act", "hidden_activation"):
        if key in cfg and cfg[key] not in ACTIVATIONS:
            raise refuse(key, cfg[key], f"the engine computes SwiGLU with {' / '.join(ACTIVATIONS)}")


def _biases(cfg: dict[str, Any], architecture: str) -> None:
    if cfg.get("mlp_bias"):
        raise refuse("mlp_bias", cfg["mlp_bias"], "MLP projections without bias")
    # Llama, Mistral, Mixtral and Qwen3 put attention_bias on o_proj too; only Qwen2's q/k/v bias is built
    if cfg.get("attention_bias") and architecture != "Qwen2ForCausalLM":
        raise refuse("attention_bias", cfg["attention_bias"], f"{architecture} without attention biases")


def rope_dict(cfg: dict[str, Any]) -> dict[str, Any]:
    """``rope_scaling`` or ``rope_parameters`` (transformers 5 writes the latter), {} when absent."""
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    return dict(scaling) if isinstance(scaling, dict) else {}


def _rope(cfg: dict[str, Any], architecture: str) -> None:
    scaling = rope_dict(cfg)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    allowed = PHI3_ROPE_TYPES if architecture == "Phi3ForCausalLM" else ROPE_TYPES
    if kind not in allowed:
        raise refuse("rope_type", kind, f"{architecture}: {', '.join(allowed)}")
    if kind == "longrope" and not {"short_factor", "long_factor"} <= set(scaling):
        raise refuse("rope_scaling", scaling, "longrope needs short_factor and long_factor")
    factor = scaling.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if factor not in (None, 1, 1.0) and architecture != "Phi3ForCausalLM":
        raise refuse("partial_rotary_factor", factor, f"rotary over the whole head for {architecture}")
    if "mrope_section" in scaling or scaling.get("mrope_interleaved"):
        raise refuse("rope_scaling.mrope_section", scaling.get("mrope_section"), "1-D positions only")


def layer_windows(cfg: dict[str, Any], architecture: str) -> list[int | None]:
    """Each layer's attention window as transformers applies it (None: full attention).

    Qwen2/Qwen3: ``layer_types`` (sliding layers get ``sliding_window`` if ``use_sliding_window``), else sliding
    from layer ``max_window_layers`` on when ``use_sliding_window``;
    Qwen3-MoE: every layer when ``use_sliding_window``; Mistral, Mixtral, Phi-3: every layer when
    ``sliding_window`` is set; Llama: never (``LlamaConfig`` has no window).
    """
    layers = int(cfg["num_hidden_layers"])
    window = None if architecture == "LlamaForCausalLM" else cfg.get("sliding_window")
    qwen = architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    if qwen and not cfg.get("use_sliding_window", False):
        window = None
    per_layer = architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM")  # the classes that read layer_types
    types = cfg.get("layer_types") if per_layer else None
    if types is None:
        if per_layer and window is not None:
            first = int(cfg.get("max_window_layers", 28))
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
        else:
            types = ["full_attention" if window is None else "sliding_attention"] * layers
    out: list[int | None] = []
    for t in types:
        if t not in ("full_attention", "sliding_attention"):
            raise refuse("layer_types", t, "full_attention, sliding_attention")
        out.append(int(window) if t == "sliding_attention" and window is not None else None)
    return out


def _layer_types(cfg: dict[str, Any], architecture: str) -> None:
    windows = layer_windows(cfg, architecture)
    if len(set(windows)) > 1:
        key = "layer_types" if cfg.get("layer_types") is not None else "max_window_layers"
        raise refuse(key, cfg.get(key), "the same attention window on every layer (sliding on some layers only "
                                        "is not implemented)")


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
