"""Reading one quantised module from a checkpoint: its release tensors, this rank's slice of them, and the
conversion into `QuantLinear`'s layout.

Tensor parallelism slices the quantised tensors where the weight is split (Megatron-LM's split, as
`pd_cluster.engine.model.loader.shard` does for plain weights): a column-parallel layer (q/k/v, gate/up) keeps
output rows ``[r N / tp, (r + 1) N / tp)``, a row-parallel one (o, down) input columns likewise, with their scales.
A split must not cut a quantisation block or group, nor a packed int32 word: FP8 blocks need ``N / tp`` (or
``K / tp``) to be a multiple of the block's rows (columns); int4 needs multiples of 8 for the packed dimension and,
for input columns without act order, of the group size (act-order checkpoints keep every group's scales on every
rank and slice ``g_idx``). Anything else is refused, naming the module, the sizes and ``--tp-size``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from pd_cluster.engine.quant import int4
from pd_cluster.engine.quant.tp import alignment, rank_range
from pd_cluster.engine.quant.weight_scheme import (AWQ, FP8, FP8_SCALE, FP8_SCALE_INV, GPTQ, GPTQ_V2, PACKED,
                                                   WeightScheme)

# The tensor that marks a module as stored quantised, per layout, and the others it brings
PRIMARY = {FP8_SCALE_INV: "weight", FP8_SCALE: "weight", GPTQ: "qweight", GPTQ_V2: "qweight", AWQ: "qweight",
           PACKED: "weight_packed"}
COMPANIONS = ("weight_scale_inv", "weight_scale", "input_scale", "input_scale_ub", "qzeros", "scales", "g_idx",
              "weight_zero_point", "weight_g_idx", "weight_shape", "qweight", "weight_packed")
FP8_DTYPE_NAMES = ("F8_E4M3",)  # safetensors' name of float8_e4m3fn

Reader = Callable[[str], object]  # name -> safetensors slice (get_shape, get_dtype, [index]) or None


@dataclass(frozen=True)
class Split:
    """This rank's cut of a module: `axis` ``rows`` (output rows: column-parallel), ``cols`` (input columns:
    row-parallel) or None (replicated); `rank` of `size`."""

    axis: str | None = None
    rank: int = 0
    size: int = 1

    def range(self, total: int, align: int, what: str, module: str) -> tuple[int, int]:
        """``[start, end)`` of this rank's share of `total` (`pd_cluster.engine.quant.tp.rank_range`)."""
        if self.axis is None:
            return 0, total
        return rank_range(total, self.rank, self.size, align, module, what)


def is_quantized(module: str, scheme: WeightScheme | None, get: Reader) -> bool:
    """Whether the checkpoint stores `module` quantised: its `PRIMARY` tensor in the layout of `scheme` (FP8: the
    ``weight`` stored as E4M3). A module without a scheme whose ``weight`` is FP8 is quantised too (its caller
    refuses it: the config leaves it unquantised)."""
    if scheme is None or scheme.layout not in PRIMARY:
        weight = get(f"{module}.weight")
        return weight is not None and weight.get_dtype() in FP8_DTYPE_NAMES
    primary = get(f"{module}.{PRIMARY[scheme.layout]}")
    if primary is None:
        return False
    return primary.get_dtype() in FP8_DTYPE_NAMES if scheme.kind == FP8 else True


def read_module(module: str, scheme: WeightScheme, get: Reader, split: Split = Split()) -> dict[str, torch.Tensor]:
    """This rank's tensors of quantised `module` in `QuantLinear.load_part`'s form (int4 adds ``shape``: this
    rank's (N, K)).

    Raises:
        ValueError: a tensor missing or of an unexpected shape, or a split that cuts a block, a group or a packed
            word (each names the module).
    """
    def need(suffix: str):
        t = get(f"{module}.{suffix}")
        if t is None:
            raise ValueError(f"{module}: {scheme.layout} weights need {module}.{suffix}, which the checkpoint lacks")
        return t

    if scheme.kind == FP8:
        return _read_fp8(module, scheme, need, get, split)
    return _read_int4(module, scheme, need, get, split)


