"""Acceptance: a tiny Llama 3 checkpoint (transformers' `save_pretrained`: real tensor names; llama3 RoPE
scaling, GQA) quantised into every dense format as released (`quant_checkpoints.FORMATS`: FP8 in blocks, per
tensor with calibrated static activation scales, per channel, compressed-tensors blocks, fbgemm; int4
compressed-tensors W4A16 with act order and zero points, AWQ, GPTQ from quantize_config.json with act order),
beside its dequantised twin:

* the engine keeps every attention and MLP layer quantised and gives exactly the same greedy tokens on the
  quantised checkpoint as on the twin, and as transformers' full-recompute loop on the twin (5 prompts x 24
  tokens; the CPU path is weight-only, `docs/quantization.md`);
* the engine's own memory report (`LoadedModel.weights_nbytes`, in the start-up log) is within 10% of the
  checkpoint's tensor bytes, and so are the quantised layers' bytes against the checkpoint's quantised tensors.

The same for a tiny Qwen3-MoE in FP8 blocks: its dense layers stay `QuantLinear`, its routed experts FP8 blocks in
the fused MoE's weights (`tests/engine/test_quantized_experts.py`). DeepSeek-V3's FP8 release:
`tests/engine/test_fp8_weights.py`.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from quant_checkpoints import FORMATS, calibrate, checkpoint_tensor_bytes, write_quantized
from random_models import build, hf_greedy_full, prompt_ids
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from pd_cluster.engine import LLM, SamplingParams
from pd_cluster.engine.quant.linear import QuantLinear

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
LLAMA = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # q 64, k/v 32 rows: whole 16-row blocks
QUANT_SUFFIXES = ("weight_scale_inv", "weight_scale", "input_scale", "qweight", "qzeros", "scales", "g_idx",
                  "weight_packed", "weight_zero_point", "weight_g_idx", "weight_shape")


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama3-quant")
    hf = build("llama3-rope-scaling", root / "src", **LLAMA)
    prompts = prompt_ids(5)
    amax = {f"model.{k}": v for k, v in calibrate(hf, prompts).items() if k.startswith("layers.")}
    for fmt in FORMATS:
        assert write_quantized(root / "src", root / fmt, root / f"{fmt}-twin", fmt, amax) == 3 * 7  # 3 layers x 7
    return root, prompts


def _quant_bytes_in_checkpoint(folder) -> int:
    total = 0
    for file in folder.glob("*.safetensors"):
        for name, t in load_file(str(file)).items():
            if name.rpartition(".")[2] in QUANT_SUFFIXES or t.dtype == torch.float8_e4m3fn:
                total += t.numel() * t.element_size()
    return total


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_format_equals_its_dequantised_twin_and_transformers(fmt, llama3, caplog):
    root, prompts = llama3
    with caplog.at_level(logging.INFO, logger="pd_cluster.engine.model.loader"):
        llm = LLM(str(root / fmt), kv_cache_dtype="fp32", page_size=16, chunked_prefill_size=7)
    model = llm.engine.loaded.model
    quant = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(quant) == 3 * 4 and all(not isinstance(layer.mlp.down_proj, torch.nn.Linear) for layer in model.layers)
    got = [list(o.token_ids) for o in llm.generate(prompts, GREEDY)]
    twin = LLM(str(root / f"{fmt}-twin"), kv_cache_dtype="fp32", page_size=16, chunked_prefill_size=7)
    assert got == [list(o.token_ids) for o in twin.generate(prompts, GREEDY)]
    hf = AutoModelForCausalLM.from_pretrained(root / f"{fmt}-twin").eval()
    assert got == [hf_greedy_full(hf, ids, 24) for ids in prompts]
    # memory: the engine's report against the checkpoint's bytes, whole and for the quantised layers alone
    resident = llm.engine.loaded.weights_nbytes
    assert abs(resident / checkpoint_tensor_bytes(root / fmt) - 1) < 0.10
    held = sum(m.nbytes - (m.bias.numel() * 4 if m.bias is not None else 0) for m in quant)
    assert abs(held / _quant_bytes_in_checkpoint(root / fmt) - 1) < 0.10, (held, _quant_bytes_in_checkpoint(root / fmt))
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Load weight end."))
    assert f"weights={resident / 2**20:.2f} MiB" in line and "quantized: 12 layers" in line
    assert resident < 0.6 * twin.engine.loaded.weights_nbytes  # against the float32 twin


def test_qwen3_moe_dense_layers_and_experts_stay_fp8_in_blocks(tmp_path):
    build("qwen3-moe", tmp_path / "src", head_dim=16, num_attention_heads=4, num_key_value_heads=2)
    count = write_quantized(tmp_path / "src", tmp_path / "fp8", tmp_path / "twin", "fp8-block")
    assert count == 3 * 4 + 3 + 2 * 4 * 3  # attention, layer 1's dense MLP, 2 MoE layers x 4 experts x 3
    llm = LLM(str(tmp_path / "fp8"), kv_cache_dtype="fp32", page_size=16, chunked_prefill_size=7)
    quant = {n for n, m in llm.engine.loaded.model.named_modules() if isinstance(m, QuantLinear)}
    assert quant == {f"layers.{i}.self_attn.{p}" for i in range(3) for p in ("qkv_proj", "o_proj")} | {
        "layers.1.mlp.gate_up_proj", "layers.1.mlp.down_proj"}
    experts = [m for m in llm.engine.loaded.model.modules() if type(m).__name__ == "FusedExperts"]
    assert len(experts) == 2 and all(m.w13_weight.dtype == torch.float8_e4m3fn for m in experts)
    prompts = prompt_ids(5)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "twin").eval()
    assert [list(o.token_ids) for o in llm.generate(prompts, GREEDY)] == [hf_greedy_full(hf, p, 24) for p in prompts]


def test_refusals_name_the_file_and_the_module(llama3, tmp_path):
    root, _ = llama3
    gptq = tmp_path / "gptq-8bit"
    gptq.mkdir()
    for f in (root / "gptq").iterdir():
        (gptq / f.name).symlink_to(f)
    (gptq / "quantize_config.json").unlink()
    (gptq / "quantize_config.json").write_text(json.dumps({"bits": 8, "group_size": 32, "desc_act": True}))
    with pytest.raises(ValueError, match=rf"{gptq}/quantize_config.json: gptq bits=8 is not supported"):
        LLM(str(gptq))
    ignored = tmp_path / "fp8-ignored"
    ignored.mkdir()
    for f in (root / "fp8-block").iterdir():
        if f.name != "config.json":
            (ignored / f.name).symlink_to(f)
    cfg = json.loads((root / "fp8-block" / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"] = ["model.layers.1.mlp"]
    (ignored / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.(down|gate|up)_proj\.weight is stored quantised but "
                                         rf"{ignored}/config.json leaves model\.layers\.1\.mlp\.\w+ unquantised"):
        LLM(str(ignored))
