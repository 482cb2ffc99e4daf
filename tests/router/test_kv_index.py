"""The router's per-worker KV index, fed by a real engine prefix cache's event log (no HTTP): stored, removed and
cleared pages; the hash is the same on both sides; a gap or a restarted worker drops the index and routing falls
back to the approximate tree until a snapshot is applied; ``cache_aware`` scores real overlap against load, for
prefill and decode workers alike; pending routes bridge the poll lag."""

from __future__ import annotations

import pytest

from pd_cluster.engine.kv.allocator import PageAllocator
from pd_cluster.engine.kv.events import KVEventLog
from pd_cluster.engine.kv.events import page_hash as engine_page_hash
from pd_cluster.engine.kv.prefix_cache import CacheChain, PrefixCache
from pd_cluster.router.args import parse_config
from pd_cluster.router.config import CacheAwareConfig, CircuitBreakerConfig, KvRoutingConfig, PolicyConfig, Role
from pd_cluster.router.kv_index import BadBatch, KvIndex, PromptTokens, page_hash, page_hashes
from pd_cluster.router.load import LoadReport
from pd_cluster.router.policies import CacheAware, RouteRequest
from pd_cluster.router.selection import PairSelector
from pd_cluster.router.workers import WorkerRegistry

PS = 4
A, B = "http://a:1", "http://b:1"


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Worker:
    """A real prefix cache with its event log, as one worker holds them."""

    def __init__(self, num_pages: int = 32) -> None:
        self.alloc = PageAllocator(num_pages)
        self.log = KVEventLog(PS, max_pages=64)
        self.cache = PrefixCache(self.alloc, PS, self.log)

    def cache_prompt(self, ids: list[int]) -> None:
        """Compute-and-cache `ids` as a finished request would (its full pages join the cache, then it ends)."""
        pages, chain = self.cache.match(ids, len(ids) - 1)
        need = -(-len(ids) // PS) - len(pages)
        if need > self.alloc.num_free:
            self.cache.evict(need - self.alloc.num_free)
        block = pages + self.alloc.allocate(need)
        self.cache.insert(ids, block, len(ids) // PS, chain)
        self.cache.release(block + chain.anchors)

    def batch(self, since: int | None) -> dict:
        return self.log.read(since).to_json()


def sync(index: KvIndex, url: str, worker: Worker, now: float) -> int:
    return index.apply(url, worker.batch(index.since(url)), now)


def prompt(ids: list[int]) -> PromptTokens:
    return PromptTokens(tuple(ids))


def test_the_router_hash_is_the_engine_hash():
    for parent, toks in ((0, [1, 2, 3, 4]), (2**64 - 1, [0] * 16), (123456789, [31999, 7, 2**31])):
        assert page_hash(parent, toks) == engine_page_hash(parent, toks)
    assert page_hash(0, [1, 2, 3, 4]) != page_hash(0, [1, 2, 3, 5]) != page_hash(1, [1, 2, 3, 5])
    ids = list(range(1, 14))  # 13 tokens: the full pages of the first 12 are 3
    hs = page_hashes(ids, PS)
    assert len(hs) == 3 and hs[1] == page_hash(hs[0], ids[4:8])
    assert len(page_hashes(ids[:12], PS)) == 2  # the last token is never a hit


def test_stored_removed_and_snapshot_through_the_index():
    w, index, now = Worker(num_pages=8), KvIndex(), 1.0
    ids = list(range(1, 18))  # 4 full pages
    w.cache_prompt(ids)
    assert sync(index, A, w, now) == 2  # snapshot: AllBlocksCleared + one BlockStored of the chain
    assert index.fresh(A, now) and index.cached_pages(A, prompt(ids)) == (4, 4)
    assert index.cached_pages(A, prompt(ids[:9] + [99] * 8)) == (2, 4)
    other = [50 + i for i in range(17)]
    w.cache_prompt(other)  # 5 pages, 4 free: the LRU leaf of `ids` (its last page) is evicted
    assert sync(index, A, w, now) == 2  # BlockRemoved, BlockStored
    assert index.cached_pages(A, prompt(ids)) == (3, 4)
    assert index.num_pages(A) == w.cache.num_pages == w.log.num_pages == 7
    assert index.cached_pages(A, prompt(other)) == (4, 4)
    assert w.cache.clear() == 7
    assert sync(index, A, w, now) == 1 and index.num_pages(A) == 0  # one BlockRemoved of all 7
    assert index.cached_pages(A, prompt(other)) == (0, 4) and index.events_received == 5


def test_gap_and_restart_drop_the_index_until_a_snapshot():
    w, index, clock = Worker(num_pages=200), KvIndex(stale_secs=2.0), Clock()
    ids = list(range(1, 18))
    w.cache_prompt(ids)
    sync(index, A, w, clock.t)
    seq = index.since(A)
    for k in range(2):
        w.cache_prompt([1000 + 17 * k + i for i in range(17)])
    skipped = w.batch(seq + 1)  # misses event seq + 1
    assert not skipped["snapshot"] and skipped["events"][0]["seq"] == seq + 2
    assert index.apply(A, skipped, clock.t) == 0  # a gap seen by the router
    assert not index.fresh(A, clock.t) and index.since(A) is None and index.resyncs == {"gap": 1}
    assert index.cached_pages(A, prompt(ids)) == (0, 4)
    assert sync(index, A, w, clock.t) == 4  # the snapshot: AllBlocksCleared, one BlockStored per chain (3)
    assert index.fresh(A, clock.t) and index.num_pages(A) == w.cache.num_pages == 12
    assert index.cached_pages(A, prompt(ids)) == (4, 4)
    # the worker's log answers a position it no longer holds with a snapshot (64 pages held at most)
    for k in range(20):
        w.cache_prompt([5000 + 17 * k + i for i in range(17)])
    assert w.log.read(index.since(A)).snapshot
    sync(index, A, w, clock.t)
    assert index.num_pages(A) == w.cache.num_pages == 92 and index.resyncs == {"gap": 2}
    # a restarted worker (new instance id) answers a snapshot to our old position: applied, counted
    restarted = Worker()
    restarted.cache_prompt(ids[:9])
    assert index.apply(A, restarted.batch(index.since(A)), clock.t) == 2
    assert index.resyncs == {"gap": 2, "new_instance": 1} and index.cached_pages(A, prompt(ids)) == (2, 4)
    # a delta from another instance is refused
    assert index.apply(A, dict(w.batch(w.log.seq), events=[]), clock.t) == 0 and index.since(A) is None
    with pytest.raises(BadBatch):
        index.apply(A, {"instance_id": "x"}, clock.t)
    clock.t += 3  # not polled for longer than stale_secs
    sync(index, B, w, clock.t - 3)
    assert not index.fresh(B, clock.t)


def _candidates(registry: WorkerRegistry, role: Role, urls: list[str], loads: dict[str, int]):
    out = []
    for url in urls:
        w = registry.add(url, role, "static", healthy=True)
        w.load = LoadReport.from_json({"num_running_reqs": loads.get(url, 0), "num_queue_reqs": 0}, 0.0)
        out.append(w)
    return out


def test_cache_aware_scores_real_overlap_against_load_and_falls_back_to_the_tree():
    clock, index = Clock(), KvIndex()
    policy = CacheAware(CacheAwareConfig(), clock, index, KvRoutingConfig(tokenizer_path="t"))
    registry = WorkerRegistry(CircuitBreakerConfig())
    wa, wb = Worker(), Worker()
    ids = list(range(1, 18))
    wb.cache_prompt(ids)  # B holds the prompt; the router never routed it there
    a, b = _candidates(registry, Role.PREFILL, [A, B], {})
    text = "the prompt as text"
    # the tree routes it to A first (no events yet: the fallback)
    assert policy.select([a, b], RouteRequest(text, 1, prompt(ids))) is a and policy.by_tree == 1
    for url, w in ((A, wa), (B, wb)):
        sync(index, url, w, clock.t)
    assert policy.select([a, b], RouteRequest(text, 1, prompt(ids))) is b  # the tree would say A
    assert (policy.by_events, policy.hits) == (1, 1)
    assert policy.select([a, b], RouteRequest(text, 1, None)) is a  # no token ids: the tree
    # loads balanced (a report may lag by a request): the cached prefix wins
    b.load = LoadReport.from_json({"num_running_reqs": 1}, 0.0)
    assert policy.select([a, b], RouteRequest(text, 1, prompt(ids))) is b
    # imbalanced (> balance_abs_threshold and > balance_rel_threshold x): cost = 1 x uncached fraction + load
    b.load = LoadReport.from_json({"num_running_reqs": 70}, 0.0)
    assert policy.select([a, b], RouteRequest(text, 1, prompt(ids))) is a
    b.load = LoadReport.from_json({"num_running_reqs": 0}, 0.0)
    b.sent_since_report, b.inflight = 3, 0  # sent since the report but already over: no load
    assert policy.select([a, b], RouteRequest(text, 1, prompt(ids))) is b
    index.drop(B, "gap")  # events broke: the tree again, which holds the text for both and counts B's 3 as load
    assert policy.select([a, b], RouteRequest(text, 1, prompt(ids))) is a and policy.by_tree == 3


def test_pages_a_worker_wrote_to_the_kv_store_count_for_every_worker_at_half_a_held_page():
    clock, index = Clock(), KvIndex()
    kv = KvRoutingConfig(tokenizer_path="t", overlap_score_weight=100.0)
    policy = CacheAware(CacheAwareConfig(), clock, index, kv)
    registry = WorkerRegistry(CircuitBreakerConfig())
    wa, wb = Worker(), Worker()
    ids = list(range(1, 18))  # 4 full pages
    wa.cache_prompt(ids)  # A holds the prompt; B nothing
    a, b = _candidates(registry, Role.PREFILL, [A, B], {A: 100, B: 20})  # imbalanced
    for url, w in ((A, wa), (B, wb)):
        sync(index, url, w, clock.t)
    assert index.l3_pages(B, prompt(ids)) == 0
    # cost = weight x uncached fraction + load: A 0 + 100 against B 100 + 20
    assert policy.select([a, b], RouteRequest("t", 1, prompt(ids))) is a
    wa.log.l3_stored(prompt(ids).hashes(PS))  # A wrote them to the store (its write thread)
    batch = wa.batch(index.since(A))
    assert batch["events"][-1]["medium"] == "L3" and batch["events"][-1]["block_hashes"] == list(prompt(ids).hashes(PS))
    index.apply(A, wa.log.read(index.since(A)).to_json(token_ids=False, packed=True), clock.t)  # as the router polls
    assert index.fresh(A, clock.t)
    assert index.l3_pages(B, prompt(ids)) == index.l3_pages(A, prompt(ids)) == 4
    assert index.cached_pages(B, prompt(ids)) == (0, 4)  # in the store, not in B's own cache
    assert index.l3_pages(B, prompt(ids[:4] + [99] * 12)) == 1  # leading pages only
    # B now reads the prompt from the store: 100 x 0.5 + 20 < 0 + 100
    assert policy.select([a, b], RouteRequest("t", 1, prompt(ids))) is b
    # balanced loads: the worker holding the prefix still wins it over the store
    a.load = LoadReport.from_json({"num_running_reqs": 1, "num_queue_reqs": 0}, 0.0)
    b.load = LoadReport.from_json({"num_running_reqs": 0, "num_queue_reqs": 0}, 0.0)
    assert policy.select([a, b], RouteRequest("t", 1, prompt(ids))) is a


def test_decode_routing_and_pending_routes_through_the_pair_selector():
    clock = Clock()
    config = PolicyConfig(prefill="cache_aware", decode="cache_aware", kv=KvRoutingConfig(tokenizer_path="t"))
    registry = WorkerRegistry(CircuitBreakerConfig(), clock)
    selector = PairSelector(registry, config, clock)
    index = selector.index
    p0, p1, d0, d1 = "http://p0:1", "http://p1:1", "http://d0:1", "http://d1:1"
    _candidates(registry, Role.PREFILL, [p0, p1], {})
    _candidates(registry, Role.DECODE, [d0, d1], {})
    workers = {url: Worker() for url in (p0, p1, d0, d1)}
    ids = list(range(1, 22))  # 5 full pages
    workers[p1].cache_prompt(ids)
    workers[d1].cache_prompt(ids[:13])  # a decode worker that kept 3 pages (delta transfers)
    for url, w in workers.items():
        sync(index, url, w, clock.t)
    pair = selector.choose(RouteRequest("x", 1, prompt(ids)), set())
    assert (pair.prefill.url, pair.decode.url) == (p1, d1)
    pair.release()
    # a new prompt lands on the emptier workers, and counts as held there until a later poll confirms it
    new = [500 + i for i in range(21)]
    pair = selector.choose(RouteRequest("y", 1, prompt(new)), set())
    assert (pair.prefill.url, pair.decode.url) == (p0, d0)
    assert index.cached_pages(p0, prompt(new)) == (5, 5)  # pending
    pair.release_prefill()  # its first token came back: the prefill's part is over
    again = selector.choose(RouteRequest("y", 1, prompt(new)), set())
    assert again.prefill.url == p0  # the next turn, before any poll, follows it
    pair.release()
    again.release()
    clock.t += 0.1
    sync(index, p0, workers[p0], clock.t)  # a poll started after both ended: the events are the truth now
    assert index.cached_pages(p0, prompt(new)) == (0, 5)
    assert selector.uses_kv_events(Role.DECODE) and selector.needs_tokens


def test_flags():
    kv = parse_config(["--tokenizer-path", "/m", "--kv-overlap-score-weight", "2.5", "--kv-events-interval-ms",
                       "50"]).policy.kv
    assert kv.enabled and (kv.tokenizer_path, kv.overlap_score_weight, kv.poll_interval_secs) == ("/m", 2.5, 0.05)
    assert kv.tokenized
    assert not parse_config(["--tokenizer", "/m", "--no-kv-events"]).policy.kv.enabled
    untokenized = parse_config([]).policy.kv  # no tokenizer: the workers' text-to-page maps
    assert untokenized.enabled and not untokenized.tokenized
