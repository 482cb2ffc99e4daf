"""Acceptance: `pd-serve` 1P1D serves the flagship MoE formats as released, kept quantised: a tiny gpt-oss with
MXFP4 experts and a tiny DeepSeek-V3 in FP8 blocks (every projection; `quant_models`). The prefill worker pushes
the prompt's KV over NIXL and the real `openai` client gets transformers' greedy tokens on the dequantised twin;
every page comes back on both sides."""

from __future__ import annotations

import openai
import pytest
from cluster_util import running_pd_serve
from reuse_util import counters
from test_moe_pd_serve import _wait_all_free
from quant_models import deepseek_fp8, gpt_oss_mxfp4

ENGINE = ["--kv-cache-dtype", "fp32", "--page-size", "16", "--chunked-prefill-size", "8"]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", ["gpt-oss", "deepseek-v3"])
def test_1p1d_quantised_experts_equal_transformers_on_the_twin(family, tmp_path):
    path, _, prompts, hf_greedy = (gpt_oss_mxfp4 if family == "gpt-oss" else deepseek_fp8)(tmp_path / "model")
    expected = [hf_greedy(ids)[:16] for ids in prompts]
    with running_pd_serve(tmp_path / "manifest.json", ["--model", str(path), *ENGINE]) as (url, manifest):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        for ids, want in zip(prompts, expected):
            r = client.completions.create(model=path.name, prompt=ids, max_tokens=16, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
            assert r.choices[0].model_dump()["token_ids"] == want, (family, ids)
        workers = {w["role"]: w["url"] for w in manifest["workers"]}
        loads = _wait_all_free(workers, timeout=10)
        assert all(v["num_free_pages"] == v["num_total_pages"] for v in loads.values()), loads
        pushed = counters(workers["prefill"])["pd:kv_transfer_bytes_total"]
        assert pushed == counters(workers["decode"])["pd:kv_transfer_received_bytes_total"] > 0
