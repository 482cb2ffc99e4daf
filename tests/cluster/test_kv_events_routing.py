"""``cache_aware`` on the workers' KV events, on a real 2P2D cluster (OS processes, NIXL, loopback), with no
tokenizer in the router: the decode workers' text-to-page maps (``GET /kv_text_map``) name the pages.

1. Two conversations, three turns each, interleaved: every continuation lands on the prefill worker that holds
   its prefix, measured by the prefill workers' own ``vllm:prefix_cache_hits`` counters, and every decision was
   made on the reported cache state (``pd_router_cache_aware_routed_total{source="kv_events"}``).
2. Where the approximate tree guesses wrong: conversation X's first turn goes through the router to prefill
   worker P; then traffic the router never sees (another router replica, played by requests sent straight to a
   decode worker naming the prefill worker) prefills X's first turn on the other worker Q and evicts it from P's
   small pool. X's second turn: the tree (``--no-kv-events``) sends it back to P, which recomputes everything
   (0 hits); the events send it to Q, which serves X's first turn from cache.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from cluster_util import metric_value, running_cluster

from pd_cluster.router.kv_index import page_hashes

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py: the fast tier starts none)

PAGE = 16
MAX_TOKENS = 16
ENGINE = ["--page-size", str(PAGE)]
PREFILL = ["--num-pages", "12"]  # small enough that a few other prompts evict a conversation
OPENINGS = ["Once upon a time, there was a little girl named Lily. She liked to play in the park.",
            "Tom had a red truck and a blue ball. Every morning he drove the truck to the hill."]
X = "A small bird lived in a tall tree near the river, and it sang a song every day."
QUESTIONS = [" Then she saw a big dog.", " The dog wanted to play."]
FLOOD = [f"Day {i}: the {a} and the {b} went to the {c} to look for a {d}, and they found it under a big rock "
         f"near the water, so they were very happy." for i, (a, b, c, d) in enumerate(
             [("cat", "dog", "farm", "hat"), ("boy", "girl", "shop", "cake"), ("bear", "fox", "woods", "key"),
              ("duck", "frog", "pond", "ring"), ("king", "queen", "castle", "crown"), ("owl", "bee", "hill", "cup"),
              ("pig", "cow", "barn", "bell"), ("ant", "bug", "log", "seed"), ("sun", "moon", "sky", "star"),
              ("car", "bus", "road", "map")])]


def _counters(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return metric_value(text, "vllm:prefix_cache_queries_total"), metric_value(text, "vllm:prefix_cache_hits_total")


def _router_metric(cluster, name: str, **labels: str) -> float:
    """The router's sample `name` whose labels include `labels` (every series also carries model_name)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(cluster.router_url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def _wait(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def _caught_up(cluster, prefills: list[str], decodes: list[str]) -> bool:
    """The router's index of every prefill worker has applied that worker's last event, and its text-to-page map
    every decode worker's last entry."""
    workers = {w["url"]: w for w in httpx.get(cluster.router_url + "/workers", timeout=10).json()["workers"]}
    for url, path, key in [(u, "/kv_events", "kv_index") for u in prefills] + \
                          [(u, "/kv_text_map", "text_map") for u in decodes]:
        seq = httpx.get(url + path, timeout=10).json()["seq"]
        got = workers[url].get(key) or {}
        if not (got.get("fresh") and got.get("seq") == seq):
            return False
    return True


