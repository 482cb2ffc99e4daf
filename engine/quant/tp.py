"""How tensor parallelism may cut a quantised weight (torch-free): each rank's share of a split dimension must
keep FP8 blocks, int4 groups and packed int32 words whole (`pd_cluster.engine.quant.loading` slices by it;
`ArchConfig.check_tp` checks a model's layers with it before any rank starts)."""

from __future__ import annotations

from collections.abc import Iterable

from pd_cluster.engine.quant import support
from pd_cluster.engine.quant.weight_scheme import FP8, INT4, QuantScheme, WeightScheme


def alignment(scheme: WeightScheme, axis: str) -> tuple[int, str]:
    """(the multiple a rank's share of `axis` (``rows`` or ``cols``) must be, what it keeps whole)."""
    if scheme.kind == FP8 and scheme.block is not None:
        bn, bk = scheme.block
        return (bn, f"{bn}x{bk} FP8 blocks (output rows)") if axis == "rows" else \
            (bk, f"{bn}x{bk} FP8 blocks (input columns)")
    if scheme.kind == INT4:
        if axis == "rows":
            return 8, "int4 output rows (8 per packed word)"
        if scheme.act_order or not scheme.group_size:
            return 8, "int4 input columns"
        return scheme.group_size, f"int4 input columns (groups of {scheme.group_size})"
    return 1, "output rows" if axis == "rows" else "input columns"


def rank_range(total: int, rank: int, size: int, align: int, module: str, what: str) -> tuple[int, int]:
    """``[start, end)`` of rank `rank`'s share of `total` over `size` ranks.

    Raises:
        ValueError: the share is not a whole multiple of `align`, naming `module`, `what` and the sizes.
    """
    if size == 1:
        return 0, total
    share = total // size
    if total % size or share % align:
        raise ValueError(f"--tp-size {size} splits {module}'s {what}: {total} / {size} = {total / size:g} per rank "
                         f"is not a multiple of {align}")
    return rank * share, (rank + 1) * share


def check_splits(layers: Iterable, scheme: QuantScheme, tp_size: int) -> None:
    """Refuse a `tp_size` that cuts a quantised layer's blocks, groups or words (`layers`: `LinearLayer` s with
    ``name``, ``n``, ``k``, ``split``, ``expert``). Layers held dequantised (`support.DEQUANTIZED_MODULES`: the
    whole weight is dequantised, then sliced) may be cut anywhere; routed experts are checked by
    `pd_cluster.engine.model.moe_config.check_moe_parallel`, which knows expert parallelism (whole experts) and
    MXFP4's padded split.

    Raises:
        ValueError: from `rank_range`, for the first layer cut.
    """
    if tp_size == 1:
        return
    for layer in layers:
        if layer.expert or layer.name.rsplit(".", 1)[-1] in support.DEQUANTIZED_MODULES:
            continue
        ws = scheme.for_module(layer.name) if layer.split else None
        if ws is None or ws.kind not in (FP8, INT4):
            continue
        align, what = alignment(ws, layer.split)
        rank_range(layer.n if layer.split == "rows" else layer.k, 0, tp_size, align, layer.name, what)
