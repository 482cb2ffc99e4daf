"""Acceptance: `pd-serve` 1P1D on quantised checkpoints as released, kept quantised on both workers:

* a tiny Llama 3 whose dense layers are in DeepSeek/Qwen3-style FP8 blocks, and in GPTQ int4 with act order
  (described by quantize_config.json);
* the flagship MoE formats: a tiny gpt-oss with MXFP4 experts, and a tiny DeepSeek-V3 and Qwen3-MoE in FP8
  blocks (every projection, routed experts included; `quant_models`).

The prefill worker pushes the prompt's KV over NIXL, and the real `openai` client gets transformers' greedy tokens
on the dequantised twin; every page comes back on both sides."""

from __future__ import annotations

import pytest
from cluster_util import greedy_token_ids, running_pd_serve
from quant_checkpoints import write_quantized
from quant_models import deepseek_fp8, gpt_oss_mxfp4, qwen3_moe_fp8
from random_models import build, hf_greedy_full, prompt_ids
from reuse_util import counters
from test_moe_pd_serve import _wait_all_free
from transformers import AutoModelForCausalLM

ENGINE = ["--kv-cache-dtype", "fp32", "--page-size", "16", "--chunked-prefill-size", "8"]


def _serve_and_compare(model, prompts, expected, tmp_path, what) -> None:
    """Greedy completions of `prompts` through 1P1D equal `expected`; no page leaks; the KV went over NIXL."""
    with running_pd_serve(tmp_path / "manifest.json", ["--model", str(model), *ENGINE]) as (url, manifest):
        assert greedy_token_ids(url, model.name, prompts, 16) == expected, what
        workers = {w["role"]: w["url"] for w in manifest["workers"]}
        loads = _wait_all_free(workers, timeout=10)
        assert all(v["num_free_pages"] == v["num_total_pages"] for v in loads.values()), loads
        pushed = counters(workers["prefill"])["pd:kv_transfer_bytes_total"]
        assert pushed == counters(workers["decode"])["pd:kv_transfer_received_bytes_total"] > 0


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("fmt", ["fp8-block", "fp8-tensor", "ct-fp8-block", "ct-fp8-channel", "fbgemm", "ct-w4a16",
                                 "awq", "gptq"])
def test_quantised_1p1d_over_nixl_equals_transformers_on_the_twin(fmt, tmp_path):
    build("llama3-rope-scaling", tmp_path / "src", num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = tmp_path / f"llama3-{fmt}"
    write_quantized(tmp_path / "src", model, tmp_path / "twin", fmt)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "twin").eval()
    prompts = prompt_ids(3)
    _serve_and_compare(model, prompts, [hf_greedy_full(hf, ids, 16) for ids in prompts], tmp_path, fmt)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", ["gpt-oss", "deepseek-v3", "qwen3-moe"])
def test_1p1d_quantised_experts_equal_transformers_on_the_twin(family, tmp_path):
    build = {"gpt-oss": gpt_oss_mxfp4, "deepseek-v3": deepseek_fp8, "qwen3-moe": qwen3_moe_fp8}[family]
    path, _, prompts, hf_greedy = build(tmp_path / "model")
    _serve_and_compare(path, prompts, [hf_greedy(ids)[:16] for ids in prompts], tmp_path, family)
