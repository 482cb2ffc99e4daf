"""The decode worker's own prefix cache: delta reservations, every way they end, and local prefills.

A real decode-role engine with the embedded model; the receiver is scripted; a "transfer" is a real
prefill-role engine's pages copied into the decode pool (only the pages the ticket names). After every
ending the pool's accounting must hold exactly: free + evictable == total, and the pages the cache held
before the request are still cached.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from prometheus_client import CollectorRegistry
from scripted import PREFILL_AGENT, LocalPrefill, ScriptedReceiver, decode_engine, run_loop

from pd_cluster.decode.handover import DecodeHooks
from pd_cluster.decode.metrics import DecodeReuseMetrics
from pd_cluster.decode.request import RemoteRequest, RemoteState
from pd_cluster.engine.args import config_from_kwargs
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.engine.sampling.params import SamplingParams
from pd_cluster.transfer.errors import TransferTimeoutError

S = RemoteState
PAGE = 16
FIRST = "Once upon a time, there was a little dog named Max who liked to run in the park with his friend Tom."
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
REST = 26  # turn 2's tokens beyond the 2 pages decode holds (checked in each test)


@pytest.fixture
def aloop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


class Worker:
    """A decode engine, its hooks over a scripted receiver, and a real prefill engine filling its pages."""

    def __init__(self, aloop, **engine_kw) -> None:
        self.engine = decode_engine(**engine_kw)
        self.registry = CollectorRegistry()
        self.hooks = DecodeHooks(ScriptedReceiver(PAGE), DecodeReuseMetrics(self.registry))
        self.prefill = LocalPrefill()
        self.aloop = aloop

    def step(self) -> list:
        out = self.engine.step()
        self.hooks.after_step(self.engine, out)
        self.hooks.poll(self.engine)
        run_loop(self.aloop)
        return out.deltas

    def register(self, rid: str, ids: list[int]) -> RemoteRequest:
        rec = RemoteRequest(rid, "http://127.0.0.1:1", PREFILL_AGENT, self.aloop)
        self.hooks.register(self.engine, rec, ids, GREEDY, stream=False)
        return rec

    def deliver(self, rec: RemoteRequest, ids: list[int]) -> None:
        """The prefill worker computes the whole prompt and pushes only the ticket's pages."""
        self.hooks.send(self.engine, rec.request_id)
        e = self.prefill.engine
        e.add_request(rec.request_id, ids, GREEDY)
        first = None
        while first is None:
            first = next((d.new_token_ids[0] for d in e.step().deltas if d.request_id == rec.request_id
                          and d.new_token_ids), None)
        src = e.scheduler.held[rec.request_id].block_table[rec.ticket.first_page:]
        self.engine.pool.kv[list(rec.ticket.dst_pages)] = e.pool.kv[src]
        e.release_request(rec.request_id)
        self.hooks.receiver.complete(rec.request_id, first)

    def run(self, rid: str) -> list[int]:
        for _ in range(100):
            done = next((d for d in self.step() if d.request_id == rid and d.finished), None)
            if done is not None:
                return done.new_token_ids
        raise AssertionError(f"{rid} did not finish")

    def answer(self, rid: str, ids: list[int]) -> list[int]:
        rec = self.register(rid, ids)
        self.step()
        self.deliver(rec, ids)
        return self.run(rid)

    def metric(self, name: str) -> float:
        return self.registry.get_sample_value(name) or 0.0

    def assert_no_page_in_use(self) -> None:
        pm = self.engine.pages
        assert pm.allocator.num_free + pm.num_evictable == pm.allocator.num_pages
        assert not self.engine.requests and self.hooks.get("r2") is None


def _mixed(ids: list[int]) -> list[int]:
    m = LLMEngine(config_from_kwargs(page_size=PAGE, num_pages=40, disable_radix_cache=True))
    m.add_request("m", ids, GREEDY)
    for _ in range(100):
        done = next((d for d in m.step().deltas if d.finished), None)
        if done is not None:
            return done.new_token_ids
    raise AssertionError("no answer")


def _second_prompt(w: Worker) -> tuple[list[int], list[int], int]:
    """Turn 1's prompt and answer on `w`, then turn 2's prompt (turn 1's tokens and 9 more); the pages held."""
    ids1 = w.engine.tokenize(FIRST)
    out1 = w.answer("r1", ids1)
    ids2 = ids1 + out1 + w.engine.tokenize(" She ran home to her mom.")[1:]
    held = (len(ids1) + len(out1) - 1) // PAGE  # full pages of computed tokens (the last one was never fed)
    assert held >= 2 and w.engine.pages.num_evictable == held
    return ids1 + out1, ids2, held


