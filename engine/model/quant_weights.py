"""Quantised checkpoints in the loader: which linear layers of the model are built quantised, and where each
quantised tensor goes (`pd_cluster.engine.quant` reads and slices it).

* `plan_quantized` reads the checkpoint's tensor names (not their data) before the model is built: every module
  stored quantised (`pd_cluster.engine.quant.loading.is_quantized`) maps to the model's layer (q/k/v parts to
  ``qkv_proj``, gate/up to ``gate_up_proj``, shared experts likewise) with its `WeightScheme`; the model then
  builds those layers as `QuantLinear` (`pd_cluster.engine.quant.modules.materialize`). A module stored
  quantised that the config leaves unquantised, or fused parts stored in different ways, are refused by name.
* `QuantWeights.load` copies a quantised module's tensors, this rank's slice, into its `QuantLinear` part;
  the model's row permutation hook (``checkpoint_tensor``: RoPE rows in rotate-half order) is applied to the
  quantised rows and their scales (refused if it would move a row out of its FP8 block).
* Routed experts (unless the MoE kernel keeps their kind: `pd_cluster.engine.quant.support`) and MLA's
  ``kv_b_proj`` are read as `DequantizedSlice` s into the model's ordinary parameters.
* A checkpoint's extra all-zero biases for layers without one (some GPTQ exports) are skipped; any other FP8
  tensor the scheme does not explain is refused.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from pd_cluster.engine.model import weight_map
from pd_cluster.engine.model.arch import ArchConfig
from pd_cluster.engine.parallel.group import TPGroup
from pd_cluster.engine.quant import support
from pd_cluster.engine.quant.linear import QuantLinear
from pd_cluster.engine.quant.loading import FP8_DTYPE_NAMES, PRIMARY, Split, is_quantized, read_module
from pd_cluster.engine.quant.modules import DequantizedSlice
from pd_cluster.engine.quant.weight_scheme import FP8, WeightScheme

PRIMARY_SUFFIXES = ("weight", "qweight", "weight_packed")
COMPANION_SUFFIXES = ("weight_scale_inv", "weight_scale", "input_scale", "input_scale_ub", "qzeros", "scales",
                      "g_idx", "weight_zero_point", "weight_g_idx", "weight_shape")
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.")


class CheckpointTensors:
    """Slices of a checkpoint's tensors by name, across its shard files (each opened once; `close` at the end).
    Calling it with a name gives the safetensors slice, or None when no file holds that tensor."""

    def __init__(self, path: Path, files: list[Path]) -> None:
        index = path / "model.safetensors.index.json"
        if index.exists():
            with open(index) as f:
                self.where = {name: path / file for name, file in json.load(f)["weight_map"].items()}
        else:
            self.where = {}
            for file in files:
                with safe_open(str(file), framework="pt") as f:
                    self.where.update(dict.fromkeys(f.keys(), file))
        self._open: dict[Path, object] = {}

    def __call__(self, name: str):
        file = self.where.get(name)
        if file is None:
            return None
        if file not in self._open:
            self._open[file] = safe_open(str(file), framework="pt")
        return self._open[file].get_slice(name)

    def close(self) -> None:
        self._open.clear()


def split_name(stored: str) -> tuple[str, str]:
    """(module, tensor suffix) of a checkpoint tensor name."""
    module, _, suffix = stored.rpartition(".")
    return module, suffix


def _is_expert(name: str) -> bool:
    return bool(weight_map._EXPERT_RE.match(name) or weight_map._STACKED_RE.match(name))


def _target(name: str, fused: dict[str, tuple[str, int]]) -> tuple[str, int | None]:
    """The model's module for engine weight `name` (``layers.0.self_attn.q_proj.weight``) and its part index in
    a fused module (None when not fused)."""
    parts = name.split(".")[:-1]
    if parts and parts[-1] in fused:
        fused_name, index = fused[parts[-1]]
        return ".".join(parts[:-1] + [fused_name]), index
    return ".".join(parts), None


def plan_quantized(arch: ArchConfig, tensors: CheckpointTensors, fused: dict[str, tuple[str, int]],
                   prefix: str = "", skipped: tuple[str, ...] = (),
                   renames: tuple[tuple[str, str], ...] = ()) -> dict[str, WeightScheme]:
    """The model's layers to build quantised: ``{model module name: WeightScheme}`` (module docstring).

    Raises:
        ValueError: a module stored quantised that the config leaves unquantised, or the parts of one fused layer
            stored with different schemes, or some quantised and some not (named).
    """
    scheme = arch.quant
    plan: dict[str, WeightScheme] = {}
    plain: set[str] = set()
    for stored in sorted(tensors.where):
        if skipped and stored.startswith(skipped):
            continue
        module, suffix = split_name(stored.removeprefix(prefix))
        layer = _LAYER_RE.match(module)
        if suffix not in PRIMARY_SUFFIXES or (layer and int(layer.group(1)) >= arch.num_hidden_layers):
            continue
        ws = scheme.for_module(prefix + module, prefix) if scheme is not None else None
        quantized = is_quantized(prefix + module, ws, tensors)
        name = weight_map.canonical(module.removeprefix("model.") + ".weight", renames)  # a rename may end the name
        if quantized and ws is None:
            where = scheme.source if scheme is not None else "config.json (no quantization_config)"
            raise ValueError(f"{stored} is stored quantised but {where} leaves {module} unquantised; refusing to load "
                             "quantised values as weights")
        if _is_expert(name) or name.endswith(tuple(f"{m}.weight" for m in support.DEQUANTIZED_MODULES)):
            continue  # routed experts (the MoE path) and layers held dequantised
        target, _ = _target(name, fused)
        if not quantized:
            plain.add(target)
        elif plan.setdefault(target, ws) != ws:
            raise ValueError(f"{target}: its fused parts are stored with different quantisation schemes")
    mixed = sorted(set(plan) & plain)
    if mixed:
        raise ValueError(f"{mixed[0]}: some of its fused parts are stored quantised and some not")
    return plan


class QuantWeights:
    """The loader's handler of quantised tensors (module docstring), for one rank.

    Args:
        model: the materialised model (its `QuantLinear` layers built from `plan_quantized`).
        arch, tp: the architecture and this rank's group.
        tensors: the checkpoint's tensors.
        fused: the model's fused parts (HF name part -> (fused name part, index)).
        adapt: the model's ``checkpoint_tensor`` hook, or None.
        prefix: the checkpoint's prefix of the served language model's tensors (multimodal), else ``""``.
    """

    def __init__(self, model: torch.nn.Module, arch: ArchConfig, tp: TPGroup, tensors: CheckpointTensors,
                 fused: dict[str, tuple[str, int]], adapt, prefix: str = "") -> None:
        self.arch, self.tp, self.tensors, self.fused, self.adapt = arch, tp, tensors, fused, adapt
        self.prefix = prefix
        self.layers = {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}
        self.expert_modules = {name: m for name, m in model.named_modules() if type(m).__name__ == "FusedExperts"}
        self.rows: dict[str, int] = dict.fromkeys(self.layers, 0)
        self.model = model

    def skips(self, stored: str) -> bool:
        """A companion of a quantised weight (its scales, zeros, g_idx, shape): read with its weight."""
        module, suffix = split_name(stored)
        if suffix not in COMPANION_SUFFIXES:
            return False
        primary = self.tensors(f"{module}.weight") or self.tensors(f"{module}.qweight") or \
            self.tensors(f"{module}.weight_packed")
        return primary is not None

    def source(self, stored: str, name: str, tensor_slice):
        """The slice the plain path reads for checkpoint tensor `stored` (engine name `name`): a
        `DequantizedSlice` for a quantised weight held dequantised, else `tensor_slice` itself.

        Raises:
            ValueError: FP8 values the scheme does not explain.
        """
        module, suffix = split_name(stored)
        if suffix in PRIMARY_SUFFIXES:
            ws = self.arch.quant.for_module(module, self.prefix) if self.arch.quant is not None else None
            if ws is not None and is_quantized(module, ws, self.tensors):
                return DequantizedSlice(module, ws, self.tensors)
        if tensor_slice.get_dtype() in FP8_DTYPE_NAMES:
            raise ValueError(f"{stored} is stored in FP8 but the checkpoint's quantisation config does not describe "
                             "its scales; refusing to load FP8 values as weights")
        return tensor_slice

    def load(self, stored: str, name: str) -> bool:
        """Copy quantised module `stored` (its primary tensor's name; engine weight name `name`) into its
        `QuantLinear`; False when `name` is not a quantised layer's part."""
        target, index = _target(name, self.fused)
        layer = self.layers.get(target)
        if layer is None:
            return False
        module, _ = split_name(stored)
        owner = name.split(".")[-2]
        axis = "rows" if owner in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q_b_proj") else \
            "cols" if owner in ("o_proj", "down_proj") else None
        if owner in ("qkv_proj", "gate_up_proj") and self.tp.size > 1:
            raise ValueError(f"{stored}: pre-fused quantised {owner} is loaded at TP 1 only")
        parts = read_module(module, layer.scheme, self.tensors, Split(axis, self.tp.rank, self.tp.size))
        n = parts["weight"].shape[0] if "weight" in parts else parts["shape"][0]
        r0 = self._offset(target, index, layer)
        if self.adapt is not None:
            parts = _permute(parts, self.adapt(name, torch.arange(n, dtype=torch.float64)[:, None]), layer, stored)
        layer.load_part((r0, r0 + n), parts)
        self.rows[target] += n
        return True

    def _offset(self, target: str, index: int | None, layer: QuantLinear) -> int:
        if index is None:
            return 0
        if target.endswith("qkv_proj"):
            sizes = [self.arch.q_size // self.tp.size] + [self.arch.kv_size // self.tp.size] * 2
        else:
            sizes = [layer.out_features // 2] * 2
        return sum(sizes[:index])

    def skip_zero_bias(self, name: str, tensor_slice) -> bool:
        """An all-zero bias of a layer without one (AutoGPTQ writes them, for routed experts too): True, to skip it.

        Raises:
            ValueError: a nonzero bias for a layer that has none.
        """
        target, _ = _target(name, self.fused)
        layer = self.layers.get(target)
        owner = name.split(".experts.")[0] + ".experts"
        expert_without_bias = ".experts." in name and owner in self.expert_modules and \
            getattr(self.expert_modules[owner], "w13_bias", None) is None
        if not name.endswith(".bias") or not expert_without_bias and (layer is None or layer.bias is not None):
            return False
        if bool(tensor_slice[:].any()):
            raise ValueError(f"{name}: a nonzero bias for a layer the config builds without one")
        return True

    def finish(self) -> None:
        """Every quantised layer complete; its scales back to the checkpoint's dtype.

        Raises:
            ValueError: a layer some of whose rows no tensor filled.
        """
        for name, layer in self.layers.items():
            if self.rows[name] != layer.out_features:
                raise ValueError(f"checkpoint lacks quantised weights of {name}: {self.rows[name]} of "
                                 f"{layer.out_features} rows loaded")
            layer.finish_loading()


def _permute(parts: dict, rows: torch.Tensor, layer: QuantLinear, stored: str) -> dict:
    """Apply the model's row permutation (the adapt hook's image of ``arange(n)``) to a part's quantised rows."""
    perm = rows[:, 0].long()
    if torch.equal(perm, torch.arange(perm.numel())):
        return parts
    out = dict(parts)
    if layer.scheme.kind == FP8:
        out["weight"] = parts["weight"][perm]
        if layer.scheme.block is None:
            out["scale"] = parts["scale"].reshape(-1).expand(perm.numel())[perm] if parts["scale"].numel() == 1 \
                else parts["scale"][perm]
        elif not torch.equal(perm // layer.scheme.block[0], torch.arange(perm.numel()) // layer.scheme.block[0]):
            raise ValueError(f"{stored}: the model's row permutation moves rows between FP8 blocks")
        return out
    for key in ("qweight", "scales", "zeros"):
        if parts.get(key) is not None:
            out[key] = parts[key][:, perm]
    return out
