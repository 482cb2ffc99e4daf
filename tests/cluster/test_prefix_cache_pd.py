"""The prefix cache through prefill/decode disaggregation, on real clusters of OS processes.

- 1P1D: a 5-turn conversation (each prompt is the previous prompt, its answer and a new question). Turn k's
  prefill computes only what the prefill worker's cache lacks: its ``vllm:prefix_cache_hits`` grow by exactly
  the previous prompt's full pages (the answer was decoded on the decode worker, so prefill never held it),
  the decode worker reports that count in OpenAI's ``usage.prompt_tokens_details.cached_tokens`` without
  counting it in its own prefix-cache counters, and every answer equals the cache-off greedy text.
  The decode worker still receives every prompt page (transfers are not yet limited to missing pages).
- 2P2D: the router's ``cache_aware`` prefill policy keeps conversations where their prefix is cached,
  measured by the prefill workers' own hit counters, against ``round_robin``.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from cluster_util import metric_value, running_cluster

from pd_cluster.engine.llm import LLM
from pd_cluster.engine.sampling.params import SamplingParams
from pd_cluster.transfer.prefill_api import PrefillResponse, PrefillTimings

PAGE = 16
MAX_TOKENS = 16
ENGINE = ["--page-size", str(PAGE)]
OPENING = "Once upon a time, there was a little girl named Lily. She liked to play in the park."
QUESTIONS = [" Then she saw a big dog.", " The dog wanted to play.", " Her mom called her home.",
             " At night she dreamed."]
OPENINGS = [OPENING, "Tom had a red truck and a blue ball. Every morning he drove the truck to the hill.",
            "A small bird lived in a tall tree near the river, and it sang a song every day."]


def _counters(url: str) -> tuple[float, float]:
    """(queries, hits) of a worker's prefix-cache counters, in tokens (vLLM's names)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return metric_value(text, "vllm:prefix_cache_queries_total"), metric_value(text, "vllm:prefix_cache_hits_total")


def _reference(openings: list[str], turns: int) -> tuple[list[list[str]], list[list[int]]]:
    """Offline greedy answers with the prefix cache off, and every turn's prompt length in tokens."""
    llm = LLM(page_size=PAGE, kv_cache_memory="64MiB", disable_radix_cache=True)
    answers, lengths = [], []
    for opening in openings:
        prompt, conv, lens = opening, [], []
        for k in range(turns):
            out = llm.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0]
            conv.append(out.outputs[0].text)
            ids = llm.engine.tokenize(prompt)
            if lens:  # the test's premise: the next prompt's tokens start with the previous prompt's
                assert ids[:len(prev)] == prev
            prev = ids
            lens.append(len(ids))
            prompt = prompt + conv[-1] + QUESTIONS[k % len(QUESTIONS)]
        answers.append(conv)
        lengths.append(lens)
    return answers, lengths


def _expected_hits(prev_len: int, prompt_len: int) -> int:
    """Prefill's cache holds the previous prompt's full pages; the engine never matches a prompt's last token."""
    return min(prev_len, prompt_len - 1) // PAGE * PAGE


def test_prefill_response_carries_cached_tokens():
    resp = PrefillResponse("r", 2, 1024, PrefillTimings(0.01, 0.02, 0.0), num_cached_tokens=48)
    assert PrefillResponse.from_dict(resp.to_dict()) == resp
    legacy = {k: v for k, v in resp.to_dict().items() if k != "num_cached_tokens"}
    assert PrefillResponse.from_dict(legacy).num_cached_tokens == 0
    with pytest.raises(ValueError):
        PrefillResponse.from_dict(dict(resp.to_dict(), num_cached_tokens=-1))


