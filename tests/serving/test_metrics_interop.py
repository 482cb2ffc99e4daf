"""Metrics interop: a real mixed worker on the embedded model exports vLLM's metric names (what llm-d's
endpoint picker, KEDA and vLLM's dashboards read) with the same values as its ``pd:`` names, every
series labelled ``model_name``."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import openai
import pytest

from pd_cluster.bench import prom
from pd_cluster.launch.cluster import free_port

MODEL = "stories260K"
TWINS = {  # pd: sample -> vllm: sample (same labels but the model_name they both carry)
    "pd:num_running_reqs": "vllm:num_requests_running",
    "pd:num_queue_reqs": "vllm:num_requests_waiting",
    "pd:token_usage": "vllm:kv_cache_usage_perc",
    "pd:prompt_tokens_total": "vllm:prompt_tokens_total",
    "pd:generation_tokens_total": "vllm:generation_tokens_total",
    "pd:prefix_cache_queries_total": "vllm:prefix_cache_queries_total",
    "pd:prefix_cache_hits_total": "vllm:prefix_cache_hits_total",
    "pd:request_success_total": "vllm:request_success_total",
    "pd:time_to_first_token_seconds_count": "vllm:time_to_first_token_seconds_count",
    "pd:time_to_first_token_seconds_sum": "vllm:time_to_first_token_seconds_sum",
    "pd:e2e_request_latency_seconds_count": "vllm:e2e_request_latency_seconds_count",
    "pd:e2e_request_latency_seconds_bucket": "vllm:e2e_request_latency_seconds_bucket",
    "pd:inter_token_latency_seconds_count": "vllm:inter_token_latency_seconds_count",
    "pd:num_retracted_reqs_total": "vllm:num_preemptions_total",
    "pd:request_queue_time_seconds_count": "vllm:request_queue_time_seconds_count",
}


@pytest.fixture(scope="module")
def worker():
    yield from _mixed_worker(["--kv-cache-memory", "64MiB"])


@pytest.fixture(scope="module")
def hicache_worker():
    """A device pool of 24 pages of 16 tokens (two requests of `_host_tier_prompts`), a host tier of 4x that."""
    yield from _mixed_worker(["--page-size", "16", "--num-pages", "24", "--enable-hierarchical-cache",
                              "--hicache-ratio", "4"])


def _mixed_worker(extra: list[str]):
    port = free_port()
    cmd = [sys.executable, "-m", "pd_cluster.launch.worker", "--role", "mixed", "--port", str(port),
           "--cpu-threads", "1", "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"worker exited: {proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("worker not healthy within 120 s")
            time.sleep(0.2)
        yield url
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _by_name(scrape: prom.Scrape, name: str) -> dict[tuple, float]:
    return {labels: v for (n, labels), v in scrape.items() if n == name}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_vllm_names_carry_the_pd_values_with_model_name(worker):
    client = openai.OpenAI(base_url=worker + "/v1", api_key="none", max_retries=0, timeout=60)
    for prompt in ("Once upon a time", "The little dog ran to the park and"):
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
        assert out.usage.completion_tokens >= 1
    scrape = prom.parse(httpx.get(worker + "/metrics", timeout=10).text)
    for pd_name, vllm_name in TWINS.items():
        pd_vals, vllm_vals = _by_name(scrape, pd_name), _by_name(scrape, vllm_name)
        assert pd_vals, pd_name
        assert vllm_vals == pd_vals, (pd_name, vllm_name)
        for labels in pd_vals:
            assert dict(labels)["model_name"] == MODEL, (pd_name, labels)
    prompt_tokens = _by_name(scrape, "vllm:prompt_tokens_total")
    assert list(prompt_tokens.values())[0] >= 8  # the two prompts were counted, not zeros
    assert sum(_by_name(scrape, "vllm:request_success_total").values()) == 2
    assert list(_by_name(scrape, "vllm:e2e_request_latency_seconds_count").values()) == [2.0]
    itl = _by_name(scrape, "vllm:inter_token_latency_seconds_count")
    assert list(itl.values())[0] >= 2 and _by_name(scrape, "vllm:time_per_output_token_seconds_count") == itl
    assert _by_name(scrape, "vllm:gpu_cache_usage_perc") == _by_name(scrape, "pd:token_usage")
    usage = list(_by_name(scrape, "vllm:kv_cache_usage_perc").values())[0]
    assert 0.0 <= usage <= 1.0


def test_busy_engine_gauges_and_prefix_cache_counters_in_both_names(monkeypatch):
    """In-process, mid-run: non-zero running requests and KV usage appear under both names; the
    prefix-cache counters follow the engine's ``stats.prefix_cache_{queries,hits}`` on a real hit."""
    from prometheus_client import CollectorRegistry, generate_latest

    from pd_cluster.engine.args import config_from_kwargs
    from pd_cluster.engine.llm_engine import LLMEngine
    from pd_cluster.engine.sampling.params import SamplingParams
    from pd_cluster.serving.metrics import PREFIX_CACHE_STATS, WorkerMetrics

    engine = LLMEngine(config_from_kwargs(page_size=16, num_pages=40))
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, "mixed")  # model_name from the engine at the first step
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    engine.add_request("a", list(range(3, 33)), params)
    engine.add_request("b", list(range(5, 45)), params)
    engine.step()
    queries_attr, hits_attr = PREFIX_CACHE_STATS
    metrics.on_step(engine)
    assert metrics.prefix_cache_counted is True
    # "c" shares a's first 30 prompt tokens: a's first full page (16 tokens) is a real prefix-cache hit
    engine.add_request("c", list(range(3, 33)) + [99, 98], params)
    engine.step()
    metrics.on_step(engine)
    scrape = prom.parse(generate_latest(registry).decode())
    label = (("model_name", engine.model_name),)
    assert engine.model_name == MODEL
    assert scrape[("pd:num_running_reqs", label)] == scrape[("vllm:num_requests_running", label)] == 3
    usage = engine.load()["token_usage"]
    assert 0 < usage < 1
    assert scrape[("pd:token_usage", label)] == scrape[("vllm:kv_cache_usage_perc", label)] == usage
    assert scrape[("pd:prompt_tokens_total", label)] == scrape[("vllm:prompt_tokens_total", label)] == 70 + 32 - 16
    q = scrape[("vllm:prefix_cache_queries_total", label)]
    h = scrape[("vllm:prefix_cache_hits_total", label)]
    assert (q, h) == (scrape[("pd:prefix_cache_queries_total", label)], scrape[("pd:prefix_cache_hits_total", label)])
    assert (q, h) == (30 + 40 + 32, 16) == (getattr(engine.stats, queries_attr), getattr(engine.stats, hits_attr))


