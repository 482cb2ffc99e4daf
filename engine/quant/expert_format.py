"""How a mixture-of-experts layer's routed experts are stored when a checkpoint keeps them quantised. Torch-free
(the memory planner and `check_moe_parallel` read it).

Four formats, each kept quantised in memory and in the fused MoE kernel:

* ``fp8_block``: DeepSeek-V3's and Qwen3's FP8 releases (``quant_method: fp8`` with ``weight_block_size``, e.g.
  [128, 128]): each expert projection ``W`` [N, K] is ``float8_e4m3fn`` with a float32 ``weight_scale_inv``
  [ceil(N / bn), ceil(K / bk)], ``W = q * scale_inv`` per block. The GPU kernel is W8A8: activations are
  quantised per token and group of ``bk`` columns (vLLM's and SGLang's ``fused_moe`` with ``use_fp8_w8a8``
  and a block shape).
* ``mxfp4``: gpt-oss's release (``quant_method: mxfp4``): E2M1 values with an E8M0 scale per 32 values along K
  (`pd_cluster.engine.quant.mxfp4`); the kernel dequantises them next to the 16-bit activations, as vLLM does
  on Hopper.
* ``fp8_rows``: FP8 with one float32 scale per output row: per channel (compressed-tensors' FP8-dynamic,
  ``fbgemm_fp8``) or per tensor (``quant_method: fp8`` without blocks, AutoFP8, compressed-tensors' ``tensor``;
  the one scale repeated on its rows, so gate and up keep their own). The GPU kernel is W8A8 with the scheme's
  activations: dynamic per token (capped by fbgemm's ``activation_scale_ub``), or the static ``input_scale``
  (the largest of the layer's experts', as vLLM takes it).
* ``int4``: W4A16 (GPTQ, AWQ, compressed-tensors ``pack-quantized``) in the engine's int4 layout
  (`pd_cluster.engine.quant.int4`): per expert ``qweight`` [K / 8, N] int32, ``scales`` [G, N] in the
  checkpoint's 16-bit dtype, ``zeros`` [G, N] uint8 when asymmetric and ``g_idx`` [K] with act order; the kernel
  dequantises each tile next to the activations, as vLLM's Triton ``fused_moe`` with ``use_int4_w4a16``.

The engine's stacked expert tensors (`pd_cluster.engine.model.moe.FusedExperts`) are ``w13`` [E, 2 I, H] (gate
rows, then up rows) and ``w2`` [E, H, I]. Quantised, they keep those logical shapes; a tensor-parallel split of
``I`` keeps whole blocks (FP8: refused otherwise, as vLLM refuses it; MXFP4: whole blocks per rank, the tail
zero-padded, as vLLM splits gpt-oss), and FP8's gate and up must each fill whole row blocks, since the two are
stacked into one tensor with one scale grid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping, Sequence

from pd_cluster.engine.quant.weight_scheme import QuantScheme, WeightScheme

ExpertFormat = Literal["fp8_block", "mxfp4", "fp8_rows", "int4"]
EXPERT_FORMATS = ("fp8_block", "mxfp4", "fp8_rows", "int4")
MXFP4_BLOCK = 32


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ExpertQuant:
    """The stored format of a layer's routed experts.

    Attributes:
        format: ``fp8_block``, ``mxfp4``, ``fp8_rows`` or ``int4`` (module docstring).
        block: (rows, columns) of one scale: FP8's ``weight_block_size``; MXFP4 (1, 32); FP8 rows (1, 0): a
            whole row; int4 (1, group size), (1, 0) for one group per row.
        scheme: the checkpoint's `WeightScheme` of the experts (``fp8_rows`` and ``int4``: how their tensors are
            read, and the activations and zero points); None for the others.

    Raises:
        ValueError: an unknown format, a block that is not (rows, columns), or ``fp8_rows`` / ``int4`` without
            their scheme.
    """

    format: ExpertFormat
    block: tuple[int, int]
    scheme: WeightScheme | None = None

    def __post_init__(self) -> None:
        if self.format not in EXPERT_FORMATS:
            raise ValueError(f"unknown expert weight format {self.format!r}; known: {', '.join(EXPERT_FORMATS)}")
        whole_rows = self.format in ("fp8_rows", "int4")
        if len(self.block) != 2 or self.block[0] < 1 or self.block[1] < (0 if whole_rows else 1):
            raise ValueError(f"expert weight block {self.block} is not (rows, columns)")
        if whole_rows and self.scheme is None:
            raise ValueError(f"{self.format} experts need the checkpoint's weight scheme")
        if self.format == "mxfp4" and tuple(self.block) != (1, MXFP4_BLOCK):
            raise ValueError(f"MXFP4 blocks are 1 x {MXFP4_BLOCK} values, not {self.block}")

    @staticmethod
    def mxfp4() -> "ExpertQuant":
        return ExpertQuant("mxfp4", (1, MXFP4_BLOCK))

    @property
    def name(self) -> str:
        """How logs and errors name it: ``fp8 blocks of 128x128``, ``mxfp4``, ``fp8 per channel`` (or per
        tensor), ``int4 groups of 128`` (or per channel)."""
        if self.format == "fp8_block":
            return f"fp8 blocks of {self.block[0]}x{self.block[1]}"
        if self.format == "fp8_rows":
            return f"fp8 per {self.scheme.granularity}"
        if self.format == "int4":
            return f"int4 groups of {self.block[1]}" if self.block[1] else "int4 per channel"
        return "mxfp4"

    @property
    def scale_suffix(self) -> str:
        """The suffix of a weight's scale tensor: ``_scale_inv`` (FP8 blocks, a multiplier despite the name, as
        DeepSeek's), ``_scale`` (MXFP4's E8M0 codes, FP8 rows' float32 scales) or ``_scales`` (int4's)."""
        return {"fp8_block": "_scale_inv", "int4": "_scales"}.get(self.format, "_scale")

    @property
    def group(self) -> int:
        """int4: input columns per group, 0 for one group per row."""
        return self.block[1]

    def data_shape(self, experts: int, n: int, k: int) -> tuple[int, int, int]:
        """The stored values of [experts, n, k] weights: one FP8 byte per value, two MXFP4 codes per byte, or
        int4's packed int32 words [experts, k / 8, n]."""
        if self.format == "mxfp4":
            return (experts, n, k // 2)
        return (experts, _cdiv(k, 8), n) if self.format == "int4" else (experts, n, k)

    def scale_shape(self, experts: int, n: int, k: int) -> tuple[int, int] | tuple[int, int, int]:
        """One scale per block: [experts, ceil(n / rows), ceil(k / columns)]; FP8 rows [experts, n]; int4
        [experts, groups, n] (with act order every group of the whole width: `groups`)."""
        if self.format == "fp8_rows":
            return (experts, n)
        if self.format == "int4":
            return (experts, self.groups(k), n)
        return (experts, _cdiv(n, self.block[0]), _cdiv(k, self.block[1]))

    def groups(self, k: int) -> int:
        """int4: the scale rows of a K-wide input (one for a group per row)."""
        return _cdiv(k, self.group) if self.group else 1

    def nbytes(self, experts: int, n: int, k: int) -> int:
        """Bytes of [experts, n, k] weights with their scales (float32 FP8 scales, one-byte E8M0 ones, 16-bit
        int4 scales and a byte per asymmetric zero point)."""
        if self.format == "int4":
            per_scale = 2 + (0 if self.scheme.symmetric else 1)
            return experts * _cdiv(k, 8) * n * 4 + experts * self.groups(k) * n * per_scale
        if self.format == "fp8_rows":
            return experts * n * k + experts * n * 4
        e, sn, sk = self.scale_shape(experts, n, k)
        values = experts * n * k if self.format == "fp8_block" else experts * n * k // 2
        return values + e * sn * sk * (4 if self.format == "fp8_block" else 1)

    def check_shapes(self, hidden_size: int, intermediate_size: int) -> None:
        """Refuse expert shapes the stacked layout cannot hold.

        Raises:
            ValueError: MXFP4 with a reduction axis (hidden or intermediate size) that is not whole blocks of
                32; FP8 gate and up projections that do not fill whole row blocks (they share one scale grid
                in ``w13``), named.
        """
        if self.format in ("mxfp4", "int4"):
            size = MXFP4_BLOCK if self.format == "mxfp4" else 8
            for what, k in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
                if k % size:
                    raise ValueError(f"{self.name} experts need {what} ({k}) in whole "
                                     f"{'blocks of 32' if size == 32 else 'packed words of 8'}")
        elif self.format == "fp8_block" and intermediate_size % self.block[0]:
            raise ValueError(f"FP8 experts in blocks of {self.block[0]}x{self.block[1]} need the experts' "
                             f"intermediate size ({intermediate_size}) in whole blocks of {self.block[0]} rows "
                             "(gate and up are stacked with one scale grid)")

    def rank_width(self, intermediate_size: int, tp_size: int) -> int:
        """Each rank's share of an expert's width under TP: ``I / tp`` for FP8 and int4 (`check_split` refuses a
        split that cuts a block); for MXFP4, ``ceil(I / 32 / tp)`` whole blocks of 32, the last rank's tail
        padded with zero codes (vLLM's split of gpt-oss-120b's 2880 = 90 blocks: 12 per rank at TP 8). A padded
        gate/up row is zero with a zero bias, the activation of (0, 0) is 0 for both SwiGLU forms, and a padded
        down column is zero, so the padding adds nothing."""
        if self.format == "mxfp4":
            return _cdiv(_cdiv(intermediate_size, MXFP4_BLOCK), tp_size) * MXFP4_BLOCK
        return intermediate_size // tp_size

    def check_split(self, intermediate_size: int, tp_size: int) -> None:
        """Refuse a tensor-parallel split of each expert's width that would cut a block.

        Each rank holds `rank_width` gate and up rows and as many down columns; for FP8 blocks that width must be
        whole row blocks (gate/up) and whole column blocks (down), for int4 whole packed words of 8 and whole
        groups (the groups need not be whole with act order: every rank keeps every group's scales). MXFP4's
        split is in whole blocks by construction; FP8 rows split anywhere.

        Raises:
            ValueError: naming the width, the block and the way out (``--enable-expert-parallel`` keeps experts
                whole).
        """
        if self.format in ("mxfp4", "fp8_rows"):
            return
        width = intermediate_size // tp_size
        rows, cols = self.block
        if self.format == "int4":  # down's input columns: whole packed words and (without act order) groups
            rows, cols = 8, 8 if self.scheme.act_order or not self.group else self.group
        for what, size in (("rows", rows), ("columns", cols)):
            if width % size:
                raise ValueError(
                    f"--tp-size {tp_size} splits each expert's intermediate size {intermediate_size} into "
                    f"{width}, which cuts the experts' weight blocks ({self.name}: {width} {what} is not a "
                    f"multiple of {size}); choose a TP size that keeps whole blocks, or --enable-expert-parallel")


def expert_quant_of(config: Mapping[str, Any] | QuantScheme | None, expert_modules: Sequence[str],
                    prefix: str = "") -> ExpertQuant | None:
    """How the checkpoint of `config` (``config.json``, or the `QuantScheme` already read from it and its side
    files) stores the routed experts of its MoE layers, read through
    `pd_cluster.engine.quant.scheme.read_quant_scheme`: None when they are not quantised.

    `expert_modules` names one routed expert's checkpoint module in each MoE layer (the family's
    `Family.expert_checkpoint_module`: ``model.layers.3.mlp.experts.0.gate_proj``, or gpt-oss's stacked
    ``model.layers.3.mlp.experts``, after `prefix`: a multimodal checkpoint's ``language_model.``): the scheme's
    targets and ignore lists are matched against them, with and without `prefix` (`QuantScheme.for_module`).

    Raises:
        QuantConfigError: the scheme is refused (`read_quant_scheme`).
        ValueError: experts in a quantised format the MoE kernel does not compute, or MoE layers whose experts
            the config stores differently, named.
    """
    from pd_cluster.engine.quant.scheme import read_quant_scheme
    from pd_cluster.engine.quant.weight_scheme import FP8, INT4, MXFP4

    scheme = config if isinstance(config, QuantScheme) or config is None else read_quant_scheme(config)
    if scheme is None or not expert_modules:
        return None
    found = {scheme.for_module(module, prefix) for module in expert_modules}
    if len(found) > 1:
        raise ValueError(f"{scheme.source}: {scheme.method} stores the routed experts of different MoE layers in "
                         "different formats; the engine holds one format for every layer's experts")
    weights = found.pop()
    if weights is None:
        return None
    if weights.kind == FP8 and weights.granularity == "block" and weights.block:
        return ExpertQuant("fp8_block", weights.block)
    if weights.kind == MXFP4:
        return ExpertQuant.mxfp4()
    stacked = any(m.endswith(".experts") for m in expert_modules)  # gpt-oss's and Llama 4's tensors per layer
    if stacked and weights.kind != MXFP4:
        raise ValueError(f"{scheme.source}: routed experts stored stacked per layer in {weights.describe()} "
                         f"({scheme.method}) are not computed by the fused MoE kernel, which reads stacked experts "
                         "in MXFP4 only")
    if weights.kind == FP8 and weights.block is None and weights.activations in ("none", "token", "tensor", "static"):
        return ExpertQuant("fp8_rows", (1, 0), weights)
    if weights.kind == INT4:
        return ExpertQuant("int4", (1, weights.group_size), weights)
    raise ValueError(f"{scheme.source}: routed experts in {weights.describe()} ({scheme.method}) are not computed by "
                     "the fused MoE kernel, which takes FP8 (in blocks, per channel or per tensor), int4 and MXFP4 "
                     "experts")
