"""Checkpoint tensors of quantised routed experts, copied as they are stored into `FusedExperts`' quantised
parameters (this rank's experts, and of each this rank's share of the width), never dequantised.

* FP8 blocks, one tensor per expert and projection (DeepSeek-V3, Qwen3-MoE-FP8; Mixtral's ``w1/w3/w2`` names
  too): ``mlp.experts.{e}.gate_proj.weight`` [I, H] E4M3 and its ``weight_scale_inv`` [I / bn, H / bk] fill
  rows ``[0, I)`` of ``w13_weight[e]`` and their scale rows; ``up_proj`` the rows after; ``down_proj.weight``
  [H, I] fills ``w2_weight[e]``. Under TP each rank reads rows (gate/up) or columns (down)
  ``[r I / N, (r + 1) I / N)`` and the scale rows or columns of those blocks (`ExpertQuant.check_split` has
  refused a split that cuts a block).
* MXFP4, stacked per layer (gpt-oss): ``mlp.experts.gate_up_proj_blocks`` [E, 2 I, H / 32, 16] with
  ``gate_up_proj_scales`` [E, 2 I, H / 32], whose rows interleave gate (even) and up (odd), and
  ``down_proj_blocks`` [E, H, I / 32, 16] with ``down_proj_scales`` [E, H, I / 32]. Rows are whole values (a
  block runs along K), so gate and up are separated by rows; under TP a rank reads its gate/up rows (and their
  ``gate_up_proj_bias``) and its block columns of down, in whole blocks (`ExpertQuant.rank_width`: the last
  rank's tail zero-padded). With expert parallelism a rank reads only its experts.

Each copied part is marked in `loaded` as the plain loader marks it (``<prefix>[<e>].gate`` ...), so missing
experts are found the same way (`weight_map.missing_experts`).
"""

from __future__ import annotations

import re

import torch

from pd_cluster.engine.quant.expert_format import ExpertQuant
from pd_cluster.engine.quant.loading import Split, read_module

_PER_EXPERT = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_STACKED = re.compile(r"layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(?:_(blocks|scales|bias))?$")
_PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}
_DTYPE = {"fp8_block": "F8_E4M3", "mxfp4": "U8", "fp8_rows": "F8_E4M3"}


def _quant_of(params: dict[str, torch.Tensor], layer: int, stored: ExpertQuant | None) -> ExpertQuant | None:
    """The layer's expert format: `stored` where the model built the layer's experts quantised (their scale
    parameter), None where it holds them unquantised (a dense layer, or no quantised experts)."""
    prefix = f"layers.{layer}.mlp.experts.w13_weight"
    if stored is not None and prefix + stored.scale_suffix in params:
        return stored
    return None


