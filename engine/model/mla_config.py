"""Multi-head latent attention's shape (DeepSeek-AI, "DeepSeek-V2", 2024, sec. 2.1). Torch-free.

`MLAConfig` is read by the families whose attention is latent (`pd_cluster.engine.model.families`) and held by
`ArchConfig.mla`; `mla_spec_fields` gives the memory planner the same shape from a config's keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MLAConfig:
    """One layer's latent attention shapes.

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
    def from_dict(cls, cfg: dict[str, Any], scaling: dict[str, Any] | None, rope_interleave: bool) -> "MLAConfig":
        """Read the MLA keys of a config (``kv_lora_rank``, ``q_lora_rank``, ``qk_nope_head_dim``,
        ``qk_rope_head_dim``, ``v_head_dim``) with its normalised RoPE scaling (YaRN's ``mscale_all_dim``)."""
        nope, rope = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
        scale = (nope + rope) ** -0.5
        if scaling and scaling.get("mscale_all_dim"):
            m = yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
            scale *= m * m
        q_lora = cfg.get("q_lora_rank")
        return cls(kv_lora_rank=int(cfg["kv_lora_rank"]), q_lora_rank=int(q_lora) if q_lora else None,
                   qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=int(cfg["v_head_dim"]),
                   rope_interleave=rope_interleave, softmax_scale=scale)


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention scale ``0.1 * mscale * ln(factor) + 1`` (1 for a factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_spec_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The memory planner's fields of a config with MLA keys: the latent's parts, and as ``head_dim`` the
    query-key width ``qk_nope_head_dim + qk_rope_head_dim``; every layer global."""
    return dict(head_dim=int(cfg["qk_nope_head_dim"]) + int(cfg["qk_rope_head_dim"]),
                intermediate_size=int(cfg["intermediate_size"]), global_layers=int(cfg["num_hidden_layers"]),
                local_layers=0, local_span=None, local_kind="", params_total=0, params_active=0,
                kv_lora_rank=int(cfg["kv_lora_rank"]), q_lora_rank=int(cfg.get("q_lora_rank") or 0),
                qk_nope_head_dim=int(cfg["qk_nope_head_dim"]), qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
                v_head_dim=int(cfg["v_head_dim"]))
