"""Policy unit tests: each policy picks as specified (pure code, no I/O)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest

from pd_cluster.router.config import CacheAwareConfig
from pd_cluster.router.load import LoadReport
from pd_cluster.router.policies import (
    CacheAware,
    LeastKvUsage,
    PowerOfTwo,
    RandomPolicy,
    RoundRobin,
    RouteRequest,
    effective_load,
    make_policy,
)
from pd_cluster.router.policies.base import estimated_usage, has_admission_room
from pd_cluster.router.policies.prefix_tree import ApproxPrefixTree


@dataclass(eq=False)
class W:
    url: str
    load: LoadReport | None = None
    inflight: int = 0
    sent_since_report: int = 0


def report(running=0, queued=0, usage=0.0, free=100, total=100, max_running=8) -> LoadReport:
    return LoadReport(num_running_reqs=running, num_queue_reqs=queued, token_usage=usage,
                      num_free_pages=free, num_total_pages=total,
                      max_running_requests=max_running)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


REQ = RouteRequest(text="hello")


def test_round_robin_cycles_in_order():
    ws = [W("a"), W("b"), W("c")]
    rr = RoundRobin()
    assert [rr.select(ws, REQ).url for _ in range(7)] == list("abcabca")
    # A retry picks among the untried workers without moving the cursor.
    assert rr.select(ws[2:], RouteRequest("x", attempt=2)).url == "c"
    assert rr.select(ws, REQ).url == "b"


def test_random_is_seeded_and_covers_all():
    ws = [W("a"), W("b"), W("c")]
    first, second = RandomPolicy(random.Random(7)), RandomPolicy(random.Random(7))
    assert [first.select(ws, REQ).url for _ in range(20)] == \
        [second.select(ws, REQ).url for _ in range(20)]
    policy = RandomPolicy(random.Random(1))
    counts = Counter(policy.select(ws, REQ).url for _ in range(3000))
    assert set(counts) == {"a", "b", "c"}
    assert all(900 < n < 1100 for n in counts.values())


def test_empty_candidates_raise():
    for policy in (RoundRobin(), RandomPolicy(random.Random(0)), PowerOfTwo(random.Random(0)),
                   LeastKvUsage(), CacheAware(CacheAwareConfig(), Clock())):
        with pytest.raises(ValueError):
            policy.select([], REQ)


def test_power_of_two_never_picks_the_most_loaded_of_three():
    ws = [W("idle", report(running=0)), W("mid", report(running=3)), W("busy", report(running=6))]
    p2 = PowerOfTwo(random.Random(3))
    counts = Counter(p2.select(ws, REQ).url for _ in range(3000))
    assert counts["busy"] == 0
    # "idle" wins whenever it is sampled: 2 of the 3 possible pairs.
    assert counts["idle"] == pytest.approx(2000, abs=120)
    assert counts["mid"] == pytest.approx(1000, abs=120)


def test_power_of_two_counts_queues_and_requests_sent_since_the_report():
    a = W("a", report(running=1, queued=2))          # 3 at the worker
    b = W("b", report(running=1), sent_since_report=3)  # 1 reported + 3 sent since
    assert effective_load(a) == 3 and effective_load(b) == 4
    p2 = PowerOfTwo(random.Random(0))
    assert {p2.select([a, b], REQ).url for _ in range(20)} == {"a"}
    # Without a report the router's own in-flight count is the load.
    assert effective_load(W("c", None, inflight=5)) == 5


def test_least_kv_usage_takes_lowest_usage_with_admission_room():
    full_pages = W("full_pages", report(usage=0.05, free=0))
    full_batch = W("full_batch", report(running=8, usage=0.10, max_running=8))
    busy = W("busy", report(running=4, usage=0.60))
    calm = W("calm", report(running=2, usage=0.30))
    assert not has_admission_room(full_pages) and not has_admission_room(full_batch)
    assert LeastKvUsage().select([full_pages, full_batch, busy, calm], REQ) is calm


def test_least_kv_usage_charges_requests_sent_since_the_report():
    # 2 running use 0.30, so each request counts 0.15; 3 sent since -> 0.75 > 0.60.
    calm = W("calm", report(running=2, usage=0.30), sent_since_report=3)
    busy = W("busy", report(running=4, usage=0.60))
    assert estimated_usage(calm) == pytest.approx(0.75)
    assert LeastKvUsage().select([calm, busy], REQ) is busy


def test_least_kv_usage_without_room_anywhere_takes_lowest_usage():
    a = W("a", report(running=8, usage=0.9, max_running=8))
    b = W("b", report(running=8, usage=0.7, max_running=8))
    assert LeastKvUsage().select([a, b], REQ) is b


def test_least_kv_usage_rotates_over_ties():
    ws = [W("a", report()), W("b", report()), W("c", report(usage=0.5, running=1))]
    policy = LeastKvUsage()
    assert sorted(policy.select(ws, REQ).url for _ in range(4)) == ["a", "a", "b", "b"]


def test_unknown_load_counts_as_empty_with_room():
    fresh = W("fresh")
    used = W("used", report(running=1, usage=0.01))
    assert has_admission_room(fresh)
    assert LeastKvUsage().select([used, fresh], REQ) is fresh


def cache_policy(clock=None, **kw) -> CacheAware:
    cfg = CacheAwareConfig(**{"cache_threshold": 0.5, "balance_abs_threshold": 4,
                              "balance_rel_threshold": 1.5, "block_chars": 8, **kw})
    return CacheAware(cfg, clock or Clock())


def route(policy, workers, text, track=True):
    choice = policy.select(workers, RouteRequest(text=text))
    if track:
        choice.inflight += 1  # what the selector does; nothing completes here
    return choice


SYSTEM_A = "You are a helpful assistant. " * 4
SYSTEM_B = "Translate the text into French. " * 4


def test_cache_aware_repeats_a_prefix_on_one_worker_and_spreads_new_ones():
    ws = [W("w0"), W("w1"), W("w2")]
    policy = cache_policy()
    first_a = route(policy, ws, SYSTEM_A + "question 0", track=False)
    first_b = route(policy, ws, SYSTEM_B + "text 0", track=False)
    assert first_a is not first_b  # a new prefix goes to the emptiest tree
    for i in range(1, 10):
        assert route(policy, ws, SYSTEM_A + f"question {i}", track=False) is first_a
        assert route(policy, ws, SYSTEM_B + f"text {i}", track=False) is first_b
    assert policy.hits == 18 and policy.misses == 2 and policy.balanced == 0


def test_cache_aware_follows_the_prefix_until_imbalance_passes_the_threshold():
    ws = [W("w0"), W("w1")]
    policy = cache_policy(balance_abs_threshold=4, balance_rel_threshold=1.5)
    owner = route(policy, ws, SYSTEM_A + "q0")
    other = ws[1] if owner is ws[0] else ws[0]
    picks = [route(policy, ws, SYSTEM_A + f"q{i}") for i in range(1, 8)]
    # Loads (owner, other) before each pick: (1,0) .. (4,0) stay on the prefix;
    # (5,0) is imbalanced (5-0 > 4 and 5 > 1.5*0) and goes to the other worker.
    assert picks[:4] == [owner] * 4
    assert picks[4] is other
    assert owner.inflight == 5
    assert policy.balanced >= 1


def test_cache_aware_relative_threshold_also_has_to_pass():
    ws = [W("w0", inflight=10), W("w1", inflight=5)]
    policy = cache_policy(balance_abs_threshold=4, balance_rel_threshold=3.0)
    policy.tree.insert(policy.tree.path_hashes(SYSTEM_A), "w0")
    # 10 - 5 > 4 but 10 < 3 * 5: balanced enough, the prefix wins.
    assert route(policy, ws, SYSTEM_A + "x", track=False).url == "w0"


def test_cache_aware_below_threshold_goes_to_least_loaded():
    ws = [W("w0", inflight=2), W("w1", inflight=1)]
    policy = cache_policy(cache_threshold=0.9)
    policy.tree.insert(policy.tree.path_hashes(SYSTEM_A), "w0")
    # Half the prompt matches w0: below 0.9, so the least loaded worker.
    choice = route(policy, ws, SYSTEM_A + "z" * len(SYSTEM_A), track=False)
    assert choice.url == "w1" and policy.misses == 1


def test_prefix_tree_match_depth_and_tenants():
    clock = Clock()
    tree = ApproxPrefixTree(block_chars=4, max_chars=1000, clock=clock)
    tree.insert(tree.path_hashes("aaaabbbbcccc"), "x")
    tree.insert(tree.path_hashes("aaaabbbbdddd"), "y")
    # three full blocks, then the whole text's node
    assert tree.match(tree.path_hashes("aaaabbbbcccc"), {"x", "y"}) == ({"x"}, 4)
    assert tree.match(tree.path_hashes("aaaabbbbzzzz"), {"x", "y"}) == ({"x", "y"}, 2)
    assert tree.match(tree.path_hashes("aaaabbbbcccc"), {"y"}) == ({"y"}, 2)
    assert tree.match(tree.path_hashes("zzzz"), {"x", "y"}) == (set(), 0)


def test_prefix_tree_is_bounded_and_evicts_tails_first():
    tree = ApproxPrefixTree(block_chars=4, max_chars=4 * 12, clock=Clock())
    for i in range(50):
        tree.insert(tree.path_hashes(f"{i:04d}" * 4), "x")
        assert len(tree) <= 12
    # 12 entries: prompts 49 and 48 whole (4 blocks and the whole text's node each), and of 47 only its
    # first 2 blocks, since a prompt's tail is older than its head in the LRU.
    depth = {i: tree.match(tree.path_hashes(f"{i:04d}" * 4), {"x"})[1] for i in (49, 48, 47, 46)}
    assert depth == {49: 5, 48: 5, 47: 2, 46: 0}


def test_prefix_tree_evicts_idle_entries_and_removed_workers():
    clock = Clock()
    policy = cache_policy(clock=clock, eviction_interval_secs=60.0)
    tree = policy.tree
    tree.insert(tree.path_hashes(SYSTEM_A), "old")
    clock.t += 50
    tree.insert(tree.path_hashes(SYSTEM_B), "new")
    clock.t += 20  # "old" idle 70 s, "new" idle 20 s
    policy.evict()
    assert tree.match(tree.path_hashes(SYSTEM_A), {"old"}) == (set(), 0)
    assert tree.match(tree.path_hashes(SYSTEM_B), {"new"})[1] > 0
    policy.on_worker_removed("new")
    assert len(tree) == 0 and tree.tenant_size("new") == 0


def test_make_policy_names():
    cfg, rng = CacheAwareConfig(), random.Random(0)
    names = {n: type(make_policy(n, cfg, rng)).__name__ for n in
             ("round_robin", "random", "power_of_two", "cache_aware", "least_kv_usage")}
    assert names == {"round_robin": "RoundRobin", "random": "RandomPolicy",
                     "power_of_two": "PowerOfTwo", "cache_aware": "CacheAware",
                     "least_kv_usage": "LeastKvUsage"}
    with pytest.raises(ValueError):
        make_policy("fastest", cfg, rng)