def copy_quantized_expert(params: dict[str, torch.Tensor], name: str, stored_name: str, tensor_slice, tensors,
                          stored: ExpertQuant | None, tp_rank: int, tp_size: int, expert_parallel: bool,
                          loaded: set[str]) -> bool:
    """Copy checkpoint tensor `name` (without ``model.``; `stored_name` as in the file) if it is a quantised
    expert tensor of a layer whose experts the model holds quantised.

    Args:
        params: the model's parameters by name.
        name, stored_name: the canonical and the stored name.
        tensor_slice: the tensor's safetensors slice (only this rank's part is read).
        tensors: the checkpoint's reader (`pd_cluster.engine.quant.loading.Reader`): the other tensors of an
            expert's module (scales, zeros, g_idx, input scales).
        stored: the experts' stored format (`MoEConfig.weight_quant`), None when they are not quantised.
        tp_rank, tp_size, expert_parallel: this rank's place.
        loaded: the names filled so far (updated).

    Returns:
        True when copied (or skipped as another expert-parallel rank's expert).

    Raises:
        ValueError: an expert tensor stored in another dtype than the config's format, a missing scale, a split
            that cuts a group or word, or an expert or layer the model does not have, named.
    """
    m = _PER_EXPERT.match(name)
    if m:
        quant = _quant_of(params, int(m.group(1)), stored)
        if quant is None or quant.format == "mxfp4":
            return False
        if quant.format != "fp8_block":
            _copy_read(params, int(m.group(1)), int(m.group(2)), _PART[m.group(3)], stored_name, tensors, quant,
                       tp_rank, tp_size, expert_parallel, loaded)
            return True
        _check_dtype(stored_name, tensor_slice, quant)
        scale = tensors(stored_name + "_scale_inv")
        if scale is None:
            raise ValueError(f"{stored_name} is an FP8 expert weight without {stored_name}_scale_inv")
        scale = scale[:]
        _copy_fp8(params, int(m.group(1)), int(m.group(2)), _PART[m.group(3)], tensor_slice, scale, quant,
                  tp_rank, tp_size, expert_parallel, loaded)
        return True
    m = _STACKED.match(name)
    if m:
        quant = _quant_of(params, int(m.group(1)), stored)
        if quant is None or m.group(3) == "bias" and m.group(2) == "down_proj":
            return False  # the down bias is whole on every rank: the plain loader's
        if quant.format != "mxfp4" or m.group(3) is None:  # plain stacked values where the config says quantised
            raise ValueError(f"{stored_name} holds the routed experts unquantised, but the checkpoint's "
                             f"quantization_config stores them in {quant.name} ({m.group(2)}_blocks and "
                             f"{m.group(2)}_scales); refusing to load it as quantised values")
        if m.group(3) != "bias":
            _check_dtype(stored_name, tensor_slice, quant)
        _copy_mxfp4(params, int(m.group(1)), m.group(2), m.group(3), tensor_slice, tp_rank, expert_parallel, loaded)
        return True
    return False


def _check_dtype(stored_name: str, tensor_slice, quant: ExpertQuant) -> None:
    if tensor_slice.get_dtype() != _DTYPE[quant.format]:
        raise ValueError(f"{stored_name} is stored as {tensor_slice.get_dtype()}, but the checkpoint's "
                         f"quantization_config stores the routed experts in {quant.name} ({_DTYPE[quant.format]})")


def _local(params, layer: int, expert: int, tp_rank: int, tp_size: int, expert_parallel: bool) -> int | None:
    w2 = params.get(f"layers.{layer}.mlp.experts.w2_weight")
    if w2 is None:
        raise ValueError(f"unexpected weight for expert {expert} of layer {layer}: the layer has no experts")
    local_experts = w2.shape[0]
    local = expert - (tp_rank * local_experts if expert_parallel else 0)
    if 0 <= local < local_experts:
        return local
    if expert_parallel and 0 <= expert < local_experts * tp_size:
        return None  # another rank's expert
    raise ValueError(f"checkpoint has expert {expert} of layer {layer}; the model has {local_experts}")


