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

How each family lays its layers out, as its transformers 5.24 class does:

======================  ===========================================================================
family                  layers
======================  ===========================================================================
Llama                   full
Mistral, Mixtral,       sliding on every layer when ``sliding_window`` is set
Phi-3
Qwen2, Qwen3            ``layer_types``; without it, sliding from layer ``max_window_layers`` on when
                        ``use_sliding_window`` (the window is dropped when ``use_sliding_window`` is false)
Qwen3-MoE               sliding on every layer when ``use_sliding_window``
Gemma 2                 ``layer_types``, default sliding / full alternating from layer 0; every layer's
                        logits soft-capped (``attn_logit_softcapping``)
Gemma 3 (text)          ``layer_types``, default 5 sliding to 1 full (``sliding_window_pattern`` 6); sliding
                        layers rotate with their own base ``rope_local_base_freq`` (10,000) and without
                        ``rope_scaling``, which applies to the full layers only
gpt-oss                 ``layer_types``, default sliding / full alternating; attention sinks on every layer
Llama 4 (text)          ``layer_types``, default from ``no_rope_layers``: RoPE layers are chunked (when
                        ``attention_chunk_size`` is set), the NoPE layers (``no_rope_layers[i] == 0``,
                        default every ``no_rope_layer_interval``-th) full and without RoPE
======================  ===========================================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

AttentionKind = Literal["full", "sliding", "chunked"]
KINDS = ("full", "sliding", "chunked")
# The transformers classes' default sliding_window, for configs that leave the key out.
_DEFAULT_WINDOW = {"Gemma2ForCausalLM": 4096, "Gemma3ForCausalLM": 4096, "GptOssForCausalLM": 128,
                   "MistralForCausalLM": 4096}
HF_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked"}


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention type.

    Attributes:
        kind: ``full``, ``sliding`` or ``chunked`` (module docstring).
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


def _kinds_from_layer_types(cfg: dict[str, Any], layers: int, allowed: tuple[str, ...]) -> list[str] | None:
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


def hf_layer_kinds(cfg: dict[str, Any], architecture: str) -> tuple[list[str], int | None, int | None]:
    """(kind of each layer, the sliding window, the chunk size) as transformers' class of `architecture` reads
    `cfg` (module docstring's table).

    Raises:
        ValueError: a ``layer_types`` entry the class does not know, named.
    """
    layers = int(cfg["num_hidden_layers"])
    window = cfg.get("sliding_window", _DEFAULT_WINDOW.get(architecture))
    full_sliding = ("full_attention", "sliding_attention")
    if architecture == "LlamaForCausalLM":
        return ["full"] * layers, None, None
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        if not cfg.get("use_sliding_window", False):
            window = None  # Qwen2Config.__post_init__ drops it
        if architecture == "Qwen3MoeForCausalLM":
            return ["sliding" if window is not None else "full"] * layers, window, None
        kinds = _kinds_from_layer_types(cfg, layers, full_sliding)
        if kinds is None:
            first = int(cfg.get("max_window_layers", 28))
            kinds = ["sliding" if window is not None and i >= first else "full" for i in range(layers)]
        return [k if window is not None else "full" for k in kinds], window, None
    if architecture in ("Gemma2ForCausalLM", "GptOssForCausalLM"):
        kinds = _kinds_from_layer_types(cfg, layers, full_sliding)
        if kinds is None:
            kinds = ["sliding" if (i + 1) % 2 else "full" for i in range(layers)]
        return [k if window is not None else "full" for k in kinds], window, None
    if architecture == "Gemma3ForCausalLM":
        kinds = _kinds_from_layer_types(cfg, layers, full_sliding)
        if kinds is None:
            pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
            kinds = ["sliding" if (i + 1) % pattern else "full" for i in range(layers)]
        return [k if window is not None else "full" for k in kinds], window, None
    if architecture in ("Llama4ForCausalLM", "Llama4ForConditionalGeneration"):
        chunk = cfg.get("attention_chunk_size", 8192)  # Llama4TextConfig's default
        kinds = _kinds_from_layer_types(cfg, layers, ("full_attention", "chunked_attention"))
        if kinds is None:
            kinds = ["chunked" if use_rope and chunk is not None else "full" for use_rope in llama4_rope_layers(cfg)]
        return [k if chunk is not None else "full" for k in kinds], None, chunk
    # Mistral, Mixtral, Phi-3: one window for every layer (their classes never read layer_types)
    return ["sliding" if window is not None else "full"] * layers, window, None


