"""``cache_aware`` on untokenized prompts: the workers' text-to-page maps (`router.text_map.TextMap`) turn a prompt's
text blocks into page hashes, scored on each worker's reported pages (`KvIndex`), with routes pending until both
polls confirm them (`RecentText`). The workers are played by ``bench/fake_kv.FakeKv``: real KV events and real map
entries (``engine/kv/text_map.py``) over word tokens."""

from __future__ import annotations

import json

import pytest

from router_testkit import StubCandidate

from pd_cluster.bench.fake_kv import FakeKv
from pd_cluster.common.routing_text import pack_entries
from pd_cluster.router.config import CacheAwareConfig, KvRoutingConfig
from pd_cluster.router.kv_index import KvIndex
from pd_cluster.router.policies import CacheAware, RouteRequest
from pd_cluster.router.request import parse_request
from pd_cluster.router.text_map import RecentText, TextMap

PAGE = 8
STORY = ("Once upon a time there was a little girl named Lily who loved to play in the park with her dog Max "
         "and one day they found a shiny red ball under a big tree near the old wooden bench by the pond ") * 3


class Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


class Fleet:
    """Two workers (a, b), each a fake cache with its events and map, and one router's policy over them."""

    def __init__(self) -> None:
        self.clock = Clock()
        self.text_map = TextMap()
        self.index = KvIndex(text_polled=self.text_map.polled_since)
        self.policy = CacheAware(CacheAwareConfig(), self.clock, self.index, KvRoutingConfig(), self.text_map)
        self.kv = {url: FakeKv(PAGE, 4096) for url in ("a", "b")}
        self.candidates = [StubCandidate("a"), StubCandidate("b")]
        self.poll()

    def poll(self) -> None:
        self.clock.t += 0.1
        for url, kv in self.kv.items():
            since = self.index.since(url)
            query = "token_ids=false&hashes=packed" + ("" if since is None else f"&since={since}")
            self.index.apply(url, json.loads(kv.kv_events(query)), self.clock.t)
            since = self.text_map.since(url)
            self.text_map.apply(url, json.loads(kv.kv_text_map("" if since is None else f"since={since}")),
                                self.clock.t)

    def route(self, prompt: str) -> str:
        request = RouteRequest(parse_request(json.dumps({"prompt": prompt}).encode(), chat=False).text)
        choice = self.policy.select(self.candidates, request)
        done = self.policy.track(choice, request)
        self.kv[choice.url].observe({"prompt": prompt}, chat=False)  # the worker caches it and maps its text
        if done is not None:
            done()
        return choice.url


def test_a_prompt_goes_where_its_text_prefix_is_cached_even_if_this_router_never_sent_it():
    fleet = Fleet()
    fleet.kv["b"].observe({"prompt": STORY}, chat=False)  # another router's traffic, on b
    fleet.poll()
    for i in range(4):
        assert fleet.route(STORY + f"What happened on day {i}?") == "b"
    assert fleet.policy.by_events == 4 and fleet.policy.by_tree == 0 and fleet.policy.hits == 4
    # a prompt sharing nothing goes to the worker holding fewer pages
    assert fleet.route("A completely different story about a robot who wanted to learn to dance. " * 3) == "a"


