"""Decode-side KV reuse on real 1P1D clusters (OS processes, NIXL between them, the openai client).

- Exactness: page sizes 1, 16 and 64, fp32 and fp8_e4m3 KV, ``--chunked-prefill-size 7``: a 3-turn
  conversation whose later turns reuse the decode worker's own pages gives the offline cache-off greedy text,
  and the decode worker receives exactly the pages it lacks.
- Conditional disaggregation (``--max-local-prefill-length`` on the decode worker): a turn whose uncached rest
  is at most the threshold is prefilled on decode, with no ``/prefill`` call; the others go to the prefill
  worker; every text is exact.
- Failure paths of a delta transfer: the client going away mid-transfer, and the prefill worker killed
  mid-transfer, leave no page of the decode worker in use (free + evictable == total).
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from cluster_util import PROMPTS, running_cluster, wait_all_free, worker_loads
from reuse_util import OPENING, conversation, counters, decode_held, delta, pages, prefill_held

from pd_cluster.engine.llm import LLM
from pd_cluster.engine.sampling.params import SamplingParams

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py: the fast tier starts none)

MAX_TOKENS = 32


def _client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.router_url + "/v1", api_key="x", timeout=60, max_retries=0)


def _urls(cluster) -> tuple[str, str]:
    return (next(p.url for p in cluster.procs if p.role == "prefill"),
            next(p.url for p in cluster.procs if p.role == "decode"))


def _prefilled(url: str) -> float:
    """The prefill worker's answered ``/prefill`` jobs (``pd:prefill_requests_total``)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("pd:prefill_requests_total{"))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("kv_dtype", ["fp32", "fp8_e4m3"])
def test_decode_reuse_is_exact(page, kv_dtype):
    engine = dict(page_size=page, kv_cache_dtype=kv_dtype, chunked_prefill_size=7)
    turns, page_nbytes = conversation(OPENING, 3, MAX_TOKENS, **engine)
    held = [decode_held(turns, k, page) for k in range(len(turns))]
    assert held[-1] > 0  # the test's premise: the last turn reuses decode's pages at every page size
    argv = ["--page-size", str(page), "--kv-cache-dtype", kv_dtype, "--chunked-prefill-size", "7"]
    with running_cluster(1, 1, engine_argv=argv) as cluster:
        prefill, decode = _urls(cluster)
        client = _client(cluster)
        for k, t in enumerate(turns):
            d0 = counters(decode)
            out = client.completions.create(model="stories260K", prompt=t.prompt, max_tokens=MAX_TOKENS,
                                            temperature=0)
            dd = delta(counters(decode), d0)
            assert out.choices[0].text == t.text, (k, page, kv_dtype)
            assert dd["pd:kv_transfer_received_bytes_total"] == (pages(len(t.ids), page) - held[k]) * page_nbytes
            assert dd["pd:kv_transfer_saved_bytes_total"] == held[k] * page_nbytes
            assert out.usage.prompt_tokens_details.cached_tokens == prefill_held(turns, k, page) * page


@pytest.mark.timeout(600)
def test_conditional_disaggregation_prefills_short_rests_on_decode():
    page = 16
    turns, page_nbytes = conversation(OPENING, 4, MAX_TOKENS, page_size=page)
    rest = [len(t.ids) - decode_held(turns, k, page) * page for k, t in enumerate(turns)]
    threshold = rest[1]
    local = [r <= threshold for r in rest]  # Dynamo's rule: remote iff prompt_len - prefix_hit_len > threshold
    assert local[1] and not local[0]  # the first turn has nothing cached: it goes to the prefill worker
    role_argv = {"decode": ["--max-local-prefill-length", str(threshold)]}
    with running_cluster(1, 1, engine_argv=["--page-size", str(page)], role_argv=role_argv) as cluster:
        prefill, decode = _urls(cluster)
        client = _client(cluster)
        for k, t in enumerate(turns):
            p0, d0, jobs0 = counters(prefill), counters(decode), _prefilled(prefill)
            out = client.completions.create(model="stories260K", prompt=t.prompt, max_tokens=MAX_TOKENS,
                                            temperature=0)
            dp, dd, jobs = delta(counters(prefill), p0), delta(counters(decode), d0), _prefilled(prefill) - jobs0
            held = decode_held(turns, k, page)
            assert out.choices[0].text == t.text, k
            assert dd["pd:decode_local_prefill_requests_total"] == int(local[k]), k
            assert jobs == int(not local[k]), k
            if local[k]:  # no /prefill call: the prefill worker saw nothing; decode computed only the rest
                assert dp["vllm:prefix_cache_queries_total"] == dp["vllm:prompt_tokens_total"] == 0
                assert dd["vllm:prompt_tokens_total"] == rest[k]
                assert dd["pd:kv_transfer_received_bytes_total"] == 0
                assert out.usage.prompt_tokens_details.cached_tokens == held * page  # decode's own hits
            else:
                assert dd["pd:kv_transfer_received_bytes_total"] == (pages(len(t.ids), page) - held) * page_nbytes
                seen = [j for j in range(k) if not local[j]]  # the prefill worker saw only the remote turns
                assert out.usage.prompt_tokens_details.cached_tokens == prefill_held(turns, k, page, seen) * page
            assert dd["pd:kv_transfer_saved_bytes_total"] == held * page_nbytes
        assert sum(local) >= 1
        loads = wait_all_free(cluster, timeout=10)
        assert all(v["num_free_pages"] == v["num_total_pages"] for v in loads.values()), loads


