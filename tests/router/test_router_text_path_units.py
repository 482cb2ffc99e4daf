"""The cheap paths of ``cache_aware`` on untokenized prompts give what the plain loops give: KV events applied in C
(packed hashes) or per item (JSON lists) against a reference count; a text-map lookup of a prompt none of whose
blocks is mapped, and the generation bound after a second page size; the pending depth's binary search against a
linear count; and the blocks a route leaves pending are the text's block hashes for the worker's page size."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from router_testkit import StubCandidate

from pd_cluster.bench.fake_kv import FakeKv
from pd_cluster.common.routing_text import block_chars_for, block_hashes, pack_entries, pack_u64
from pd_cluster.router.config import CacheAwareConfig, KvRoutingConfig
from pd_cluster.router.kv_index import KvIndex
from pd_cluster.router.policies import CacheAware, RouteRequest
from pd_cluster.router.request import parse_request
from pd_cluster.router.text_map import RecentText, TextMap

HASHES = st.lists(st.integers(0, 5), max_size=8)  # few values: repeats within and across events
EVENTS = st.lists(st.tuples(st.sampled_from(["BlockStored", "BlockRemoved"]), HASHES), max_size=12)


def reference(events: list[tuple[str, list[int]]]) -> dict[int, int]:
    """Each stored page counts once more, each removal once less; a page at 0 is gone."""
    blocks: dict[int, int] = {}
    for kind, hashes in events:
        for h in hashes:
            left = blocks.get(h, 0) + (1 if kind == "BlockStored" else -1)
            if left > 0:
                blocks[h] = left
            else:
                blocks.pop(h, None)
    return blocks


def batch(events: list[tuple[str, list[int]]], packed: bool) -> dict:
    return {"instance_id": "i", "seq": len(events), "snapshot": True, "page_size": 4, "events": [
        {"type": kind, "seq": n + 1, "block_hashes": pack_u64(hashes) if packed else hashes}
        for n, (kind, hashes) in enumerate(events)]}


@settings(max_examples=100, deadline=None)
@given(EVENTS)
def test_events_applied_packed_or_listed_count_pages_as_the_reference(events):
    for packed in (True, False):
        index = KvIndex()
        assert index.apply("w", batch(events, packed), 1.0) == len(events)
        assert index.get("w").blocks == reference(events)


def test_listed_hashes_are_read_as_integers():
    index = KvIndex()
    index.apply("w", batch([("BlockStored", ["7", 8.0, 9])], packed=False), 1.0)
    assert index.get("w").blocks == {7: 1, 8: 1, 9: 1}


def test_a_lookup_that_maps_nothing_still_bounds_the_generations():
    tm = TextMap(max_entries=8)  # one page size: generations of 4 entries
    first = {"instance_id": "x", "seq": 4, "page_size": 16, "block_chars": 32,
             "entries": pack_entries([(h, 10 * h, h) for h in (1, 2, 3, 4)])}
    tm.apply("w", first, 1.0)
    assert tm.lookup(16, [50, 60]) == [] and len(tm) == 4
    # a second page size halves every generation's bound: the next lookup of page size 16 rotates, mapped or not
    tm.apply("v", {"instance_id": "y", "seq": 1, "page_size": 32, "block_chars": 64,
                   "entries": pack_entries([(9, 90, 1)])}, 1.0)
    assert tm.lookup(16, [50]) == []
    tm.apply("w", dict(first, seq=5, entries=pack_entries([(5, 50, 5)])), 2.0)
    assert tm.lookup(16, [1, 5]) == [(0, 10, 1), (1, 50, 5)]  # 1 came back from the older generation
    assert tm.lookup(16, [2, 3, 4]) == [(0, 20, 2), (1, 30, 3), (2, 40, 4)]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(0, 3)), max_size=10), st.integers(0, 8), st.integers(0, 6))
def test_the_pending_depth_is_the_count_of_leading_blocks_routed_since_the_horizon(routes, probe_len, confirmed):
    """Routes add whole prompts (prefixes of one story of blocks 0..8): the pending blocks of a probe are a prefix."""
    recent = RecentText()
    added = [recent.add(list(range(n)), now=float(t)) for t, (n, _) in enumerate(routes)]
    for t, (route, (_, lag)) in enumerate(zip(added, routes)):
        route.done_at = float(t + lag)
    recent.confirm(seen=float(confirmed), now=float(len(routes)))
    pending = set()  # every block routed at or after the horizon (the oldest route still unconfirmed)
    for route, (n, _) in zip(added, routes):
        if route.routed_at >= recent.horizon:
            pending.update(range(n))
    probe = list(range(probe_len))
    linear = next((k for k, h in enumerate(probe) if h not in pending), len(probe))
    assert recent.depth(probe) == linear

def test_a_routed_prompt_leaves_its_text_blocks_pending_on_the_chosen_worker():
    text_map, clock = TextMap(), lambda: 100.0
    index = KvIndex(text_polled=text_map.polled_since)
    policy = CacheAware(CacheAwareConfig(), clock, index, KvRoutingConfig(), text_map)
    kv = FakeKv(8, 4096)
    index.apply("a", json.loads(kv.kv_events("token_ids=false&hashes=packed")), 100.0)
    text_map.apply("a", json.loads(kv.kv_text_map("")), 100.0)
    text = parse_request(json.dumps({"prompt": "Once upon a time " * 40}).encode(), chat=False).text
    request = RouteRequest(text)
    choice = policy.select([StubCandidate("a")], request)
    assert policy.track(choice, request) is not None
    expected = block_hashes(text, block_chars_for(8))
    assert index.get("a").text.depth(expected) == len(expected)
    assert set(index.get("a").text._cur) == set(expected)


def test_remembered_block_hashes_are_those_of_the_very_text_even_when_fingerprints_collide(monkeypatch):
    import pd_cluster.router.policies.cache_aware as cache_aware

    policy = CacheAware(CacheAwareConfig(), lambda: 0.0)
    head, tail = "h" * 70, "t" * 70
    one, two = head + "middle one" + tail, head + "middle two" + tail  # same length and ends: one fingerprint
    for text in (one, two, one, two + "!", one):
        assert policy.hashes(text, 8) == block_hashes(text, block_chars_for(8))
    assert policy.hashes(one, 8) is policy.hashes(one, 8)  # remembered: hashed once
    assert policy.hashes(one, 16) == block_hashes(one, block_chars_for(16))
    assert policy._hashed_chars == sum(len(text) for text, _ in policy._hashed.values())
    monkeypatch.setattr(cache_aware, "HASHED_CHARS", 2 * len(one))  # room for two: the least recent goes
    policy.hashes(two, 8)
    assert [text for text, _ in policy._hashed.values()] == [one, two]
