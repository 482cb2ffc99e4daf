"""Tiny checkpoints in the quantised release formats of the MoE flagships, each with its dequantised twin.

* `write_mxfp4` rewrites a gpt-oss checkpoint (`random_models.build("gpt-oss")`) as openai/gpt-oss-20b/-120b
  are released: each layer's ``mlp.experts.gate_up_proj`` [E, H, 2 I] and ``down_proj`` [E, I, H] (``x @ W``
  form) become ``gate_up_proj_blocks`` [E, 2 I, H / 32, 16] / ``gate_up_proj_scales`` [E, 2 I, H / 32] and
  ``down_proj_blocks`` [E, H, I / 32, 16] / ``down_proj_scales`` [E, H, I / 32] (uint8: E2M1 pairs, E8M0), the
  biases stay, and ``config.json`` gets the release's ``quantization_config``.
* DeepSeek-V3 and Qwen3-MoE in block FP8: `deepseek_models.write_block_fp8` (every attention, dense and expert
  projection E4M3 with a float32 ``weight_scale_inv`` per block, as DeepSeek-V3 and Qwen3-*-FP8 ship).

The twin holds the exact dequantised values as an ordinary checkpoint (same names as the source): the engine
on the quantised folder must give the tokens it gives on the twin, and transformers' on the twin.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from pd_cluster.engine.quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4

FP8_BLOCK = (32, 32)  # partial blocks at these tiny shapes (kv_a_proj's 48 rows), whole ones in the experts

# openai/gpt-oss-20b's and -120b's config.json
GPT_OSS_QUANTIZATION = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                   "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}


def write_mxfp4(src: Path, q_dir: Path, twin_dir: Path) -> int:
    """Write gpt-oss checkpoint `src` with MXFP4 experts to `q_dir` and its dequantised twin to `twin_dir`.

    Returns:
        The number of expert tensors quantised (two per layer).
    """
    for out in (q_dir, twin_dir):
        shutil.copytree(src, out)
    index_path = q_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    count = 0
    for file in sorted(set(index["weight_map"].values())):
        tensors = load_file(str(src / file))
        quantised, twin = {}, {}
        for name, t in tensors.items():
            if not name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
                quantised[name] = twin[name] = t
                continue
            blocks, scales = quantize_mxfp4(t.transpose(1, 2).float())  # [E, N, K]: K, the input, in blocks
            quantised[name + "_blocks"], quantised[name + "_scales"] = blocks, scales
            twin[name] = dequantize_mxfp4(blocks, scales).transpose(1, 2).to(t.dtype).contiguous()
            del index["weight_map"][name]
            index["weight_map"].update({name + "_blocks": file, name + "_scales": file})
            count += 1
        save_file(quantised, str(q_dir / file), metadata={"format": "pt"})
        save_file(twin, str(twin_dir / file), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index, indent=2))
    cfg = json.loads((q_dir / "config.json").read_text())
    cfg["quantization_config"] = dict(GPT_OSS_QUANTIZATION)
    (q_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return count


def expert_tensor_bytes(folder: Path, skip: tuple[str, ...] = ()) -> int:
    """Bytes of the routed experts' tensors in a checkpoint folder (values, scales, zero points, g_idx, biases),
    but those whose names end with one of `skip`."""
    total = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if ".mlp.experts." in name and not name.endswith(skip or ("\0",)):
                    t = f.get_slice(name)
                    shape, dtype = t.get_shape(), t.get_dtype()
                    size = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "U8": 1, "I32": 4, "I64": 8}[dtype]
                    n = 1
                    for d in shape:
                        n *= d
                    total += n * size
    return total


def same_weights(a, b) -> bool:
    """Two torch modules hold equal parameters (names and values)."""
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


def gpt_oss_mxfp4(root: Path, intermediate_size: int = 64):
    """(MXFP4 folder, twin folder, prompts, transformers' greedy on the twin: ``ids -> 24 tokens``) of a tiny
    gpt-oss whose experts are `intermediate_size` wide (64: one block of 32 per rank at TP 2; 96: two blocks on
    rank 0, one and its padding on rank 1); prompts of 40 to 64 tokens (past its 16-token windows)."""
    import random_models
    from transformers import GptOssForCausalLM

    random_models.build("gpt-oss", root / "src", intermediate_size=intermediate_size)
    write_mxfp4(root / "src", root / "q", root / "twin")
    hf = GptOssForCausalLM.from_pretrained(root / "twin").eval()
    return (root / "q", root / "twin", random_models.long_prompt_ids(3),
            lambda ids: random_models.hf_greedy_full(hf, ids, 24))


def deepseek_fp8(root: Path, **overrides):
    """The same for a tiny DeepSeek-V3 in `FP8_BLOCK` blocks, experts 64 wide (`overrides`: config keys)."""
    import deepseek_models
    from transformers import DeepseekV3ForCausalLM

    deepseek_models.build("deepseek-v3", root / "src", **{"moe_intermediate_size": 64, **overrides})
    deepseek_models.write_block_fp8(root / "src", root / "q", root / "twin", FP8_BLOCK)
    hf = DeepseekV3ForCausalLM.from_pretrained(root / "twin").eval()
    return (root / "q", root / "twin", [deepseek_models.prompt_ids(p) for p in deepseek_models.PROMPTS[:3]],
            lambda ids: deepseek_models.hf_greedy_recompute(hf, ids, 24))


def qwen3_moe_fp8(root: Path, **overrides):
    """The same for a tiny Qwen3-MoE (Qwen3-30B-A3B-FP8's format) in `FP8_BLOCK` blocks, experts 64 wide (whole
    blocks per rank at TP 2; `overrides`: config keys); prompts of `random_models.prompt_ids`."""
    import deepseek_models
    import random_models
    from transformers import Qwen3MoeForCausalLM

    random_models.build("qwen3-moe", root / "src", **{"moe_intermediate_size": 64, **overrides})
    deepseek_models.write_block_fp8(root / "src", root / "q", root / "twin", FP8_BLOCK)
    hf = Qwen3MoeForCausalLM.from_pretrained(root / "twin").eval()
    return (root / "q", root / "twin", random_models.prompt_ids(3),
            lambda ids: random_models.hf_greedy_full(hf, ids, 24))
