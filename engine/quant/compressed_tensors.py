"""compressed-tensors (llm-compressor) quantisation configs read into a `QuantScheme`: FP8 W8A8 / W8A16 and
int4 W4A16 ``config_groups`` (`pd_cluster.engine.quant.scheme` lists the tensors). Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pd_cluster.engine.quant.weight_scheme import (FP8, FP8_SCALE, INT4, PACKED, QuantRule, QuantScheme, ReadContext,
                                                   WeightScheme)


def read_compressed_tensors(quant: Mapping[str, Any], ctx: ReadContext) -> QuantScheme | None:
    """compressed-tensors (llm-compressor): FP8 W8A8 / W8A16 and int4 W4A16 ``config_groups``."""
    status = quant.get("quantization_status", "compressed")
    if status not in ("compressed", "frozen"):
        raise ctx.refuse("quantization_status", status, "compressed (or frozen) weights")
    sparsity = quant.get("sparsity_config")
    if sparsity and (not isinstance(sparsity, Mapping) or sparsity.get("format") not in (None, "dense")):
        raise ctx.refuse("sparsity_config", sparsity, "dense weights (no sparse compression)")
    if quant.get("transform_config"):
        raise ctx.refuse("transform_config", quant["transform_config"], "weights without rotations")
    groups = quant.get("config_groups") or {}
    if not groups:
        if quant.get("kv_cache_scheme"):
            return None  # FP8 KV-cache scales alone (the loader reads them); the weights are not quantised
        raise ctx.refuse("config_groups", groups, "at least one quantisation group")
    rules = []
    for name, group in groups.items():
        if not isinstance(group, Mapping):
            raise ctx.refuse(f"config_groups.{name}", group, "an object")
        targets = tuple(group.get("targets") or ())
        for t in targets:
            if t != "Linear" and not t.startswith("re:") and (t[:1].isupper() or not t):
                raise ctx.refuse(f"config_groups.{name}.targets", t, "Linear, re: patterns or module names")
        if group.get("output_activations"):
            raise ctx.refuse(f"config_groups.{name}.output_activations", group["output_activations"], "none")
        fmt = group.get("format") or quant.get("format")
        rules.append(QuantRule(targets, _ct_weights(ctx, f"config_groups.{name}", group.get("weights"),
                                                    group.get("input_activations"), fmt)))
    return ctx.scheme(rules, quant.get("ignore"))


def _ct_weights(ctx: ReadContext, where: str, w: Any, a: Any, fmt: Any) -> WeightScheme:
    if not isinstance(w, Mapping):
        raise ctx.refuse(f"{where}.weights", w, "quantised weights")
    kind, bits, strategy = w.get("type", "int"), w.get("num_bits"), w.get("strategy")
    if w.get("dynamic"):
        raise ctx.refuse(f"{where}.weights.dynamic", w["dynamic"], "weights quantised in the checkpoint")
    if kind == "float" and bits == 8:
        if fmt not in ("float-quantized", "naive-quantized"):
            raise ctx.refuse("format", fmt, "float-quantized (or naive-quantized) FP8 weights")
        if not w.get("symmetric", True):
            raise ctx.refuse(f"{where}.weights.symmetric", w["symmetric"], "symmetric FP8 weights")
        if strategy not in ("tensor", "channel", "block"):
            raise ctx.refuse(f"{where}.weights.strategy", strategy, "tensor, channel or block FP8 scales")
        block = ctx.block(f"{where}.weights.block_structure", w.get("block_structure")) \
            if strategy == "block" else None
        acts = _ct_activations(ctx, where, a, block)
        return WeightScheme(FP8, strategy, FP8_SCALE, block=block, activations=acts)
    if kind == "int" and bits == 4:
        if fmt != "pack-quantized":
            raise ctx.refuse("format", fmt, "pack-quantized int4 weights")
        if a:
            raise ctx.refuse(f"{where}.input_activations", a, "weight-only int4 (W4A16)")
        if strategy not in ("group", "channel"):
            raise ctx.refuse(f"{where}.weights.strategy", strategy, "group or channel int4 scales")
        group = w.get("group_size") if strategy == "group" else 0
        if strategy == "group" and not (isinstance(group, int) and group > 0):
            raise ctx.refuse(f"{where}.weights.group_size", group, "a positive group size")
        actorder = w.get("actorder")
        if actorder not in (None, "group", "weight"):
            raise ctx.refuse(f"{where}.weights.actorder", actorder, "none, group or weight")
        return WeightScheme(INT4, strategy, PACKED, group_size=int(group or 0),
                            symmetric=bool(w.get("symmetric", True)), act_order=actorder == "group")
    raise ctx.refuse(f"{where}.weights", {"type": kind, "num_bits": bits},
                     "FP8 (float, 8 bits) or int4 (int, 4 bits) weights")


def _ct_activations(ctx: ReadContext, where: str, a: Any, block: tuple[int, int] | None) -> str:
    """What a compressed-tensors FP8 group does to activations (`WeightScheme.activations`)."""
    if not a:
        return "none"
    if not isinstance(a, Mapping) or a.get("type", "float") != "float" or a.get("num_bits") != 8 \
            or not a.get("symmetric", True):
        raise ctx.refuse(f"{where}.input_activations", a, "symmetric FP8 activations, or none")
    strategy, dynamic = a.get("strategy"), bool(a.get("dynamic"))
    if not dynamic:
        if strategy != "tensor":
            raise ctx.refuse(f"{where}.input_activations.strategy", strategy, "static scales per tensor")
        return "static"
    if strategy == "group":
        if block is None or a.get("group_size") != block[1]:
            raise ctx.refuse(f"{where}.input_activations.group_size", a.get("group_size"),
                             "per-token groups as wide as the weight blocks' columns")
        return "group"
    if strategy not in ("token", "tensor"):
        raise ctx.refuse(f"{where}.input_activations.strategy", strategy, "token, tensor or group")
    return strategy