# ---- failure paths of a delta transfer ------------------------------------------------------------------------
# The prefill worker has no cache and takes 4 tokens per step, so the delta transfer of a ~250-token rest lasts
# many steps; the decode worker holds the ~150-token warm-up prompt's pages.
SLOW_PREFILL = {"prefill": ["--chunked-prefill-size", "4", "--max-prefill-tokens", "4", "--disable-radix-cache"]}
HEAD = " ".join(PROMPTS[1:5])
TAIL = " ".join(reversed(PROMPTS)) * 2


async def _delta_request_in_flight(client: openai.AsyncOpenAI, cluster, prompt: str) -> tuple[asyncio.Task, dict]:
    """Start `prompt` through the router; return once decode waits for its (delta) transfer, and the loads."""
    task = asyncio.ensure_future(client.completions.create(model="stories260K", prompt=prompt, max_tokens=8,
                                                           temperature=0))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not task.done():
        loads = await asyncio.to_thread(worker_loads, cluster)
        if loads["decode-0"]["num_decode_transfer_queue_reqs"] and loads["prefill-0"]["num_running_reqs"]:
            return task, loads
        await asyncio.sleep(0.01)
    raise AssertionError(f"the delta transfer was never seen in flight (done: {task.done()})")


def _aclient(cluster) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=cluster.router_url + "/v1", api_key="x", timeout=30, max_retries=0)


def _warm(cluster) -> float:
    """Run the warm-up prompt; return the decode worker's prefix-cache hits so far."""
    _client(cluster).completions.create(model="stories260K", prompt=HEAD, max_tokens=8, temperature=0)
    return counters(_urls(cluster)[1])["pd:prefix_cache_hits_total"]


def _assert_no_page_in_use(cluster, name: str = "decode-0", timeout: float = 15.0) -> None:
    load = wait_all_free(cluster, timeout=timeout)[name]
    assert load["num_free_pages"] == load["num_total_pages"], load  # free + evictable == total
    assert load["num_running_reqs"] == load["num_queue_reqs"] == 0, load
    assert not load["num_decode_transfer_queue_reqs"] and not load["num_decode_prealloc_queue_reqs"], load


@pytest.mark.timeout(600)
def test_client_gone_mid_delta_transfer_leaks_no_decode_page():
    prompt = HEAD + " " + TAIL
    want = LLM(kv_cache_memory="64MiB", disable_radix_cache=True).generate(
        prompt, SamplingParams(max_tokens=8, temperature=0))[0].text
    with running_cluster(1, 1, engine_argv=["--page-size", "16"], role_argv=SLOW_PREFILL) as cluster:
        hits0 = _warm(cluster)

        async def run():
            async with _aclient(cluster) as client:
                task, loads = await _delta_request_in_flight(client, cluster, prompt)
                task.cancel()  # the client goes away: its connection to the router closes
                with pytest.raises(asyncio.CancelledError):
                    await task
                return loads

        loads = asyncio.run(run())
        assert counters(_urls(cluster)[1])["pd:prefix_cache_hits_total"] > hits0  # it was a delta request
        assert loads["decode-0"]["num_free_pages"] < loads["decode-0"]["num_total_pages"]
        _assert_no_page_in_use(cluster)
        # the cached pages were neither lost nor overwritten: the same prompt again reuses them, exactly
        d0 = counters(_urls(cluster)[1])
        out = _client(cluster).completions.create(model="stories260K", prompt=prompt, max_tokens=8, temperature=0)
        assert out.choices[0].text == want
        assert delta(counters(_urls(cluster)[1]), d0)["pd:kv_transfer_saved_bytes_total"] > 0
        _assert_no_page_in_use(cluster)


@pytest.mark.timeout(600)
def test_prefill_killed_mid_delta_transfer_leaks_no_decode_page():
    with running_cluster(1, 1, engine_argv=["--page-size", "16"], role_argv=SLOW_PREFILL) as cluster:
        hits0 = _warm(cluster)

        async def run():
            async with _aclient(cluster) as client:
                task, loads = await _delta_request_in_flight(client, cluster, HEAD + " " + TAIL)
                cluster.kill("prefill-0")
                with pytest.raises(openai.APIStatusError) as err:  # no other prefill worker: the request fails
                    await asyncio.wait_for(task, 40)
                return loads, err.value.status_code

        loads, status = asyncio.run(run())
        assert status in (502, 503), status
        assert counters(_urls(cluster)[1])["pd:prefix_cache_hits_total"] > hits0
        _assert_no_page_in_use(cluster)
