"""Block-quantised FP8 weights (DeepSeek-V3's release format): the dense layers and the routed experts stay FP8,
``kv_b_proj`` is dequantised on load.

A tiny DeepSeek-V3 (MLA and MoE layers) is rewritten in that format by `deepseek_models.write_block_fp8`: every
attention, MLP, expert and shared-expert projection as ``float8_e4m3fn`` with a float32 ``weight_scale_inv`` per
32 x 32 block (the tiny shapes give partial blocks, e.g. kv_a_proj's 48 rows), the scales in another shard than
their weights. The engine keeps its attention projections (RoPE rows permuted inside their blocks), dense MLP and
shared experts in FP8 (`QuantLinear`) and its routed experts in FP8 blocks (the fused MoE's weights), and its
greedy tokens equal transformers' on the exactly dequantised weights.
"""

from __future__ import annotations

import json

import pytest
import torch
from deepseek_models import PROMPTS, build, hf_greedy_recompute, prompt_ids, write_block_fp8
from safetensors import safe_open
from transformers import DeepseekV3ForCausalLM

from pd_cluster.engine import LLM, SamplingParams
from pd_cluster.engine.model.loader import load_model
from pd_cluster.engine.quant.fp8 import dequantize_fp8
from pd_cluster.engine.quant.linear import QuantLinear

BLOCK = (32, 32)


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """(FP8 folder, transformers' model on the dequantised weights)."""
    root = tmp_path_factory.mktemp("fp8")
    build("deepseek-v3", root / "src")
    # 2 layers x 5 attention projections, the dense MLP's 3, 4 experts x 3 and the shared expert's 3
    assert write_block_fp8(root / "src", root / "fp8", root / "deq", BLOCK) == 2 * 5 + 3 + 4 * 3 + 3
    return root / "fp8", DeepseekV3ForCausalLM.from_pretrained(root / "deq").eval()


def test_dense_layers_and_experts_stay_fp8_and_the_rest_holds_the_dequantised_weights(fp8_checkpoint):
    path, _ = fp8_checkpoint
    loaded = load_model(str(path))
    model, ref = loaded.model, load_model(str(path.parent / "deq")).model
    quant = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    # per layer: q_a, q_b, kv_a_proj_with_mqa, o; layer 0's dense MLP, layer 1's shared expert (gate_up, down)
    assert sorted(n.split(".", 2)[2] for n in quant if n.startswith("layers.0.")) == [
        "mlp.down_proj", "mlp.gate_up_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.o_proj", "self_attn.q_a_proj",
        "self_attn.q_b_proj"]
    assert len(quant) == 12 and all(m.weight.dtype == torch.float8_e4m3fn for m in quant.values())
    ref_modules = dict(ref.named_modules())
    for name, m in quant.items():  # the twin's weights, RoPE rows permuted alike (rotate-half order)
        assert torch.equal(m.dequantized(), ref_modules[name].weight), name
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if ".mlp.experts." in name:
            continue  # the routed experts: FP8 with their block scales, below
        assert torch.equal(p, ref_params[name]), name  # norms, embeddings, router, kv_b_proj
    experts = model.layers[1].mlp.experts  # `tests/engine/test_quantized_experts.py`
    assert experts.w13_weight.dtype == torch.float8_e4m3fn
    assert torch.equal(experts.w13.dequantize(torch.float32), ref_params["layers.1.mlp.experts.w13_weight"])
    assert torch.equal(experts.w2.dequantize(torch.float32), ref_params["layers.1.mlp.experts.w2_weight"])
    assert loaded.weights_nbytes < load_model(str(path.parent / "deq")).weights_nbytes
    with safe_open(str(next(path.glob("*.safetensors"))), framework="pt") as f:
        assert any(f.get_slice(n).get_dtype() == "F8_E4M3" for n in f.keys())  # the files really are FP8
    w = quant["layers.0.mlp.down_proj"]
    assert torch.equal(w.dequantized(), dequantize_fp8(w.weight, w.weight_scale, BLOCK))


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
    with pytest.raises(ValueError, match=r"model\.layers\.\d+\..*proj\.weight is stored in FP8 but the checkpoint's "
                                         r"quantisation config does not describe its scales"):
        load_model(str(tmp_path))
