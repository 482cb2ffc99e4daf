"""Acceptance: `pd-serve` 1P1D, at TP 1 and TP 2, on two families added one file each: Gemma 3's multimodal class
(its language model: 5 sliding-window layers to 1 global, two RoPE bases; the vision tower's tensors unread)
and Qwen2-MoE (experts and a gated shared expert). The prefill worker pushes the KV over NIXL (at TP 2, every
rank its KV head's), and the real `openai` client gets transformers' full-recompute greedy tokens; an image
part in a chat message is refused with a 400 naming it; every page comes back on both sides."""

from __future__ import annotations

import httpx
import openai
import pytest
from cluster_util import running_pd_serve
from random_models import build, hf_greedy_full, long_prompt_ids
from reuse_util import counters
from test_moe_pd_serve import _wait_all_free

ENGINE = ["--kv-cache-dtype", "fp32", "--page-size", "16", "--chunked-prefill-size", "8"]
IMAGE = [{"type": "text", "text": "What is in it?"},
         {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("family, tp", [("gemma3-multimodal", 1), ("gemma3-multimodal", 2), ("qwen2-moe", 1),
                                        ("qwen2-moe", 2)])
def test_new_family_1p1d_over_nixl_equals_transformers(family, tp, tmp_path):
    model = tmp_path / family
    hf = build(family, model)
    prompts = long_prompt_ids(5)
    expected = [hf_greedy_full(hf, ids, 32) for ids in prompts]
    with running_pd_serve(tmp_path / "manifest.json", ["--model", str(model), *ENGINE, "--tp-size", str(tp)]) \
            as (url, manifest):
        workers = {w["role"]: w["url"] for w in manifest["workers"]}
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        for ids, want in zip(prompts, expected):
            r = client.completions.create(model=model.name, prompt=ids, max_tokens=32, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
            assert r.choices[0].model_dump()["token_ids"] == want, (family, tp, len(ids))
        pushed = counters(workers["prefill"])["pd:kv_transfer_bytes_total"]
        assert pushed == counters(workers["decode"])["pd:kv_transfer_received_bytes_total"] > 0
        bad = httpx.post(url + "/v1/chat/completions", timeout=30,
                         json={"model": model.name, "max_tokens": 4, "messages": [{"role": "user", "content": IMAGE}]})
        assert bad.status_code == 400, bad.text
        error = bad.json()["error"]
        assert error["param"] == "messages[0].content[1]" and "image_url input is not supported" in error["message"]
        loads = _wait_all_free(workers, timeout=10)
        assert all(v["num_free_pages"] == v["num_total_pages"] for v in loads.values()), loads
