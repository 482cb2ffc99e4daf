"""Each decoder layer's attention type, read from a Hugging Face ``config.json``: the single source of truth.

`LayerAttention` says, for one layer, which earlier tokens a query sees and how its q and k are rotated.
`ArchConfig.layer_attention` holds one per layer; the attention backends read their masks, sinks and
softcapping from it, the model its RoPE, and a KV manager may read from it which pages a layer will never
read again (`LayerAttention.first_visible`). Torch-free (the memory planner reads it).

Units: positions and sizes are tokens, positions counted from 0 in the request's sequence.

* ``full``: a query at position ``p`` sees keys ``0..p``.
* ``sliding`` (window ``W``): keys ``p - W + 1..p``, W tokens, itself included (transformers'
  ``sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``; Mistral, Qwen2's upper layers,
  Gemma 2/3's local layers, gpt-oss's even layers).
* ``chunked`` (chunk ``C``): keys ``p - p % C..p``, only its own chunk of C tokens (transformers'
  ``chunked_overlay``; Llama 4's local layers, ``attention_chunk_size``).
* ``linear``: no softmax attention and no KV per token: a linear-attention layer (Gated DeltaNet,
  `pd_cluster.engine.model.gated_deltanet`) that keeps a fixed-size recurrent state per request instead
  (a KV manager's state group, `pd_cluster.engine.kv.groups`). It sees every earlier token, through that state.

Each family reads its layer layout from its own keys (`pd_cluster.engine.model.families`, `Family.layer_kinds`)
as its transformers class does, and builds the tuple with `build_layers`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

AttentionKind = Literal["full", "sliding", "chunked", "linear"]
KINDS = ("full", "sliding", "chunked", "linear")
HF_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked",
                  "linear_attention": "linear"}


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention type.

    Attributes:
        kind: ``full``, ``sliding``, ``chunked`` or ``linear`` (module docstring).
        window: ``sliding`` only: the tokens a query sees, itself included (a query at ``p`` sees
            ``[p - window + 1, p]``).
        chunk_size: ``chunked`` only: a query at ``p`` sees ``[p - p % chunk_size, p]``.
        rope: RoPE rotates this layer's q and k; False for a NoPE layer (Llama 4's global layers).
        rope_theta: this layer's RoPE base (Gemma 3's local layers have their own).
        rope_scaling: this layer's HF ``rope_scaling`` dict, None for plain RoPE (Gemma 3 scales only its
            global layers). Not part of the hash.
        sinks: a learned logit per query head joins the softmax's denominator (gpt-oss's attention sinks;
            the weights are the model's, ``self_attn.sinks``).
        logit_softcap: the scores ``s`` become ``cap * tanh(s / cap)`` before the mask and softmax (Gemma 2's
            ``attn_logit_softcapping``), None for none.

    Raises:
        ValueError: a kind without its size, a size on the wrong kind, or a size below 1.
    """

    kind: AttentionKind = "full"
    window: int | None = None
    chunk_size: int | None = None
    rope: bool = True
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    sinks: bool = False
    logit_softcap: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"attention kind {self.kind!r}; expected one of {KINDS}")
        if (self.window is not None) != (self.kind == "sliding"):
            raise ValueError(f"a window belongs to sliding layers only (kind {self.kind}, window {self.window})")
        if (self.chunk_size is not None) != (self.kind == "chunked"):
            raise ValueError(f"a chunk size belongs to chunked layers only (kind {self.kind}, "
                             f"chunk_size {self.chunk_size})")
        for name in ("window", "chunk_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.logit_softcap is not None and not self.logit_softcap > 0:
            raise ValueError(f"logit_softcap must be > 0, got {self.logit_softcap}")

    def first_visible(self, position: int) -> int:
        """The first key position a query at `position` sees (tokens; keys up to `position` itself)."""
        if self.kind == "sliding":
            return max(position - self.window + 1, 0)
        if self.kind == "chunked":
            return position - position % self.chunk_size
        return 0

    @property
    def max_visible(self) -> int | None:
        """The most keys one query sees (window or chunk size, tokens); None when unbounded (full)."""
        return self.window if self.kind == "sliding" else self.chunk_size

    @property
    def mask_key(self) -> tuple[str, int]:
        """(kind, window or chunk size, 0 for full): layers with equal keys attend to the same keys."""
        return self.kind, self.max_visible or 0


def uniform(layers: int, window: int | None, rope_theta: float, rope_scaling: dict[str, Any] | None
            ) -> tuple[LayerAttention, ...]:
    """Every layer alike: sliding with `window`, or full when it is None."""
    one = LayerAttention("sliding" if window else "full", window=window or None, rope_theta=rope_theta,
                         rope_scaling=rope_scaling)
    return (one,) * layers


def refuse(key: str, value: Any, supported: str) -> ValueError:
    return ValueError(f"config.json: {key}={value!r} is not implemented ({supported}); refusing to load a model "
                      f"that would run with different math")


def kinds_from_layer_types(cfg: dict[str, Any], layers: int, allowed: tuple[str, ...]) -> list[str] | None:
    """Each layer's kind from ``layer_types`` (None when the config has none).

    Raises:
        ValueError: fewer entries than layers, or an entry outside `allowed` (HF names, `HF_LAYER_TYPES`), named.
    """
    types = cfg.get("layer_types")
    if types is None:
        return None
    if len(types) < layers:
        raise refuse("layer_types", types, f"one entry per layer ({layers})")
    out = []
    for t in types[:layers]:
        if t not in allowed:
            raise refuse("layer_types", t, ", ".join(allowed))
        out.append(HF_LAYER_TYPES[t])
    return out


FULL_SLIDING = ("full_attention", "sliding_attention")


def alternating(cfg: dict[str, Any], layers: int, pattern: int) -> list[str]:
    """``layer_types`` when given (full or sliding), else every `pattern`-th layer full and the others sliding
    (pattern 2: sliding / full alternating from layer 0)."""
    kinds = kinds_from_layer_types(cfg, layers, FULL_SLIDING)
    return kinds if kinds is not None else ["sliding" if (i + 1) % pattern else "full" for i in range(layers)]


def rope_layers(cfg: dict[str, Any]) -> list[bool]:
    """Which layers rotate, from ``no_rope_layers`` (1: RoPE, 0: NoPE), else all but every
    ``no_rope_layer_interval``-th (default 4): the keys of transformers' Llama 4 and SmolLM3 configs."""
    layers = int(cfg["num_hidden_layers"])
    given = cfg.get("no_rope_layers")
    if given:
        return [bool(x) for x in list(given)[:layers]]
    interval = int(cfg.get("no_rope_layer_interval") or 4)
    return [(i + 1) % interval != 0 for i in range(layers)]


def build_layers(kinds: list[str], window: int | None, chunk: int | None, ropes: list[tuple[bool, float, Any]],
                 sinks: bool = False, softcap: float | None = None) -> tuple[LayerAttention, ...]:
    """One `LayerAttention` per layer: its kind (a kind whose size is None becomes ``full``), the window or
    chunk, and its RoPE ``(rotates, base, scaling dict or None)``."""
    out = []
    for kind, (rope, theta, scaling) in zip(kinds, ropes):
        if (kind == "sliding" and window is None) or (kind == "chunked" and chunk is None):
            kind = "full"
        out.append(LayerAttention(
            kind,  # type: ignore[arg-type]
            window=int(window) if kind == "sliding" else None,
            chunk_size=int(chunk) if kind == "chunked" else None,
            rope=rope, rope_theta=theta, rope_scaling=scaling, sinks=sinks,
            logit_softcap=float(softcap) if softcap else None))
    return tuple(out)


def rope_key(layer: LayerAttention) -> str | None:
    """A key naming the layer's rotation (None for NoPE): layers with equal keys share one cos/sin table."""
    if not layer.rope:
        return None
    scaling = sorted((layer.rope_scaling or {}).items())
    return f"{layer.rope_theta!r}:{scaling!r}"