@pytest.mark.timeout(600)
def test_multi_turn_1p1d_prefill_computes_only_new_tokens():
    turns = 5
    answers, lengths = _reference([OPENING], turns)
    with running_cluster(1, 1, engine_argv=ENGINE) as cluster:
        prefill = next(p.url for p in cluster.procs if p.role == "prefill")
        decode = next(p.url for p in cluster.procs if p.role == "decode")
        client = openai.OpenAI(base_url=cluster.router_url + "/v1", api_key="x", timeout=60, max_retries=0)
        prompt = OPENING
        for k in range(turns):
            q0, h0 = _counters(prefill)
            out = client.completions.create(model="stories260K", prompt=prompt, max_tokens=MAX_TOKENS,
                                            temperature=0)
            q1, h1 = _counters(prefill)
            want = _expected_hits(lengths[0][k - 1], lengths[0][k]) if k else 0
            assert out.choices[0].text == answers[0][k], k
            assert out.usage.prompt_tokens == lengths[0][k]
            assert (q1 - q0, h1 - h0) == (lengths[0][k], want), k
            assert out.usage.prompt_tokens_details.cached_tokens == want, k
            last, prompt = prompt, prompt + out.choices[0].text + QUESTIONS[k % len(QUESTIONS)]
        assert want > 0
        # the last turn again, streamed: its whole prompt is cached but for the last token (the engine's cap)
        chunks = list(client.completions.create(model="stories260K", prompt=last, max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == answers[0][-1]
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (lengths[0][-1] - 1) // PAGE * PAGE
        assert _counters(decode)[1] == 0  # decode's own cache is off; prefill's hits are not counted twice


def _conversations_hits(policy: str, answers: list[list[str]], turns: int) -> tuple[float, float]:
    """Run the conversations interleaved (turn 1 of each, then turn 2, ...) on 2P2D under `policy`.

    Returns the prefill workers' summed (queries, hits) over the run, in tokens.
    """
    argv = ["--prefill-policy", policy, "--decode-policy", "round_robin"]
    with running_cluster(2, 2, engine_argv=ENGINE, router_argv=argv) as cluster:
        prefills = [p.url for p in cluster.procs if p.role == "prefill"]
        before = [_counters(u) for u in prefills]
        client = openai.OpenAI(base_url=cluster.router_url + "/v1", api_key="x", timeout=60, max_retries=0)
        prompts = list(OPENINGS)
        for k in range(turns):
            for c, prompt in enumerate(prompts):
                out = client.completions.create(model="stories260K", prompt=prompt, max_tokens=MAX_TOKENS,
                                                temperature=0)
                assert out.choices[0].text == answers[c][k], (policy, c, k)
                prompts[c] = prompt + out.choices[0].text + QUESTIONS[k % len(QUESTIONS)]
        after = [_counters(u) for u in prefills]
    return (sum(a[0] - b[0] for a, b in zip(after, before)), sum(a[1] - b[1] for a, b in zip(after, before)))


@pytest.mark.timeout(600)
def test_cache_aware_routing_lands_on_cached_prefixes_2p2d():
    """Three conversations (an odd count, so that round robin does not happen to send a conversation back
    to the same worker), three turns each; hits are the prefill workers' own counters."""
    turns = 3
    answers, lengths = _reference(OPENINGS, turns)
    ideal = sum(_expected_hits(lens[k - 1], lens[k]) for lens in lengths for k in range(1, turns))
    queries = sum(sum(lens) for lens in lengths)
    aware = _conversations_hits("cache_aware", answers, turns)
    robin = _conversations_hits("round_robin", answers, turns)
    print(f"prefill hit tokens: cache_aware {aware[1]:.0f}, round_robin {robin[1]:.0f}, ideal {ideal}, "
          f"of {queries} prompt tokens")
    assert aware[0] == robin[0] == queries
    assert aware[1] == ideal > 0  # every continuation found its prefix where it was prefilled
    assert robin[1] <= 0.5 * aware[1], (robin, aware)


def test_benchmark_lru_simulation_matches_the_engine():
    """The benchmark's offline LRU reference equals what the engine's own cache does on the same replay."""
    from pd_cluster.bench.scripts.prefix_cache import TRACE, load_trace, simulate

    reqs = load_trace(TRACE, 200, PAGE, 28, 1, seed=0)
    llm = LLM(page_size=PAGE, kv_cache_memory="32MiB")
    capacity = llm.engine.load()["num_total_pages"]
    for r in reqs:  # one at a time, as the simulation assumes; one output token, so nothing but the prompt is cached
        llm.generate([r.prompt], SamplingParams(max_tokens=1, temperature=0))
    hits, full_pages = simulate(reqs, PAGE, capacity)
    unbounded, _ = simulate(reqs, PAGE, None)
    assert llm.engine.stats.prefix_cache_hits == hits * PAGE
    assert 0 < hits < unbounded  # the pool is small enough that eviction changes the answer
