"""Tiny checkpoints in the weight-quantisation formats as released, and their dequantised twins.

`write_quantized(src, out, twin, fmt)` takes a transformers-saved checkpoint (real random weights, real tensor
names), quantises every linear layer of its decoder layers (attention and MLP projections; experts too; never the
router, the norms, the embeddings or the LM head) into format `fmt` with the tensor
names, dtypes, packings and config keys of that format's real releases, and writes the exact dequantised values
of the same weights as an ordinary checkpoint to `twin` (transformers and the engine load it as unquantised).

The packings here are written out from the formats' definitions, independently of the engine's readers
(`pd_cluster.engine.quant.int4`): ``pack_nibbles`` puts column ``8 c + order[i]`` in nibble ``i``.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

BLOCK = (16, 32)  # FP8 block of the tiny models: divides their q/k/v parts and MLP widths, per rank at TP 2
GROUP = 32        # int4 group of the tiny models
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
FORMATS = {  # name: (quantised layout, config written)
    "fp8-block": "quant_method fp8, weight_block_size (DeepSeek-V3, Qwen3-FP8): weight + weight_scale_inv",
    "fp8-tensor": "quant_method fp8 per tensor, static activations (AutoFP8): weight_scale, input_scale",
    "ct-fp8-channel": "compressed-tensors FP8 per channel, dynamic per-token activations (FP8-dynamic)",
    "ct-fp8-block": "compressed-tensors FP8 in blocks, per-token-group activations",
    "fbgemm": "fbgemm_fp8 (Llama 3.1 405B FP8): weight_scale [N, 1], activation_scale_ub",
    "ct-w4a16": "compressed-tensors W4A16 pack-quantized, asymmetric, actorder group (g_idx)",
    "awq": "AWQ GEMM: qweight/qzeros in AWQ order, fp16 scales",
    "gptq": "GPTQ from quantize_config.json (no quantization_config), desc_act, sym: qzeros stored minus one",
}
# projections by their usual names, StarCoder2's c_fc and Mixtral-style experts' w1/w2/w3
_LINEAR = re.compile(r"\.layers\.\d+\..*(_proj|_proj_with_mqa|\.c_fc|\.experts\.\d+\.w[123])\.weight$")


def pack_nibbles(values: torch.Tensor, axis: int, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """uint8 values in 0..15 -> int32, 8 per word along `axis`: nibble i of word c is element 8 c + order[i]."""
    v = values.numpy().astype(np.uint32)
    v = v.T if axis == 0 else v
    rows, cols = v.shape
    v = np.pad(v, ((0, 0), (0, -cols % 8)))
    out = np.zeros((rows, v.shape[1] // 8), dtype=np.uint32)
    for i, col in enumerate(order):
        out |= v[:, col::8] << np.uint32(4 * i)
    out = out.T if axis == 0 else out
    return torch.from_numpy(np.ascontiguousarray(out).view(np.int32))


def _fp8(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)


def _blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(E4M3 weight, float32 scale per block, dequantised float32 weight)."""
    n, k = w.shape
    bn, bk = block
    amax = torch.zeros(-(-n // bn), -(-k // bk))
    for i in range(amax.shape[0]):
        for j in range(amax.shape[1]):
            amax[i, j] = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().max()
    scale = amax.clamp(min=1e-12) / 448
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    q = _fp8(w, full)
    return q, scale, q.float() * full


def _rows(w: torch.Tensor, dtype: torch.dtype, per_tensor: bool = False):
    """(E4M3 weight, scale [N, 1] or [] in `dtype`, dequantised float32 weight)."""
    amax = w.float().abs().max() if per_tensor else w.float().abs().amax(dim=1, keepdim=True)
    scale = (amax.clamp(min=1e-12) / 448).to(dtype)
    q = _fp8(w, scale.float())
    return q, scale, q.float() * scale.float()


def _int4(w: torch.Tensor, symmetric: bool, g_idx: torch.Tensor | None, scale_dtype: torch.dtype):
    """Round-to-nearest int4 per group: (q [K, N] 0..15, scales [G, N] `scale_dtype`, zeros [G, N] 0..15,
    dequantised float32 [N, K])."""
    n, k = w.shape
    g = g_idx.long() if g_idx is not None else torch.arange(k) // GROUP
    wt = w.float().t()
    scales = torch.empty(int(g.max()) + 1, n)
    zeros = torch.empty(scales.shape, dtype=torch.int64)
    for group in range(scales.shape[0]):
        cols = wt[g == group]
        lo, hi = cols.min(dim=0).values, cols.max(dim=0).values
        if symmetric:
            scales[group], zeros[group] = torch.maximum(lo.abs(), hi.abs()) / 7.5, 8
        else:
            scales[group] = (hi - lo) / 15
            zeros[group] = (-lo / scales[group].to(scale_dtype).float()).round().clamp(0, 15).long()
    scales = scales.clamp(min=1e-8).to(scale_dtype)
    q = (wt / scales.float()[g] + zeros[g]).round().clamp(0, 15).long()
    deq = ((q - zeros[g]).float() * scales.float()[g]).t()
    return q.to(torch.uint8), scales, zeros.to(torch.uint8), deq


def _act_order(k: int, seed: int) -> torch.Tensor:
    """A GPTQ desc_act g_idx: columns in a permuted order, groups of GROUP along it."""
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // GROUP).to(torch.int32)
    return g_idx


def quantize_tensor(fmt: str, name: str, w: torch.Tensor, input_amax: float | None = None
                    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One linear weight `name` (``....weight``) in `fmt`: (the release's tensors, dequantised float32 weight)."""
    base = name.removesuffix(".weight")
    if fmt == "fp8-block":
        q, scale, deq = _blocks(w, BLOCK)
        return {name: q, f"{name}_scale_inv": scale}, deq
    if fmt == "ct-fp8-block":
        q, scale, deq = _blocks(w, BLOCK)
        return {name: q, f"{base}.weight_scale": scale}, deq
    if fmt in ("fp8-tensor", "ct-fp8-channel", "fbgemm"):
        per_tensor = fmt == "fp8-tensor"
        q, scale, deq = _rows(w, torch.bfloat16 if fmt == "ct-fp8-channel" else torch.float32, per_tensor)
        out = {name: q, f"{base}.weight_scale": scale}
        if per_tensor:  # AutoFP8's static activation scale, from calibration
            out[f"{base}.input_scale"] = torch.tensor(input_amax / 448, dtype=torch.float32)
        return out, deq
    k = w.shape[1]
    # act order follows the input's Hessian: layers of one input (q/k/v, gate/up) share their g_idx, as GPTQ's do
    seed = sum(map(ord, re.sub(r"\.(q|k|v)_proj\.|\.(gate|up)_proj\.|\.(w1|w3)\.",
                              lambda m: "." + ("qkv" if m.group(1) else "gu") + ".", name)))
    if fmt == "ct-w4a16":
        g_idx = _act_order(k, seed)
        q, scales, zeros, deq = _int4(w, False, g_idx, torch.bfloat16)
        return {f"{base}.weight_packed": pack_nibbles(q.t(), 1), f"{base}.weight_scale": scales.t().contiguous(),
                f"{base}.weight_zero_point": pack_nibbles(zeros.t(), 0), f"{base}.weight_g_idx": g_idx,
                f"{base}.weight_shape": torch.tensor(list(w.shape), dtype=torch.int64)}, deq
    if fmt == "awq":
        q, scales, zeros, deq = _int4(w, False, None, torch.float16)
        return {f"{base}.qweight": pack_nibbles(q, 1, AWQ_ORDER), f"{base}.qzeros": pack_nibbles(zeros, 1, AWQ_ORDER),
                f"{base}.scales": scales}, deq
    if fmt == "gptq":
        g_idx = _act_order(k, seed)
        q, scales, zeros, deq = _int4(w, True, g_idx, torch.float16)
        return {f"{base}.qweight": pack_nibbles(q, 0), f"{base}.qzeros": pack_nibbles((zeros - 1) & 0xF, 1),
                f"{base}.scales": scales, f"{base}.g_idx": g_idx,
                f"{base}.bias": torch.zeros(w.shape[0], dtype=torch.float16)}, deq  # AutoGPTQ writes zero biases
    raise ValueError(f"unknown format {fmt!r}")


def quantization_config(fmt: str) -> dict | None:
    """The ``quantization_config`` the format's releases carry (None: GPTQ's quantize_config.json instead)."""
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "group_size": None,
           "actorder": None, "observer": "minmax"}
    ct = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
          "ignore": ["lm_head", "re:.*mlp.gate$"], "kv_cache_scheme": None, "global_compression_ratio": 1.5}
    if fmt == "fp8-block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
    if fmt == "fp8-tensor":
        return {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}
    if fmt == "ct-fp8-channel":
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}
        return {**ct, "config_groups": {"group_0": {"targets": ["Linear"], "output_activations": None,
                                                    "weights": {**fp8, "strategy": "channel"},
                                                    "input_activations": acts}}}
    if fmt == "ct-fp8-block":
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "group",
                "group_size": BLOCK[1]}
        return {**ct, "config_groups": {"group_0": {"targets": ["Linear"], "output_activations": None,
                                                    "weights": {**fp8, "strategy": "block",
                                                                "block_structure": list(BLOCK)},
                                                    "input_activations": acts}}}
    if fmt == "fbgemm":
        return {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]}
    if fmt == "ct-w4a16":
        weights = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": GROUP,
                   "dynamic": False, "actorder": "group", "observer": "minmax"}
        return {**ct, "format": "pack-quantized", "config_groups": {"group_0": {
            "targets": ["Linear"], "weights": weights, "input_activations": None, "output_activations": None}}}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": None}
    return None


