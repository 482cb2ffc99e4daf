"""Quantised checkpoints of the families added one file each (`family_models.NEW_FAMILIES`): each tiny random
checkpoint written by transformers is quantised as released (`quant_checkpoints.write_quantized`) beside its
dequantised twin, and the engine

* builds every attention and dense or shared-expert MLP projection of the served language model as a
  `QuantLinear` (none left as a full-precision ``nn.Linear``; the router and Qwen2-MoE's one-row shared-expert
  gate are not quantised by the releases), routed experts dequantised on load;
* gives exactly the twin's greedy tokens (at TP 2: transformers' on the twin, and their logprobs).

FP8 in blocks for every family (experts too: Phi-3.5-MoE's ``w1``/``w3``/``w2``, Qwen2-MoE's and GLM-4-MoE's
``gate/up/down_proj``); GPTQ int4 for the families whose projections carry biases (the bias added to the
quantised layer's output, once after the all-reduce for o_proj and down_proj), with routed and GLM-4-MoE's shared
experts left unquantised as the int4 writer leaves them.
"""

from __future__ import annotations

import pytest
import torch
from family_models import NEW_FAMILIES
from quant_checkpoints import write_quantized
from random_models import build, hf_greedy_full, long_prompt_ids, prompt_ids
from torch import nn
from transformers import AutoModelForCausalLM

from pd_cluster.engine import LLM, SamplingParams
from pd_cluster.engine.quant.linear import QuantLinear

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
WINDOWED = ("gemma3-multimodal", "mistral3-multimodal", "ministral", "starcoder2", "exaone4")
WITH_BIASES = ("cohere", "glm4", "glm4-moe", "granite", "phimoe", "qwen2-moe", "starcoder2")
CASES = [(f, "fp8-block") for f in sorted(NEW_FAMILIES)] + [(f, "gptq") for f in WITH_BIASES]


@pytest.mark.parametrize("family,fmt", CASES)
def test_quantised_family_equals_its_dequantised_twin(family, fmt, tmp_path):
    build(family, tmp_path / "src")
    assert write_quantized(tmp_path / "src", tmp_path / fmt, tmp_path / "twin", fmt) > 0
    llm = LLM(str(tmp_path / fmt), kv_cache_dtype="fp32", page_size=16, chunked_prefill_size=7)
    model = llm.engine.loaded.model
    quant = [n for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    kept = ("shared_expert_gate",) + ((".shared_experts.",) if fmt == "gptq" else ())  # the writer's int4 skips
    plain = [n for n, m in model.named_modules()
             if isinstance(m, nn.Linear) and n.startswith("layers.") and not any(k in n for k in kept)]
    assert quant and not plain, plain
    assert all(f"layers.{i}.self_attn.o_proj" in quant for i in range(len(model.layers)))
    prompts = long_prompt_ids(3) if family in WINDOWED else prompt_ids(3)
    got = [list(o.token_ids) for o in llm.generate(prompts, GREEDY)]
    twin = LLM(str(tmp_path / "twin"), kv_cache_dtype="fp32", page_size=16, chunked_prefill_size=7)
    assert got == [list(o.token_ids) for o in twin.generate(prompts, GREEDY)]
    assert llm.engine.num_free_pages() == llm.engine.allocator.num_pages


# at TP 2 (two gloo ranks): StarCoder2 in GPTQ (biases on every projection, an ungated MLP whose up_proj is its
# own layer, down_proj's input columns cut on groups); Qwen2-MoE in FP8 blocks (q/k/v biases, FP8 experts
# dequantised then sliced, the quantised shared expert's rows cut on 16-row blocks: 4 heads of 16, experts and
# shared expert 64 wide, so that each rank's half keeps whole 32-column blocks)
TP_CASES = [("starcoder2", "gptq", {}), ("qwen2-moe", "fp8-block", dict(
    num_attention_heads=4, moe_intermediate_size=64, shared_expert_intermediate_size=64))]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("family,fmt,overrides", TP_CASES)
def test_quantised_family_at_tp2_equals_transformers_on_the_twin(family, fmt, overrides, tmp_path):
    build(family, tmp_path / "src", **overrides)
    write_quantized(tmp_path / "src", tmp_path / fmt, tmp_path / "twin", fmt)
    prompts = long_prompt_ids(3) if family in WINDOWED else prompt_ids(3)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "twin").eval()
    expected = [hf_greedy_full(hf, ids, 16) for ids in prompts]
    llm = LLM(str(tmp_path / fmt), tp_size=2, kv_cache_dtype="fp32", page_size=16, chunked_prefill_size=7)
    try:
        layer = llm.engine.loaded.model.layers[0]
        assert isinstance(layer.self_attn.o_proj, QuantLinear) and layer.self_attn.o_proj.bias is not None \
            if family == "starcoder2" else isinstance(layer.mlp.shared_experts.down_proj, QuantLinear)
        outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=1))
        for ids, want, out in zip(prompts, expected, outs):
            assert list(out.token_ids) == want
            with torch.no_grad():  # the chosen tokens' logprobs too: a bias added twice may keep the argmax
                logits = hf(torch.tensor([ids + want[:-1]])).logits[0, len(ids) - 1:].float()
            ref = logits.log_softmax(-1).gather(-1, torch.tensor(want)[:, None])[:, 0]
            got = torch.tensor([lp for lp, _ in out.outputs[0].logprobs])
            assert torch.allclose(got, ref, atol=1e-3), (got - ref).abs().max().item()
    finally:
        llm.engine.close()
