"""PD with a hybrid KV pool, in process: a decode-role engine reserves per KV group only the pages its decode
reads, the ticket names them per group, and a real prefill-role engine's pages for exactly those slots are copied
in (the NIXL WRITEs, as `group_slots` orders them on both sides).

Tiny random Gemma 3 (5 sliding-window layers of 16 tokens to 1 global) and Llama 4 (chunked local attention of 16
tokens, NoPE global layers) checkpoints written by transformers: the decode worker's greedy tokens equal
transformers' full-recompute greedy tokens, a windowed group receives only its window, a second request sharing a
prefix is a delta transfer per group, the byte counters add up, and every page comes back.
"""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry
from random_models import build, hf_greedy_full, long_prompt_ids
from scripted import PREFILL_AGENT, ScriptedReceiver, run_loop

from pd_cluster.decode.handover import DecodeHooks
from pd_cluster.decode.metrics import DecodeReuseMetrics
from pd_cluster.decode.request import RemoteRequest
from pd_cluster.engine.args import config_from_kwargs
from pd_cluster.engine.kv.allocator import NULL_PAGE
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.engine.sampling.params import SamplingParams
from pd_cluster.transfer.ticket import group_slots

PAGE = 16
# 13 tokens: a 100-token prompt's decode computes 112 tokens, so its last full page (96..111) is a real page in
# every group; a chunked group whose last full page lies behind its chunk keeps no hollow path after the request
# ends (`WindowPrefixCache.prune_hollow`), and a later hit is then shorter
GREEDY = SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True)


@pytest.fixture
def aloop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _engine(path, role: str) -> LLMEngine:
    return LLMEngine(config_from_kwargs(role=role, model=str(path), kv_cache_dtype="fp32", page_size=PAGE,
                                        chunked_prefill_size=32, num_pages=64, attention_backend="cpu"))


class Pair:
    """A decode engine with its hooks over a scripted receiver, and a prefill engine of the same checkpoint."""

    def __init__(self, path, aloop) -> None:
        self.decode = _engine(path, "decode")
        self.prefill = _engine(path, "prefill")
        self.registry = CollectorRegistry()
        self.hooks = DecodeHooks(ScriptedReceiver(PAGE), DecodeReuseMetrics(self.registry))
        self.aloop = aloop

    def metric(self, name: str) -> float:
        return self.registry.get_sample_value(name) or 0.0

    def step(self) -> list:
        out = self.decode.step()
        self.hooks.after_step(self.decode, out)
        self.hooks.poll(self.decode)
        run_loop(self.aloop)
        return out.deltas

    def request(self, rid: str, ids: list[int]) -> tuple[list[int], RemoteRequest]:
        """Serve `ids` through the pair; returns the tokens and the request's record."""
        rec = RemoteRequest(rid, "http://127.0.0.1:1", PREFILL_AGENT, self.aloop)
        self.hooks.register(self.decode, rec, ids, GREEDY, stream=False)
        self.step()
        assert rec.ticket is not None
        self._deliver(rec, ids)
        for _ in range(100):
            done = next((d for d in self.step() if d.request_id == rid and d.finished), None)
            if done is not None:
                return done.new_token_ids, rec
        raise AssertionError(f"request {rid} did not finish")

    def _deliver(self, rec: RemoteRequest, ids: list[int], params: SamplingParams = GREEDY) -> None:
        """The prefill engine computes the whole prompt; only the ticket's slots are copied."""
        self.hooks.send(self.decode, rec.request_id)
        e = self.prefill
        e.add_request(rec.request_id, ids, params)
        first = None
        while first is None:
            first = next((d.new_token_ids[0] for d in e.step().deltas if d.request_id == rec.request_id
                          and d.new_token_ids), None)
        t = rec.ticket
        src = group_slots(e.pages.tables(e.scheduler.held[rec.request_id]), t.group_first_pages, t.first_page,
                          t.num_prompt_pages)
        assert NULL_PAGE not in src and len(src) == len(t.dst_pages)
        self.decode.pool.kv[list(t.dst_pages)] = e.pool.kv[src]
        e.release_request(rec.request_id)
        self.hooks.receiver.complete(rec.request_id, first)

    def all_free(self) -> bool:
        """No request holds a page (cached ones may stay)."""
        return all(x.num_free_pages() == x.allocator.num_pages for x in (self.decode, self.prefill))

    def drained(self) -> bool:
        """Every page is free once the caches are emptied: none counted evictable that eviction never frees."""
        for x in (self.decode, self.prefill):
            x.pages.cache.evict(10 ** 6)
        return all(x.allocator.num_free == x.allocator.num_pages for x in (self.decode, self.prefill))

    def start(self, rid: str, ids: list[int], params: SamplingParams = GREEDY) -> RemoteRequest:
        """Register a request, let the decode reserve its pages, and deliver its KV."""
        rec = RemoteRequest(rid, "http://127.0.0.1:1", PREFILL_AGENT, self.aloop)
        self.hooks.register(self.decode, rec, ids, params, stream=False)
        self.step()
        assert rec.ticket is not None, rid
        self._deliver(rec, ids, params)
        return rec

    def finish(self, rids: set[str]) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for _ in range(100):
            for d in self.step():
                if d.request_id in rids:
                    out.setdefault(d.request_id, []).extend(d.new_token_ids)
                    if d.finished:
                        rids = rids - {d.request_id}
            if not rids:
                return out
        raise AssertionError(f"requests {sorted(rids)} did not finish")


