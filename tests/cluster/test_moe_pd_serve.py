"""Acceptance: `pd-serve` 1P1D on a tiny random Qwen3-MoE checkpoint (written by transformers): the prefill
worker pushes the prompt's KV over NIXL and the decode worker's greedy tokens equal transformers' own
full-recompute greedy loop, through the real `openai` client; every page comes back on both sides."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from cluster_util import running_pd_serve
from random_models import build, hf_greedy_batch, prompt_ids
from reuse_util import counters

ENGINE = ["--kv-cache-dtype", "fp32", "--page-size", "16", "--chunked-prefill-size", "8"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_qwen3_moe_1p1d_over_nixl_equals_transformers(tmp_path):
    model = tmp_path / "qwen3-moe-tiny"
    hf = build("qwen3-moe", model)
    prompts = prompt_ids(5)
    expected = hf_greedy_batch(hf, prompts, 32)
    with running_pd_serve(tmp_path / "manifest.json", ["--model", str(model), *ENGINE]) as (url, manifest):
        assert sorted(w["role"] for w in manifest["workers"]) == ["decode", "prefill"]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        for ids, want in zip(prompts, expected):
            r = client.completions.create(model=model.name, prompt=ids, max_tokens=32, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
            assert r.choices[0].model_dump()["token_ids"] == want, ids
        workers = {w["role"]: w["url"] for w in manifest["workers"]}
        loads = _wait_all_free(workers, timeout=10)
        assert all(v["num_free_pages"] == v["num_total_pages"] for v in loads.values()), loads
        pushed = counters(workers["prefill"])["pd:kv_transfer_bytes_total"]
        received = counters(workers["decode"])["pd:kv_transfer_received_bytes_total"]
        assert pushed == received > 0  # the KV came over NIXL, not recomputed on decode


def _all_free(load: dict) -> bool:
    """Every page free: the KV pool's and, with a draft model (STANDALONE), the draft pool's."""
    return (load["num_free_pages"] == load["num_total_pages"]
            and load.get("draft_num_free_pages") == load.get("draft_num_total_pages"))


def _wait_all_free(workers: dict[str, str], timeout: float) -> dict[str, dict]:
    """Poll each worker's /get_load until every page is free, the draft pool's included (bounded by `timeout`);
    return the last loads."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=10) as c:
        while True:
            loads = {role: c.get(u + "/get_load").json() for role, u in workers.items()}
            if all(_all_free(v) for v in loads.values()) or time.monotonic() > deadline:
                return loads
            time.sleep(0.05)