def test_a_delta_reservation_tickets_only_the_missing_pages_and_the_text_is_exact(aloop, caplog):
    w = Worker(aloop)
    _, ids2, held = _second_prompt(w)
    cached_pages = set(w.engine.prefix_cache._by_page)
    rec = w.register("r2", ids2)
    with caplog.at_level(logging.INFO, logger="engine"):
        w.step()
    req = w.engine.requests["r2"]
    assert rec.state is S.RESERVED and rec.ticket.first_page == held
    assert rec.ticket.dst_pages == tuple(req.block_table[held:]) and len(req.block_table) == -(-len(ids2) // PAGE)
    assert set(req.block_table[:held]) <= cached_pages and w.engine.pages.num_evictable == 0  # referenced
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Prealloc batch."))
    assert f"#new-seq: 1, #new-token: {len(ids2) - held * PAGE}, #cached-token: {held * PAGE}," in line
    w.deliver(rec, ids2)
    assert w.run("r2") == _mixed(ids2)
    assert w.metric("pd:kv_transfer_saved_bytes_total") == held * w.engine.layout.page_nbytes
    assert w.engine.stats.prefix_cache_hits == held * PAGE
    w.assert_no_page_in_use()
    assert w.engine.pages.num_evictable == (len(ids2) + 12 - 1) // PAGE  # turn 2's pages joined the cache


@pytest.mark.parametrize("ending", ["refused", "aborted_before_send", "timeout_then_released", "peer_gone"])
def test_every_ending_of_a_delta_request_gives_every_page_back(aloop, ending):
    w = Worker(aloop)
    _, ids2, held = _second_prompt(w)
    cached = set(w.engine.prefix_cache._by_page)
    rec = w.register("r2", ids2)
    w.step()
    assert rec.state is S.RESERVED and rec.ticket.first_page == held
    if ending == "aborted_before_send":
        w.hooks.abort(w.engine, "r2", "the client went away")
    else:
        w.hooks.send(w.engine, "r2")
        if ending == "refused":
            w.hooks.fail(w.engine, "r2", RuntimeError("stale"), refused=True)
        elif ending == "peer_gone":
            w.hooks.fail(w.engine, "r2", RuntimeError("reset"), peer_gone=True)
            assert rec.state is S.QUARANTINED and w.engine.pages.num_evictable == 0  # still held
            w.hooks.receiver.release("r2", "sender process gone")
        else:
            w.hooks.receiver.fail("r2", TransferTimeoutError("no push for 30 s", transfer_id=rec.transfer_id))
            w.step()
            assert rec.state is S.QUARANTINED and w.engine.pages.num_evictable == 0
            w.hooks.receiver.release("r2")
    w.step()
    assert rec.state is S.RELEASED
    w.assert_no_page_in_use()
    assert set(w.engine.prefix_cache._by_page) == cached  # nothing of the failed request was cached
    assert w.engine.pages.num_evictable == len(cached)
    assert w.metric("pd:kv_transfer_saved_bytes_total") == 0


def test_a_short_uncached_rest_is_prefilled_locally_without_a_ticket(aloop, caplog):
    w = Worker(aloop, max_local_prefill_length=REST)
    _, ids2, held = _second_prompt(w)
    rest = len(ids2) - held * PAGE
    assert rest == REST
    rec = w.register("r2", ids2)
    with caplog.at_level(logging.INFO):
        w.step()
    assert rec.history == [S.QUEUED, S.RUNNING] and rec.ticket_future.result() is None
    assert ("expect", "r2") not in w.hooks.receiver.calls and w.hooks.get("r2") is None
    assert any(f"prefilling {rest} of {len(ids2)} prompt tokens locally" in r.getMessage() for r in caplog.records)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Prefill batch."))
    assert f"#new-token: {rest}, #cached-token: {held * PAGE}," in line
    tokens = w.run("r2")
    assert tokens == _mixed(ids2)
    assert w.metric("pd:decode_local_prefill_requests_total") == 1
    assert w.metric("pd:kv_transfer_saved_bytes_total") == held * w.engine.layout.page_nbytes
    w.assert_no_page_in_use()


def test_a_longer_rest_still_goes_to_the_prefill_worker(aloop):
    w = Worker(aloop, max_local_prefill_length=REST - 1)
    _, ids2, held = _second_prompt(w)
    assert len(ids2) - held * PAGE == REST  # one more than the threshold: remote (Dynamo's strict ">")
    rec = w.register("r2", ids2)
    w.step()
    assert rec.state is S.RESERVED and w.metric("pd:decode_local_prefill_requests_total") == 0
