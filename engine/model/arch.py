"""The architecture of a Llama-family checkpoint, read from its ``config.json``.

Supported: Llama 2/3 (``LlamaForCausalLM``), Mistral (``MistralForCausalLM``),
Qwen2 (``Qwen2ForCausalLM``, q/k/v bias) and Qwen3 (``Qwen3ForCausalLM``, q/k
RMSNorm); DeepSeek-V2/V3 (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``,
also Kimi K2's shape) with multi-head latent attention (`MLAConfig`). This module
has no torch dependency, so the memory planner can use it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}

# Architectures whose mixture-of-experts layers this build cannot construct yet: a config of theirs that has
# MoE layers is refused by name (`ArchConfig.from_dict`, and pd-plan's "engine support"); one whose layers are
# all dense (``first_k_dense_replace >= num_hidden_layers``) loads.
ARCHITECTURES_WITHOUT_MOE_LAYER = frozenset({"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"})


@dataclass(frozen=True)
class ArchConfig:
    """The shape of a decoder-only Llama-family model.

    Attributes:
        architecture: HF class name, e.g. ``LlamaForCausalLM``.
        rope_scaling: HF ``rope_scaling`` / ``rope_parameters`` dict, or None for
            plain RoPE. Keys as in HF (``rope_type``, ``factor``, ...).
        attention_bias: q/k/v projections carry a bias (Qwen2).
        mla: the latent attention's shape (DeepSeek-V2/V3), or None for K/V per head.
        moe_layers: indices of the layers whose MLP is a mixture of experts (empty: all dense).
        qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3).
        sliding_window: attention window in tokens, or None (Mistral v0.1).
        torch_dtype: the checkpoint's dtype name, e.g. ``bfloat16``.
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
    qk_norm: bool = False
    sliding_window: int | None = None
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    mla: MLAConfig | None = None
    moe_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES.get(self.architecture, "llama")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def num_params(self) -> int:
        """Parameter count of the decoder (embedding, layers, final norm, head), dense MLPs only."""
        h, i = self.hidden_size, self.intermediate_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.mla is not None:
            attn = self.mla.num_params(h, self.num_attention_heads)
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        layer = attn + 3 * h * i + 2 * h
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return embed + self.num_hidden_layers * layer + h + head

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ArchConfig":
        """Build from a parsed HF ``config.json``.

        Raises:
            ValueError: the architecture is not a supported Llama-family one.
        """
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architectures {archs}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        theta = cfg.get("rope_theta")
        if theta is None and isinstance(scaling, dict):
            theta = scaling.get("rope_theta")
        if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        mla = MLAConfig.from_dict(cfg, arch, scaling) if arch in MLA_ARCHITECTURES else None
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta if theta is not None else 10000.0),
            rope_scaling=dict(scaling) if scaling else None,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=_sliding_window(cfg),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            mla=mla,
            moe_layers=_deepseek_moe_layers(cfg, arch) if mla is not None else (),
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
        """Read a DeepSeek config.

        Raises:
            ValueError: a key that changes the math and is not implemented (``hidden_act`` other than
                ``silu``, ``attention_bias``, ``mlp_bias``), named.
        """
        for key, ok in (("hidden_act", cfg.get("hidden_act", "silu") == "silu"),
                        ("attention_bias", not cfg.get("attention_bias", False)),
                        ("mlp_bias", not cfg.get("mlp_bias", False))):
            if not ok:
                raise ValueError(f"{arch}: config key {key}={cfg.get(key)!r} is not supported "
                                 "(hidden_act silu, attention_bias and mlp_bias false are)")
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


def _deepseek_moe_layers(cfg: dict[str, Any], arch: str) -> tuple[int, ...]:
    """DeepSeek's MoE layers: those from ``first_k_dense_replace`` on, when the config has routed experts.

    Raises:
        ValueError: there are some, and this build cannot construct them (`ARCHITECTURES_WITHOUT_MOE_LAYER`).
    """
    layers = int(cfg["num_hidden_layers"])
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    moe = tuple(range(first_dense, layers)) if cfg.get("n_routed_experts") else ()
    if moe and arch in ARCHITECTURES_WITHOUT_MOE_LAYER:
        raise ValueError(
            f"{arch}: layers {moe[0]}..{moe[-1]} are mixture-of-experts layers (first_k_dense_replace="
            f"{first_dense}, n_routed_experts={cfg.get('n_routed_experts')}), and this build has no MoE layer "
            "for this architecture yet; checkpoints whose layers are all dense (first_k_dense_replace >= "
            "num_hidden_layers) load")
    return moe


def _sliding_window(cfg: dict[str, Any]) -> int | None:
    window = cfg.get("sliding_window")
    if window is None or cfg.get("use_sliding_window") is False:
        return None
    return int(window)
