"""Load an HF checkpoint folder into its family's model class (`Family.model`, `pd_cluster.engine.model.decoder`).

Reads ``config.json`` and ``*.safetensors`` (single file, or sharded with
``model.safetensors.index.json``). The family names the tensors: a multimodal checkpoint's language-model
prefix and the prefixes it skips (its vision tower), and the renames of its module names
(`weight_map.canonical`). HF's separate q/k/v and gate/up tensors are
copied into the model's fused matrices; experts, shared experts and pre-fused
tensors go through `pd_cluster.engine.model.weight_map`. FP8 KV scales, where a checkpoint has
them (``...self_attn.k_scale`` / ``v_scale``, as written by llm-compressor and
ModelOpt), are returned for the KV pool (for an MLA latent, the K scale).
Quantised weights (`pd_cluster.engine.quant`) stay quantised: the dense layers the checkpoint stores in FP8 or
int4 are built as `QuantLinear` (`pd_cluster.engine.model.quant_weights.plan_quantized`) and filled with this
rank's slice of their tensors; routed experts in FP8 blocks (DeepSeek-V3's release) or MXFP4 (gpt-oss's) stay in
that format in the fused MoE's weights (`pd_cluster.engine.quant.expert_loading`); MLA's ``kv_b_proj`` is
dequantised as it is read.
A checkpoint tensor that is itself a parameter is copied as it is; the model adapts a tensor
(``checkpoint_tensor(name, tensor)``: interleaved RoPE rows put in rotate-half order).
Layers past ``num_hidden_layers`` (DeepSeek-V3's multi-token-prediction layer)
are skipped, as transformers does. ``load_format="dummy"`` fills the
weights with seeded random values instead (vLLM's ``--load-format dummy``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from pd_cluster.engine.model import families, weight_map
from pd_cluster.engine.model.arch import ArchConfig
from pd_cluster.engine.model.family import Family
from pd_cluster.engine.model.moe import FusedExperts
from pd_cluster.engine.model.quant_weights import (PRIMARY_SUFFIXES, CheckpointTensors, QuantWeights, plan_quantized,
                                                   split_name)
from pd_cluster.engine.model.rope import RotaryEmbedding
from pd_cluster.engine.parallel.group import SINGLE, TPGroup
from pd_cluster.engine.quant.expert_loading import copy_quantized_expert, init_dummy_quantized
from pd_cluster.engine.quant.linear import QuantLinear
from pd_cluster.engine.quant.modules import deferred_linears, materialize

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
_FUSED = {  # HF name part -> (fused name part, shard index)
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
_ROW_SPLIT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj",  # column-parallel: split output rows
              "q_b_proj", "kv_b_proj")
_COL_SPLIT = ("o_proj", "down_proj")                                 # row-parallel: split input columns
_SCALE_RE = re.compile(r"model\.layers\.(\d+)\.self_attn\.(?:(k|v)_proj\.output_scale|(k|v)_scale)$")
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.")


@dataclass
class LoadedModel:
    """A model ready to run, plus what the KV pool and the transfer handshake need.

    Attributes:
        model: the module, in eval mode on its device.
        arch: the architecture.
        dtype: the weights' dtype.
        k_scales, v_scales: per-layer FP8 KV scales (1.0 where the checkpoint has none).
        identity: sha256 over the config and the weights' names, shapes and dtypes.
        weights_nbytes: bytes the weights take on this rank: parameters (quantised experts at their stored
            bytes), and the quantised linear layers' values and scales (`QuantLinear.nbytes`).
        expert_nbytes: bytes of this rank's routed experts (values, scales, biases), as held: quantised
            experts count their stored bytes.
    """

    model: torch.nn.Module
    arch: ArchConfig
    dtype: torch.dtype
    k_scales: list[float]
    v_scales: list[float]
    identity: str
    weights_nbytes: int
    expert_nbytes: int = 0


def resolve_dtype(name: str, arch: ArchConfig) -> torch.dtype:
    """``auto`` gives the checkpoint's dtype; else the named one.

    Raises:
        ValueError: unknown dtype name.
    """
    key = arch.torch_dtype if name == "auto" else name
    if key not in _DTYPES:
        raise ValueError(f"unsupported dtype {key!r}; use float32, bfloat16 or float16")
    return _DTYPES[key]


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    return files


def model_identity(path: Path, arch: ArchConfig, load_format: str, seed: int) -> str:
    """A hash naming the exact model: config plus every tensor's name, shape and dtype.

    Dummy weights hash the seed instead of files. Used by the KV transfer
    handshake to refuse pages from a different model.
    """
    h = hashlib.sha256(json.dumps(arch.__dict__, sort_keys=True, default=str).encode())
    if load_format == "dummy":
        h.update(f"dummy:{seed}".encode())
        return h.hexdigest()
    for file in _weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in sorted(f.keys()):
                sl = f.get_slice(name)
                h.update(f"{name}:{sl.get_shape()}:{sl.get_dtype()}".encode())
    return h.hexdigest()


def _fused(arch: ArchConfig) -> dict[str, tuple[str, int]]:
    """The checkpoint parts the model fuses: q/k/v (not under MLA: its q_proj is a layer) and gate/up (not in a
    plain MLP, `ArchConfig.mlp_gated` false: its up_proj is a layer)."""
    kept = {"qkv_proj"} if arch.mla is None else set()
    if arch.mlp_gated:
        kept.add("gate_up_proj")
    return {k: v for k, v in _FUSED.items() if v[0] in kept}


def _skipped(stored_name: str, hf_name: str, other_parts: tuple[str, ...], arch: ArchConfig,
             quant: QuantWeights) -> bool:
    """Tensors not read here: a multimodal checkpoint's vision tower, a quantised weight's companions (read with
    it), RoPE buffers and other scales, DeepSeek-V3's multi-token-prediction layer (``model.layers.61.*``)."""
    if other_parts and stored_name.startswith(other_parts):
        return True
    if quant.skips(stored_name):
        return True
    if "rotary_emb" in hf_name or hf_name.endswith("_scale") or hf_name.endswith("scale_inv"):
        return True
    layer = _LAYER_RE.match(hf_name)
    return bool(layer and int(layer.group(1)) >= arch.num_hidden_layers)


