"""What the memory planner needs to know about a model, read from an HF ``config.json``.

Torch-free. The config's family (`pd_cluster.engine.model.families`) gives the spec of its layers, experts
and latent attention (`Family.memory_spec`): dense configs, mixtures of experts as the engine reads them
(`Family.moe`), local attention layers (sliding windows, and chunks: Meta's iRoPE design), whose queries never
see more than `ModelSpec.local_span` tokens, and multi-head latent attention, whose KV is one latent of
``kv_lora_rank + qk_rope_head_dim`` values per token per layer. Where the engine's loader accepts a config,
the layer counts come from its own per-layer description (`ArchConfig.layer_attention`) and the parameter
counts from `ArchConfig.num_params` (every family's norms, biases, sinks and expert biases counted). A config
of no registered family is sized from its common keys (and is not servable).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pd_cluster.engine.model import families
from pd_cluster.engine.model.arch import ArchConfig
from pd_cluster.engine.model.family import Family
from pd_cluster.engine.model.moe_config import MoEConfig
from pd_cluster.engine.planner.weights import WeightBytes, weight_bytes
from pd_cluster.engine.quant.scheme import QuantConfigError, QuantScheme, read_quant_scheme

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
BUNDLED = {p.stem: p for p in sorted(CONFIG_DIR.glob("*.json"))}


@dataclass(frozen=True)
class ModelSpec:
    """Sizes that decide weights and KV bytes.

    Attributes:
        global_layers: layers whose queries see the whole context.
        local_layers: sliding-window or chunked layers, whose queries see at most `local_span` tokens.
        local_span: the most tokens a local layer's query sees (the largest window or chunk), None without one.
        local_kind: ``sliding`` or ``chunked`` (``""`` without local layers).
        state_layers: linear-attention layers, which hold no KV per token but a fixed-size recurrent state per
            request (the engine's state group, `pd_cluster.engine.kv.groups`).
        state_bytes_per_request: that state's bytes for one request over all TP ranks (float32; 0 without).
        params_total, params_active: the engine's own parameter counts (`ArchConfig.num_params`,
            `ArchConfig.num_active_params`), 0 when its loader refuses the config (then computed here).
        num_experts, expert_intermediate_size, shared_experts, moe_layers: MoE shape (0 when dense).
        experts_per_token: routed experts each token goes through (``num_experts_per_tok``; 0 when dense).
        architectures: the config's ``architectures`` (HF class names), as the engine's loader reads them.
        rope_scaling: HF ``rope_scaling`` (or ``rope_parameters``), None for plain RoPE.
        refusal: why the engine's loader (`ArchConfig.from_dict`) refuses this config, None when it loads.
        quant: the checkpoint's weight quantisation as the engine reads it (`pd_cluster.engine.quant.scheme`),
            None for unquantised weights (or a format it refuses: `refusal` says why).
        arch: the engine's `ArchConfig` of the model's shape (None when it cannot build one).
        kv_lora_rank, q_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim: multi-head latent
            attention's shape (0 when the model has K and V per head; ``q_lora_rank`` 0: a direct query).
    """

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    global_layers: int
    local_layers: int = 0
    local_span: int | None = None
    local_kind: str = ""
    state_layers: int = 0
    state_bytes_per_request: int = 0
    params_total: int = 0
    params_active: int = 0
    num_experts: int = 0
    expert_intermediate_size: int = 0
    shared_experts: int = 0
    moe_layers: int = 0
    experts_per_token: int = 0
    architectures: tuple[str, ...] = ()
    rope_scaling: dict[str, Any] | None = field(default=None, compare=False)
    refusal: str | None = field(default=None, compare=False)
    quant: QuantScheme | None = field(default=None, compare=False)
    arch: ArchConfig | None = field(default=None, compare=False, repr=False)
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def mla_latent_dim(self) -> int:
        """Values cached per token per layer under MLA (576 for DeepSeek-V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def _attention_params(self) -> int:
        h = self.hidden_size
        if self.is_mla:  # q (direct, or low-rank with its norm), kv_a, its norm, kv_b, o
            q_out = self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
            q = h * q_out if not self.q_lora_rank else h * self.q_lora_rank + self.q_lora_rank * (1 + q_out)
            kv = h * self.mla_latent_dim + self.kv_lora_rank * (1 + self.num_heads * (self.qk_nope_head_dim
                                                                                      + self.v_head_dim))
            return q + kv + self.num_heads * self.v_head_dim * h
        return h * self.head_dim * (self.num_heads + 2 * self.num_kv_heads) + self.num_heads * self.head_dim * h

    def active_params_per_token(self) -> int:
        """Parameters each prompt token multiplies through in prefill: attention, the dense MLPs, and in
        MoE layers the router, the shared expert(s) and ``experts_per_token`` routed experts. Embeddings
        (a lookup) and the LM head (applied to the last token only) are left out."""
        h = self.hidden_size
        dense_layers = self.num_layers - self.moe_layers
        moe = (self.experts_per_token + self.shared_experts) * 3 * h * self.expert_intermediate_size \
            + h * self.num_experts
        return self.num_layers * (self._attention_params() + 2 * h) + dense_layers * 3 * h * self.intermediate_size \
            + self.moe_layers * moe

    def num_params(self) -> int:
        """Parameters of the language model (embeddings, attention, MLP/experts, norms, head)."""
        if self.params_total:
            return self.params_total
        h = self.hidden_size
        attn = self._attention_params()
        dense_mlp = 3 * h * self.intermediate_size
        moe_mlp = (self.num_experts + self.shared_experts) * 3 * h * self.expert_intermediate_size \
            + h * self.num_experts
        dense_layers = self.num_layers - self.moe_layers
        layers = self.num_layers * (attn + 2 * h) + dense_layers * dense_mlp + self.moe_layers * moe_mlp
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embed + layers + h

    def weight_bytes(self, dtype_bytes: int, tp_size: int) -> int:
        """Weight bytes per GPU: a quantised checkpoint's as the engine holds them (`quantized_weights`);
        otherwise every parameter at `dtype_bytes`, divided by the TP size."""
        quantized = self.quantized_weights(dtype_bytes, tp_size)
        return quantized.total if quantized is not None else self.num_params() * dtype_bytes // tp_size

    def quantized_weights(self, dtype_bytes: int, tp_size: int) -> WeightBytes | None:
        """A quantised checkpoint's weight bytes per GPU (`pd_cluster.engine.planner.weights.weight_bytes`:
        quantised layers at their bits, the rest at `dtype_bytes`, the replicated parts whole); None when the
        weights are not quantised or the model's shape is unknown."""
        if self.quant is None or self.arch is None:
            return None
        return weight_bytes(self.arch, self.quant, dtype_bytes, tp_size)

    def active_params(self) -> int:
        """`num_params` less the routed experts a token does not use (``experts - experts_per_token`` per MoE
        layer): the "active parameters" model cards quote (Mixtral-8x7B: 12.9B of 46.7B)."""
        if self.params_active:
            return self.params_active
        unused = max(self.num_experts - self.experts_per_token, 0) * 3 * self.hidden_size * self.expert_intermediate_size
        return self.num_params() - self.moe_layers * unused


def load_spec(name_or_path: str) -> ModelSpec:
    """A bundled config by name (``llama-3.1-8b``, ...) or a folder / config.json path.

    Raises:
        FileNotFoundError: neither a bundled name nor an existing path.
    """
    if name_or_path.lower() in BUNDLED:
        path, name = BUNDLED[name_or_path.lower()], name_or_path.lower()
    else:
        path = Path(name_or_path)
        path = path / "config.json" if path.is_dir() else path
        if not path.exists():
            raise FileNotFoundError(f"{name_or_path!r} is neither a bundled config ({', '.join(BUNDLED)}) "
                                    f"nor a config.json path")
        name = path.parent.name
    with open(path) as f:
        return spec_from_config(json.load(f), name)


def spec_from_config(cfg: dict, name: str) -> ModelSpec:
    """Build a `ModelSpec` from a parsed config (a multimodal config's language model, as its family reads it)."""
    architectures = tuple(str(a) for a in cfg.get("architectures") or ())
    full_cfg = cfg
    family = families.find(architectures)
    cfg = family.text_config(cfg) if family is not None else cfg.get("text_config", cfg)
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    moe, refusal, arch = _engine_view(cfg, architectures, family)
    fields: dict[str, Any] = dict(
        name=name, hidden_size=hidden, num_layers=int(cfg["num_hidden_layers"]), num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads), vocab_size=int(cfg["vocab_size"]),
        intermediate_size=int(cfg.get("intermediate_size_mlp") or cfg["intermediate_size"]),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        architectures=architectures, rope_scaling=dict(scaling) if isinstance(scaling, dict) else None,
        refusal=refusal, quant=_quant(full_cfg), arch=arch, params_total=arch.num_params() if arch else 0,
        params_active=arch.num_active_params() if arch else 0)
    fields.update((family or Family()).memory_spec(cfg, arch, moe))
    return ModelSpec(**fields)


