"""Rotary position embedding (RoPE) with the scaling types Llama-family configs use.

Scaling types (the ``rope_type`` of HF's ``rope_scaling``):
- ``default``: Su et al., "RoFormer" (2021).
- ``linear``: position interpolation, Chen et al. 2023 (inverse frequencies / factor).
- ``dynamic``: NTK-aware base scaling, fixed at the longest context
  (``max_position_embeddings * factor``) as vLLM does, so that cached keys stay valid
  as a sequence grows (HF instead changes the base with the current length).
- ``llama3``: Llama 3.1's frequency-dependent scaling (Meta's reference code).
- ``yarn``: Peng et al., "YaRN" (2023), with its attention factor on cos/sin.
- ``longrope``: Ding et al., "LongRoPE" (2024), as Phi-3 uses it: per-frequency ``short_factor`` and
  ``long_factor`` divisors and the attention factor ``sqrt(1 + ln(f) / ln(L0))`` (or Phi-3.5-MoE's
  ``short_mscale`` / ``long_mscale``). As transformers does, each sequence is rotated by the set its own
  length calls for: the short factors up to ``original_max_position_embeddings`` (L0) tokens, the long ones
  past it. The model holds both (`longrope_variants`); each request carries its set
  (`Request.rope_variant`: its length when its KV is computed from the start), the step's
  `ForwardBatch.rope_variant` gives it per token, and a request that grows past L0 on the short factors is
  recomputed with the long ones (transformers' ``generate`` recomputes its cache at that point too), since a
  paged cache cannot mix the two rotations. The prefix cache keeps the two sets' pages apart
  (`Request.cache_tokens`).

cos/sin are computed per step from the positions, never as a table sized by
the context length, so a 10M-token context costs nothing at start-up.
The rotation is the "rotate half" (NeoX) form that HF Llama checkpoints use.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, p: dict[str, Any], max_pos: int) -> torch.Tensor:
    factor = p["factor"]
    low, high = p.get("low_freq_factor", 1.0), p.get("high_freq_factor", 4.0)
    old_len = p.get("original_max_position_embeddings", max_pos)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(base: float, dim: int, p: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    factor = p["factor"]
    orig = p.get("original_max_position_embeddings") or max_pos
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = _yarn_mscale(factor, p["mscale"]) / _yarn_mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    extrapolation = _default_inv_freq(base, dim)
    interpolation = extrapolation / factor
    keep = 1 - ramp  # share of the original (extrapolated) frequency
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def rope_parameters(head_dim: int, base: float, scaling: dict[str, Any] | None,
                    max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale for a RoPE configuration.

    Args:
        head_dim: rotary dimension (the full head).
        base: ``rope_theta``.
        scaling: HF ``rope_scaling`` dict or None; for ``longrope`` the engine adds ``use_long_factor``
            (`longrope_variants`).
        max_position_embeddings: the config's value.

    Returns:
        (inv_freq [head_dim // 2] float32, attention_factor).

    Raises:
        ValueError: unsupported ``rope_type``.
    """
    if not scaling:
        return _default_inv_freq(base, head_dim), 1.0
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return _default_inv_freq(base, head_dim), 1.0
    if kind == "linear":
        return _default_inv_freq(base, head_dim) / scaling["factor"], 1.0
    if kind == "dynamic":
        f = scaling["factor"]
        return _default_inv_freq(base * (f * f - f + 1) ** (head_dim / (head_dim - 2)), head_dim), 1.0
    if kind == "llama3":
        return _llama3(_default_inv_freq(base, head_dim), scaling, max_position_embeddings), 1.0
    if kind == "yarn":
        return _yarn(base, head_dim, scaling, max_position_embeddings)
    if kind == "longrope":
        short, long, orig, factors = longrope(base, head_dim, scaling, max_position_embeddings)
        use_long = scaling.get("use_long_factor")
        if use_long is None:  # the engine's default context length: max_position_embeddings
            use_long = max_position_embeddings > orig
        return (long if use_long else short), factors[1 if use_long else 0]
    raise ValueError(f"unsupported rope_type {kind!r}; supported: default, linear, dynamic, llama3, yarn, longrope")