@pytest.mark.parametrize("family", ["gemma3", "llama4"])
def test_hybrid_pd_moves_only_the_window_and_stays_exact(family, tmp_path, aloop):
    hf = build(family, tmp_path, max_position_embeddings=2048)
    pair = Pair(tmp_path, aloop)
    groups = pair.decode.kv_groups
    assert not groups.is_single and groups.frees_window_pages
    assert pair.decode.layout.kv_groups == pair.prefill.layout.kv_groups == groups.signature()
    page_nbytes = pair.decode.layout.page_nbytes
    moved = skipped = 0
    for i, ids in enumerate(long_prompt_ids(3, lengths=(71, 100, 130))):
        total = -(-len(ids) // PAGE)
        tokens, rec = pair.request(f"r{i}", ids)
        assert tokens == hf_greedy_full(hf, ids, GREEDY.max_tokens), (family, len(ids))
        firsts = rec.ticket.group_first_pages
        assert len(firsts) == groups.num_groups and rec.num_cached_pages == 0
        for g, f in zip(groups.groups, firsts):  # a full group receives every page, a windowed one its window
            assert f == (0 if not g.is_windowed else g.first_visible(len(ids)) // PAGE)
        assert sum(firsts) > 0 and len(rec.ticket.dst_pages) == sum(total - f for f in firsts)
        moved += len(rec.ticket.dst_pages)
        skipped += sum(firsts)
    assert pair.metric("pd:kv_transfer_window_skipped_bytes_total") == skipped * page_nbytes > 0
    assert pair.metric("pd:kv_transfer_saved_bytes_total") == 0
    assert pair.all_free()  # the cache keeps its pages for the next turn (`drained` at the end)
    # a second turn: the decode's own cache holds the shared prefix (full groups: every page; windowed groups: the
    # pages the hit's window needs, reached through hollow nodes behind it); the ticket is a delta per group
    ids = long_prompt_ids(3, lengths=(71, 100, 130))[1]  # request r1's prompt
    longer = ids + [7, 8, 9] * 20
    tokens, rec = pair.request("turn2", longer)
    assert tokens == hf_greedy_full(hf, longer, GREEDY.max_tokens)
    h = rec.num_cached_pages
    assert h >= 100 // PAGE
    for g, f in zip(groups.groups, rec.ticket.group_first_pages):
        assert f == max(h, g.first_visible(len(longer)) // PAGE if g.is_windowed else 0)
    saved = sum(max(h - (g.first_visible(len(longer)) // PAGE if g.is_windowed else 0), 0) for g in groups.groups)
    assert pair.metric("pd:kv_transfer_saved_bytes_total") == saved * page_nbytes  # cached pages the decode reads
    assert pair.all_free() and pair.drained()


def test_requests_sharing_a_hollow_path_under_eviction_pressure(tmp_path, aloop):
    """Llama 4 (chunk 16 = page 16): a 64-token prompt ends on a chunk boundary, so its chunked group's cached
    path is hollow. A second request stands on that path and ends first (its end prunes the path); the first
    keeps decoding and caches pages below it; a long third request needs every evictable page. Nothing breaks,
    the tokens are transformers', and every page comes back."""
    hf = build("llama4", tmp_path, max_position_embeddings=2048)
    pair = Pair(tmp_path, aloop)
    base = long_prompt_ids(1, lengths=(64,))[0]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    long_a = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    pair.start("A", base, long_a)
    pair.step()
    b = pair.start("B", base + [5, 6, 7, 8] * 4, one)
    assert b.num_cached_pages == 4  # A's prompt pages, reached through the chunked group's hollow path
    out = pair.finish({"A", "B"})
    assert out["A"] == hf_greedy_full(hf, base, 24) and out["B"] == hf_greedy_full(hf, base + [5, 6, 7, 8] * 4, 1)
    big = [(i * 7) % 500 + 3 for i in range(950)]  # 60 of the decode's 64 pages: evicts the cache
    c = pair.start("C", big, one)
    assert c.ticket is not None and pair.finish({"C"})["C"] == hf_greedy_full(hf, big, 1)
    assert pair.all_free() and pair.drained()


def test_an_unmatched_request_walking_cached_window_pages_leaves_them_evictable(tmp_path, aloop):
    """Gemma 3: a request that asks for prompt logprobs is not matched, so its insert walks the window pages
    an earlier request cached, holding none of them: they stay evictable (and are evicted), not stuck."""
    build("gemma3", tmp_path, max_position_embeddings=2048)
    pair = Pair(tmp_path, aloop)
    ids = long_prompt_ids(1, lengths=(100,))[0]
    pair.start("A", ids)
    pair.finish({"A"})
    scored = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    pair.start("B", ids + [7, 8, 9] * 30, scored)
    pair.finish({"B"})
    assert pair.all_free() and pair.drained()


def test_decode_holds_no_page_behind_a_window(tmp_path, aloop):
    """While the KV is on its way, a windowed group's table holds the null page behind the window of the first
    decode query: the pool holds the full group's pages and only a window's per windowed group."""
    build("gemma3", tmp_path, max_position_embeddings=2048)
    pair = Pair(tmp_path, aloop)
    ids = long_prompt_ids(1, lengths=(150,))[0]
    rec = RemoteRequest("w", "http://127.0.0.1:1", PREFILL_AGENT, aloop)
    pair.hooks.register(pair.decode, rec, ids, GREEDY, stream=False)
    pair.step()
    req = pair.decode.requests["w"]
    total = -(-len(ids) // PAGE)
    for g, table in zip(pair.decode.kv_groups.groups, pair.decode.pages.tables(req)):
        first = g.first_visible(len(ids)) // PAGE if g.is_windowed else 0
        assert len(table) == total and all(p == NULL_PAGE for p in table[:first])
        assert all(p != NULL_PAGE for p in table[first:])
        assert total - first <= (2 if g.is_windowed else total)
    assert sorted(rec.ticket.dst_pages) == sorted(p for t in pair.decode.pages.tables(req) for p in t if p)
    pair._deliver(rec, ids)
    pair.finish({"w"})
    assert pair.all_free() and pair.drained()
