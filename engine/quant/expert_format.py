"""How a mixture-of-experts layer's routed experts are stored when a checkpoint keeps them quantised. Torch-free
(the memory planner and `check_moe_parallel` read it).

Two formats, each kept quantised in memory and in the fused MoE kernel:

* ``fp8_block``: DeepSeek-V3's and Qwen3's FP8 releases (``quant_method: fp8`` with ``weight_block_size``, e.g.
  [128, 128]): each expert projection ``W`` [N, K] is ``float8_e4m3fn`` with a float32 ``weight_scale_inv``
  [ceil(N / bn), ceil(K / bk)], ``W = q * scale_inv`` per block. The GPU kernel is W8A8: activations are
  quantised per token and group of ``bk`` columns (vLLM's and SGLang's ``fused_moe`` with ``use_fp8_w8a8``
  and a block shape).
* ``mxfp4``: gpt-oss's release (``quant_method: mxfp4``): E2M1 values with an E8M0 scale per 32 values along K
  (`pd_cluster.engine.quant.mxfp4`); the kernel dequantises them next to the 16-bit activations, as vLLM does
  on Hopper.

The engine's stacked expert tensors (`pd_cluster.engine.model.moe.FusedExperts`) are ``w13`` [E, 2 I, H] (gate
rows, then up rows) and ``w2`` [E, H, I]. Quantised, they keep those logical shapes; a tensor-parallel split of
``I`` keeps whole blocks (FP8: refused otherwise, as vLLM refuses it; MXFP4: whole blocks per rank, the tail
zero-padded, as vLLM splits gpt-oss), and FP8's gate and up must each fill whole row blocks, since the two are
stacked into one tensor with one scale grid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping, Sequence

ExpertFormat = Literal["fp8_block", "mxfp4"]
EXPERT_FORMATS = ("fp8_block", "mxfp4")
MXFP4_BLOCK = 32


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ExpertQuant:
    """The stored format of a layer's routed experts.

    Attributes:
        format: ``fp8_block`` or ``mxfp4``.
        block: (rows, columns) of one scale: FP8's ``weight_block_size``; MXFP4 (1, 32).

    Raises:
        ValueError: an unknown format or a block that is not two positive sizes.
    """

    format: ExpertFormat
    block: tuple[int, int]

    def __post_init__(self) -> None:
        if self.format not in EXPERT_FORMATS:
            raise ValueError(f"unknown expert weight format {self.format!r}; known: {', '.join(EXPERT_FORMATS)}")
        if len(self.block) != 2 or min(self.block) < 1:
            raise ValueError(f"expert weight block {self.block} is not (rows, columns)")
        if self.format == "mxfp4" and tuple(self.block) != (1, MXFP4_BLOCK):
            raise ValueError(f"MXFP4 blocks are 1 x {MXFP4_BLOCK} values, not {self.block}")

    @staticmethod
    def mxfp4() -> "ExpertQuant":
        return ExpertQuant("mxfp4", (1, MXFP4_BLOCK))

    @property
    def name(self) -> str:
        """How logs and errors name it: ``fp8 blocks of 128x128`` or ``mxfp4``."""
        return f"fp8 blocks of {self.block[0]}x{self.block[1]}" if self.format == "fp8_block" else "mxfp4"

    @property
    def scale_suffix(self) -> str:
        """The suffix of a weight's scale tensor: ``_scale_inv`` (FP8, a multiplier despite the name, as
        DeepSeek's) or ``_scale`` (MXFP4's E8M0 codes)."""
        return "_scale_inv" if self.format == "fp8_block" else "_scale"

    def data_shape(self, experts: int, n: int, k: int) -> tuple[int, int, int]:
        """The stored values of [experts, n, k] weights: one FP8 byte per value, or two MXFP4 codes per byte."""
        return (experts, n, k) if self.format == "fp8_block" else (experts, n, k // 2)

    def scale_shape(self, experts: int, n: int, k: int) -> tuple[int, int, int]:
        """One scale per block: [experts, ceil(n / rows), ceil(k / columns)]."""
        return (experts, _cdiv(n, self.block[0]), _cdiv(k, self.block[1]))

    def nbytes(self, experts: int, n: int, k: int) -> int:
        """Bytes of [experts, n, k] weights with their scales (float32 FP8 scales, one-byte E8M0 ones)."""
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
        if self.format == "mxfp4":
            for what, k in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
                if k % MXFP4_BLOCK:
                    raise ValueError(f"MXFP4 experts need {what} ({k}) in whole blocks of {MXFP4_BLOCK}")
        elif intermediate_size % self.block[0]:
            raise ValueError(f"FP8 experts in blocks of {self.block[0]}x{self.block[1]} need the experts' "
                             f"intermediate size ({intermediate_size}) in whole blocks of {self.block[0]} rows "
                             "(gate and up are stacked with one scale grid)")

    def rank_width(self, intermediate_size: int, tp_size: int) -> int:
        """Each rank's share of an expert's width under TP: ``I / tp`` for FP8 blocks (`check_split` refuses a
        split that cuts a block); for MXFP4, ``ceil(I / 32 / tp)`` whole blocks of 32, the last rank's tail
        padded with zero codes (vLLM's split of gpt-oss-120b's 2880 = 90 blocks: 12 per rank at TP 8). A padded
        gate/up row is zero with a zero bias, the activation of (0, 0) is 0 for both SwiGLU forms, and a padded
        down column is zero, so the padding adds nothing."""
        if self.format == "mxfp4":
            return _cdiv(_cdiv(intermediate_size, MXFP4_BLOCK), tp_size) * MXFP4_BLOCK
        return intermediate_size // tp_size

    def check_split(self, intermediate_size: int, tp_size: int) -> None:
        """Refuse a tensor-parallel split of each expert's width that would cut a block.

        Each rank holds `rank_width` gate and up rows and as many down columns; for FP8 that width must be whole
        row blocks (gate/up) and whole column blocks (down). MXFP4's split is in whole blocks by construction.

        Raises:
            ValueError: naming the width, the block and the way out (``--enable-expert-parallel`` keeps experts
                whole).
        """
        if self.format == "mxfp4":
            return
        width = intermediate_size // tp_size
        rows, cols = self.block
        for what, size in (("rows", rows), ("columns", cols)):
            if width % size:
                raise ValueError(
                    f"--tp-size {tp_size} splits each expert's intermediate size {intermediate_size} into "
                    f"{width}, which cuts the experts' weight blocks ({self.name}: {width} {what} is not a "
                    f"multiple of {size}); choose a TP size that keeps whole blocks, or --enable-expert-parallel")


def expert_quant_of(config: Mapping[str, Any], expert_modules: Sequence[str]) -> ExpertQuant | None:
    """How the checkpoint of `config` (``config.json``) stores the routed experts of its MoE layers, read through
    `pd_cluster.engine.quant.scheme.read_quant_scheme`: None when they are not quantised.

    `expert_modules` names one routed expert's checkpoint module in each MoE layer (the family's
    `Family.expert_checkpoint_module`: ``model.layers.3.mlp.experts.0.gate_proj``, or gpt-oss's stacked
    ``model.layers.3.mlp.experts``): the scheme's targets and ignore lists are matched against them.

    Raises:
        QuantConfigError: the scheme is refused (`read_quant_scheme`).
        ValueError: experts in a quantised format the MoE kernel does not compute (per-tensor or per-channel FP8,
            int4), or MoE layers whose experts the config stores differently, named.
    """
    from pd_cluster.engine.quant.scheme import read_quant_scheme
    from pd_cluster.engine.quant.weight_scheme import FP8, MXFP4

    scheme = read_quant_scheme(config)
    if scheme is None or not expert_modules:
        return None
    found = {scheme.for_module(module) for module in expert_modules}
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
    raise ValueError(f"{scheme.source}: routed experts in {weights.describe()} ({scheme.method}) are not computed by "
                     "the fused MoE kernel, which takes FP8 in blocks (weight_block_size) and MXFP4 experts")
