"""The architecture of a decoder-only checkpoint, read from its ``config.json``: `ArchConfig`, the engine's typed
config.

Each supported architecture is a family of `pd_cluster.engine.model.families` (one file per family): the family
reads its config into these fields and refuses, by name, every key whose value would change the math in a way
the engine does not implement (`pd_cluster.engine.model.config_check`). Each layer's attention type is
`ArchConfig.layer_attention` (`pd_cluster.engine.layer_attention`); latent attention's shape `MLAConfig`
(`pd_cluster.engine.model.mla_config`). This module has no torch dependency, so the memory planner can use it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pd_cluster.engine.layer_attention import LayerAttention, uniform
from pd_cluster.engine.model import families
from pd_cluster.engine.model.linear_config import LinearAttentionConfig
from pd_cluster.engine.model.mla_config import MLAConfig
from pd_cluster.engine.model.linear_layers import linear_layers
from pd_cluster.engine.model.moe_config import MoEConfig, check_moe_parallel
from pd_cluster.engine.quant import support
from pd_cluster.engine.quant.scheme import QuantScheme, read_quant_scheme
from pd_cluster.engine.quant.tp import check_splits

__all__ = ["ArchConfig", "MLAConfig", "check_model_folder"]

QK_NORMS = ("", "rms", "gemma", "l2", "rms_across")
NORM_STYLES = ("llama", "gemma", "float", "layernorm", "layernorm_bias")
NORM_LAYOUTS = ("pre", "sandwich", "post", "parallel")


@dataclass(frozen=True)
class ArchConfig:
    """The shape of a decoder-only model, as its family reads it (families named here as examples only).

    Attributes:
        architecture: the HF class name of ``architectures`` that chose the family (`families`).
        rope_scaling: HF ``rope_scaling`` / ``rope_parameters`` dict, or None for
            plain RoPE. Keys as in HF (``rope_type``, ``factor``, ...).
        attention_bias: q/k/v projections carry a bias (Qwen2, gpt-oss; Gemma and Llama 4 when set).
        o_proj_bias: the output projection carries a bias too (gpt-oss; Gemma and Llama 4 with attention_bias).
        mla: the latent attention's shape (DeepSeek-V2/V3), or None for K/V per head.
        qk_norm: per-head norm on q and k: ``""`` none, ``rms`` RMSNorm before RoPE (Qwen3), ``gemma`` the
            ``(1 + w)`` RMSNorm before RoPE (Gemma 3), ``l2`` a weightless RMSNorm after RoPE on RoPE layers only
            (Llama 4's ``use_qk_norm``), ``rms_across`` one ``float``-style RMSNorm over all of q's heads and one
            over all of k's, before RoPE (OLMo 2).
        layer_attention: each layer's attention type (`LayerAttention`: full, sliding window or chunked;
            RoPE or NoPE and its base; sinks; logit softcapping). One entry per layer.
        torch_dtype: the checkpoint's dtype name, e.g. ``bfloat16``.
        moe: the mixture-of-experts layers (`MoEConfig`), None for a dense model.
        partial_rotary_factor: the share of each head that RoPE rotates (Phi-3 family), from its start.
        quant: the checkpoint's weight quantisation (`pd_cluster.engine.quant.scheme.QuantScheme`), None for
            unquantised weights.
        hidden_act: the dense MLP's activation: ``silu`` (SwiGLU) or ``gelu_pytorch_tanh`` (Gemma's GeGLU).
        mlp_gated: the dense MLP is gated (``act(gate) * up``); False: ``down(act(up(x)))`` (StarCoder2).
        mlp_bias: the dense MLP's projections carry biases.
        norm_style: the norms: RMSNorm applying its weight ``llama``'s way (``w * round(x_normed)``), ``gemma``'s
            (``round((1 + w) * x_normed)`` in float32) or ``float`` (``round(w * x_normed)`` in float32, gpt-oss);
            or a LayerNorm (mean removed): ``layernorm`` with a weight alone, multiplied in float32 (Cohere), or
            ``layernorm_bias``, torch's ``LayerNorm`` with weight and bias (StarCoder2, Phi-3.5-MoE).
        norm_layout: where a layer's norms sit: ``pre`` (before attention and before the MLP), ``sandwich`` (also
            after each: Gemma's post_attention, pre_feedforward and post_feedforward layernorms), ``post`` (after
            each only, none before: OLMo 2, EXAONE 4) or ``parallel`` (one norm; attention and MLP both read it
            and both outputs join the residual: Cohere).
        residual_multiplier: each block's output is multiplied by this before its residual add (Granite).
        embedding_scale: embeddings multiplied by this (Gemma: ``sqrt(hidden_size)``, rounded to the weights'
            dtype), None for none.
        final_logit_softcap: logits ``l`` become ``cap * tanh(l / cap)`` (Gemma 2), None for none.
        logit_scale: logits multiplied by this (Cohere), None for none.
        logit_divisor: logits divided by this (Granite's ``logits_scaling``), None for none.
        lm_head_bias: the LM head carries a bias (Phi-3.5-MoE).
        attention_scale: the softmax scale (Gemma: ``query_pre_attn_scalar ** -0.5``); None: ``head_dim ** -0.5``.
        attn_temperature: Llama 4's temperature tuning of NoPE layers, ``(attn_scale, floor_scale)``: a query at
            position ``p`` is multiplied by ``1 + attn_scale * log(1 + floor((p + 1) / floor_scale))``; None off.
        rope_interleaved: the checkpoint rotates (x0, x1), (x2, x3), ... pairs of each head's rotary part
            (Llama 4, GLM-4, Cohere); the loader permutes those q and k rows into the rotate-half order, which leaves
            every q.k unchanged.
        linear: the linear-attention layers' shape (`LinearAttentionConfig`: the ``linear`` layers of
            `layer_attention`, Gated DeltaNet), None for a model without them.
        attn_output_gate: the attention's q projection also gives a gate per head and dimension; the attention
            output is multiplied by its sigmoid before ``o_proj`` (Qwen3-Next's gated attention).
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
    quant: QuantScheme | None = None
    o_proj_bias: bool = False
    hidden_act: str = "silu"
    mlp_gated: bool = True
    mlp_bias: bool = False
    norm_style: str = "llama"
    norm_layout: str = "pre"
    residual_multiplier: float | None = None
    embedding_scale: float | None = None
    final_logit_softcap: float | None = None
    logit_scale: float | None = None
    logit_divisor: float | None = None
    lm_head_bias: bool = False
    attention_scale: float | None = None
    attn_temperature: tuple[float, float] | None = None
    rope_interleaved: bool = False
    linear: LinearAttentionConfig | None = None
    attn_output_gate: bool = False

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
        if (self.qk_norm not in QK_NORMS or self.norm_style not in NORM_STYLES
                or self.norm_layout not in NORM_LAYOUTS):
            raise ValueError(f"unknown qk_norm {self.qk_norm!r}, norm_style {self.norm_style!r} or norm_layout "
                             f"{self.norm_layout!r}")

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
        """The family's short name (`families`)."""
        return families.get(self.architecture).name

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def q_proj_size(self) -> int:
        """Rows of the q projection: q, and with `attn_output_gate` each head's gate after its q."""
        return self.q_size * (2 if self.attn_output_gate else 1)

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        """The linear-attention layers (`LayerAttention` kind ``linear``), in order."""
        return tuple(i for i, a in enumerate(self.layer_attention) if a.kind == "linear")

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that RoPE rotates (the first ones; all but for partial rotary; under MLA the
        shared RoPE key's ``qk_rope_head_dim``)."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and self.moe.is_moe_layer(layer)

    def check_tp(self, tp_size: int, expert_parallel: bool = False, num_redundant_experts: int = 0) -> None:
        """Refuse a TP size that does not divide the KV heads (MLA: the attention heads; the latent is
        replicated on every rank), the dense MLP width or the experts (`moe_config.check_moe_parallel`), or
        that cuts a quantised layer's blocks, groups or packed words (`pd_cluster.engine.quant.tp`).

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
            check_moe_parallel(self.moe, tp_size, expert_parallel, num_redundant_experts)
        if self.quant is not None:
            check_splits(linear_layers(self), self.quant, tp_size)
        if self.linear is not None:
            self.linear.check_tp(tp_size)

    def _attention_params(self, layer: int = 0) -> int:
        h = self.hidden_size
        if self.linear is not None and self.layer_attention[layer].kind == "linear":
            return self.linear.num_params(h)
        attn = h * (self.q_proj_size + 2 * self.kv_size) + self.q_size * h
        if self.mla is not None:
            attn = self.mla.num_params(h, self.num_attention_heads)
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.o_proj_bias:
            attn += h
        if self.qk_norm in ("rms", "gemma"):
            attn += 2 * self.head_dim
        if self.qk_norm == "rms_across":
            attn += self.q_size + self.kv_size
        if self.layer_attention[layer].sinks:
            attn += self.num_attention_heads
        return attn

    def _norm_params(self) -> int:
        norms = {"pre": 2, "sandwich": 4, "post": 2, "parallel": 1}[self.norm_layout]
        return norms * self.hidden_size * (2 if self.norm_style == "layernorm_bias" else 1)

    def _mlp_params(self, layer: int, active: bool) -> int:
        h, inter = self.hidden_size, self.intermediate_size
        if not self.is_moe_layer(layer):
            mats = 3 if self.mlp_gated else 2
            return mats * h * inter + ((mats - 1) * inter + h if self.mlp_bias else 0)
        assert self.moe is not None
        return self.moe.active_layer_params(h) if active else self.moe.layer_params(h)

    def num_params(self) -> int:
        """Parameter count of the decoder (embedding, layers, final norm, head); every expert counted."""
        h = self.hidden_size
        layers = sum(self._attention_params(i) + self._mlp_params(i, False) + self._norm_params()
                     for i in range(self.num_hidden_layers))
        embed = self.vocab_size * h
        head = (0 if self.tie_word_embeddings else self.vocab_size * h) + (self.vocab_size if self.lm_head_bias else 0)
        return embed + layers + self._final_norm_params() + head

    def _final_norm_params(self) -> int:
        return self.hidden_size * (2 if self.norm_style == "layernorm_bias" else 1)

    def num_active_params(self) -> int:
        """Parameters one token multiplies through: as `num_params` but only the router, the shared experts
        and ``top_k`` routed experts of each MoE layer (the embedding row lookup still counts its table)."""
        h = self.hidden_size
        layers = sum(self._attention_params(i) + self._mlp_params(i, True) + self._norm_params()
                     for i in range(self.num_hidden_layers))
        head = (0 if self.tie_word_embeddings else self.vocab_size * h) + (self.vocab_size if self.lm_head_bias else 0)
        return self.vocab_size * h + layers + self._final_norm_params() + head

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], folder: str | Path | None = None) -> "ArchConfig":
        """Build from a parsed HF ``config.json`` (of the checkpoint `folder`, where a ``quantize_config.json``
        is looked for and which refusals name): its family (`families.family_of`) reads the language model's
        config after refusing what it would not honour.

        Raises:
            ValueError: the architecture is not a supported one, or a key that changes the math has a value
                the engine does not implement (named; `Family.check`, and for the weights' quantisation
                `pd_cluster.engine.quant.scheme.read_quant_scheme`).
        """
        family = families.family_of(cfg)
        quant = _quant(cfg, folder)
        text = family.text_config(cfg)
        family.check(text)
        return cls(**family.arch_fields(text, quant), quant=quant)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ArchConfig":
        """Read ``<path>/config.json``.

        Raises:
            FileNotFoundError: `path` is not a folder (a Hugging Face Hub id, say: the message says how to
                download it), or it has no config.json.
        """
        folder = check_model_folder(path)
        with open(folder / "config.json") as f:
            return cls.from_dict(json.load(f), folder)


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


def _quant(cfg: dict[str, Any], folder: str | Path | None) -> QuantScheme | None:
    """The weights' quantisation; MXFP4 (gpt-oss's experts) is read only while the fused MoE keeps that kind
    (`support.EXPERT_KINDS_KEPT`).

    Raises:
        QuantConfigError: a format or value the engine does not compute, naming it and its file.
    """
    quant = read_quant_scheme(cfg, folder)
    for w in quant.weight_schemes if quant is not None else ():
        if w.kind == "mxfp4" and w.kind not in support.EXPERT_KINDS_KEPT:
            raise quant.refuse("quant_method", quant.method, "MXFP4 experts (gpt-oss) are read but the engine's MoE "
                                                             "kernel does not compute them yet")
    return quant