def llama4_rope_layers(cfg: dict[str, Any]) -> list[bool]:
    """Llama 4: which layers use RoPE (``no_rope_layers[i] == 1``; default: all but every
    ``no_rope_layer_interval``-th), as ``Llama4TextConfig.__post_init__``."""
    layers = int(cfg["num_hidden_layers"])
    given = cfg.get("no_rope_layers")
    if given:
        return [bool(x) for x in list(given)[:layers]]
    interval = int(cfg.get("no_rope_layer_interval") or 4)
    return [(i + 1) % interval != 0 for i in range(layers)]


def gemma3_rope(cfg: dict[str, Any], kind: str) -> tuple[float, dict[str, Any] | None]:
    """Gemma 3's RoPE of a ``full`` or ``sliding`` layer: (base, scaling dict or None).

    transformers 5 writes ``rope_parameters`` keyed by layer type; earlier configs (those on the Hub) have
    ``rope_theta`` (global, default 1e6), ``rope_local_base_freq`` (local, default 1e4) and a ``rope_scaling``
    that applies to the global layers only (``Gemma3TextConfig.convert_rope_params_to_dict``).
    """
    params = cfg.get("rope_parameters")
    hf_type = "sliding_attention" if kind == "sliding" else "full_attention"
    if isinstance(params, dict) and isinstance(params.get(hf_type), dict):
        p = dict(params[hf_type])
    elif kind == "sliding":
        p = {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    else:
        p = dict(cfg.get("rope_scaling") or {"rope_type": "default"})
        p.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    theta = float(p.pop("rope_theta"))
    kind_name = p.get("rope_type", p.get("type", "default"))
    return theta, (None if kind_name == "default" else {**p, "rope_type": kind_name})


def layer_attention_from_hf(cfg: dict[str, Any], architecture: str, rope_theta: float,
                            rope_scaling: dict[str, Any] | None) -> tuple[LayerAttention, ...]:
    """Every layer's `LayerAttention` for an HF config of `architecture` (the model-wide RoPE already
    normalised by `ArchConfig.from_dict`).

    Raises:
        ValueError: a ``layer_types`` entry the family does not know, named.
    """
    kinds, window, chunk = hf_layer_kinds(cfg, architecture)
    rope_layers = (llama4_rope_layers(cfg) if architecture in ("Llama4ForCausalLM", "Llama4ForConditionalGeneration")
                   else [True] * len(kinds))
    softcap = cfg.get("attn_logit_softcapping", 50.0) if architecture == "Gemma2ForCausalLM" else None
    out = []
    for kind, rope in zip(kinds, rope_layers):
        theta, scaling = rope_theta, rope_scaling
        if architecture == "Gemma3ForCausalLM":
            theta, scaling = gemma3_rope(cfg, kind)
        out.append(LayerAttention(
            kind,  # type: ignore[arg-type]
            window=int(window) if kind == "sliding" else None,
            chunk_size=int(chunk) if kind == "chunked" else None,
            rope=rope, rope_theta=theta, rope_scaling=scaling,
            sinks=architecture == "GptOssForCausalLM",
            logit_softcap=float(softcap) if softcap else None))
    return tuple(out)


def rope_key(layer: LayerAttention) -> str | None:
    """A key naming the layer's rotation (None for NoPE): layers with equal keys share one cos/sin table."""
    if not layer.rope:
        return None
    scaling = sorted((layer.rope_scaling or {}).items())
    return f"{layer.rope_theta!r}:{scaling!r}"
