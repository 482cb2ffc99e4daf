"""Checkpoint tensors that do not map one to one onto the model's parameters: experts and pre-fused tensors.

* Routed experts, one tensor per expert and projection, go into the stacked ``w13_weight`` [E_local, 2 I, H]
  (gate rows, then up rows) and ``w2_weight`` [E_local, H, I] of `pd_cluster.engine.model.moe.FusedExperts`:
  ``mlp.experts.{e}.w1/w3/w2`` (gate, up, down) or ``mlp.experts.{e}.gate_proj/up_proj/down_proj``.
* ``mlp.shared_experts.gate_proj/up_proj/down_proj`` go into the shared experts' fused matrices.
* q/k/v and gate/up stored already fused (``qkv_proj``, ``gate_up_proj``): under TP each rank reads its rows
  of each part.
* Experts stored stacked per layer: ``mlp.experts.gate_up_proj`` [E, H, 2 I] (x @ W form; the family's
  `Family.split_gate_up` says where the gate and up columns are) and ``mlp.experts.down_proj`` [E, I, H],
  with optional ``gate_up_proj_bias`` [E, 2 I] and ``down_proj_bias`` [E, H]. They are transposed into
  ``w13``/``w2`` (and ``w13_bias``/``w2_bias``).

A family names its modules the model's way first (`canonical`, with `Family.weight_renames`: e.g. a
``block_sparse_moe`` or ``feed_forward`` that is the model's ``mlp``, a ``router`` that is its ``gate``).

Under TP every slice is read from the safetensors file directly (only this rank's bytes): gate/up rows and
down columns of each expert (Megatron-LM's split per expert, vLLM's default); with expert parallelism the
experts of other ranks are not read at all.
"""

from __future__ import annotations

import re

import torch

from pd_cluster.engine.model.arch import ArchConfig
from pd_cluster.engine.parallel.group import TPGroup

_EXPERT_RE = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)"
                        r"\.weight$")
_SHARED_RE = re.compile(r"layers\.(\d+)\.mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight$")
_STACKED_RE = re.compile(r"layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")
_PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


