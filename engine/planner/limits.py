"""What the memory arithmetic does not say: whether the engine can load the model, how long a
context the model was trained for, and how long one long prefill takes.

- **Engine support.** The engine's loader accepts only the architectures of its family registry
  (`engine/model/families/`), its RoPE (`engine/model/rope.py`) only the scaling types in
  `SUPPORTED_ROPE_TYPES` (and a family's other names for them), and refuses any config key it would not
  honour (`Family.check`); the planner asks the loader's own check (`ModelSpec.refusal`).
- **Context limit.** As vLLM derives ``max_model_len`` (``_get_and_verify_max_len``):
  ``max_position_embeddings``, times the RoPE ``factor`` for ``linear`` and ``dynamic`` scaling;
  for ``yarn``, ``original_max_position_embeddings * factor``; ``llama3`` (and ``longrope``)
  configs already state the extended length in ``max_position_embeddings``.
- **Prefill time.** FLOPs of one causal prefill of ``L`` tokens: ``2 * P_active * L`` for the
  matrix multiplies (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", sec. 2.1)
  plus attention, ``2 * H * d * L^2`` per global layer (QK^T and AV, halved by the causal mask)
  and ``2 * H * d * L * C`` per local layer of window or chunk ``C``; divided by an assumed
  sustained rate per GPU times the TP size. Under MLA prefill runs the expanded form, so ``d`` is the
  mean of the query-key and value head widths (``(qk_nope + qk_rope + v_head_dim) / 2``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pd_cluster.engine.model import families
from pd_cluster.engine.model.config_check import ROPE_TYPES
from pd_cluster.engine.planner.spec import ModelSpec

# The rope_type values engine/model/rope.py implements (tests/engine/test_planner.py checks the two agree).
SUPPORTED_ROPE_TYPES = ROPE_TYPES

# Sustained prefill rate per GPU assumed by default, in TFLOP/s: about 40% of an H100/H200's dense BF16
# peak (989 TFLOP/s), what long-context prefill typically sustains. A planning number, not a measurement.
DEFAULT_PREFILL_TFLOPS = 400.0


def unsupported_reason(spec: ModelSpec) -> str | None:
    """Why the engine would refuse to load `spec`, naming the architecture; None when it loads."""
    family = families.find(spec.architectures)
    if family is None:
        names = ", ".join(spec.architectures) or "no `architectures` in config.json"
        return f"the engine cannot serve {names} (it loads {', '.join(families.supported_architectures())})"
    kind = rope_type(spec)
    if kind not in SUPPORTED_ROPE_TYPES and kind not in family.rope_aliases:
        return f"the engine cannot apply rope_scaling type {kind!r} (it has {', '.join(SUPPORTED_ROPE_TYPES)})"
    if spec.refusal:
        return f"the engine refuses this config: {spec.refusal}"
    return None


def rope_type(spec: ModelSpec) -> str:
    s = spec.rope_scaling or {}
    return str(s.get("rope_type", s.get("type", "default")))


@dataclass(frozen=True)
class ContextLimit:
    """The longest context the model supports (tokens) and how it was derived, in words."""

    tokens: int
    derivation: str


def context_limit(spec: ModelSpec) -> ContextLimit:
    """The model's context limit, RoPE scaling included (see the module docstring)."""
    base, s, kind = spec.max_position_embeddings, spec.rope_scaling or {}, rope_type(spec)
    factor = float(s.get("factor", 1.0) or 1.0)
    if kind in ("linear", "dynamic"):
        return ContextLimit(int(base * factor), f"max_position_embeddings {base:,} x {kind} RoPE factor {factor:g}")
    if kind == "yarn":
        orig = int(s.get("original_max_position_embeddings") or base)
        return ContextLimit(int(orig * factor), f"original_max_position_embeddings {orig:,} x yarn factor {factor:g}")
    if kind in ("llama3", "longrope"):
        orig = s.get("original_max_position_embeddings")
        via = f", {kind} RoPE from {int(orig):,}" if orig else f", {kind} RoPE"
        return ContextLimit(base, f"max_position_embeddings {base:,}{via}")
    return ContextLimit(base, f"max_position_embeddings {base:,}")


def prefill_flops(spec: ModelSpec, num_tokens: int) -> float:
    """FLOPs of one causal prefill of `num_tokens` tokens (module docstring)."""
    L, hd = float(num_tokens), float(spec.num_heads * spec.head_dim)
    if spec.is_mla:
        hd = spec.num_heads * (spec.qk_nope_head_dim + spec.qk_rope_head_dim + spec.v_head_dim) / 2
    chunk = float(min(num_tokens, spec.local_span or num_tokens))
    attention = 2 * hd * L * L * spec.global_layers + 2 * hd * L * chunk * spec.local_layers
    return 2.0 * spec.active_params_per_token() * L + attention


def prefill_seconds(spec: ModelSpec, num_tokens: int, tp_size: int, tflops_per_gpu: float) -> float:
    """Seconds for one prefill of `num_tokens` on a TP-`tp_size` instance at `tflops_per_gpu` each.

    Raises:
        ValueError: a non-positive rate.
    """
    if tflops_per_gpu <= 0:
        raise ValueError(f"--prefill-tflops must be > 0, got {tflops_per_gpu}")
    return prefill_flops(spec, num_tokens) / (tflops_per_gpu * 1e12 * tp_size)