def _host_tier_prompts() -> list[list[int]]:
    """Four 170-token prompts with distinct 160-token prefixes, then the first prefix with a new tail."""
    prefix = [[1] + [(i * 37 + 101 * k) % 500 + 3 for i in range(159)] for k in range(4)]
    tails = [[(i * 13 + 7 * k) % 500 + 3 for i in range(10)] for k in range(5)]
    return [prefix[k] + tails[k] for k in range(4)] + [prefix[0] + tails[4]]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_host_tier_hits_loads_and_spills_on_a_mixed_worker(worker, hicache_worker):
    """Over HTTP: later prompts push the first prefix out of the tiny device pool into the host tier; the
    last prompt loads it back. Outputs equal those of a worker whose pool holds everything; /metrics shows
    the host tier's loads, spills and hits under SGLang's HiCache names and vLLM's external_prefix_cache."""
    ref = openai.OpenAI(base_url=worker + "/v1", api_key="none", max_retries=0, timeout=60)
    hic = openai.OpenAI(base_url=hicache_worker + "/v1", api_key="none", max_retries=0, timeout=60)
    cached = []
    for prompt in _host_tier_prompts():
        want = ref.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
        got = hic.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
        assert got.choices[0].text == want.choices[0].text
        cached.append(got.usage.prompt_tokens_details.cached_tokens if got.usage.prompt_tokens_details else 0)
    assert cached[-1] == 160  # the whole first prefix, loaded back from the host
    scrape = prom.parse(httpx.get(hicache_worker + "/metrics", timeout=10).text)
    label = (("model_name", MODEL),)
    hits = scrape[("pd:external_prefix_cache_hits_total", label)]
    assert hits == scrape[("vllm:external_prefix_cache_hits_total", label)] == 160
    queries = scrape[("pd:external_prefix_cache_queries_total", label)]
    assert queries == scrape[("vllm:external_prefix_cache_queries_total", label)] == 5 * 170
    assert scrape[("pd:load_back_tokens_total", label)] == 160  # one load: the 10 pages of the first prefix
    backup = scrape[("pd:hicache_backup_tokens_total", label)]
    assert backup >= 160 and backup % 16 == 0
    assert scrape[("pd:evicted_tokens_total", label)] >= backup
    assert scrape[("pd:hicache_host_total_tokens", label)] == 4 * 24 * 16
    assert 0 < scrape[("pd:hicache_host_used_tokens", label)] <= backup
    assert scrape[("pd:prefix_cache_hits_total", label)] + hits == sum(cached)
    # The worker without the flag has the families at 0 (no host tier was built).
    plain = prom.parse(httpx.get(worker + "/metrics", timeout=10).text)
    assert plain[("pd:hicache_host_total_tokens", label)] == plain[("pd:load_back_tokens_total", label)] == 0
