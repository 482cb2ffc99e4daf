"""A checkpoint's weight quantisation, read as released into a typed, frozen `QuantScheme`. Torch-free.

`read_quant_scheme(config, folder)` reads, in this order, ``config.json``'s ``quantization_config`` (a
multimodal checkpoint's ``text_config`` one too), llm-compressor's older ``compression_config`` key (vLLM reads it
as the same thing), then a ``quantize_config.json`` (AutoGPTQ) or ``quant_config.json`` (AutoAWQ) beside
``config.json``. It returns None for unquantised weights, and raises `QuantConfigError` (a ValueError) naming the
format, the key and the file for anything the engine does not compute. The formats:

* ``fp8`` with ``weight_block_size`` (DeepSeek-V3, Qwen3-FP8): E4M3 ``weight`` and a float32 ``weight_scale_inv``
  per block; on the GPU, activations get dynamic FP8 scales per token and block column (``group``).
* ``fp8`` without blocks (AutoFP8): E4M3 ``weight``, a scalar ``weight_scale``, and with
  ``activation_scheme: static`` the scalar ``input_scale``; else dynamic per-token activation scales.
* ``compressed-tensors`` (llm-compressor): FP8 ``weight`` with ``weight_scale`` per tensor ([1]), channel ([N, 1])
  or block ([N/bn, K/bk]) and activations as ``input_activations`` says (token, group or tensor, dynamic; static
  with ``input_scale``; none: W8A16); int4 W4A16 ``pack-quantized``: ``weight_packed`` [N, K/8] int32,
  ``weight_scale`` [N, K/g], ``weight_shape``, ``weight_zero_point`` (asymmetric), ``weight_g_idx``
  (``actorder: group``).
* ``fbgemm_fp8`` (Llama 3.1 405B FP8): E4M3 ``weight``, ``weight_scale`` [N, 1]; per-token activation scales
  capped by ``activation_scale_ub``.
* ``awq`` (AutoAWQ GEMM): ``qweight`` [K, N/8] and ``qzeros`` [K/g, N/8] in AWQ's nibble order, ``scales``
  [K/g, N]; weight-only.
* ``gptq``: ``qweight`` [K/8, N], ``qzeros`` [K/g, N/8] (stored minus one unless ``checkpoint_format: gptq_v2``),
  ``scales`` [K/g, N], ``g_idx`` [K] (``desc_act``); weight-only.
* ``mxfp4`` (gpt-oss): the routed experts' e2m1 ``*_blocks`` with e8m0 ``*_scales`` per 32 inputs (the MoE
  code computes them); the layers in ``modules_to_not_convert`` stay unquantised.

Which modules: a scheme holds `QuantRule` s (compressed-tensors' ``config_groups``: ``targets`` are ``Linear``
(every linear layer), ``re:<regex>`` (``re.match`` on the module name) or a module name) and the modules left
unquantised (``ignore``, ``modules_to_not_convert``, ``ignored_layers``), matched by `module_matches`.
`QuantScheme.for_module` answers for one checkpoint module name (``model.layers.0.self_attn.q_proj``): how its
weight is stored *when its tensors are quantised*. A module a rule covers but whose checkpoint stores a plain
float ``weight`` (DeepSeek-V3's router, which no ignore list names) holds its true weights and loads as it is, as
vLLM and transformers load it; a module stored quantised that the scheme leaves unquantised is refused by the
loader. bitsandbytes stays refused by name (its 4-bit NF4 and 8-bit LLM.int8() need their own kernels), and so does
every other method.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pd_cluster.engine.quant.compressed_tensors import read_compressed_tensors
from pd_cluster.engine.quant.weight_scheme import (AWQ, FP8, FP8_SCALE, FP8_SCALE_INV, GPTQ, GPTQ_V2, INT4, MXFP4,
                                                   MXFP4_BLOCKS, PACKED, QuantConfigError, QuantRule, QuantScheme,
                                                   ReadContext, WeightScheme, module_matches, refusal)

__all__ = ["AWQ", "FP8", "FP8_SCALE", "FP8_SCALE_INV", "GPTQ", "GPTQ_V2", "INT4", "MXFP4", "MXFP4_BLOCKS", "PACKED",
           "SUPPORTED_METHODS", "QuantConfigError", "QuantRule", "QuantScheme", "WeightScheme", "module_matches",
           "read_quant_scheme"]

SUPPORTED_METHODS = ("fp8", "compressed-tensors", "fbgemm_fp8", "awq", "gptq", "mxfp4")
SIDE_FILES = ("quantize_config.json", "quant_config.json")  # AutoGPTQ's, AutoAWQ's (and GPTQModel's)


def read_quant_scheme(config: Mapping[str, Any], folder: str | Path | None = None) -> QuantScheme | None:
    """The weight quantisation of the checkpoint whose ``config.json`` is `config` (module docstring).

    Args:
        config: the parsed ``config.json``.
        folder: the checkpoint folder: where a ``quantize_config.json`` / ``quant_config.json`` is looked for,
            and the files named in refusals (``config.json`` alone when None).

    Returns:
        None when the weights are not quantised (no config, or llm-compressor's KV-cache scales alone).

    Raises:
        QuantConfigError: a method or a value the engine does not compute, naming it and the file.
    """
    base = Path(folder) if folder is not None else None
    source = str(base / "config.json") if base is not None else "config.json"
    text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else {}
    quant, key = None, "quantization_config"
    for where, name in ((config, "quantization_config"), (config, "compression_config"),
                        (text, "quantization_config")):
        if where.get(name) is not None:
            quant, key = where[name], name
            break
    if quant is None and base is not None:
        for name in SIDE_FILES:
            if (base / name).is_file():
                source, key = str(base / name), ""
                with open(base / name) as f:
                    quant = json.load(f)
                break
    if quant is None:
        return None
    prefix = f"{key}." if key else ""
    if not isinstance(quant, Mapping):
        raise QuantConfigError(f"{source}: {key or 'the file'} is {quant!r}, not an object")
    method = _method(quant, key)
    if method.startswith("bitsandbytes") or quant.get("load_in_4bit") or quant.get("load_in_8bit"):
        raise refusal(source, "bitsandbytes", f"{prefix}quant_method", method or "bitsandbytes",
                      "bitsandbytes' NF4 / LLM.int8() weights need their own kernels; serve an FP8, AWQ or GPTQ "
                      "release instead")
    if method not in _READERS:
        raise refusal(source, method or "unknown", f"{prefix}quant_method", method,
                      "unquantised weights or " + ", ".join(SUPPORTED_METHODS))
    return _READERS[method](quant, ReadContext(source, method, prefix))


def _method(quant: Mapping[str, Any], key: str) -> str:
    """``quant_method``; a side file without one is AutoGPTQ's (``bits``) or AutoAWQ's (``w_bit``)."""
    method = quant.get("quant_method")
    if method is None and not key:
        method = "awq" if "w_bit" in quant or "q_group_size" in quant else "gptq"
    return str(method or "").lower()


def _ignore_list(quant: Mapping[str, Any], *keys: str) -> list[str]:
    out: list[str] = []
    for key in keys:
        out += list(quant.get(key) or ())
    return out


def _read_fp8(quant: Mapping[str, Any], ctx: ReadContext) -> QuantScheme:
    """``quant_method: fp8``: DeepSeek-V3's blocks with ``weight_scale_inv``, or AutoFP8's per-tensor scales."""
    if quant.get("fmt", "e4m3") != "e4m3":
        raise ctx.refuse("fmt", quant.get("fmt"), "e4m3 FP8 weights")
    acts = quant.get("activation_scheme", "dynamic")
    if acts not in ("dynamic", "static"):
        raise ctx.refuse("activation_scheme", acts, "dynamic or static")
    ignore = _ignore_list(quant, "ignored_layers", "modules_to_not_convert")
    if quant.get("weight_block_size") is not None:
        block = ctx.block("weight_block_size", quant["weight_block_size"])
        if acts != "dynamic":
            raise ctx.refuse("activation_scheme", acts, "dynamic activation scales with weights in blocks")
        weights = WeightScheme(FP8, "block", FP8_SCALE_INV, block=block, activations="group")
    else:
        weights = WeightScheme(FP8, "tensor", FP8_SCALE, activations="token" if acts == "dynamic" else "static")
    return ctx.scheme([QuantRule(("Linear",), weights)], ignore)


def _read_fbgemm(quant: Mapping[str, Any], ctx: ReadContext) -> QuantScheme:
    """``fbgemm_fp8`` (Llama 3.1 405B's FP8 release): E4M3 weights per channel, activations per token."""
    ub = quant.get("activation_scale_ub")
    if ub is not None and not (isinstance(ub, (int, float)) and ub > 0):
        raise ctx.refuse("activation_scale_ub", ub, "a positive number")
    weights = WeightScheme(FP8, "channel", FP8_SCALE, activations="token",
                           activation_scale_ub=float(ub) if ub is not None else None)
    return ctx.scheme([QuantRule(("Linear",), weights)], _ignore_list(quant, "modules_to_not_convert"))


def _int4_bits_and_group(ctx: ReadContext, quant: Mapping[str, Any], bits_keys: tuple[str, ...],
                         group_keys: tuple[str, ...]) -> int:
    bits_key = next((k for k in bits_keys if k in quant), bits_keys[0])
    if quant.get(bits_key, 4) != 4:
        raise ctx.refuse(bits_key, quant.get(bits_key), "4-bit weights")
    group_key = next((k for k in group_keys if k in quant), group_keys[0])
    group = quant.get(group_key, 128)
    if not isinstance(group, int) or isinstance(group, bool) or not (group == -1 or group > 0):
        raise ctx.refuse(group_key, group, "a positive group size, or -1 for one group per row")
    return 0 if group == -1 else group


def _read_gptq(quant: Mapping[str, Any], ctx: ReadContext) -> QuantScheme:
    """GPTQ (AutoGPTQ, GPTQModel, optimum): from ``config.json`` or ``quantize_config.json``."""
    group = _int4_bits_and_group(ctx, quant, ("bits",), ("group_size",))
    fmt_key = "checkpoint_format" if "checkpoint_format" in quant else "format"
    fmt = str(quant.get(fmt_key) or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ctx.refuse(fmt_key, quant.get(fmt_key), "gptq or gptq_v2 packing")
    if quant.get("dynamic"):
        raise ctx.refuse("dynamic", quant["dynamic"], "one bits/group_size for every module")
    if str(quant.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
        raise ctx.refuse("pack_dtype", quant.get("pack_dtype"), "int32 packing")
    weights = WeightScheme(INT4, "group" if group else "channel", GPTQ_V2 if fmt == "gptq_v2" else GPTQ,
                           group_size=group, symmetric=bool(quant.get("sym", True)),
                           act_order=bool(quant.get("desc_act", False)))
    ignore = [] if quant.get("lm_head") else ["lm_head"]
    return ctx.scheme([QuantRule(("Linear",), weights)], ignore)


def _read_awq(quant: Mapping[str, Any], ctx: ReadContext) -> QuantScheme:
    """AWQ (AutoAWQ's GEMM packing): from ``config.json`` or AutoAWQ's ``quant_config.json``."""
    group = _int4_bits_and_group(ctx, quant, ("bits", "w_bit"), ("group_size", "q_group_size"))
    version = str(quant.get("version", "gemm")).lower()
    if version != "gemm":
        raise ctx.refuse("version", quant.get("version"), "AutoAWQ's gemm packing")
    if not quant.get("zero_point", True):
        raise ctx.refuse("zero_point", quant.get("zero_point"), "AWQ with zero points")
    if str(quant.get("backend", "autoawq")).lower() != "autoawq":
        raise ctx.refuse("backend", quant.get("backend"), "autoawq packing")
    weights = WeightScheme(INT4, "group" if group else "channel", AWQ, group_size=group, symmetric=False)
    return ctx.scheme([QuantRule(("Linear",), weights)], _ignore_list(quant, "modules_to_not_convert"))


def _read_mxfp4(quant: Mapping[str, Any], ctx: ReadContext) -> QuantScheme:
    """gpt-oss: the routed experts in MXFP4 (computed by the MoE code); ``modules_to_not_convert`` unquantised."""
    weights = WeightScheme(MXFP4, "block", MXFP4_BLOCKS, group_size=32)
    return ctx.scheme([QuantRule((r"re:.*mlp\.experts(\.|$)",), weights)],
                      _ignore_list(quant, "modules_to_not_convert"))


_READERS = {"fp8": _read_fp8, "fbgemm_fp8": _read_fbgemm, "gptq": _read_gptq, "awq": _read_awq,
            "mxfp4": _read_mxfp4, "compressed-tensors": read_compressed_tensors}
