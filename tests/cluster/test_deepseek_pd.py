"""Acceptance: `pd-serve` at 1P1D serves a tiny DeepSeek-V3 (MLA, q_lora_rank, YaRN with mscale; a dense layer then
a MoE layer: sigmoid routing with e_score_correction_bias, grouped top-k, routed_scaling_factor, a shared expert)
built with transformers: the prefill worker pushes latent pages over NIXL, and the real `openai` client gets transformers'
greedy tokens (full recompute) for every prompt; a repeated prompt's pages come from decode's own prefix cache
(latent pages are pages like any other); no page leaks on either side.

At TP 2 on both sides every decode rank receives the whole latent from the prefill rank of the same index (the
latent is the same on every rank; vLLM's NIXL connector and SGLang's disaggregation do the same): the bytes
received are the prompt pages times the page size times the TP size, and the tokens are still transformers'."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from cluster_util import FAST_ENGINE, running_cluster, wait_all_free
from deepseek_models import PROMPTS, build, hf_greedy_recompute
from reuse_util import counters

from pd_cluster.launch.cluster import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
MAX_TOKENS = 32
NAME = "deepseek-v3-tiny"
KEY = "test-internal-key"  # pd-serve's internal key, so the test may read the agents' info


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(router URL, manifest, the HF model) of a pd-serve 1P1D over the tiny DeepSeek-V3, fp32 latents."""
    model = tmp_path_factory.mktemp("dsv3")
    hf = build("deepseek-v3", model)
    manifest = tmp_path_factory.mktemp("pd") / "manifest.json"
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pd_cluster.launch.serve", "--port", str(port),
                             "--manifest", str(manifest), "--log-level", "warning", *FAST_ENGINE,
                             "--model", str(model), "--served-model-name", NAME, "--kv-cache-dtype", "fp32",
                             "--page-size", "16", "--chunked-prefill-size", "8", "--enable-overlap-schedule"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, "PD_INTERNAL_API_KEY": KEY})
    try:
        deadline = time.monotonic() + 240
        while not manifest.exists():
            assert proc.poll() is None, "pd-serve exited during start-up"
            assert time.monotonic() < deadline, "pd-serve not ready"
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}", json.loads(manifest.read_text()), hf
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(60)
    assert proc.returncode == 0


def test_1p1d_greedy_equals_transformers_over_latent_pages(served):
    url, manifest, hf = served
    workers = {w["role"]: w["url"] for w in manifest["workers"]}
    assert sorted(workers) == ["decode", "prefill"]
    info = httpx.get(workers["decode"] + "/kv_transfer/info", headers={"X-PD-Internal-Key": KEY}, timeout=10).json()
    layout = info["layout"]
    assert (layout["kv_format"], layout["num_kv_heads"], layout["head_dim"]) == ("mla", 1, 48)  # 32 + 16
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    before = counters(workers["decode"])
    prompt_pages = 0
    for prompt in PROMPTS + PROMPTS[:1]:  # the repeat: decode's prefix cache holds its full pages
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
        choice = r.choices[0].model_dump()
        ids = choice["prompt_token_ids"]
        assert choice["token_ids"] == hf_greedy_recompute(hf, ids, MAX_TOKENS), prompt
        prompt_pages += -(-len(ids) // 16)
    for role, worker in workers.items():  # no page leaks: every page free again (cached ones count as free)
        load = _idle_load(worker, 10)
        assert load["num_free_pages"] == load["num_total_pages"], (role, load)
    after = counters(workers["decode"])
    pushed = counters(workers["prefill"])["pd:kv_transfer_bytes_total"]
    received = after["pd:kv_transfer_received_bytes_total"] - before.get("pd:kv_transfer_received_bytes_total", 0)
    saved = after.get("pd:kv_transfer_saved_bytes_total", 0.0) - before.get("pd:kv_transfer_saved_bytes_total", 0)
    assert saved > 0 and pushed == received > 0
    assert received + saved == prompt_pages * layout["page_nbytes"]  # 2 layers x 16 tokens x 48 x 4 B a page


def _idle_load(url: str, timeout: float) -> dict:
    """The worker's /get_load once nothing runs or waits (or after `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        load = httpx.get(url + "/get_load", timeout=5).json()
        idle = load["num_running_reqs"] == 0 and load["num_queue_reqs"] == 0 and \
            load["num_free_pages"] == load["num_total_pages"]
        if idle or time.monotonic() > deadline:
            return load
        time.sleep(0.05)


def test_tp2_1p1d_every_decode_rank_receives_the_whole_latent(tmp_path):
    hf = build("deepseek-v3", tmp_path)
    argv = ["--model", str(tmp_path), "--served-model-name", NAME, "--kv-cache-dtype", "fp32", "--page-size", "16",
            "--chunked-prefill-size", "8", "--tp-size", "2", "--disable-radix-cache"]
    with running_cluster(1, 1, engine_argv=argv) as cluster:
        client = openai.OpenAI(base_url=cluster.router_url + "/v1", api_key="x", max_retries=0)
        prompt_pages = 0
        for prompt in PROMPTS[:3]:
            r = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0,
                                          extra_body={"return_token_ids": True, "ignore_eos": True})
            choice = r.choices[0].model_dump()
            assert choice["token_ids"] == hf_greedy_recompute(hf, choice["prompt_token_ids"], 16), prompt
            prompt_pages += -(-len(choice["prompt_token_ids"]) // 16)
        loads = wait_all_free(cluster, 10)
        assert all(v["num_free_pages"] == v["num_total_pages"] for v in loads.values()), loads
        by_role = {p.role: counters(p.url) for p in cluster.procs if p.role in ("prefill", "decode")}
    page_nbytes = 2 * 16 * 48 * 4  # layers x page size x (kv_lora_rank + qk_rope_head_dim) x fp32: the whole latent
    received = by_role["decode"]["pd:kv_transfer_received_bytes_total"]
    assert by_role["prefill"]["pd:kv_transfer_bytes_total"] == received == prompt_pages * page_nbytes * 2