def _quant(cfg: dict) -> QuantScheme | None:
    """The weights' quantisation as the engine reads it, None for none or one it refuses (`ModelSpec.refusal`)."""
    try:
        return read_quant_scheme(cfg)
    except QuantConfigError:
        return None


def _engine_view(cfg: dict, architectures: tuple[str, ...], family: Family | None
                 ) -> tuple[MoEConfig | None, str | None, ArchConfig | None]:
    """The MoE part as the engine reads it, the engine loader's refusal of the config (None: it loads), and the
    loader's `ArchConfig` (when it loads, or when only the weights' quantisation is refused: `_shape_only`)."""
    moe = None
    if family is not None:
        try:
            moe = family.moe(cfg)
        except (ValueError, KeyError):
            moe = None
    full = {**cfg, "architectures": list(architectures)}
    try:
        arch = ArchConfig.from_dict(full)
    except (ValueError, KeyError) as e:
        return moe, str(e), _shape_only(full)
    return moe, None, arch


def _shape_only(cfg: dict) -> ArchConfig | None:
    """The loader's `ArchConfig` of a config it refuses for its weights' quantisation alone (gpt-oss's released
    MXFP4 experts): the layers and parameter counts do not depend on how the weights are stored. None otherwise."""
    keys = ("quantization_config", "compression_config")
    if not any(k in cfg for k in keys):
        return None
    try:
        return ArchConfig.from_dict({k: v for k, v in cfg.items() if k not in keys})
    except (ValueError, KeyError):
        return None