def _complete(client: openai.OpenAI, prompt: str) -> str:
    out = client.completions.create(model="stories260K", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    return out.choices[0].text


def _direct(decode: str, prefill: str, prompt: str) -> None:
    """A request from outside this router: straight to a decode worker, naming its prefill worker."""
    r = httpx.post(decode + "/v1/completions", headers={"X-PD-Prefill-Url": prefill}, timeout=60,
                   json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text


def _tokens(decode: str, prompt: str) -> list[int]:
    return httpx.post(decode + "/tokenize", json={"prompt": prompt}, timeout=10).json()["tokens"]


def _run(kv_events: bool) -> dict:
    argv = ["--prefill-policy", "cache_aware", "--decode-policy", "round_robin"]
    argv += [] if kv_events else ["--no-kv-events"]
    with running_cluster(2, 2, engine_argv=ENGINE, router_argv=argv, role_argv={"prefill": PREFILL}) as cluster:
        prefills = [p.url for p in cluster.procs if p.role == "prefill"]
        decodes = [p.url for p in cluster.procs if p.role == "decode"]
        decode = decodes[0]
        client = openai.OpenAI(base_url=cluster.router_url + "/v1", api_key="x", timeout=60, max_retries=0)
        if kv_events:
            _wait(lambda: _caught_up(cluster, prefills, decodes), "kv index sync")
        out: dict = {"conv_hits": 0.0, "conv_queries": 0.0}
        prompts = list(OPENINGS)
        for k in range(3):  # part 1: interleaved conversations
            for c, prompt in enumerate(prompts):
                before = [_counters(u) for u in prefills]
                answer = _complete(client, prompt)
                after = [_counters(u) for u in prefills]
                out["conv_queries"] += sum(a[0] - b[0] for a, b in zip(after, before))
                out["conv_hits"] += sum(a[1] - b[1] for a, b in zip(after, before))
                prompts[c] = prompt + answer + QUESTIONS[k % 2]
        before = [_counters(u) for u in prefills]  # part 2: X's first turn through the router lands on P
        x_answer = _complete(client, X)
        p = next(i for i, (a, b) in enumerate(zip([_counters(u) for u in prefills], before)) if a[0] > b[0])
        q = 1 - p
        _direct(decode, prefills[q], X)  # another replica's traffic: X's first turn now cached on Q
        first_page = page_hashes(_tokens(decode, X), PAGE)[0]
        since = httpx.get(prefills[p] + "/kv_events", timeout=10).json()["seq"]
        for prompt in FLOOD:  # ... and evicted from P's pool
            _direct(decode, prefills[p], prompt)
            events = httpx.get(prefills[p] + "/kv_events", params={"since": since}, timeout=10).json()["events"]
            if any(first_page in e["block_hashes"] for e in events if e["type"] == "BlockRemoved"):
                break
        else:
            raise AssertionError("the flood did not evict X's first page from P")
        if kv_events:
            _wait(lambda: _caught_up(cluster, prefills, decodes), "kv index catch-up")
        turn2 = X + x_answer + QUESTIONS[0]
        before = [_counters(u) for u in prefills]
        _complete(client, turn2)
        after = [_counters(u) for u in prefills]
        out["x_queries"] = [a[0] - b[0] for a, b in zip(after, before)]
        out["x_hits"] = [a[1] - b[1] for a, b in zip(after, before)]
        out["p"], out["q"] = p, q
        out["x_expected"] = len(_tokens(decode, X)) // PAGE * PAGE  # Q prefilled all of X: its full pages
        out["by_events"] = _router_metric(cluster, "pd_router_cache_aware_routed_total", role="prefill",
                                          source="kv_events")
        out["by_tree"] = _router_metric(cluster, "pd_router_cache_aware_routed_total", role="prefill",
                                        source="approx_tree")
    return out


@pytest.mark.timeout(900)
def test_real_state_routing_beats_the_tree_where_the_tree_guesses_wrong_2p2d():
    events = _run(kv_events=True)
    tree = _run(kv_events=False)
    print(f"events: {events}\ntree: {tree}")
    # part 1: the same conversations, the same server-side hits; with events every decision used them
    assert events["conv_queries"] == tree["conv_queries"] > 0
    assert events["conv_hits"] == tree["conv_hits"] > 0
    assert events["by_events"] == 8 and events["by_tree"] == 0  # 6 conversation turns and X's two turns
    assert tree["by_events"] == 0 and tree["by_tree"] == 8
    # part 2: the tree sends X's second turn back to P, where it was evicted; the events send it to Q
    assert tree["x_queries"][tree["p"]] > 0 and tree["x_hits"] == [0, 0]
    assert events["x_queries"][events["q"]] > 0 and events["x_queries"][events["p"]] == 0
    assert events["x_hits"][events["q"]] == events["x_expected"] > 0
