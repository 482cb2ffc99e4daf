"""The types of a checkpoint's weight quantisation (`WeightScheme`, `QuantRule`, `QuantScheme`), the module
matching rule of ignore lists and targets, and the reader context that names the file in refusals. Torch-free.
The readers are `pd_cluster.engine.quant.scheme` (``read_quant_scheme``) and
`pd_cluster.engine.quant.compressed_tensors`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

FP8, INT4, MXFP4 = "fp8", "int4", "mxfp4"
# Checkpoint tensor layouts (`WeightScheme.layout`): which tensors a quantised module has, and how they pack
FP8_SCALE_INV = "fp8_scale_inv"  # weight (E4M3) + weight_scale_inv per block: quant_method fp8 with blocks
FP8_SCALE = "fp8_scale"          # weight (E4M3) + weight_scale (+ input_scale): fp8 per tensor, compressed-tensors, fbgemm
AWQ = "awq"                      # qweight [K, N/8], qzeros [K/g, N/8] in AWQ's nibble order, scales [K/g, N]
GPTQ = "gptq"                    # qweight [K/8, N], qzeros [K/g, N/8] stored minus one, scales, g_idx
GPTQ_V2 = "gptq_v2"              # the same with true zeros
PACKED = "pack_quantized"        # compressed-tensors: weight_packed [N, K/8], weight_scale [N, K/g], ...
MXFP4_BLOCKS = "mxfp4"           # gpt-oss: <proj>_blocks (e2m1 pairs) and <proj>_scales (e8m0)
ACTIVATIONS = ("none", "token", "group", "tensor", "static")


class QuantConfigError(ValueError):
    """A quantisation config the engine does not compute; the message names the format, key and file."""


@dataclass(frozen=True)
class WeightScheme:
    """How one module's weight is stored in the checkpoint and computed.

    Attributes:
        kind: ``fp8`` (float8_e4m3fn values times float32 scales), ``int4`` (4-bit integers ``q``, a scale ``s``
            and a zero point ``z`` per group of input columns: ``(q - z) * s``) or ``mxfp4`` (OCP MX: e2m1 values,
            one e8m0 scale per 32 inputs).
        granularity: fp8: ``block``, ``channel`` (one scale per output row) or ``tensor``; int4: ``group`` or
            ``channel`` (one group spanning the row); mxfp4: ``block``.
        layout: the checkpoint's tensors (the module constants above).
        block: fp8 ``block``: (rows, columns) of one scale's block (``weight_block_size``); else None.
        group_size: int4 ``group``: input columns per group; mxfp4: 32; else 0.
        activations: what the GPU path does to a layer's input: ``group`` (dynamic FP8 scales per token and
            ``block[1]`` columns), ``token`` (dynamic per token), ``tensor`` (dynamic, one per step), ``static``
            (the checkpoint's ``input_scale``) or ``none`` (weight-only: W4A16, W8A16).
        activation_scale_ub: fbgemm_fp8's upper bound on a dynamic activation scale's amax; None without.
        symmetric: int4: no zero-point tensor (the zero is 8; GPTQ's ``sym`` checkpoints still store theirs).
        act_order: int4: the checkpoint's ``g_idx`` maps input column k to its group (GPTQ ``desc_act``,
            compressed-tensors ``actorder: group``); else column k is in group ``k // group_size``.
    """

    kind: str
    granularity: str
    layout: str
    block: tuple[int, int] | None = None
    group_size: int = 0
    activations: str = "none"
    activation_scale_ub: float | None = None
    symmetric: bool = True
    act_order: bool = False

    def __post_init__(self) -> None:
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {ACTIVATIONS}, got {self.activations!r}")

    @property
    def bits(self) -> int:
        return 8 if self.kind == FP8 else 4

    def bits_per_weight(self, dtype_bits: int = 16) -> float:
        """Memory per weight as the engine holds it: the values plus their scales (float32 for FP8, the model's
        `dtype_bits` for int4, whose zero points take a byte per group and column when asymmetric; e8m0 for MXFP4).
        Per-channel and per-tensor scales are counted as 0 (one per row)."""
        if self.kind == FP8:
            return 8 + (32 / (self.block[0] * self.block[1]) if self.block else 0.0)
        if self.kind == MXFP4:
            return 4 + 8 / 32
        if not self.group_size:
            return 4.0
        return 4 + (dtype_bits + (0 if self.symmetric else 8)) / self.group_size

    def describe(self) -> str:
        """e.g. ``fp8 128x128 blocks, dynamic per-token-group FP8 activations``."""
        if self.kind == FP8:
            what = (f"fp8 {self.block[0]}x{self.block[1]} blocks" if self.block else f"fp8 per {self.granularity}")
        elif self.kind == INT4:
            what = (f"int4 groups of {self.group_size}" if self.group_size else "int4 per channel") + \
                f" ({self.layout}{', asymmetric' if not self.symmetric else ''}{', g_idx' if self.act_order else ''})"
        else:
            what = "mxfp4 blocks of 32"
        acts = {"none": "weight-only", "group": "dynamic per-token-group FP8 activations",
                "token": "dynamic per-token FP8 activations", "tensor": "dynamic per-tensor FP8 activations",
                "static": "static FP8 activation scales"}[self.activations]
        return f"{what}, {acts}"


@dataclass(frozen=True)
class QuantRule:
    """Modules matching any of `targets` (``Linear``, ``re:<regex>`` or a name) are stored as `weights`."""

    targets: tuple[str, ...]
    weights: WeightScheme


@dataclass(frozen=True)
class QuantScheme:
    """A checkpoint's weight quantisation.

    Attributes:
        method: ``quant_method`` as released (`pd_cluster.engine.quant.scheme.SUPPORTED_METHODS`).
        source: the file it was read from (``.../config.json``, ``.../quantize_config.json``, ...).
        rules: the first rule whose targets match a module decides its `WeightScheme`.
        ignore: modules left unquantised (matched before the rules).
    """

    method: str
    source: str
    rules: tuple[QuantRule, ...]
    ignore: tuple[str, ...] = ()

    def for_module(self, name: str, prefix: str = "") -> WeightScheme | None:
        """The `WeightScheme` of checkpoint module `name` (no ``.weight`` suffix), None when it is unquantised.

        `prefix` is the checkpoint's prefix of a multimodal model's language model (``language_model.``): its
        releases name those modules in ignore lists and targets either with it (Llama 4's
        ``language_model.model.layers.0.feed_forward.router``) or without it, so either form matches."""
        names = (name, name.removeprefix(prefix)) if prefix and name.startswith(prefix) else (name,)
        if any(module_matches(p, n) for p in self.ignore for n in names):
            return None
        for rule in self.rules:
            if any(module_matches(t, n) for t in rule.targets for n in names):
                return rule.weights
        return None

    @property
    def weight_schemes(self) -> tuple[WeightScheme, ...]:
        """The distinct schemes of the rules, in order."""
        return tuple(dict.fromkeys(r.weights for r in self.rules))

    def describe(self) -> str:
        """One line for the start-up log: the method, its file and each rule's scheme."""
        return f"{self.method} ({self.source}): " + "; ".join(w.describe() for w in self.weight_schemes)

    def refuse(self, key: str, value: Any, supported: str) -> QuantConfigError:
        """A `QuantConfigError` about this scheme's `key` (naming the format and the file)."""
        return refusal(self.source, self.method, key, value, supported)


def module_matches(pattern: str, name: str) -> bool:
    """Whether an ignore or target entry names module `name`.

    ``Linear``: every module; ``re:<regex>``: ``re.match`` (compressed-tensors' rule); otherwise the pattern's
    dot-separated parts (``*`` one part) appear as consecutive parts of `name` (``lm_head``, ``mlp.gate`` or
    gpt-oss's ``model.layers.*.self_attn`` name that module and what is inside it; ``gate`` is not ``gate_proj``).
    """
    if pattern == "Linear":
        return True
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    want, parts = pattern.split("."), name.split(".")
    for start in range(len(parts) - len(want) + 1):
        if all(w in ("*", p) for w, p in zip(want, parts[start:start + len(want)])):
            return True
    return False


def refusal(source: str, method: str, key: str, value: Any, supported: str) -> QuantConfigError:
    """``<file>: <method> <key>=<value> is not supported (<what is>); ...``."""
    return QuantConfigError(f"{source}: {method} {key}={value!r} is not supported ({supported}); refusing to load "
                            "weights the engine would compute differently")


@dataclass(frozen=True)
class ReadContext:
    """Where a config is being read (its file, method and key prefix), to name them in refusals."""

    source: str
    method: str
    prefix: str

    def refuse(self, key: str, value: Any, supported: str) -> QuantConfigError:
        return refusal(self.source, self.method, self.prefix + key, value, supported)

    def scheme(self, rules: list[QuantRule], ignore: Any) -> QuantScheme:
        if ignore is not None and not (isinstance(ignore, list) and all(isinstance(i, str) for i in ignore)):
            raise self.refuse("ignore", ignore, "a list of module names or re: patterns")
        return QuantScheme(self.method, self.source, tuple(rules), tuple(ignore or ()))

    def block(self, key: str, block: Any) -> tuple[int, int]:
        """A ``[rows, columns]`` block size.

        Raises:
            QuantConfigError: not two positive integers.
        """
        if not (isinstance(block, (list, tuple)) and len(block) == 2
                and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise self.refuse(key, block, "[rows, columns] of one scale's block, positive integers")
        return int(block[0]), int(block[1])
