"""Acceptance: a decode worker with data-parallel attention through `pd-serve` (``--decode-arg=--tp-size=2
--decode-arg=--dp-size=2 --decode-arg=--enable-dp-attention --decode-arg=--enable-expert-parallel``) serves a tiny
DeepSeek-V3 (MLA + MoE, built by transformers, fp32 latents; EPLB on: two redundant experts, rebalanced every two
steps) pushed by a TP-1 prefill: concurrent requests spread
over both DP ranks (one pinned by ``data_parallel_rank``) give transformers' greedy tokens; the prefill pushed each
request's pages into its rank's pool only (the bytes it pushed are the bytes the two ranks received); the ranks
stepped in lockstep; every page is free again on every rank and on the prefill; bad settings fail at start-up
naming the flag."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from cluster_util import FAST_ENGINE, running_pd_serve
from deepseek_models import PROMPTS, build, hf_greedy_recompute
from prometheus_client.parser import text_string_to_metric_families
from reuse_util import counters

from pd_cluster.launch.cluster import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MAX_TOKENS = 12
ENGINE = ["--kv-cache-dtype", "fp32", "--page-size", "16", "--chunked-prefill-size", "8"]
DP_DECODE = ["--decode-arg=--tp-size=2", "--decode-arg=--dp-size=2", "--decode-arg=--enable-dp-attention",
             "--decode-arg=--enable-expert-parallel"]
# EPLB on the DeepSeek decode: 2 redundant experts, a rebalance every 2 steps while the requests decode
EPLB_DECODE = ["--decode-arg=--ep-num-redundant-experts=2", "--decode-arg=--enable-eplb",
               "--decode-arg=--eplb-rebalance-num-iterations=2"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(router URL, decode URL, every DP rank's URL, prefill URL, the HF model) of pd-serve 1P1D, the decode DP 2."""
    model = tmp_path_factory.mktemp("dsv3") / "deepseek-v3-tiny"
    hf = build("deepseek-v3", model)
    manifest = tmp_path_factory.mktemp("pd") / "manifest.json"
    with running_pd_serve(manifest, ["--model", str(model), *ENGINE, *DP_DECODE, *EPLB_DECODE]) as (url, m):
        workers = {w["role"]: w["url"] for w in m["workers"]}
        info = httpx.get(workers["decode"] + "/server_info", timeout=10).json()
        assert info["dp_size"] == 2 and info["dp_urls"][0] == workers["decode"]
        yield url, workers["decode"], info["dp_urls"], workers["prefill"], hf
    for rank_url in info["dp_urls"][1:]:  # the DP rank processes went with the instance
        with pytest.raises(httpx.ConnectError):
            httpx.get(rank_url + "/health", timeout=2)