def canonical(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    """The model's name for a checkpoint name without its ``model.`` prefix: each ``(old, new)`` part of
    `renames` replaced, in order (`Family.weight_renames`)."""
    for old, new in renames:
        name = name.replace(old, new)
    return name


def copy_special(params: dict[str, torch.Tensor], name: str, tensor_slice, arch: ArchConfig, split_gate_up,
                 tp: TPGroup, expert_parallel: bool, loaded: set[str]) -> bool:
    """Copy `name` (a checkpoint name without ``model.``) if it is an expert, shared-expert or pre-fused tensor;
    `split_gate_up` splits a stacked ``gate_up_proj`` (`Family.split_gate_up`).

    Returns:
        True when handled (copied, or skipped as another expert-parallel rank's expert); False otherwise.

    Raises:
        ValueError: the tensor names a layer or expert the model does not have.
    """
    m = _EXPERT_RE.match(name)
    if m:
        _copy_expert(params, int(m.group(1)), int(m.group(2)), _PART[m.group(3)], tensor_slice, tp,
                     expert_parallel and tp.size > 1, loaded)
        return True
    m = _STACKED_RE.match(name)
    if m:
        _copy_stacked(params, int(m.group(1)), m.group(2), bool(m.group(3)), tensor_slice, split_gate_up, tp,
                      expert_parallel and tp.size > 1, loaded)
        return True
    m = _SHARED_RE.match(name)
    if m:
        target = f"layers.{m.group(1)}.mlp.shared_experts"
        _copy_dense(params, target, _PART[m.group(2)], tensor_slice, tp, loaded)
        return True
    if name.endswith("self_attn.qkv_proj.weight") or name.endswith("self_attn.qkv_proj.bias"):
        sizes = [arch.q_proj_size, arch.kv_size, arch.kv_size]
        _copy_fused_rows(params, name, tensor_slice, sizes, tp, loaded)
        return True
    if name.endswith("mlp.gate_up_proj.weight") and "shared_experts" not in name:
        half = tensor_slice.get_shape()[0] // 2
        _copy_fused_rows(params, name, tensor_slice, [half, half], tp, loaded)
        return True
    return False


def _param(params: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in params:
        raise ValueError(f"unexpected weight {name!r} in checkpoint")
    return params[name].data


def _copy_expert(params, layer: int, expert: int, part: str, tensor_slice, tp: TPGroup, expert_parallel: bool,
                 loaded: set[str]) -> None:
    w13 = _param(params, f"layers.{layer}.mlp.experts.w13_weight")
    w2 = params[f"layers.{layer}.mlp.experts.w2_weight"].data
    local_experts, inter = w2.shape[0], w2.shape[2]
    first = tp.rank * local_experts if expert_parallel else 0
    local = expert - first
    if not 0 <= local < local_experts:
        if expert_parallel and 0 <= expert < local_experts * tp.size:
            return  # another rank's expert
        raise ValueError(f"checkpoint has expert {expert} of layer {layer}; the model has {local_experts}")
    rows = slice(0, None) if expert_parallel else slice(tp.rank * inter, (tp.rank + 1) * inter)
    if part == "down":
        w2[local].copy_(tensor_slice[:, rows])
        loaded.add(f"layers.{layer}.mlp.experts.w2_weight")
    else:
        offset = 0 if part == "gate" else inter
        w13[local, offset:offset + inter].copy_(tensor_slice[rows])
        loaded.add(f"layers.{layer}.mlp.experts.w13_weight")
    loaded.add(f"layers.{layer}.mlp.experts[{local}].{part}")


def _copy_stacked(params, layer: int, part: str, bias: bool, tensor_slice, split_gate_up, tp: TPGroup,
                  expert_parallel: bool, loaded: set[str]) -> None:
    """One stacked expert tensor of a layer (module docstring): this rank's experts, and of each this rank's
    share of the intermediate width (all of it with expert parallelism)."""
    prefix = f"layers.{layer}.mlp.experts"
    w2 = _param(params, f"{prefix}.w2_weight")
    local_experts, inter = w2.shape[0], params[f"{prefix}.w13_weight"].shape[1] // 2  # rows: quantised or not
    first = tp.rank * local_experts if expert_parallel else 0
    t = tensor_slice[first:first + local_experts]
    cols = slice(0, None) if expert_parallel else slice(tp.rank * inter, (tp.rank + 1) * inter)
    if part == "gate_up_proj":
        gate, up = split_gate_up(t)
        gate, up = gate[..., cols], up[..., cols]
        if bias:
            target = _param(params, f"{prefix}.w13_bias")
            target[:, :inter].copy_(gate)
            target[:, inter:].copy_(up)
            loaded.add(f"{prefix}.w13_bias")
            return
        w13 = _param(params, f"{prefix}.w13_weight")
        w13[:, :inter].copy_(gate.transpose(1, 2))
        w13[:, inter:].copy_(up.transpose(1, 2))
        loaded.add(f"{prefix}.w13_weight")
        loaded.update(f"{prefix}[{e}].{p}" for e in range(local_experts) for p in ("gate", "up"))
        return
    if bias:
        _param(params, f"{prefix}.w2_bias").copy_(t)
        loaded.add(f"{prefix}.w2_bias")
        return
    w2.copy_(t[:, cols, :].transpose(1, 2))
    loaded.add(f"{prefix}.w2_weight")
    loaded.update(f"{prefix}[{e}].down" for e in range(local_experts))


def _copy_dense(params, target: str, part: str, tensor_slice, tp: TPGroup, loaded: set[str]) -> None:
    if part == "down":
        down = _param(params, f"{target}.down_proj.weight")
        n = down.shape[1]
        down.copy_(tensor_slice[:, tp.rank * n:(tp.rank + 1) * n])
        loaded.add(f"{target}.down_proj.weight")
        return
    gate_up = _param(params, f"{target}.gate_up_proj.weight")
    n = gate_up.shape[0] // 2
    offset = 0 if part == "gate" else n
    gate_up[offset:offset + n].copy_(tensor_slice[tp.rank * n:(tp.rank + 1) * n])
    loaded.add(f"{target}.gate_up_proj.weight")
    loaded.add(f"{target}.gate_up_proj.{part}")


def _copy_fused_rows(params, name: str, tensor_slice, sizes: list[int], tp: TPGroup, loaded: set[str]) -> None:
    """A pre-fused [sum(sizes), ...] tensor: this rank's rows of each part, in order."""
    target = _param(params, name)
    if sum(sizes) != tensor_slice.get_shape()[0]:
        raise ValueError(f"{name}: {tensor_slice.get_shape()[0]} rows, expected {sum(sizes)} ({sizes})")
    start, out = 0, 0
    for size in sizes:
        n = size // tp.size
        target[out:out + n].copy_(tensor_slice[start + tp.rank * n:start + (tp.rank + 1) * n])
        start, out = start + size, out + n
    loaded.add(name)


def missing_experts(params: dict[str, torch.Tensor], loaded: set[str]) -> list[str]:
    """Expert and shared-expert parts that no checkpoint tensor filled (each part of each local expert)."""
    missing = []
    for name, p in params.items():
        if name.endswith("experts.w13_weight") or name.endswith("experts.w2_weight"):
            prefix = name.rsplit(".", 1)[0]
            parts = ("gate", "up") if name.endswith("w13_weight") else ("down",)
            missing += [f"{prefix}[{e}].{part}" for e in range(p.shape[0]) for part in parts
                        if f"{prefix}[{e}].{part}" not in loaded]
        elif name.endswith("shared_experts.gate_up_proj.weight"):
            prefix = name.rsplit(".", 1)[0]
            missing += [f"{prefix}.{part}" for part in ("gate", "up") if f"{prefix}.{part}" not in loaded]
    return missing