GPTQ_SIDE_FILE = {"bits": 4, "group_size": GROUP, "damp_percent": 0.01, "desc_act": True, "static_groups": False,
                  "sym": True, "true_sequential": True, "model_name_or_path": None, "model_file_base_name": "model"}


def calibrate(model, prompts: list[list[int]]) -> dict[str, float]:
    """The largest |input| each linear module of `model` sees over `prompts` (static activation scales)."""
    amax: dict[str, float] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            def hook(mod, args, name=name):
                amax[name] = max(amax.get(name, 0.0), float(args[0].abs().max()))
            hooks.append(module.register_forward_pre_hook(hook))
    with torch.no_grad():
        for ids in prompts:
            model(torch.tensor([ids]), use_cache=False)
    for h in hooks:
        h.remove()
    return amax


def write_quantized(src: Path, out: Path, twin: Path, fmt: str, input_amax: dict[str, float] | None = None,
                    experts: bool = True) -> int:
    """Write `src` in format `fmt` to `out` and its dequantised twin to `twin` (module docstring); MoE experts
    (routed and shared) are quantised too unless `experts` is False. Returns the number of weights quantised."""
    for d in (out, twin):
        shutil.copytree(src, d)
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    stored = set(index["weight_map"])
    count = 0
    for file in sorted(set(index["weight_map"].values())):
        tensors = load_file(str(src / file))
        quant, deq = {}, {}
        for name, w in tensors.items():
            is_expert = ".experts." in name or ".shared_experts." in name
            if not _LINEAR.search(name) or (is_expert and not experts):
                quant[name] = deq[name] = w
                continue
            amax = (input_amax or {}).get(name.removesuffix(".weight"), 1.0)
            parts, values = quantize_tensor(fmt, name, w, amax)
            parts = {k: v for k, v in parts.items() if k == name or k not in stored}  # a real bias is kept
            quant.update(parts)
            deq[name] = values.to(w.dtype)
            del index["weight_map"][name]
            index["weight_map"].update(dict.fromkeys(parts, file))
            count += 1
        save_file(quant, str(out / file), metadata={"format": "pt"})
        save_file(deq, str(twin / file), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index, indent=2))
    cfg = json.loads((out / "config.json").read_text())
    quant_cfg = quantization_config(fmt)
    if quant_cfg is None:
        (out / "quantize_config.json").write_text(json.dumps(GPTQ_SIDE_FILE, indent=2))
    else:
        cfg["quantization_config"] = quant_cfg
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return count


def checkpoint_tensor_bytes(folder: Path) -> int:
    """Bytes of every tensor in the folder's safetensors files."""
    total = 0
    for file in folder.glob("*.safetensors"):
        total += sum(t.numel() * t.element_size() for t in load_file(str(file)).values())
    return total
