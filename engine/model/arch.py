"""The architecture of a Llama-family checkpoint, read from its ``config.json``.

Supported: Llama 2/3 (``LlamaForCausalLM``), Mistral (``MistralForCausalLM``),
Qwen2 (``Qwen2ForCausalLM``, q/k/v bias), Qwen3 (``Qwen3ForCausalLM``, q/k
RMSNorm), Mixtral (``MixtralForCausalLM``, mixture of experts), Qwen3-MoE
(``Qwen3MoeForCausalLM``: q/k RMSNorm and experts), Phi-3
(``Phi3ForCausalLM``: fused qkv/gate-up tensors, partial rotary, longrope),
Gemma 2 (``Gemma2ForCausalLM``) and Gemma 3's text model (``Gemma3ForCausalLM``):
GeGLU, the ``(1 + w)`` RMSNorm, four norms per layer, embeddings scaled by
``sqrt(hidden_size)``, ``query_pre_attn_scalar``, logit softcapping (Gemma 3:
q/k norms, its local RoPE base); gpt-oss (``GptOssForCausalLM``: attention sinks,
biases everywhere, experts with a clamped SwiGLU); Llama 4's text model
(``Llama4ForCausalLM``, and the language model of ``Llama4ForConditionalGeneration``:
chunked local attention, NoPE global layers with attention temperature tuning,
L2 q/k norms, a top-1 sigmoid MoE with a shared expert); and
DeepSeek-V2/V3 (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``, also Kimi
K2's shape) with multi-head latent attention (`MLAConfig`).
Each layer's attention type is `ArchConfig.layer_attention`
(`pd_cluster.engine.layer_attention`).
Keys that change the math and are not implemented are refused by name
(`pd_cluster.engine.model.config_check`). This module has no torch dependency,
so the memory planner can use it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pd_cluster.engine.model.config_check import check_config, fp8_weight_block, rope_dict
from pd_cluster.engine.model.family_config import family_fields, language_model_config
from pd_cluster.engine.layer_attention import LayerAttention, gemma3_rope, layer_attention_from_hf, uniform
from pd_cluster.engine.model.moe_config import MoEConfig, check_moe_parallel, moe_from_hf
from pd_cluster.engine.quant.expert_format import expert_quant_of

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Phi3ForCausalLM": "phi3",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "GptOssForCausalLM": "gpt_oss",
    "Llama4ForCausalLM": "llama4",
    "Llama4ForConditionalGeneration": "llama4",
}
# Multimodal checkpoints whose language model the engine serves (text input only): its config is the
# ``text_config``, its tensors carry this prefix, and tensors under the other prefixes (the vision tower) are
# not read.
LANGUAGE_MODEL_OF = {"Llama4ForConditionalGeneration": ("language_model.", ("vision_model.", "multi_modal_projector."))}


@dataclass(frozen=True)
class ArchConfig:
    """The shape of a decoder-only Llama-family model.

    Attributes:
        architecture: HF class name, e.g. ``LlamaForCausalLM``.
        rope_scaling: HF ``rope_scaling`` / ``rope_parameters`` dict, or None for
            plain RoPE. Keys as in HF (``rope_type``, ``factor``, ...).
        attention_bias: q/k/v projections carry a bias (Qwen2, gpt-oss; Gemma and Llama 4 when set).
        o_proj_bias: the output projection carries a bias too (gpt-oss; Gemma and Llama 4 with attention_bias).
        mla: the latent attention's shape (DeepSeek-V2/V3), or None for K/V per head.
        qk_norm: per-head norm on q and k: ``""`` none, ``rms`` RMSNorm before RoPE (Qwen3), ``gemma`` the
            ``(1 + w)`` RMSNorm before RoPE (Gemma 3), ``l2`` a weightless RMSNorm after RoPE on RoPE layers only
            (Llama 4's ``use_qk_norm``).
        layer_attention: each layer's attention type (`LayerAttention`: full, sliding window or chunked;
            RoPE or NoPE and its base; sinks; logit softcapping). One entry per layer.
        torch_dtype: the checkpoint's dtype name, e.g. ``bfloat16``.
        moe: the mixture-of-experts layers (`MoEConfig`), None for a dense model.
        partial_rotary_factor: the share of each head that RoPE rotates (Phi-3 family), from its start.
        fp8_weight_block: the checkpoint's linear weights are block-quantised FP8 in blocks of this
            (rows, columns), dequantised on load (`fp8_weights`); None for unquantised weights.
        hidden_act: the dense MLP's gate activation: ``silu`` (SwiGLU) or ``gelu_pytorch_tanh`` (Gemma's GeGLU).
        norm_style: how an RMSNorm applies its weight: ``llama`` (``w * round(x_normed)``), ``gemma``
            (``round((1 + w) * x_normed)`` in float32) or ``float`` (``round(w * x_normed)`` in float32, gpt-oss).
        sandwich_norms: norms after attention and around the MLP (Gemma's post_attention, pre_feedforward and
            post_feedforward layernorms).
        embedding_scale: embeddings multiplied by this (Gemma: ``sqrt(hidden_size)``, rounded to the weights'
            dtype), None for none.
        final_logit_softcap: logits ``l`` become ``cap * tanh(l / cap)`` (Gemma 2), None for none.
        attention_scale: the softmax scale (Gemma: ``query_pre_attn_scalar ** -0.5``); None: ``head_dim ** -0.5``.
        attn_temperature: Llama 4's temperature tuning of NoPE layers, ``(attn_scale, floor_scale)``: a query at
            position ``p`` is multiplied by ``1 + attn_scale * log(1 + floor((p + 1) / floor_scale))``; None off.
        rope_interleaved: the checkpoint rotates (x0, x1), (x2, x3), ... pairs (Llama 4); the loader permutes
            q and k rows into the rotate-half order, which leaves every q.k unchanged.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: str = ""
    layer_attention: tuple[LayerAttention, ...] = ()
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    moe: MoEConfig | None = None
    partial_rotary_factor: float = 1.0
    mla: MLAConfig | None = None
    fp8_weight_block: tuple[int, int] | None = None
    o_proj_bias: bool = False
    hidden_act: str = "silu"
    norm_style: str = "llama"
    sandwich_norms: bool = False
    embedding_scale: float | None = None
    final_logit_softcap: float | None = None
    attention_scale: float | None = None
    attn_temperature: tuple[float, float] | None = None
    rope_interleaved: bool = False

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if not self.layer_attention:
            object.__setattr__(self, "layer_attention", uniform(self.num_hidden_layers, None, self.rope_theta,
                                                                self.rope_scaling))
        if len(self.layer_attention) != self.num_hidden_layers:
            raise ValueError(f"{len(self.layer_attention)} layer attention types for {self.num_hidden_layers} layers")
        if self.qk_norm not in ("", "rms", "gemma", "l2") or self.norm_style not in ("llama", "gemma", "float"):
            raise ValueError(f"unknown qk_norm {self.qk_norm!r} or norm_style {self.norm_style!r}")

    @property
    def softmax_scale(self) -> float:
        """The attention softmax scale (`attention_scale`, default ``head_dim ** -0.5``)."""
        return self.attention_scale if self.attention_scale is not None else self.head_dim ** -0.5

    @property
    def is_hybrid(self) -> bool:
        """Layers attend to different key ranges (some windowed or chunked, some not, or different sizes)."""
        return len({a.mask_key for a in self.layer_attention}) > 1

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES.get(self.architecture, "llama")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that RoPE rotates (the first ones; all but for partial rotary)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and self.moe.is_moe_layer(layer)

    def check_tp(self, tp_size: int, expert_parallel: bool = False) -> None:
        """Refuse a TP size that does not divide the KV heads (MLA: the attention heads; the latent is
        replicated on every rank), the dense MLP width or the experts (`moe_config.check_moe_parallel`).

        Raises:
            ValueError: naming the sizes.
        """
        dense = any(not self.is_moe_layer(i) for i in range(self.num_hidden_layers))
        heads, what = ((self.num_attention_heads, "num_attention_heads") if self.mla is not None
                       else (self.num_key_value_heads, "num_key_value_heads"))
        if heads % tp_size or (dense and self.intermediate_size % tp_size):
            raise ValueError(f"--tp-size {tp_size} must divide {what} ({heads}) "
                             f"and intermediate_size ({self.intermediate_size})")
        if self.moe is not None:
            check_moe_parallel(self.moe, tp_size, expert_parallel)

    def _attention_params(self, layer: int = 0) -> int:
        h = self.hidden_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.mla is not None:
            attn = self.mla.num_params(h, self.num_attention_heads)
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.o_proj_bias:
            attn += h
        if self.qk_norm in ("rms", "gemma"):
            attn += 2 * self.head_dim
        if self.layer_attention[layer].sinks:
            attn += self.num_attention_heads
        return attn

    def _norm_params(self) -> int:
        return (4 if self.sandwich_norms else 2) * self.hidden_size

    def _mlp_params(self, layer: int, active: bool) -> int:
        h = self.hidden_size
        if not self.is_moe_layer(layer):
            return 3 * h * self.intermediate_size
        assert self.moe is not None
        return self.moe.active_layer_params(h) if active else self.moe.layer_params(h)

    def num_params(self) -> int:
        """Parameter count of the decoder (embedding, layers, final norm, head); every expert counted."""
        h = self.hidden_size
        layers = sum(self._attention_params(i) + self._mlp_params(i, False) + self._norm_params()
                     for i in range(self.num_hidden_layers))
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return embed + layers + h + head

    def num_active_params(self) -> int:
        """Parameters one token multiplies through: as `num_params` but only the router, the shared experts
        and ``top_k`` routed experts of each MoE layer (the embedding row lookup still counts its table)."""
        h = self.hidden_size
        layers = sum(self._attention_params(i) + self._mlp_params(i, True) + self._norm_params()
                     for i in range(self.num_hidden_layers))
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + layers + h + head

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ArchConfig":
        """Build from a parsed HF ``config.json``.

        Raises:
            ValueError: the architecture is not a supported one, or a key that changes the math has a value
                the engine does not implement (named; `config_check.check_config`).
        """
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architectures {archs}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        cfg = language_model_config(cfg, arch)
        check_config(cfg, arch)
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        scaling: dict[str, Any] | None = rope_dict(cfg)
        theta = cfg.get("rope_theta")
        if theta is None and scaling:
            theta = scaling.get("rope_theta")
        partial = float(scaling.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0)
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if arch == "Phi3ForCausalLM" and kind in ("su", "yarn"):  # Phi3Config's renaming
            kind, scaling = "longrope", {**scaling, "rope_type": "longrope"}
        if kind in ("llama3", "yarn", "longrope"):
            # transformers' standardize_rope_params: a top-level original_max_position_embeddings wins (Phi3Config
            # always has one, 4096 by default); else the dict's, else max_position_embeddings
            top = cfg.get("original_max_position_embeddings", 4096 if arch == "Phi3ForCausalLM" else None)
            if top is not None:
                scaling = {**scaling, "original_max_position_embeddings": int(top)}
        elif kind == "default":
            scaling = None
        if arch == "Gemma3ForCausalLM":  # the model-wide RoPE is the global layers' (each layer has its own)
            theta, scaling = gemma3_rope(cfg, "full")
        theta = float(theta if theta is not None else 10000.0)
        mla = MLAConfig.from_dict(cfg, arch, scaling) if arch in MLA_ARCHITECTURES else None
        fields = family_fields(cfg, arch)
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size_mlp") or cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=dict(scaling) if scaling else None,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            layer_attention=layer_attention_from_hf(cfg, arch, theta, dict(scaling) if scaling else None),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            moe=_moe(cfg, arch),
            partial_rotary_factor=partial,
            mla=mla,
            fp8_weight_block=_fp8_weight_block(cfg),
            **fields,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ArchConfig":
        """Read ``<path>/config.json``.

        Raises:
            FileNotFoundError: `path` is not a folder (a Hugging Face Hub id, say: the message says how to
                download it), or it has no config.json.
        """
        folder = check_model_folder(path)
        with open(folder / "config.json") as f:
            return cls.from_dict(json.load(f))


