"""The keys in which Gemma 2/3, gpt-oss and Llama 4 differ from Llama, read from a ``config.json`` into
`ArchConfig`'s fields (with each transformers class's defaults for keys a config leaves out). Torch-free.

Sources: transformers 5.24 ``Gemma2Config``/``Gemma2ForCausalLM``, ``Gemma3TextConfig``/``Gemma3ForCausalLM``,
``GptOssConfig``/``GptOssForCausalLM``, ``Llama4TextConfig``/``Llama4ForCausalLM``/``Llama4ForConditionalGeneration``.
"""

from __future__ import annotations

from typing import Any

GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
LLAMA4 = ("Llama4ForCausalLM", "Llama4ForConditionalGeneration")
# A multimodal checkpoint's config keys the engine takes from its top level into its text_config.
_TOP_LEVEL_KEYS = ("torch_dtype", "dtype", "quantization_config")


def language_model_config(cfg: dict[str, Any], architecture: str) -> dict[str, Any]:
    """The config of the language model the engine serves: a multimodal checkpoint's ``text_config``
    (Llama4ForConditionalGeneration), with its ``architectures`` and dtype; other configs unchanged."""
    if architecture != "Llama4ForConditionalGeneration":
        return cfg
    if "text_config" not in cfg:
        return cfg  # already the language model's config (the memory planner unwraps it first)
    text = dict(cfg["text_config"] or {})
    for key in _TOP_LEVEL_KEYS:
        if key in cfg and key not in text:
            text[key] = cfg[key]
    text["architectures"] = list(cfg.get("architectures") or [architecture])
    return text


def family_fields(cfg: dict[str, Any], architecture: str) -> dict[str, Any]:
    """`ArchConfig` keyword arguments particular to `architecture`'s family: biases, norms, activation, scales."""
    bias = cfg.get("attention_bias")
    out: dict[str, Any] = dict(
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(bias if bias is not None else architecture == "Qwen2ForCausalLM"),
        qk_norm="rms" if architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM") else "",
    )
    if architecture in GEMMA:
        softcap = cfg.get("final_logit_softcapping", 30.0 if architecture == "Gemma2ForCausalLM" else None)
        out.update(tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)), o_proj_bias=bool(bias),
                   hidden_act="gelu_pytorch_tanh", norm_style="gemma", sandwich_norms=True,
                   embedding_scale=float(cfg["hidden_size"]) ** 0.5,
                   final_logit_softcap=float(softcap) if softcap else None,
                   attention_scale=float(cfg.get("query_pre_attn_scalar") or 256) ** -0.5,
                   qk_norm="gemma" if architecture == "Gemma3ForCausalLM" else "")
    elif architecture == "GptOssForCausalLM":
        bias = True if bias is None else bool(bias)
        out.update(attention_bias=bias, o_proj_bias=bias, norm_style="float")
    elif architecture in LLAMA4:
        tuning = cfg.get("attn_temperature_tuning", True)
        out.update(o_proj_bias=bool(bias), qk_norm="l2" if cfg.get("use_qk_norm", True) else "",
                   attn_temperature=((float(cfg.get("attn_scale", 0.1)), float(cfg.get("floor_scale", 8192)))
                                     if tuning else None),
                   rope_interleaved=True)
    return out