def _complete(client, prompt: str, extra: dict | None = None) -> dict:
    r = client.completions.create(model="deepseek-v3-tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"return_token_ids": True, "ignore_eos": True, **(extra or {})})
    return r.choices[0].model_dump()


def _idle_loads(urls: dict[str, str], timeout: float) -> dict[str, dict]:
    """Each URL's /get_load once nothing runs or waits and every page is free (or after `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        loads = {k: httpx.get(u + "/get_load", timeout=5).json() for k, u in urls.items()}
        if all(v["num_running_reqs"] == 0 and v["num_queue_reqs"] == 0 and v["num_free_pages"] == v["num_total_pages"]
               for v in loads.values()) or time.monotonic() > deadline:
            return loads
        time.sleep(0.05)


def test_concurrent_requests_on_both_dp_ranks_equal_transformers(served):
    url, decode, rank_urls, prefill, hf = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    before = {r: counters(u).get("pd:kv_transfer_received_bytes_total", 0.0) for r, u in enumerate(rank_urls)}
    pushed_before = counters(prefill).get("pd:kv_transfer_bytes_total", 0.0)
    dispatched_before = [r["dispatched"] for r in httpx.get(decode + "/get_load", timeout=5).json()["dp_ranks"]]
    # the first request goes to rank 0 (no request in flight), the last is pinned to rank 1
    extras = [None, None, None, None, {"data_parallel_rank": 1}]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        choices = list(pool.map(lambda i: _complete(client, PROMPTS[i], extras[i]), range(len(PROMPTS))))
    for prompt, choice in zip(PROMPTS, choices):
        assert choice["token_ids"] == hf_greedy_recompute(hf, choice["prompt_token_ids"], MAX_TOKENS), prompt

    loads = _idle_loads({"decode": decode, "prefill": prefill, **{f"dp{r}": u for r, u in enumerate(rank_urls)}}, 10)
    for name, load in loads.items():  # no page leaks anywhere (cached pages count as free)
        assert load["num_free_pages"] == load["num_total_pages"], (name, load)
    ranks = loads["decode"]["dp_ranks"]
    dispatched = [r["dispatched"] - b for r, b in zip(ranks, dispatched_before)]
    assert sum(dispatched) == len(PROMPTS) and min(dispatched) >= 1, dispatched
    assert ranks[0]["num_steps"] == ranks[1]["num_steps"] > 0  # lockstep: every step of one rank is one of the other's
    assert loads["decode"]["num_total_pages"] == sum(r["num_total_pages"] for r in ranks)

    received = [counters(u).get("pd:kv_transfer_received_bytes_total", 0.0) - before[r]
                for r, u in enumerate(rank_urls)]
    pushed = counters(prefill)["pd:kv_transfer_bytes_total"] - pushed_before
    assert all(b > 0 for b in received) and pushed == sum(received), (pushed, received)  # each page to one rank
    # the instance's /metrics is every rank's, under dp_rank: rank 1's samples are its own server's
    merged = {s.labels.get("dp_rank"): s.value for fam in text_string_to_metric_families(
        httpx.get(decode + "/metrics", timeout=10).text) for s in fam.samples
        if s.name == "pd:kv_transfer_received_bytes_total"}
    assert merged == {"0": counters(rank_urls[0])["pd:kv_transfer_received_bytes_total"],
                      "1": counters(rank_urls[1])["pd:kv_transfer_received_bytes_total"]}, merged
    # EPLB: the experts moved between the ranks while the requests decoded (the tokens above stayed exact), both
    # ranks placed them alike, and their counts are the (token, choice) pairs of both ranks' tokens
    eplb = httpx.get(decode + "/expert_distribution", timeout=10).json()["dp_ranks"]
    assert [s["dp_rank"] for s in eplb] == [0, 1]
    assert all(s["enabled"] and s["rebalances"] >= 2 and s["experts_moved"] > 0 for s in eplb), eplb
    assert httpx.get(prefill + "/expert_distribution", timeout=10).json() == {"enabled": False}  # no EPLB there
    assert eplb[0]["layers"][0]["placement"] == eplb[1]["layers"][0]["placement"]
    assert sorted(set(eplb[0]["layers"][0]["placement"])) == [0, 1, 2, 3] and len(eplb[0]["layers"][0]["placement"]) == 6
    assert all(sum(s["layers"][0]["total_load"]) > 0 for s in eplb)


def test_data_parallel_rank_out_of_range_is_refused(served):
    url, *_ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as e:
        _complete(client, PROMPTS[0], {"data_parallel_rank": 2})
    assert "data_parallel_rank" in str(e.value)


@pytest.mark.parametrize("role_argv, message", [
    (["--decode-arg=--tp-size=2", "--decode-arg=--dp-size=3", "--decode-arg=--enable-dp-attention"],
     "--dp-size 3 must divide --tp-size 2"),
    (["--prefill-arg=--tp-size=2", "--prefill-arg=--dp-size=2", "--prefill-arg=--enable-dp-attention"],
     "--enable-dp-attention is built for decode workers"),
])
def test_bad_dp_settings_fail_at_start_up_naming_the_flag(tmp_path, role_argv, message):
    build("deepseek-v3", tmp_path / "m")
    proc = subprocess.run([sys.executable, "-m", "pd_cluster.launch.serve", "--port", str(free_port()), "--manifest",
                           str(tmp_path / "manifest.json"), "--log-level", "warning", *FAST_ENGINE, "--model",
                           str(tmp_path / "m"), *role_argv], capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0 and message in proc.stderr + proc.stdout
    assert not (tmp_path / "manifest.json").exists()


def test_qwen3_moe_tp2_prefill_into_dp_ranks(tmp_path):
    """GQA K/V pages from a TP-2 prefill: each DP rank (attention TP 1) receives every KV head, merged from both
    prefill ranks, for its own requests only; experts split by width (no expert parallelism). Then kill -9 of DP
    rank 1: the instance restarts whole and serves exactly again."""
    from random_models import build as build_random
    from random_models import hf_greedy_batch, prompt_ids

    model = tmp_path / "qwen3-moe-tiny"
    hf = build_random("qwen3-moe", model)
    prompts = prompt_ids(4)
    expected = hf_greedy_batch(hf, prompts, MAX_TOKENS)
    argv = ["--model", str(model), *ENGINE, "--prefill-arg=--tp-size=2", *DP_DECODE[:3]]
    with running_pd_serve(tmp_path / "manifest.json", argv) as (url, m):
        workers = {w["role"]: w["url"] for w in m["workers"]}
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        pins = [0, 1, None, None]
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda i: client.completions.create(
                model=model.name, prompt=prompts[i], max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"return_token_ids": True, "ignore_eos": True,
                            **({} if pins[i] is None else {"data_parallel_rank": pins[i]})}
            ).choices[0].model_dump()["token_ids"], range(len(prompts))))
        assert got == expected
        loads = _idle_loads(workers, 10)
        for name, load in loads.items():
            assert load["num_free_pages"] == load["num_total_pages"], (name, load)
        assert all(r["dispatched"] >= 1 for r in loads["decode"]["dp_ranks"])
        rank_urls = httpx.get(workers["decode"] + "/server_info", timeout=10).json()["dp_urls"]
        received = [counters(u)["pd:kv_transfer_received_bytes_total"] for u in rank_urls]
        assert counters(workers["prefill"])["pd:kv_transfer_bytes_total"] == sum(received) and min(received) > 0

        # kill -9 of DP rank 1: the instance goes down as a unit and pd-serve restarts it whole (new rank processes)
        pid = httpx.get(rank_urls[1] + "/server_info", timeout=10).json()["pid"]
        os.kill(pid, signal.SIGKILL)
        deadline, answer = time.monotonic() + 180, None
        while answer is None and time.monotonic() < deadline:
            time.sleep(1)
            try:
                answer = client.completions.create(model=model.name, prompt=prompts[0], max_tokens=MAX_TOKENS,
                                                   temperature=0, extra_body={"data_parallel_rank": 1,
                                                                              "return_token_ids": True,
                                                                              "ignore_eos": True})
            except openai.APIError:
                continue
        assert answer is not None and answer.choices[0].model_dump()["token_ids"] == expected[0]
        assert httpx.get(workers["decode"] + "/server_info", timeout=10).json()["dp_urls"] != rank_urls
