"""Acceptance: load leaves no trace, disconnects are cleaned up, bad input gets 4xx, PD equals colocated."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from cluster_util import PROMPTS, metric_value, running_cluster, wait_all_free, worker_loads

from pd_cluster.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py: the fast tier starts none)


@pytest.fixture(scope="module")
def pd(pd_1p1d):
    """The shared default 1P1D cluster (`tests/support/shared_clusters.py`): these tests only read from it."""
    return pd_1p1d


def _mixed_requests(n: int) -> list[tuple[str, int]]:
    return [(PROMPTS[i % len(PROMPTS)] + " " * (i % 3), 8 + (i * 37) % 120) for i in range(n)]


async def _stream_one(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> tuple[str, str | None]:
    stream = await client.completions.create(model="stories260K", prompt=prompt, max_tokens=max_tokens,
                                             temperature=0, stream=True)
    text, finish = [], None
    async for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
    return "".join(text), finish


@pytest.mark.timeout(900)
def test_64_concurrent_streams_complete_and_leave_no_trace(pd):
    reqs = _mixed_requests(64)
    decode = next(p for p in pd.procs if p.role == "decode")
    transfers_before = metric_value(httpx.get(decode.url + "/metrics", timeout=5).text,
                                    "pd:request_transfer_time_seconds_count")  # the cluster is shared: a delta
    llm = LLM()
    ref = llm.generate([p for p, _ in reqs], [SamplingParams(max_tokens=n, temperature=0.0) for _, n in reqs])

    async def run():
        client = openai.AsyncOpenAI(base_url=pd.router_url + "/v1", api_key="x", max_retries=0, timeout=300)
        return await asyncio.wait_for(asyncio.gather(*(_stream_one(client, p, n) for p, n in reqs)), 600)

    results = asyncio.run(run())
    for (text, finish), r, (p, n) in zip(results, ref, reqs):
        assert text == r.text, (p, n)
        assert finish == r.finish_reason
    loads = wait_all_free(pd, timeout=10)
    for name, load in loads.items():
        assert load["num_free_pages"] == load["num_total_pages"], name
    with httpx.Client(timeout=5) as c:
        for p in pd.procs:
            text = c.get(p.url + "/metrics").text
            assert metric_value(text, "pd:num_running_reqs") == 0
            assert metric_value(text, "pd:num_queue_reqs") == 0
        transfers = metric_value(c.get(decode.url + "/metrics").text, "pd:request_transfer_time_seconds_count")
        assert transfers - transfers_before >= 64
        prefill = next(p for p in pd.procs if p.role == "prefill")
        assert metric_value(c.get(prefill.url + "/metrics").text, "pd:kv_transfer_bytes_total") > 0


@pytest.mark.timeout(300)
def test_client_disconnect_frees_both_workers_within_2s(pd):
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", pd.router_url + "/v1/completions", json={
                "model": "stories260K", "prompt": "Once upon a time", "max_tokens": 500, "temperature": 0,
                "ignore_eos": True, "stream": True}) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: {") for line in got)
            busy = worker_loads(pd)
            assert any(v["num_running_reqs"] for v in busy.values())  # decoding when we hang up
        closed = time.monotonic()
    loads = wait_all_free(pd, timeout=2.0)
    assert time.monotonic() - closed <= 2.5
    for name, load in loads.items():
        assert load["num_running_reqs"] == 0 and load["num_free_pages"] == load["num_total_pages"], (name, load)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (json.dumps({"model": "stories260K", "prompt": "hi", "max_tokens": -5}).encode(), 400, "max_tokens"),
    (json.dumps({"model": "stories260K", "prompt": "x " * 600, "max_tokens": 10}).encode(), 400, "prompt"),
    (json.dumps({"model": "gpt-17", "prompt": "hi"}).encode(), 404, "model"),
    (json.dumps({"model": "stories260K", "prompt": "hi", "top_p": 3}).encode(), 400, "top_p"),
    (json.dumps({"model": "stories260K", "prompt": "hi", "stop": {"x": 1}}).encode(), 400, None),
])
def test_bad_input_gets_openai_4xx_and_servers_stay_healthy(pd, body, status, param):
    with httpx.Client(timeout=30) as c:
        r = c.post(pd.router_url + "/v1/completions", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["message"] and "type" in err
        if param is not None:
            assert err.get("param") == param or param in err["message"]
        for p in pd.procs + [pd.router]:
            assert c.get(p.url + "/health").status_code == 200
        ok = c.post(pd.router_url + "/v1/completions", json={"model": "stories260K", "prompt": "Once upon a time",
                                                               "max_tokens": 5, "temperature": 0})
        assert ok.status_code == 200
    assert all(v["num_free_pages"] == v["num_total_pages"] for v in wait_all_free(pd, 5).values())


@pytest.mark.timeout(900)
def test_pd_and_colocated_agree(pd):
    reqs = _mixed_requests(12)

    def run(url: str) -> list[str]:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        return [client.completions.create(model="stories260K", prompt=p, max_tokens=n, temperature=0).choices[0].text
                for p, n in reqs]

    pd_texts = run(pd.router_url)
    with running_cluster(colocated=True, num_workers=2) as colo:
        colo_texts = run(colo.router_url)
    assert pd_texts == colo_texts
