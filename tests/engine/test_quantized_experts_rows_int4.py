"""Routed experts kept quantised in the formats of most FP8 and int4 releases: FP8 per tensor (AutoFP8, static
activation scales), per channel (compressed-tensors FP8-dynamic, fbgemm_fp8) and int4 W4A16 (AWQ; GPTQ from
``quantize_config.json`` with act order; compressed-tensors ``pack-quantized``, asymmetric with ``g_idx``).

A tiny Qwen3-MoE written by transformers has every attention, dense, shared and routed expert projection
quantised as released (`quant_checkpoints.write_quantized`) beside its dequantised twin. The engine's greedy
tokens on the quantised folder equal its tokens on the twin and transformers' on the twin; its experts stay in
the format (FP8 values or int4 words) and the resident expert bytes from its memory report are within 10% of the
checkpoint's expert tensor bytes. TP 2 (two gloo ranks, each reading its rows of gate/up and columns of down):
slow tier.
"""

from __future__ import annotations

import pytest
import torch
import random_models
from quant_checkpoints import write_quantized
from quant_models import expert_tensor_bytes
from transformers import Qwen3MoeForCausalLM

from pd_cluster.engine import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
HELD = {"fp8-tensor": torch.float8_e4m3fn, "ct-fp8-channel": torch.float8_e4m3fn, "fbgemm": torch.float8_e4m3fn,
        "awq": torch.int32, "gptq": torch.int32, "ct-w4a16": torch.int32}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3moe")
    random_models.build("qwen3-moe", root / "src")
    hf = Qwen3MoeForCausalLM.from_pretrained(root / "src").eval()
    return root, hf


def _write(source, fmt):
    root, _ = source
    if not (root / fmt).exists():
        write_quantized(root / "src", root / fmt, root / f"{fmt}-twin", fmt)
    return root / fmt, root / f"{fmt}-twin"


def _generate(path, prompts, **kw):
    llm = LLM(str(path), kv_cache_dtype="fp32", page_size=16, **kw)
    try:
        outs = [list(o.token_ids) for o in llm.generate(prompts, GREEDY)]
        assert llm.engine.num_free_pages() == llm.engine.allocator.num_pages
        return outs, llm.engine.loaded
    finally:
        llm.engine.close()


@pytest.mark.parametrize("fmt", list(HELD))
def test_experts_equal_the_twin_and_stay_quantised(source, fmt):
    path, twin = _write(source, fmt)
    prompts = random_models.prompt_ids(3)
    got, loaded = _generate(path, prompts)
    want, _ = _generate(twin, prompts)
    assert got == want
    twin_hf = Qwen3MoeForCausalLM.from_pretrained(twin).eval()
    assert got == [random_models.hf_greedy_full(twin_hf, ids, 16) for ids in prompts]
    experts = [m for m in loaded.model.modules() if type(m).__name__ == "FusedExperts"]
    assert experts and all(m.w13_weight.dtype == HELD[fmt] for m in experts)
    ckpt = expert_tensor_bytes(path, (".bias",) if fmt == "gptq" else ())  # AutoGPTQ's zero biases: skipped
    assert abs(loaded.expert_nbytes - ckpt) <= 0.1 * ckpt, (loaded.expert_nbytes, ckpt)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("fmt", ["fbgemm", "ct-w4a16"])
def test_tp2_experts_equal_the_twin(fmt, tmp_path):
    """Experts 64 wide: each rank's 32 down columns are whole int4 groups of 32."""
    random_models.build("qwen3-moe", tmp_path / "src", moe_intermediate_size=64)
    write_quantized(tmp_path / "src", tmp_path / fmt, tmp_path / "twin", fmt)
    prompts = random_models.prompt_ids(2)
    got, _ = _generate(tmp_path / fmt, prompts, tp_size=2, chunked_prefill_size=7)
    want, _ = _generate(tmp_path / "twin", prompts)
    assert got == want
