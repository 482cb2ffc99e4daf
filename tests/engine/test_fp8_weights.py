"""Block-quantised FP8 weights (DeepSeek-V3's release format) are dequantised on load (the routed experts stay FP8).

A tiny DeepSeek-V3 (MLA and MoE layers) is rewritten in that format by `deepseek_models.write_block_fp8`: every
attention, MLP, expert and shared-expert projection as ``float8_e4m3fn`` with a float32 ``weight_scale_inv`` per
32 x 32 block (the tiny shapes give partial blocks, e.g. kv_a_proj's 48 rows), the scales in another shard than
their weights. The engine loads it and its greedy tokens equal transformers' on the exactly dequantised weights.
"""

from __future__ import annotations

import json

import pytest
import torch
from deepseek_models import PROMPTS, build, hf_greedy_recompute, prompt_ids, write_block_fp8
from safetensors import safe_open
from transformers import DeepseekV3ForCausalLM

from pd_cluster.engine import LLM, SamplingParams
from pd_cluster.engine.model.fp8_weights import dequantize_block_fp8
from pd_cluster.engine.model.loader import load_model

BLOCK = (32, 32)


def test_dequantize_matches_a_per_element_loop_with_partial_blocks():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(48, 70, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(2, 3, generator=g) + 0.5
    out = dequantize_block_fp8(w, scale_inv, BLOCK)
    want = torch.empty(48, 70)
    for i in range(48):
        for j in range(70):
            want[i, j] = w[i, j].float() * scale_inv[i // 32, j // 32]
    assert torch.equal(out, want)
    with pytest.raises(ValueError, match=r"does not tile a 48x70 weight in 32x32 blocks \(expected \(2, 3\)\)"):
        dequantize_block_fp8(w, scale_inv[:1], BLOCK)


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """(FP8 folder, transformers' model on the dequantised weights)."""
    root = tmp_path_factory.mktemp("fp8")
    build("deepseek-v3", root / "src")
    # 2 layers x 5 attention projections, the dense MLP's 3, 4 experts x 3 and the shared expert's 3
    assert write_block_fp8(root / "src", root / "fp8", root / "deq", BLOCK) == 2 * 5 + 3 + 4 * 3 + 3
    return root / "fp8", DeepseekV3ForCausalLM.from_pretrained(root / "deq").eval()


def test_the_engine_holds_the_dequantised_weights(fp8_checkpoint):
    """Every weight but the routed experts' is held dequantised; the experts stay FP8 with their block scales
    (`tests/engine/test_quantized_experts.py`), and dequantise to the same values."""
    path, _ = fp8_checkpoint
    model = load_model(str(path)).model
    ref = dict(load_model(str(path.parent / "deq")).model.named_parameters())
    for name, p in model.named_parameters():
        if ".mlp.experts." in name:
            continue
        assert torch.equal(p, ref[name]), name
    experts = model.layers[1].mlp.experts
    assert experts.w13_weight.dtype == torch.float8_e4m3fn
    assert torch.equal(experts.w13.dequantize(torch.float32), ref["layers.1.mlp.experts.w13_weight"])
    assert torch.equal(experts.w2.dequantize(torch.float32), ref["layers.1.mlp.experts.w2_weight"])
    with safe_open(str(next(path.glob("*.safetensors"))), framework="pt") as f:
        assert any(f.get_slice(n).get_dtype() == "F8_E4M3" for n in f.keys())  # the files really are FP8


def test_greedy_equals_transformers_on_the_dequantised_weights(fp8_checkpoint):
    path, hf = fp8_checkpoint
    llm = LLM(str(path), kv_cache_dtype="fp32", page_size=16)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy_recompute(hf, prompt_ids(prompt), 32), prompt


def test_fp8_values_without_their_block_scales_are_refused(fp8_checkpoint, tmp_path):
    path, _ = fp8_checkpoint
    cfg = json.loads((path / "config.json").read_text())
    del cfg["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for f in path.iterdir():
        if f.name != "config.json":
            (tmp_path / f.name).symlink_to(f)
    with pytest.raises(ValueError, match=r"model\.layers\.\d+\..*proj\.weight is stored in FP8 but the checkpoint "
                                         r"has no block scale for it"):
        load_model(str(tmp_path))
