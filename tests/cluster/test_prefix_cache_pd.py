"""The prefix cache through prefill/decode disaggregation, on real clusters of OS processes.

- 1P1D: a 5-turn conversation (each prompt is the previous prompt, its answer and a new question). Turn k's
  prefill computes only what the prefill worker's cache lacks: its ``vllm:prefix_cache_hits`` grow by exactly
  the previous prompt's full pages (the answer was decoded on the decode worker, so prefill never held it),
  and the decode worker reports that count in OpenAI's ``usage.prompt_tokens_details.cached_tokens``. The
  decode worker kept the previous prompt's and answer's full pages in its own cache and receives only the
  rest: ``pd:kv_transfer_received_bytes`` grows by exactly the missing pages' bytes and
  ``pd:kv_transfer_saved_bytes`` by the held ones'. Every answer equals the cache-off PD run's
  (``--disable-radix-cache`` on both workers, every page transferred) and the offline greedy text.
- 2P2D: the router's ``cache_aware`` prefill policy keeps conversations where their prefix is cached,
  measured by the prefill workers' own hit counters, against ``round_robin``.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from cluster_util import metric_value, running_cluster, wait_all_free
from reuse_util import OPENING, QUESTIONS, Turn, conversation, counters, decode_held, delta, pages, prefill_held

from pd_cluster.engine.llm import LLM
from pd_cluster.engine.sampling.params import SamplingParams
from pd_cluster.disagg.prefill_api import PrefillResponse, PrefillTimings

PAGE = 16
MAX_TOKENS = 16
ENGINE = ["--page-size", str(PAGE)]
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


def _pd_turns(engine_argv: list[str], turns: list[Turn], page_nbytes: int, reuse: bool) -> list[str]:
    """Run the conversation on a real 1P1D through the router; check every counter per turn; return the texts.

    With `reuse` (the caches on) turn k's prefill computes only what the prefill worker's cache lacks, and
    the decode worker receives only the pages its own cache lacks; without it, every page, every time.
    """
    texts = []
    with running_cluster(1, 1, engine_argv=engine_argv) as cluster:
        prefill = next(p.url for p in cluster.procs if p.role == "prefill")
        decode = next(p.url for p in cluster.procs if p.role == "decode")
        client = openai.OpenAI(base_url=cluster.router_url + "/v1", api_key="x", timeout=60, max_retries=0)
        for k, t in enumerate(turns):
            p0, d0 = counters(prefill), counters(decode)
            out = client.completions.create(model="stories260K", prompt=t.prompt, max_tokens=MAX_TOKENS,
                                            temperature=0)
            dp, dd = delta(counters(prefill), p0), delta(counters(decode), d0)
            texts.append(out.choices[0].text)
            n = len(t.ids)
            held_p = prefill_held(turns, k, PAGE) if reuse else 0
            held_d = decode_held(turns, k, PAGE) if reuse else 0
            moved = (pages(n, PAGE) - held_d) * page_nbytes
            assert out.usage.prompt_tokens == n
            assert out.usage.prompt_tokens_details.cached_tokens == held_p * PAGE, k  # prefill computed the rest
            assert (dp["vllm:prefix_cache_queries_total"], dp["vllm:prefix_cache_hits_total"],
                    dp["vllm:prompt_tokens_total"]) == ((n, held_p * PAGE, n - held_p * PAGE) if reuse else (0, 0, n))
            assert (dd["pd:kv_transfer_received_bytes_total"], dd["pd:kv_transfer_saved_bytes_total"],
                    dp["pd:kv_transfer_bytes_total"]) == (moved, held_d * page_nbytes, moved), k
            assert (dd["pd:prefix_cache_queries_total"], dd["pd:prefix_cache_hits_total"]) == \
                ((n, held_d * PAGE) if reuse else (0, 0)), k
            assert dd["pd:decode_local_prefill_requests_total"] == 0
        if reuse:
            # the last turn again, streamed: decode holds all its full pages but the last token's (the engine's
            # cap), prefill its whole prompt's but that token's
            d0 = counters(decode)
            chunks = list(client.completions.create(model="stories260K", prompt=turns[-1].prompt,
                                                    max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                                    stream_options={"include_usage": True}))
            dd = delta(counters(decode), d0)
            n = len(turns[-1].ids)
            assert "".join(c.choices[0].text for c in chunks if c.choices) == turns[-1].text
            assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (n - 1) // PAGE * PAGE
            assert dd["pd:kv_transfer_received_bytes_total"] == (pages(n, PAGE) - (n - 1) // PAGE) * page_nbytes
        loads = wait_all_free(cluster, timeout=10)
        assert all(v["num_free_pages"] == v["num_total_pages"] for v in loads.values()), loads
    return texts


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_multi_turn_1p1d_prefill_computes_and_decode_receives_only_new_tokens():
    turns, page_nbytes = conversation(OPENING, 5, MAX_TOKENS, page_size=PAGE)
    held = [decode_held(turns, k, PAGE) for k in range(len(turns))]
    assert all(h > p for h, p in zip(held[1:], (prefill_held(turns, k, PAGE) for k in range(1, 5))))
    cache_off = _pd_turns(ENGINE + ["--disable-radix-cache"], turns, page_nbytes, reuse=False)
    cache_on = _pd_turns(ENGINE, turns, page_nbytes, reuse=True)
    assert cache_on == cache_off == [t.text for t in turns]


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


@pytest.mark.slow
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


@pytest.mark.slow  # runs long (over 5 s on a 2-core CPU): the fast tier stays under 4 minutes
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
