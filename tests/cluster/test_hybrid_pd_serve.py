"""Acceptance: `pd-serve` 1P1D on tiny random hybrid-attention checkpoints written by transformers: Gemma 3 (5
sliding-window layers to 1 global, two RoPE bases) and a Llama4ForConditionalGeneration checkpoint (its language
model: chunked local attention, NoPE global layers, MoE; the vision tower's tensors are left unread). Both workers
keep KV cache groups: the prefill worker pushes over NIXL, per group, only the pages the decode reads (every page
of the global layers, the last window of the local ones), and the real `openai` client gets transformers'
full-recompute greedy tokens for prompts longer than the 16-token windows and chunks. The byte counters show the
saving: bytes pushed = bytes received = the needed pages' bytes, and the pages behind the windows are counted as
skipped. A second turn sharing a prompt's prefix is a delta transfer per group from the decode's own cache, with
the exact tokens. Every page comes back on both sides. An image part in a chat message is refused with a 400
naming it. Gemma 3 runs at TP 2 as well (every rank pushes its KV head's slots)."""

from __future__ import annotations

import httpx
import openai
import pytest
from cluster_util import running_pd_serve
from random_models import build, hf_greedy_batch, hf_greedy_full, long_prompt_ids
from reuse_util import counters, delta
from test_moe_pd_serve import _wait_all_free

from pd_cluster.engine.kv.groups import plan_kv_groups
from pd_cluster.engine.model.arch import ArchConfig

ENGINE = ["--kv-cache-dtype", "fp32", "--page-size", "16", "--chunked-prefill-size", "8"]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("family, tp", [("gemma3", 1), ("llama4-multimodal", 1), ("gemma3", 2)])
def test_hybrid_1p1d_over_nixl_equals_transformers(family, tp, tmp_path):
    model = tmp_path / family
    hf = build(family, model)
    prompts = long_prompt_ids(5)
    expected = hf_greedy_batch(hf, prompts, 32)
    argv = ["--model", str(model), *ENGINE, "--tp-size", str(tp)]
    with running_pd_serve(tmp_path / "manifest.json", argv) as (url, manifest):
        assert sorted(w["role"] for w in manifest["workers"]) == ["decode", "prefill"]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        workers = {w["role"]: w["url"] for w in manifest["workers"]}

        def complete(ids: list[int]) -> list[int]:
            r = client.completions.create(model=model.name, prompt=ids, max_tokens=32, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
            return r.choices[0].model_dump()["token_ids"]

        for ids, want in zip(prompts, expected):
            assert complete(ids) == want, (family, len(ids))
        groups = plan_kv_groups(ArchConfig.from_pretrained(model).layer_attention)
        n = groups.num_groups  # Gemma 3: 1 global and 5 sliding layers, one layer a page: 6 groups; Llama 4: 2
        assert n == (6 if family == "gemma3" else 2) and groups.frees_window_pages
        # K and V of 2 KV heads x 16 tokens x 16 x fp32 (at TP 2 each rank moves its head; the counters add the ranks)
        page_nbytes = groups.layers_per_page * 2 * 2 * 16 * 16 * 4
        assert httpx.get(workers["decode"] + "/server_info").json()["kv_groups"] == list(groups.signature())
        firsts = [groups.transfer_first_pages(len(ids), 16) for ids in prompts]
        assert all(f[0] == 0 and min(f[1:]) > 0 for f in firsts)  # the global group: every page; local: a window
        moved = sum(n * -(-len(ids) // 16) - sum(f) for ids, f in zip(prompts, firsts))
        pushed = counters(workers["prefill"])["pd:kv_transfer_bytes_total"]
        got = counters(workers["decode"])
        assert pushed == got["pd:kv_transfer_received_bytes_total"] == moved * page_nbytes
        assert got["pd:kv_transfer_window_skipped_bytes_total"] == sum(map(sum, firsts)) * page_nbytes
        # turn 2 shares prompt 4's 80 tokens (5 pages) with what the decode cached from turn 1
        before = got
        turn2 = prompts[4] + [7, 8, 9] * 10
        assert complete(turn2) == hf_greedy_full(hf, turn2, 32)
        d = delta(counters(workers["decode"]), before)
        # saved: the cached pages the decode reads (the global group's 5; the local groups read from page 5 on)
        saved = sum(max(5 - f, 0) for f in groups.decode_first_pages(len(turn2), 16))
        assert saved == 5 and d["pd:kv_transfer_saved_bytes_total"] == saved * page_nbytes
        f2 = groups.transfer_first_pages(len(turn2), 16, 5)
        assert d["pd:kv_transfer_received_bytes_total"] == (n * -(-len(turn2) // 16) - sum(f2)) * page_nbytes
        image = [{"type": "text", "text": "What is in it?"},
                 {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]
        bad = httpx.post(url + "/v1/chat/completions", timeout=30,
                         json={"model": model.name, "max_tokens": 4, "messages": [{"role": "user", "content": image}]})
        assert bad.status_code == 400, bad.text
        error = bad.json()["error"]
        assert error["param"] == "messages[0].content[1]" and "image_url input is not supported" in error["message"]
        loads = _wait_all_free(workers, timeout=10)
        assert all(v["num_free_pages"] == v["num_total_pages"] for v in loads.values()), loads