def _load_tensors(model: torch.nn.Module, path: Path, arch: ArchConfig, family: Family,
                  tp: TPGroup, tensors: CheckpointTensors, expert_parallel: bool = False,
                  rename=None) -> tuple[list[float], list[float]]:
    params = dict(model.named_parameters())
    adapt = getattr(model, "checkpoint_tensor", None)
    k_scales = [1.0] * arch.num_hidden_layers
    v_scales = [1.0] * arch.num_hidden_layers
    loaded: set[str] = set()
    prefix, other_parts = family.language_model_prefix, family.skipped_prefixes
    quant = QuantWeights(model, arch, tp, tensors, _fused(arch), adapt, prefix)
    experts_stored = arch.moe.weight_quant if arch.moe is not None else None  # `ExpertQuant` or None

    for file in _weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for stored_name in f.keys():
                hf_name = stored_name.removeprefix(prefix)
                if rename is not None and (hf_name := rename(hf_name)) is None:
                    continue  # NEXTN: the MTP layer's tensors only (`pd_cluster.engine.model.nextn`)
                m = _SCALE_RE.match(hf_name)
                if m:
                    which = m.group(2) or m.group(3)
                    (k_scales if which == "k" else v_scales)[int(m.group(1))] = float(
                        f.get_tensor(stored_name).float().item())
                    continue
                if _skipped(stored_name, hf_name, other_parts, arch, quant):
                    continue
                module, suffix = split_name(hf_name)
                name = weight_map.canonical((module + ".weight" if suffix in PRIMARY_SUFFIXES else hf_name)
                                            .removeprefix("model."), family.weight_renames)
                g = _group_of(name, arch, tp, expert_parallel)
                if copy_quantized_expert(params, name, stored_name, f.get_slice(stored_name), tensors,
                                         experts_stored, g.rank, g.size, expert_parallel and g.size > 1,
                                         loaded) or suffix in PRIMARY_SUFFIXES and quant.load(stored_name, name):
                    continue  # experts kept quantised (`expert_loading`), quantised linear layers (`quant`)
                values = quant.source(stored_name, name, f.get_slice(stored_name))
                if quant.skip_zero_bias(name, values) or weight_map.copy_special(
                        params, name, values, arch, family.split_gate_up, g, expert_parallel, loaded):
                    continue
                tensor = shard(name, values, g)
                _copy(params, name, adapt(name, tensor) if adapt else tensor, arch, g, loaded)
    quant.finish()
    missing = (set(params) - loaded) | set(weight_map.missing_experts(params, loaded))
    if arch.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights: {sorted(missing)[:8]}")
    return k_scales, v_scales


