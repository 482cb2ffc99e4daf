"""``echo`` with ``max_tokens`` 0 scores the prompt and generates nothing: a mixed worker's generation counters do not
count the token its engine sampled and dropped (a real worker, in this process)."""

from __future__ import annotations

import time

import httpx
from worker_kit import running_worker

from pd_cluster.bench import prom

NAMES = ("vllm:generation_tokens_total", "vllm:request_generation_tokens_sum",
         "vllm:request_max_num_generation_tokens_sum", "vllm:request_success_total")


def test_echo_with_max_tokens_0_counts_no_generated_token():
    with running_worker() as w:
        scrape = lambda: prom.parse(httpx.get(w.url + "/metrics", timeout=10).text)  # noqa: E731
        before = scrape()
        echo = httpx.post(w.url + "/v1/completions", timeout=60, json={
            "prompt": "Once upon a time", "max_tokens": 0, "echo": True, "logprobs": 1}).json()
        assert echo["usage"]["completion_tokens"] == 0 and echo["choices"][0]["text"] == "Once upon a time"
        plain = httpx.post(w.url + "/v1/completions", timeout=60, json={
            "prompt": "The little dog", "max_tokens": 3, "temperature": 0, "ignore_eos": True}).json()
        assert plain["usage"]["completion_tokens"] == 3
        deadline = time.monotonic() + 10
        while True:  # the counters follow the engine's steps
            after = scrape()
            got = {n: prom.delta_sum(before, after, n) for n in NAMES}
            if got["vllm:request_success_total"] == 2 and got["vllm:generation_tokens_total"] >= 3 \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        time.sleep(0.3)
        got = {n: prom.delta_sum(before, scrape(), n) for n in NAMES}
        assert got == {"vllm:generation_tokens_total": 3, "vllm:request_generation_tokens_sum": 3,
                       "vllm:request_max_num_generation_tokens_sum": 3, "vllm:request_success_total": 2}