def _read_fp8(module: str, scheme: WeightScheme, need, get: Reader, split: Split) -> dict[str, torch.Tensor]:
    w = need("weight")
    n, k = w.get_shape()
    scale_t = need("weight_scale_inv" if scheme.layout == FP8_SCALE_INV else "weight_scale")
    input_scale = get(f"{module}.input_scale")
    if scheme.block is not None:
        bn, bk = scheme.block
        want = [-(-n // bn), -(-k // bk)]
        if list(scale_t.get_shape()) != want:
            raise ValueError(f"{module}: block scale of shape {scale_t.get_shape()} for a {n}x{k} weight in {bn}x{bk} "
                             f"blocks (expected {want})")
        if split.axis == "rows":
            r0, r1 = split.range(n, *alignment(scheme, "rows"), module=module)
            return {"weight": w[r0:r1], "scale": scale_t[r0 // bn:-(-r1 // bn)]}
        c0, c1 = split.range(k, *alignment(scheme, "cols"), module=module)
        return {"weight": w[:, c0:c1], "scale": scale_t[:, c0 // bk:-(-c1 // bk)]}
    scale = scale_t[...].float().reshape(-1)
    if scale.numel() not in (1, n):
        raise ValueError(f"{module}: weight_scale of shape {scale_t.get_shape()} for {n} output rows")
    out: dict[str, torch.Tensor] = {}
    if scheme.activations == "static":
        if input_scale is None:
            raise ValueError(f"{module}: static activation scales but no {module}.input_scale in the checkpoint")
        out["input_scale"] = input_scale[...].float().reshape(())
    if scheme.activation_scale_ub is not None and get(f"{module}.input_scale_ub") is not None:
        stored = float(get(f"{module}.input_scale_ub")[...].float().reshape(-1)[0])
        if stored != scheme.activation_scale_ub:
            raise ValueError(f"{module}.input_scale_ub = {stored} differs from the config's activation_scale_ub "
                             f"{scheme.activation_scale_ub}")
    rows = scale.expand(n) if scale.numel() == 1 else scale
    if split.axis == "rows":
        r0, r1 = split.range(n, 1, "output rows", module)
        return {**out, "weight": w[r0:r1], "scale": rows[r0:r1]}
    c0, c1 = split.range(k, 1, "input columns", module)
    return {**out, "weight": w[:, c0:c1], "scale": rows}


def _g_idx(module: str, scheme: WeightScheme, t, k: int) -> torch.Tensor | None:
    """The checkpoint's g_idx, None when it is the trivial ``k // group_size`` (AutoGPTQ writes one always)."""
    if t is None:
        return None
    g_idx = t[...].to(torch.int32)
    plain = torch.arange(k) // scheme.group_size if scheme.group_size else torch.zeros(k, dtype=torch.int64)
    if torch.equal(g_idx.long(), plain):
        return None
    if not scheme.act_order:
        raise ValueError(f"{module}: its g_idx permutes the groups but the config does not say act order "
                         "(desc_act / actorder: group)")
    return g_idx


def _read_int4(module: str, scheme: WeightScheme, need, get: Reader, split: Split) -> dict[str, torch.Tensor]:
    group = scheme.group_size
    if scheme.layout == PACKED:
        shape_t = get(f"{module}.weight_shape")
        packed = need("weight_packed")
        n, k = ([int(v) for v in shape_t[...].tolist()] if shape_t is not None
                else [packed.get_shape()[0], packed.get_shape()[1] * 8])
        g_idx_t = get(f"{module}.weight_g_idx")
    elif scheme.layout == AWQ:
        qw = need("qweight")
        k, n = qw.get_shape()[0], qw.get_shape()[1] * 8
        g_idx_t = None
    else:
        qw = need("qweight")
        k, n = qw.get_shape()[0] * 8, qw.get_shape()[1]
        g_idx_t = get(f"{module}.g_idx")
    g_idx = _g_idx(module, scheme, g_idx_t, k)
    act = g_idx is not None
    r0, r1, c0, c1 = 0, n, 0, k
    if split.axis == "rows":
        r0, r1 = split.range(n, *alignment(scheme, "rows"), module=module)
    elif split.axis == "cols":  # act order as the checkpoint's g_idx says (a trivial g_idx is none)
        c0, c1 = split.range(k, *alignment(replace(scheme, act_order=act), "cols"), module=module)
    g0, g1 = (0, None) if act or not group else (c0 // group, -(-c1 // group))
    if g_idx is not None:
        g_idx = g_idx[c0:c1].contiguous()
    if scheme.layout == PACKED:
        zp = get(f"{module}.weight_zero_point")
        qweight, scales, zeros, _ = int4.from_packed(
            packed[r0:r1, c0 // 8:c1 // 8], need("weight_scale")[r0:r1, g0:g1],
            None if zp is None else zp[r0 // 8:r1 // 8, g0:g1], None, (r1 - r0, c1 - c0))
    elif scheme.layout == AWQ:
        qweight, scales, zeros, _ = int4.from_awq(qw[c0:c1, r0 // 8:r1 // 8], need("qzeros")[g0:g1, r0 // 8:r1 // 8],
                                                  need("scales")[g0:g1, r0:r1])
    else:
        qweight, scales, zeros, _ = int4.from_gptq(qw[c0 // 8:c1 // 8, r0:r1], need("qzeros")[g0:g1, r0 // 8:r1 // 8],
                                                   need("scales")[g0:g1, r0:r1], None, scheme.layout == GPTQ_V2)
    if zeros is not None and scheme.symmetric and scheme.layout == PACKED:
        raise ValueError(f"{module}: weight_zero_point in a symmetric scheme")
    return {"qweight": qweight, "scales": scales, "zeros": zeros, "g_idx": g_idx, "shape": (r1 - r0, c1 - c0)}