def check_model_folder(path: str | Path) -> Path:
    """`path` as a folder, before anything tries to load from it (transformers would go to the Hub for a
    Hub id).

    Raises:
        FileNotFoundError: not a folder, in one line that says what to do (a Hub id: how to download it).
    """
    folder = Path(path).expanduser()
    if not folder.is_dir():
        text = str(path)
        hint = (f"download it first (huggingface-cli download {text} --local-dir DIR) and pass --model DIR"
                if text.count("/") == 1 and not text.startswith((".", "/", "~")) else
                "pass a Hugging Face model folder (config.json, tokenizer files, *.safetensors)")
        raise FileNotFoundError(f"--model {text}: no such folder; pd-cluster loads local folders only: {hint}")
    return folder


MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-AI, "DeepSeek-V2", 2024, sec. 2.1): one layer's shapes.

    Each token caches one latent of `latent_dim` = ``kv_lora_rank + qk_rope_head_dim`` values per layer
    (576 for DeepSeek-V3): the normalised compressed KV ``c`` and the shared RoPE key ``k_pe``.

    Attributes:
        kv_lora_rank: width of the compressed KV ``c`` (512 in V2/V3).
        q_lora_rank: width of the compressed query, or None: the query is one projection (V2-Lite).
        qk_nope_head_dim, qk_rope_head_dim, v_head_dim: per head, the query/key part without RoPE, the part
            with RoPE (shared by all heads on the key side), and the value.
        rope_interleave: the checkpoint's RoPE dimensions are interleaved pairs ``(x0, x1), (x2, x3), ...``
            (DeepSeek's layout: V2 always; V3 unless ``rope_interleave`` is false). The loader permutes those
            weight rows into the rotate-half order once, so the engine's one RoPE op serves both.
        softmax_scale: ``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` with YaRN
            (DeepSeek's and transformers' ``yarn_apply_mscale``).
    """

    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    softmax_scale: float

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token per layer: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def num_params(self, hidden: int, heads: int) -> int:
        """Parameters of one attention layer: q (direct or low-rank with its norm), kv_a, its norm, kv_b, o."""
        q_out = heads * self.qk_head_dim
        q = hidden * q_out if self.q_lora_rank is None else \
            hidden * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * q_out
        kv = hidden * self.latent_dim + self.kv_lora_rank + \
            self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + heads * self.v_head_dim * hidden

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], arch: str, scaling: dict[str, Any] | None) -> "MLAConfig":
        """Read a DeepSeek config (its keys that change the math were checked by `config_check.check_config`)."""
        nope, rope = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
        scale = (nope + rope) ** -0.5
        if scaling and scaling.get("mscale_all_dim"):
            m = _yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
            scale *= m * m
        q_lora = cfg.get("q_lora_rank")
        return cls(kv_lora_rank=int(cfg["kv_lora_rank"]), q_lora_rank=int(q_lora) if q_lora else None,
                   qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=int(cfg["v_head_dim"]),
                   rope_interleave=arch == "DeepseekV2ForCausalLM" or bool(cfg.get("rope_interleave", True)),
                   softmax_scale=scale)


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _fp8_weight_block(cfg: dict[str, Any]) -> tuple[int, int] | None:
    quant = cfg.get("quantization_config")
    return fp8_weight_block(quant) if isinstance(quant, dict) and quant.get("quant_method") == "fp8" else None


def _moe(cfg: dict[str, Any], arch: str) -> MoEConfig | None:
    """`moe_from_hf` with its experts' stored format (`expert_quant_of`), or None when it places no MoE layer (a
    DeepSeek config with ``first_k_dense_replace >= num_hidden_layers`` is a dense model: its unused expert widths
    are not checked against the TP size)."""
    moe = moe_from_hf(cfg, arch)
    if moe is None or not moe.moe_layers:
        return None
    quant = expert_quant_of(cfg, arch, moe.moe_layers)
    return dataclasses.replace(moe, weight_quant=quant) if quant else moe