def longrope(base: float, dim: int, p: dict[str, Any],
             max_pos: int) -> tuple[torch.Tensor, torch.Tensor, int, tuple[float, float]]:
    """LongRoPE's (short inv_freq, long inv_freq, L0, (short attention factor, long attention factor)), as
    transformers' ``_compute_longrope_parameters``: ``factor`` defaults to max_position_embeddings / L0, and one
    attention factor serves both sets; with ``short_mscale`` and ``long_mscale`` (Phi-3.5-MoE) each set has its
    own (transformers' ``PhimoeRotaryEmbedding``).

    Raises:
        ValueError: the factor lists do not have `dim` / 2 entries.
    """
    orig = int(p.get("original_max_position_embeddings") or max_pos)
    factor = p.get("factor") or max_pos / orig
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    factors = (float(attention_factor), float(attention_factor))
    if p.get("short_mscale") is not None and p.get("long_mscale") is not None:
        factors = (float(p["short_mscale"]), float(p["long_mscale"]))
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    out = []
    for key in ("short_factor", "long_factor"):
        ext = torch.tensor(p[key], dtype=torch.float32)
        if ext.numel() != dim // 2:
            raise ValueError(f"longrope {key} has {ext.numel()} entries, the rotary dimension needs {dim // 2}")
        out.append(1.0 / (ext * base ** shape))
    return out[0], out[1], orig, factors


class RotaryEmbedding(torch.nn.Module):
    """Applies RoPE to q and k at given positions.

    Args:
        head_dim, base, scaling, max_position_embeddings: see `rope_parameters` (`head_dim` is the rotary
            dimension: the first ``partial_rotary_factor`` of a head).
    """

    def __init__(self, head_dim: int, base: float, scaling: dict[str, Any] | None,
                 max_position_embeddings: int) -> None:
        super().__init__()
        inv_freq, self.attention_factor = rope_parameters(head_dim, base, scaling, max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape [T, head_dim // 2] for positions [T] (computed in float32)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, head_dim] by cos/sin [T, head_dim // 2] (rotate-half form)."""
        from pd_cluster.engine.model.layer_ops import rotate_half

        return rotate_half(x, cos, sin)


def is_longrope(scaling: dict[str, Any] | None) -> bool:
    return bool(scaling) and scaling.get("rope_type", scaling.get("type")) == "longrope"


def longrope_variants(scaling: dict[str, Any] | None) -> list[dict[str, Any] | None]:
    """The scalings a model rotates by: `scaling` alone, or for longrope the short then the long set
    (``use_long_factor`` false, then true; module docstring)."""
    if not is_longrope(scaling):
        return [scaling]
    return [{**scaling, "use_long_factor": False}, {**scaling, "use_long_factor": True}]


def longrope_threshold(layers) -> int | None:
    """The L0 past which a sequence rotates by longrope's long factors (``original_max_position_embeddings``),
    for the layers' `LayerAttention`s; None when no layer uses longrope."""
    for layer in layers:
        if layer.rope and is_longrope(layer.rope_scaling):
            return int(layer.rope_scaling.get("original_max_position_embeddings") or 0) or None
    return None


def deinterleave_rope_rows(w: torch.Tensor, start: int) -> torch.Tensor:
    """`w` [..., rows, cols] with rows ``[start:]`` reordered from interleaved pairs ``(0, 1), (2, 3), ...``
    to rotate-half order ``0, 2, 4, ..., 1, 3, 5, ...`` (a copy)."""
    rope = w[..., start:, :]
    return torch.cat((w[..., :start, :], rope[..., 0::2, :], rope[..., 1::2, :]), dim=-2)
