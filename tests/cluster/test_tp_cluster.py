"""Tensor parallelism in a PD cluster: every TP rank pushes its share of the KV heads to the same rank of
the decode worker, and the output equals a single process's; a layout the transfer cannot convert (a page size)
fails at the handshake."""

from __future__ import annotations

import httpx
import openai
import pytest
from cluster_util import PROMPTS, running_cluster, wait_all_free
from reuse_util import counters

from pd_cluster.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py: the fast tier starts none)

TP2_FP8 = ["--tp-size", "2", "--kv-cache-dtype", "fp8_e4m3", "--page-size", "16", "--chunked-prefill-size", "8"]


@pytest.mark.timeout(900)
def test_tp2_pd_equals_single_process():
    llm = LLM(kv_cache_dtype="fp8_e4m3", page_size=16)
    ref = llm.generate(PROMPTS, SamplingParams(max_tokens=30, temperature=0.0))
    page_nbytes = llm.engine.layout.page_nbytes  # all heads: each TP rank moves its half
    with running_cluster(1, 1, engine_argv=TP2_FP8) as cluster:
        info = httpx.get(next(p.url for p in cluster.procs if p.role == "decode") + "/kv_transfer/info").json()
        assert len(info["tp_peers"]) == 1  # rank 1's agent is announced with rank 0's
        client = openai.OpenAI(base_url=cluster.router_url + "/v1", api_key="x", max_retries=0)
        for prompt, r in zip(PROMPTS + PROMPTS[4:5], ref + ref[4:5]):  # the repeat: decode's cache spares pages
            out = client.completions.create(model="stories260K", prompt=prompt, max_tokens=30, temperature=0)
            assert out.choices[0].text == r.text, prompt
        loads = wait_all_free(cluster, 10)
        assert all(v["num_free_pages"] == v["num_total_pages"] for v in loads.values()), loads
        by_role = {p.role: counters(p.url) for p in cluster.procs if p.role in ("prefill", "decode")}
    # the served transfer counters add up every rank's agent: what prefill pushed is what decode received,
    # and with the pages decode's cache spared it is every prompt page of every request
    pushed = by_role["prefill"]["pd:kv_transfer_bytes_total"]
    received = by_role["decode"]["pd:kv_transfer_received_bytes_total"]
    saved = by_role["decode"].get("pd:kv_transfer_saved_bytes_total", 0.0)
    prompt_pages = sum(-(-len(r.prompt_token_ids) // 16) for r in ref + ref[4:5])
    assert saved > 0
    assert pushed == received and received + saved == prompt_pages * page_nbytes, (pushed, received, saved)


@pytest.mark.timeout(900)
def test_a_layout_that_cannot_be_converted_fails_at_the_handshake_with_both_values():
    """TP sizes are converted (tests/cluster/test_tp_hetero_pd.py); a page size is not: the handshake refuses it
    before any byte moves, naming both sides and both values, and no page is leaked."""
    with running_cluster(1, 1, role_argv={"prefill": ["--tp-size", "2", "--page-size", "32"]}) as cluster:
        r = httpx.post(cluster.router_url + "/v1/completions", timeout=60, json={
            "model": "stories260K", "prompt": "Once upon a time", "max_tokens": 5})
        assert r.status_code == 502, r.text
        message = r.json()["error"]["message"]
        assert "page_size" in message and "remote=32" in message and "(fatal)" in message, message
        assert "tp_size: local=" in message and "(converted)" in message, message  # says what it would convert
        assert "prefill-" in message and "decode-" in message, message
        loads = wait_all_free(cluster, 10)
        assert all(v["num_free_pages"] == v["num_total_pages"] for v in loads.values()), loads