_MLP_RE = re.compile(r"layers\.(\d+)\.mlp\.")


def _group_of(name: str, arch: ArchConfig, tp: TPGroup, expert_parallel: bool) -> TPGroup:
    """The group that splits the tensor `name` (canonical, without ``model.``): a MoE layer's MLP tensors split
    over ``tp.moe`` (under DP attention the DP ranks, `pd_cluster.engine.parallel.dp_attention`), the rest over
    `tp`."""
    if tp.moe is tp or (expert_parallel and ".shared_expert" in name):
        return tp  # DP attention with expert parallelism keeps the shared experts whole (`SparseMoE.routed`)
    m = _MLP_RE.match(name)
    return tp.moe if m and arch.moe is not None and arch.is_moe_layer(int(m.group(1))) else tp


def shard(name: str, tensor_slice, tp: TPGroup) -> torch.Tensor:
    """This rank's part of a checkpoint tensor (read from a safetensors slice, so only that part is read).

    q/k/v and gate/up weights and biases, and attention sinks: rows ``[rank * n / size, (rank + 1) * n / size)``;
    o and down weights: the same range of columns; everything else whole (Megatron-LM's split; an o_proj bias is
    added once, after the all-reduce).
    """
    shape = tensor_slice.get_shape()
    parts = name.split(".")
    if tp.size == 1 or len(parts) < 2:
        return tensor_slice[:]
    if parts[-1] == "sinks":  # one per query head (gpt-oss): this rank's heads
        n = shape[0] // tp.size
        return tensor_slice[tp.rank * n:(tp.rank + 1) * n]
    owner = parts[-2]
    if owner in _ROW_SPLIT:
        n = shape[0] // tp.size
        return tensor_slice[tp.rank * n:(tp.rank + 1) * n]
    if owner in _COL_SPLIT and parts[-1] == "weight":
        n = shape[1] // tp.size
        return tensor_slice[:, tp.rank * n:(tp.rank + 1) * n]
    return tensor_slice[:]


