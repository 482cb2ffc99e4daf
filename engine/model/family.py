"""A model family: how one Hugging Face architecture's ``config.json`` and checkpoint become the engine's model.

Every file of `pd_cluster.engine.model.families` defines one family (one or a few architectures) as a
subclass of `Family`, and the registry there finds it by the ``architectures`` of a config (vLLM's and
mini-sglang's model registries, keyed the same way). A family:

* reads its config into the engine's typed config: `arch_fields` gives `ArchConfig`'s fields, from the hooks
  `rope`, `layer_kinds`, `layer_rope`, `moe`, `mla` and `fields`; a multimodal class serves its language
  model (`text_config`);
* refuses the keys it would not honour (`check`: the rules of `config_check`, with the family's settings
  `own_keys`, `rope_types`, `partial_rotary`, `attention_bias_built`);
* maps its weight names (`language_model_prefix`, `skipped_prefixes`, `weight_renames`, `split_gate_up`) and
  names its routed experts' checkpoint modules (`expert_projections`, read by `checkpoint_name` and
  `expert_checkpoint_module`): the planner, the TP checks and the reading of the experts' stored format;
* picks its model class (`model_class`, a ``module:Class`` path imported when a model is built, so that this
  module and the registry stay torch-free);
* gives ``pd-plan`` its memory spec (`memory_spec`).

The base class reads a config as transformers' Llama-like classes do: plain RoPE or one of `ROPE_TYPES`, one
sliding window for every layer when ``sliding_window`` is set, SwiGLU, no biases. Torch-free.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from pd_cluster.engine.layer_attention import LayerAttention, build_layers
from pd_cluster.engine.model import config_check as rules
from pd_cluster.engine.model.mla_config import MLAConfig, mla_spec_fields
from pd_cluster.engine.model.moe_config import MoEConfig
from pd_cluster.engine.quant.expert_format import expert_quant_of

DECODER = "pd_cluster.engine.model.decoder:CausalLM"
_FROM_CONFIG = object()  # `Family.arch_fields`: read the quantisation from the config itself


class Family:
    """One architecture's reading (module docstring). Subclasses set the class attributes and override hooks.

    Attributes:
        architecture: the HF class name in ``config.json``'s ``architectures``.
        name: the family's short name (`ArchConfig.family`).
        own_keys: keys of other families (`config_check.FOREIGN_VALUES`, ...) this class reads and honours.
        rope_types: the ``rope_type`` values its transformers class accepts and the engine computes.
        rope_aliases: other names of a RoPE type in its configs (Phi-3's ``su``), renamed when read.
        default_original_max_position: ``original_max_position_embeddings`` when the config has none (Phi-3).
        partial_rotary: RoPE may rotate only part of each head (``partial_rotary_factor``).
        default_partial_rotary: ``partial_rotary_factor`` when the config has none.
        default_head_dim: ``head_dim`` when the config has none (None: ``hidden_size // num_attention_heads``).
        attention_bias_built: ``attention_bias`` true is built (else refused).
        default_window: the class's ``sliding_window`` when the config leaves the key out.
        sinks: every layer has attention sinks (the learned logits are the checkpoint's ``self_attn.sinks``).
        language_model_prefix: the checkpoint's prefix of the served language model's tensors (a multimodal
            class, whose config's ``text_config`` is the language model's: `text_config`).
        skipped_prefixes: tensor name prefixes that are not read (a vision tower).
        weight_renames: ``(old, new)`` parts of checkpoint names, replaced in order (`weight_map.canonical`).
        ignored_keys: config keys the transformers class never reads (dropped before the config is read).
        mlp_bias_built: ``mlp_bias`` true is built (else refused).
        expert_projections: the checkpoint names of one routed expert's gate, up and down projections
            (``mlp.experts.{e}.<name>``), or None when the experts are stored stacked (one ``experts`` tensor per
            projection and layer); `pd_cluster.engine.model.linear_layers` names the quantised layers by them.
        model_class: ``module:Class`` of the model (`model`).
    """

    architecture: str = ""
    name: str = ""
    own_keys: tuple[str, ...] = ()
    rope_types: tuple[str, ...] = rules.ROPE_TYPES
    rope_aliases: dict[str, str] = {}
    default_original_max_position: int | None = None
    partial_rotary: bool = False
    default_partial_rotary: float = 1.0
    default_head_dim: int | None = None
    attention_bias_built: bool = False
    default_window: int | None = None
    sinks: bool = False
    language_model_prefix: str = ""
    skipped_prefixes: tuple[str, ...] = ()
    weight_renames: tuple[tuple[str, str], ...] = ()
    ignored_keys: tuple[str, ...] = ()
    mlp_bias_built: bool = False
    expert_projections: tuple[str, str, str] | None = ("gate_proj", "up_proj", "down_proj")
    model_class: str = DECODER
    # a multimodal config's keys taken from its top level into its text_config (where the text_config lacks them)
    top_level_keys: tuple[str, ...] = ("torch_dtype", "dtype", "quantization_config")

    # --- reading the config --------------------------------------------------------------------------------

    def text_config(self, cfg: dict[str, Any]) -> dict[str, Any]:
        """The config of the language model the engine serves, without the `ignored_keys`: a multimodal class's
        ``text_config`` with its ``architectures`` and the `top_level_keys` it lacks (a config without
        ``text_config`` is already the language model's: the memory planner unwraps it first)."""
        if self.language_model_prefix and "text_config" in cfg:
            text = dict(cfg["text_config"] or {})
            for key in self.top_level_keys:
                if key in cfg and key not in text:
                    text[key] = cfg[key]
            cfg = {**text, "architectures": list(cfg.get("architectures") or [self.architecture])}
        return {k: v for k, v in cfg.items() if k not in self.ignored_keys}

    def arch_fields(self, cfg: dict[str, Any], quant: Any = _FROM_CONFIG) -> dict[str, Any]:
        """`ArchConfig`'s keyword arguments for `cfg` (the language model's config, already `check`-ed); `quant`
        the checkpoint's `QuantScheme` (read with its side files), else read from `cfg`."""
        heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        theta, scaling, partial = self.rope(cfg)
        moe = self.stored_experts(cfg if quant is _FROM_CONFIG else quant, self.moe(cfg))
        fields: dict[str, Any] = dict(
            architecture=self.architecture,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or self.default_head_dim or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=dict(scaling) if scaling else None,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            layer_attention=self.layer_attention(cfg, theta, dict(scaling) if scaling else None),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
            moe=moe if moe is not None and moe.moe_layers else None,  # DeepSeek with every layer dense: dense
            partial_rotary_factor=partial,
            mla=self.mla(cfg, scaling),
        )
        return {**fields, **self.fields(cfg)}

    def rope(self, cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
        """The model-wide RoPE: (base, scaling dict or None for plain RoPE, partial rotary factor).

        ``rope_scaling`` or ``rope_parameters``; `rope_aliases` renamed; for ``llama3``, ``yarn`` and
        ``longrope`` a top-level ``original_max_position_embeddings`` wins (transformers'
        ``standardize_rope_params``), else the dict's."""
        scaling: dict[str, Any] | None = rules.rope_dict(cfg)
        theta = cfg.get("rope_theta")
        if theta is None and scaling:
            theta = scaling.get("rope_theta")
        partial = float(scaling.get("partial_rotary_factor") or cfg.get("partial_rotary_factor")
                        or self.default_partial_rotary)
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind in self.rope_aliases:
            kind = self.rope_aliases[kind]
            scaling = {**scaling, "rope_type": kind}
        if kind in ("llama3", "yarn", "longrope"):
            top = cfg.get("original_max_position_embeddings", self.default_original_max_position)
            if top is not None:
                scaling = {**scaling, "original_max_position_embeddings": int(top)}
        elif kind == "default":
            scaling = None
        return float(theta if theta is not None else 10000.0), scaling, partial

    def layer_kinds(self, cfg: dict[str, Any]) -> tuple[list[str], int | None, int | None]:
        """(kind of each layer, the sliding window, the chunk size): one window for every layer when
        ``sliding_window`` is set (the class's `default_window` when absent), else every layer full.

        Raises:
            ValueError: a ``layer_types`` entry the class does not know, named.
        """
        window = cfg.get("sliding_window", self.default_window)
        return ["sliding" if window is not None else "full"] * int(cfg["num_hidden_layers"]), window, None

    def layer_rope(self, cfg: dict[str, Any], kind: str, layer: int, theta: float,
                   scaling: dict[str, Any] | None) -> tuple[bool, float, dict[str, Any] | None]:
        """Layer `layer`'s RoPE (of kind `kind`): (rotates, base, scaling); the model-wide one by default."""
        return True, theta, scaling

    def layer_attention(self, cfg: dict[str, Any], theta: float,
                        scaling: dict[str, Any] | None) -> tuple[LayerAttention, ...]:
        """Every layer's `LayerAttention`.

        Raises:
            ValueError: a ``layer_types`` entry the family does not know, named.
        """
        kinds, window, chunk = self.layer_kinds(cfg)
        ropes = [self.layer_rope(cfg, kind, i, theta, scaling) for i, kind in enumerate(kinds)]
        return build_layers(kinds, window, chunk, ropes, self.sinks, self.attention_softcap(cfg))

    def attention_softcap(self, cfg: dict[str, Any]) -> float | None:
        """Every layer's attention logit softcap, None for none."""
        return None

    def moe(self, cfg: dict[str, Any]) -> MoEConfig | None:
        """The mixture-of-experts part, None for a dense model.

        Raises:
            ValueError: a routing key with a value the engine does not implement, named.
        """
        return None

    def stored_experts(self, cfg: Any, moe: MoEConfig | None) -> MoEConfig | None:
        """`moe` with the format its checkpoint stores the routed experts in (``weight_quant``: FP8 blocks, MXFP4),
        read from the quantisation config or the `QuantScheme` `cfg` (`expert_quant_of`); as it is for unquantised
        experts.

        Raises:
            ValueError: experts in a quantised format the fused MoE does not compute, named.
        """
        if moe is None or not moe.moe_layers:
            return moe
        modules = [self.language_model_prefix + self.expert_checkpoint_module(layer) for layer in moe.moe_layers]
        quant = expert_quant_of(cfg, modules, self.language_model_prefix)
        return dataclasses.replace(moe, weight_quant=quant) if quant else moe

    def checkpoint_name(self, name: str) -> str:
        """The checkpoint's name of model module `name` (``model.layers.0.mlp.down_proj``): `weight_renames`
        undone (Mixtral's ``block_sparse_moe``, Llama 4's ``feed_forward``)."""
        name += "."
        for old, new in reversed(self.weight_renames):
            name = name.replace(new, old)
        return name[:-1]

    def expert_checkpoint_module(self, layer: int) -> str:
        """One routed expert's checkpoint module in layer `layer`, from `expert_projections`: expert 0's gate
        projection (``model.layers.3.mlp.experts.0.gate_proj``, Mixtral's ``...block_sparse_moe.experts.0.w1``), or
        the stacked module (gpt-oss's ``model.layers.3.mlp.experts``). A quantisation config's targets and ignore
        lists are matched against it (`expert_quant_of`)."""
        experts = f"model.layers.{layer}.mlp.experts"
        if self.expert_projections is not None:
            experts += f".0.{self.expert_projections[0]}"
        return self.checkpoint_name(experts)

    def mla(self, cfg: dict[str, Any], scaling: dict[str, Any] | None) -> MLAConfig | None:
        """The latent attention's shape, None for K and V per head."""
        return None

    def fields(self, cfg: dict[str, Any]) -> dict[str, Any]:
        """`ArchConfig` fields particular to the family (biases, norms, activation, scales); they override
        `arch_fields`' generic ones."""
        return dict(tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                    attention_bias=bool(cfg.get("attention_bias") or False), mlp_bias=bool(cfg.get("mlp_bias")))

    # --- refusing what would run with different math --------------------------------------------------------

    def check(self, cfg: dict[str, Any]) -> None:
        """Raise if `cfg` sets a key the engine would not honour for this family.

        Raises:
            ValueError: naming the key and its value.
        """
        self.check_activation(cfg)
        rules.check_biases(cfg, self.architecture, self.attention_bias_built, self.mlp_bias_built)
        self.check_rope(cfg)
        self.layer_kinds(cfg)  # an unknown layer type is refused by name
        self.check_family(cfg)
        rules.check_foreign_keys(cfg, self.own_keys, self.foreign_key_reason)

    @property
    def foreign_key_reason(self) -> str:
        return f"{self.architecture} as the engine builds it has no such key"

    def check_activation(self, cfg: dict[str, Any]) -> None:
        rules.check_activation(cfg, ("hidden_act", "hidden_activation"), rules.ACTIVATIONS,
                               f"the engine computes SwiGLU with {' / '.join(rules.ACTIVATIONS)}")

    def check_rope(self, cfg: dict[str, Any]) -> None:
        rules.check_rope(cfg, self.architecture, self.rope_types, self.partial_rotary)

    def check_family(self, cfg: dict[str, Any]) -> None:
        """The family's own keys with values outside what the engine builds (none by default)."""

    # --- weights and model ---------------------------------------------------------------------------------

    def split_gate_up(self, t: Any) -> tuple[Any, Any]:
        """A stacked experts' ``gate_up_proj`` [E, H, 2 I] as (gate, up): gate columns first by default."""
        half = t.shape[-1] // 2
        return t[..., :half], t[..., half:]

    def model(self) -> type:
        """The model class (`model_class`, imported now: it needs torch)."""
        module, _, name = self.model_class.partition(":")
        return getattr(importlib.import_module(module), name)

    # --- the memory planner ----------------------------------------------------------------------------------

    def memory_spec(self, cfg: dict[str, Any], arch: Any, moe: MoEConfig | None) -> dict[str, Any]:
        """``pd-plan``'s `ModelSpec` fields of the layers, experts and latent attention: from the engine's own
        reading `arch` (an `ArchConfig`, None when the engine refuses the config) and `moe`; without them,
        counted from the config's common keys (``num_local_experts``, ``attention_chunk_size``, ...)."""
        layers = int(cfg["num_hidden_layers"])
        out = {**_local_layers(cfg, layers, arch), **_moe_fields(cfg, layers, moe)}
        if cfg.get("kv_lora_rank"):
            out.update(mla_spec_fields(cfg))
        return out


def _local_layers(cfg: dict[str, Any], layers: int, arch: Any) -> dict[str, Any]:
    """The spec's layer fields: from the engine's per-layer description when it reads the config (linear-attention
    layers as state layers), else from the chunk keys (``attention_chunk_size`` with ``no_rope_layer_interval``)."""
    if arch is not None:
        local = [a for a in arch.layer_attention if a.kind in ("sliding", "chunked")]
        state = arch.linear_attention_layers
        out = dict(global_layers=layers - len(local) - len(state), local_layers=len(local),
                   local_span=max((a.max_visible for a in local), default=None),
                   local_kind=local[0].kind if local else "")
        if state:  # linear-attention layers: a fixed-size state per request instead of KV per token
            out.update(state_layers=len(state), state_bytes_per_request=arch.linear.state_bytes(len(state)))
        return out
    chunk, interval = cfg.get("attention_chunk_size"), cfg.get("no_rope_layer_interval")
    if not (chunk and interval):
        return dict(global_layers=layers)
    global_layers = layers // int(interval)
    return dict(global_layers=global_layers, local_layers=layers - global_layers, local_span=int(chunk),
                local_kind="chunked")


def _moe_fields(cfg: dict[str, Any], layers: int, moe: MoEConfig | None) -> dict[str, int]:
    """The spec's MoE fields from the engine's reading of the config; when it has none, experts counted from
    ``num_local_experts`` (a shared expert, every ``interleave_moe_layer_step``-th layer)."""
    if moe is not None and moe.moe_layers:
        return dict(num_experts=moe.num_experts, expert_intermediate_size=moe.intermediate_size,
                    shared_experts=moe.shared_intermediate_size // moe.intermediate_size,
                    moe_layers=len(moe.moe_layers), experts_per_token=moe.top_k)
    experts = int(cfg.get("num_local_experts", 0) or 0)
    if moe is not None or not experts:
        return dict(num_experts=0, expert_intermediate_size=0, shared_experts=0, moe_layers=0, experts_per_token=0)
    step = int(cfg.get("interleave_moe_layer_step", 1) or 1)
    return dict(num_experts=experts, expert_intermediate_size=int(cfg["intermediate_size"]), shared_experts=1,
                moe_layers=layers // step, experts_per_token=int(cfg.get("num_experts_per_tok", 1) or 1))
