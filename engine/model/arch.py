"""The architecture of a Llama-family checkpoint, read from its ``config.json``.

Supported: Llama 2/3 (``LlamaForCausalLM``), Mistral (``MistralForCausalLM``),
Qwen2 (``Qwen2ForCausalLM``, q/k/v bias) and Qwen3 (``Qwen3ForCausalLM``, q/k
RMSNorm). This module has no torch dependency, so the memory planner can use it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class ArchConfig:
    """The shape of a decoder-only Llama-family model.

    Attributes:
        architecture: HF class name, e.g. ``LlamaForCausalLM``.
        rope_scaling: HF ``rope_scaling`` / ``rope_parameters`` dict, or None for
            plain RoPE. Keys as in HF (``rope_type``, ``factor``, ...).
        attention_bias: q/k/v projections carry a bias (Qwen2).
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
        """Parameter count of the decoder (embedding, layers, final norm, head)."""
        h, i = self.hidden_size, self.intermediate_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
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


def _sliding_window(cfg: dict[str, Any]) -> int | None:
    window = cfg.get("sliding_window")
    if window is None or cfg.get("use_sliding_window") is False:
        return None
    return int(window)