def _copy(params: dict, name: str, tensor: torch.Tensor, arch: ArchConfig, tp: TPGroup, loaded: set[str]) -> None:
    """Copy into the parameter of that name, else into its part of a fused matrix (`_FUSED`)."""
    parts = name.split(".")
    for i, part in enumerate(parts if name not in params else ()):
        if part in _FUSED:
            fused, index = _FUSED[part]
            target = ".".join(parts[:i] + [fused] + parts[i + 1:])
            param = params[target]
            if fused == "qkv_proj":
                sizes = [arch.q_proj_size // tp.size, arch.kv_size // tp.size, arch.kv_size // tp.size]
            else:
                sizes = [arch.intermediate_size // tp.size] * 2
            start = sum(sizes[:index])
            param.data[start:start + sizes[index]].copy_(tensor)
            loaded.add(target)
            return
    if name not in params:
        if name == "lm_head.weight" and arch.tie_word_embeddings:
            return
        raise ValueError(f"unexpected weight {name!r} in checkpoint")
    params[name].data.copy_(tensor)
    loaded.add(name)


def _init_dummy(model: torch.nn.Module, seed: int, device: torch.device) -> None:
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if init_dummy_quantized(name, p, gen):
            continue
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        else:
            p.data.normal_(0.0, 0.02, generator=gen)  # HF's initializer_range


def _held_bytes(model: torch.nn.Module, arch: ArchConfig, dtype: torch.dtype) -> tuple[int, int, str]:
    """(bytes of this rank's weights, of its routed experts, the start-up log's note on quantised layers); logs the
    experts' bytes and format."""
    quantized = [m for m in model.modules() if isinstance(m, QuantLinear)]
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters()) + \
        sum(m.nbytes - (m.bias.numel() * m.bias.element_size() if m.bias is not None else 0) for m in quantized)
    quant_note = (f", quantized: {len(quantized)} layers, {arch.quant.describe()}" if quantized else "")
    experts = [m for m in model.modules() if isinstance(m, FusedExperts)]
    expert_nbytes = sum(m.nbytes for m in experts)
    if experts:
        logger.info("Routed experts: %.2f MiB on this rank, %s", expert_nbytes / 2**20,
                    experts[0].quant.name + " (kept quantised)" if experts[0].quant else str(dtype).removeprefix(
                        "torch."))
    return nbytes, expert_nbytes, quant_note


@contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(path: str, dtype_name: str = "auto", load_format: str = "auto", seed: int = 0,
               device: torch.device | str = "cpu", tp: TPGroup = SINGLE, expert_parallel: bool = False,
               nextn: bool = False) -> LoadedModel:
    """Build the model of the folder `path` on `device` (this rank's shard under tensor parallelism; with
    `expert_parallel`, whole MoE experts per rank instead of a slice of each). With `nextn`, the checkpoint's
    multi-token-prediction layer instead, as a one-layer `NextNModel` (`pd_cluster.engine.model.nextn`).

    Raises:
        FileNotFoundError: no config.json or no weights.
        ValueError: unsupported architecture or dtype; missing or unexpected tensors.
    """
    folder = Path(path)
    arch = ArchConfig.from_pretrained(folder)
    family = families.get(arch.architecture)
    model_cls, rename = family.model(), None
    tensors = CheckpointTensors(folder, _weight_files(folder)) if load_format != "dummy" else None
    if nextn:
        from pd_cluster.engine.model.nextn import NextNModel, nextn_arch

        arch, rename = nextn_arch(folder, set(tensors.where) if tensors is not None else set())
        model_cls = NextNModel
    dtype = resolve_dtype(dtype_name, arch)
    device = torch.device(device)
    plan = plan_quantized(arch, tensors, _fused(arch), family.language_model_prefix, family.skipped_prefixes,
                          family.weight_renames) if tensors is not None and arch.quant is not None else {}
    with torch.device(device), _default_dtype(dtype), deferred_linears():
        model = model_cls(arch, tp, expert_parallel)
    materialize(model, plan, device, dtype)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.inv_freq = module.inv_freq.float()  # RoPE frequencies stay float32
        if isinstance(module, QuantLinear):
            module.set_kernels(device.type == "cuda")  # the quantised GEMM kernels; the reference path on CPU
    if load_format == "dummy":
        if arch.quant is not None:
            logger.info("dummy weights: the checkpoint's %s quantisation is not applied to the linear layers "
                        "(routed experts are drawn in their stored format)", arch.quant.method)
        _init_dummy(model, seed, device)  # the same seed on every rank: replicated weights agree
        k_scales, v_scales = [1.0] * arch.num_hidden_layers, [1.0] * arch.num_hidden_layers
    else:
        try:
            k_scales, v_scales = _load_tensors(model, folder, arch, family, tp, tensors, expert_parallel, rename)
        finally:
            tensors.close()
    model.eval()
    nbytes, expert_nbytes, quant_note = _held_bytes(model, arch, dtype)
    identity = model_identity(folder, arch, load_format, seed)
    if arch.mla is not None:
        logger.info("Load weight end. arch=%s, dtype=%s, weights=%.2f MiB, layers=%d, MLA latent=%d (kv_lora_rank %d"
                    " + qk_rope_head_dim %d), heads=%d%s", arch.architecture, str(dtype).removeprefix("torch."),
                    nbytes / 2**20, arch.num_hidden_layers, arch.mla.latent_dim, arch.mla.kv_lora_rank,
                    arch.mla.qk_rope_head_dim, arch.num_attention_heads, quant_note)
    else:
        logger.info("Load weight end. arch=%s, dtype=%s, weights=%.2f MiB, layers=%d, kv_heads=%d, head_dim=%d%s",
                    arch.architecture, str(dtype).removeprefix("torch."), nbytes / 2**20,
                    arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim, quant_note)
    return LoadedModel(model, arch, dtype, k_scales, v_scales, identity, nbytes, expert_nbytes)