def _copy_fp8(params, layer: int, expert: int, part: str, tensor_slice, scale: torch.Tensor, quant: ExpertQuant,
              tp_rank: int, tp_size: int, expert_parallel: bool, loaded: set[str]) -> None:
    local = _local(params, layer, expert, tp_rank, tp_size, expert_parallel)
    if local is None:
        return
    prefix = f"layers.{layer}.mlp.experts"
    bn, bk = quant.block
    inter = params[f"{prefix}.w2_weight"].shape[2]
    start = 0 if expert_parallel else tp_rank * inter
    if part == "down":
        params[f"{prefix}.w2_weight"].data[local].copy_(tensor_slice[:, start:start + inter])
        params[f"{prefix}.w2_weight_scale_inv"].data[local].copy_(scale[:, start // bk:(start + inter) // bk])
        loaded.update((f"{prefix}.w2_weight", f"{prefix}.w2_weight_scale_inv"))
    else:
        offset = 0 if part == "gate" else inter
        params[f"{prefix}.w13_weight"].data[local, offset:offset + inter].copy_(tensor_slice[start:start + inter])
        params[f"{prefix}.w13_weight_scale_inv"].data[local, offset // bn:(offset + inter) // bn].copy_(
            scale[start // bn:(start + inter) // bn])
        loaded.update((f"{prefix}.w13_weight", f"{prefix}.w13_weight_scale_inv"))
    loaded.add(f"{prefix}[{local}].{part}")


def _copy_read(params, layer: int, expert: int, part: str, stored_name: str, tensors, quant: ExpertQuant,
               tp_rank: int, tp_size: int, expert_parallel: bool, loaded: set[str]) -> None:
    """FP8 rows or int4: expert `expert`'s projection read as the dense layers read theirs
    (`pd_cluster.engine.quant.loading.read_module`: this rank's rows of gate/up, columns of down, converted to
    the engine's layout) and copied into its slot of the stacked tensors."""
    local = _local(params, layer, expert, tp_rank, tp_size, expert_parallel)
    if local is None:
        return
    if quant.format == "fp8_rows":
        _check_dtype(stored_name, tensors(stored_name), quant)
    split = Split(None if expert_parallel else "cols" if part == "down" else "rows", tp_rank, tp_size)
    parts = read_module(stored_name.rpartition(".")[0], quant.scheme, tensors, split)
    name = f"layers.{layer}.mlp.experts.{'w2' if part == 'down' else 'w13'}_weight"
    inter = params[f"layers.{layer}.mlp.experts.w13_weight"].shape[-1 if quant.format == "int4" else 1] // 2
    rows = slice(None) if part == "down" else slice(0, inter) if part == "gate" else slice(inter, 2 * inter)
    if quant.format == "fp8_rows":
        params[name].data[local, rows].copy_(parts["weight"])
        params[name + "_scale"].data[local, rows].copy_(parts["scale"])
        if name + "_input_scale" in params:
            held = params[name + "_input_scale"].data
            held.copy_(torch.maximum(held, parts["input_scale"].reshape(1)))
    else:
        other = {"gate": "up", "up": "gate"}.get(part)
        _copy_int4(params, name, local, rows, parts, quant, stored_name, name + "_scales" in loaded,
                   other is not None and f"layers.{layer}.mlp.experts[{local}].{other}" in loaded)
    loaded.update(n for n in params if n.startswith(name))
    loaded.add(f"layers.{layer}.mlp.experts[{local}].{part}")


def _copy_int4(params, name: str, local: int, rows: slice, parts: dict, quant: ExpertQuant, stored_name: str,
               started: bool, sibling_in: bool) -> None:
    """One int4 projection's ``qweight`` [K / 8, n], ``scales`` [G, n] (in the checkpoint's dtype: the stacked
    scales take it on the first copy, `started` False), ``zeros`` and ``g_idx`` (the same as gate's or up's when
    `sibling_in`) into the columns `rows` of expert `local`."""
    scales = params[name + "_scales"]
    if scales.dtype != parts["scales"].dtype:
        if started:
            raise ValueError(f"{stored_name}: scales in {parts['scales'].dtype}, other experts' in {scales.dtype}")
        scales.data = torch.empty_like(scales.data, dtype=parts["scales"].dtype)
    params[name].data[local][:, rows].copy_(parts["qweight"])
    g = parts["scales"].shape[0]
    scales.data[local, :g, rows].copy_(parts["scales"])
    zeros, g_idx = parts["zeros"], parts["g_idx"]
    if name + "_zeros" in params:
        params[name + "_zeros"].data[local, :g, rows].copy_(zeros if zeros is not None else 8)
    elif zeros is not None:
        raise ValueError(f"{stored_name}: zero points in a symmetric scheme ({quant.scheme.describe()})")
    if name + "_g_idx" in params:  # act order; a checkpoint's trivial g_idx (read as None) is each column's group
        held = params[name + "_g_idx"].data[local]
        g_idx = g_idx if g_idx is not None else torch.arange(held.shape[-1]) // quant.group
        if sibling_in and not torch.equal(held.cpu(), g_idx.to(torch.int32).cpu()):  # gate and up share one row
            raise ValueError(f"{stored_name}: its g_idx differs from its expert's other gate/up projection's; the "
                             "engine stacks gate and up, which share their input's group order")
        held.copy_(g_idx)
    elif g_idx is not None:
        raise ValueError(f"{stored_name}: a g_idx that permutes the groups, but the config does not say act order")


def _copy_mxfp4(params, layer: int, part: str, suffix: str, tensor_slice, tp_rank: int, expert_parallel: bool,
                loaded: set[str]) -> None:
    """One stacked MXFP4 tensor (``_blocks``, ``_scales``) or gpt-oss's gate/up bias (``_bias``, split like the
    rows): this rank's experts, and of each the columns ``[r w, r w + w)`` of the full width (``w`` =
    `ExpertQuant.rank_width`, whole blocks); past the width's end the rank's share is zeros."""
    prefix = f"layers.{layer}.mlp.experts"
    w13 = params.get(f"{prefix}.w13_weight")
    if w13 is None:
        raise ValueError(f"unexpected weight {prefix}.{part}_{suffix}: layer {layer} has no experts")
    local_experts, width = w13.shape[0], w13.shape[1] // 2
    first = tp_rank * local_experts if expert_parallel else 0
    start = 0 if expert_parallel else tp_rank * width
    t = tensor_slice[first:first + local_experts]  # this rank's experts, [E_local, N, K / 32 (, 16)] or [E, 2 I]
    name = f"{prefix}.{'w13' if part == 'gate_up_proj' else 'w2'}_{'bias' if suffix == 'bias' else 'weight'}"
    name += "_scale" if suffix == "scales" else ""
    target = params[name].data
    target.zero_()
    if part == "gate_up_proj":
        full = t.shape[1] // 2
        real = max(0, min(width, full - start))
        gate, up = t[:, 0::2][:, start:start + real], t[:, 1::2][:, start:start + real]
        target[:, :real].copy_(gate.reshape(target[:, :real].shape))
        target[:, width:width + real].copy_(up.reshape(target[:, width:width + real].shape))
        parts = ("gate", "up")
    else:
        full = t.shape[2] * 32
        real = max(0, min(width, full - start))
        cols = t[:, :, start // 32:(start + real) // 32]
        cols = cols.reshape(*cols.shape[:2], -1)  # [E_local, H, real / 2] bytes or [E_local, H, real / 32] scales
        target[:, :, :cols.shape[2]].copy_(cols)
        parts = ("down",)
    loaded.add(name)
    if suffix == "blocks":
        loaded.update(f"{prefix}[{e}].{p}" for e in range(local_experts) for p in parts)


def init_dummy_quantized(name: str, p: torch.Tensor, gen: torch.Generator) -> bool:
    """Fill quantised expert parameter `name` with seeded random values whose dequantised weights are about
    N(0, 0.02), HF's initializer range (``--load-format dummy``); True when `p` is one (the caller fills the
    others). FP8: values of N(0, 64), scales 0.02 / 64 (static input scales 1 / 448). MXFP4: random codes, scales
    2^-9..2^-7. int4: random words, scales 0.02 / 4.6 (the deviation of uniform codes about 8), zeros 8, every
    column in group 0."""
    if not name.startswith("layers.") or ".mlp.experts.w" not in name:
        return False
    if p.dtype == torch.float8_e4m3fn:
        p.data.copy_((torch.randn(p.shape, generator=gen, device=p.device) * 64).clamp(-448, 448))
    elif name.endswith(("_scale_inv", "_weight_scale")) and p.dtype == torch.float32:
        p.data.fill_(0.02 / 64)
    elif name.endswith("_input_scale"):
        p.data.fill_(1 / 448)
    elif p.dtype == torch.int32 and name.endswith("_weight"):
        p.data.copy_(torch.randint(-2**31, 2**31 - 1, p.shape, generator=gen, device=p.device, dtype=torch.int32))
    elif name.endswith("_scales"):
        p.data.fill_(0.02 / 4.6)
    elif name.endswith("_zeros"):
        p.data.fill_(8)
    elif name.endswith("_g_idx"):
        p.data.zero_()
    elif p.dtype == torch.uint8:
        low, high = (118, 121) if name.endswith("_scale") else (0, 256)
        p.data.copy_(torch.randint(low, high, p.shape, generator=gen, device=p.device, dtype=torch.uint8))
    else:
        return False
    return True
