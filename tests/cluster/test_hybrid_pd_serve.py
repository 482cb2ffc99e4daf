"""Acceptance: `pd-serve` 1P1D on tiny random hybrid-attention checkpoints written by transformers: Gemma 3 (5
sliding-window layers to 1 global, two RoPE bases) and a Llama4ForConditionalGeneration checkpoint (its language
model: chunked local attention, NoPE global layers, MoE; the vision tower's tensors are left unread). The prefill
worker pushes every layer's pages over NIXL (a window is a mask: every layer keeps every page), and the real
`openai` client gets transformers' full-recompute greedy tokens for prompts longer than the 16-token windows and
chunks; every page comes back on both sides. An image part in a chat message is refused with a 400 naming it."""

from __future__ import annotations

import httpx
import openai
import pytest
from cluster_util import running_pd_serve
from random_models import build, hf_greedy_full, long_prompt_ids
from reuse_util import counters
from test_moe_pd_serve import _wait_all_free

ENGINE = ["--kv-cache-dtype", "fp32", "--page-size", "16", "--chunked-prefill-size", "8"]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", ["gemma3", "llama4-multimodal"])
def test_hybrid_1p1d_over_nixl_equals_transformers(family, tmp_path):
    model = tmp_path / family
    hf = build(family, model)
    prompts = long_prompt_ids(5)
    expected = [hf_greedy_full(hf, ids, 32) for ids in prompts]
    with running_pd_serve(tmp_path / "manifest.json", ["--model", str(model), *ENGINE]) as (url, manifest):
        assert sorted(w["role"] for w in manifest["workers"]) == ["decode", "prefill"]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        for ids, want in zip(prompts, expected):
            r = client.completions.create(model=model.name, prompt=ids, max_tokens=32, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
            assert r.choices[0].model_dump()["token_ids"] == want, (family, len(ids))
        image = [{"type": "text", "text": "What is in it?"},
                 {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]
        bad = httpx.post(url + "/v1/chat/completions", timeout=30,
                         json={"model": model.name, "max_tokens": 4, "messages": [{"role": "user", "content": image}]})
        assert bad.status_code == 400, bad.text
        error = bad.json()["error"]
        assert error["param"] == "messages[0].content[1]" and "image_url input is not supported" in error["message"]
        workers = {w["role"]: w["url"] for w in manifest["workers"]}
        loads = _wait_all_free(workers, timeout=10)
        assert all(v["num_free_pages"] == v["num_total_pages"] for v in loads.values()), loads
        pushed = counters(workers["prefill"])["pd:kv_transfer_bytes_total"]
        received = counters(workers["decode"])["pd:kv_transfer_received_bytes_total"]
        layers = len(hf.config.get_text_config().layer_types)
        page_nbytes = layers * 2 * 2 * 16 * 16 * 4  # every layer's K and V: 2 KV heads x 16 tokens x 16 x fp32
        assert pushed == received == sum(-(-len(ids) // 16) for ids in prompts) * page_nbytes