def test_the_match_is_a_fraction_of_the_text_not_of_pages_estimated_from_other_texts():
    """A conversation's next turn, whose held prefix is 48% of its text: the pages of the turn are estimated from
    the sources' mean characters per token, which short-token text elsewhere (worker a) pulls down, so the held
    pages were 2 of an estimated 7 (below ``cache_threshold`` 0.3) and the turn went to the worker holding fewer
    pages. Measured in characters, as SGLang's router does, it goes where its prefix is (the 2P2D conversations'
    missing page: ``tests/cluster/test_prefix_cache_pd.py``)."""
    fleet = Fleet()
    head = STORY[:120]
    fleet.kv["b"].observe({"prompt": head}, chat=False)
    fleet.kv["b"].observe({"prompt": "Another tale of a brave knight and a dragon who lived far away in the hills " * 8},
                          chat=False)
    fleet.kv["a"].observe({"prompt": "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 4}, chat=False)
    fleet.poll()
    assert fleet.index.num_pages("a") < fleet.index.num_pages("b")  # a tie would go to a
    turn = head + " and then the little girl went home to her mother who was waiting with a warm pie."
    assert fleet.route(turn) == "b"
    assert fleet.policy.by_events == 1 and fleet.policy.hits == 1


def test_a_new_prompt_stays_where_it_was_sent_until_the_events_say_otherwise():
    fleet = Fleet()
    first = fleet.route(STORY)  # nothing cached anywhere: the lower load, then fewer pages
    # the next turn comes before any poll: its prefix is pending on the first worker
    assert fleet.route(STORY + "And then the dog barked.") == first
    fleet.poll()  # both polls started after the routes ended: the events are the truth now
    assert not fleet.index.get(first).text.routes
    assert fleet.route(STORY + "And then it rained.") == first  # by the worker's real pages


def test_stale_maps_fall_back_to_the_tree():
    fleet = Fleet()
    fleet.kv["b"].observe({"prompt": STORY}, chat=False)
    fleet.poll()
    fleet.clock.t += 10  # past --kv-events-stale-secs: the index and the map are not used
    fleet.route(STORY + "?")
    assert fleet.policy.by_tree == 1 and fleet.policy.by_events == 0


def test_text_map_keeps_the_entries_in_use_within_its_bound_and_says_whose_map_is_fresh():
    tm = TextMap(max_entries=4, stale_secs=2.0)  # two generations of 2 entries
    batch = {"instance_id": "x", "seq": 2, "page_size": 16, "block_chars": 32,
             "entries": pack_entries([(1, 11, 1), (2, 22, 2)])}
    assert tm.apply("w", batch, 5.0) == 2 and tm.since("w") == 2
    assert tm.lookup(16, [9, 1, 2]) == [(1, 11, 1), (2, 22, 2)] and tm.lookup(32, [1]) == []
    tm.apply("w", dict(batch, seq=3, entries=pack_entries([(3, 33, 3)])), 6.0)  # a full generation: a new one
    assert tm.lookup(16, [1]) == [(0, 11, 1)]  # used: it moves to the newer generation
    tm.apply("w", dict(batch, seq=5, entries=pack_entries([(4, 44, 4), (5, 55, 5)])), 6.0)  # unused ones go
    assert tm.lookup(16, [1, 2, 3, 4, 5]) == [(0, 11, 1), (3, 44, 4), (4, 55, 5)] and len(tm) == 3
    assert tm.fresh(16, 7.0) and not tm.fresh(16, 9.0) and not tm.fresh(32, 7.0)
    tm.stale("w")
    assert not tm.fresh(16, 6.1)
    with pytest.raises(ValueError):
        tm.apply("w", dict(batch, block_chars=64), 7.0)


def test_recent_text_counts_routes_until_confirmed_and_drops_old_generations():
    recent = RecentText()
    route = recent.add([1, 2, 3], now=10.0)
    assert recent.depth([1, 2, 3, 4]) == 3 and recent.depth([1, 2, 3]) == 3 and recent.depth([9, 8]) == 0
    route.done_at = 11.0
    recent.confirm(seen=10.5, now=10.5)  # the poll started before the route ended: still pending
    assert recent.depth([1, 2]) == 2
    recent.confirm(seen=11.5, now=11.5)
    assert recent.depth([1, 2]) == 0 and recent.horizon == float("inf")
    recent.add([5], now=12.0)
    assert recent.depth([1]) == 0 and recent.depth([5]) == 1  # older blocks do not count for a new horizon


def test_an_untokenized_prompt_counts_the_pages_a_worker_wrote_to_the_kv_store():
    fleet = Fleet()
    fleet.policy = CacheAware(CacheAwareConfig(), fleet.clock, fleet.index, KvRoutingConfig(overlap_score_weight=100.0),
                              fleet.text_map)
    fleet.kv["a"].observe({"prompt": STORY}, chat=False)  # a holds the story; b nothing
    fleet.poll()
    busy_a = [StubCandidate("a", inflight=100), StubCandidate("b", inflight=20)]  # imbalanced
    request = RouteRequest(parse_request(json.dumps({"prompt": STORY + "?"}).encode(), chat=False).text)
    assert fleet.policy.select(busy_a, request).url == "a"  # b would compute it all: 100 + 20 against ~100
    fleet.kv["a"].events.l3_stored(list(fleet.index.get("a").blocks))  # a wrote its pages to the store
    fleet.poll()
    assert fleet.index.l3 and not fleet.index.get("b").blocks
    assert fleet.policy.select(busy_a, request).url == "b"  # b reads them from the store at half a page's cost
    assert fleet.policy.by_events == 2 and fleet.policy.by_tree == 0
