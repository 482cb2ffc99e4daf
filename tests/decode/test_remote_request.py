"""The decode side's `RemoteRequest` state machine, every transition, on a real engine with a scripted receiver.

No processes: the engine is the real embedded model in the decode role, the receiver is scripted, and the KV
"transfer" is a real prefill-role engine's pages copied into the decode pool.
"""

from __future__ import annotations

import asyncio
import gc

import pytest
from scripted import PREFILL_AGENT, LocalPrefill, ScriptedReceiver, decode_engine, run_loop

from pd_cluster.decode.handover import DecodeHooks, RequestAborted
from pd_cluster.decode.request import NEXT, IllegalTransition, RemoteRequest, RemoteState
from pd_cluster.engine.args import config_from_kwargs
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.engine.sampling.params import SamplingParams
from pd_cluster.transfer.errors import PeerDiedError, TransferTimeoutError

S = RemoteState
PROMPT = "Once upon a time, there was a little dog named Max who"
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture
def aloop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture
def engine():
    return decode_engine()


@pytest.fixture
def hooks(engine):
    return DecodeHooks(ScriptedReceiver(engine.layout.page_size))


def _register(engine, hooks, aloop, rid="r1", prompt=PROMPT, params=GREEDY) -> RemoteRequest:
    rec = RemoteRequest(rid, "http://127.0.0.1:1", PREFILL_AGENT, aloop)
    hooks.register(engine, rec, engine.tokenize(prompt), params, stream=False)
    return rec


def _step(engine, hooks) -> list:
    out = engine.step()
    hooks.after_step(engine, out)
    hooks.poll(engine)
    return out.deltas


def _reserved(engine, hooks, aloop, **kw) -> RemoteRequest:
    rec = _register(engine, hooks, aloop, **kw)
    _step(engine, hooks)
    run_loop(aloop)
    assert rec.state is S.RESERVED and rec.ticket_future.result() is rec.ticket
    return rec


def _error_of(fut: asyncio.Future) -> BaseException:
    assert fut.done()
    return fut.exception()


def test_the_transition_table_is_the_documented_one():
    assert NEXT[S.QUEUED] == {S.RESERVED, S.RUNNING, S.FAILED}  # RUNNING: prefilled here (--max-local-prefill-length)
    assert NEXT[S.RESERVED] == {S.ARRIVING, S.FAILED}
    assert NEXT[S.ARRIVING] == {S.RUNNING, S.FAILED}
    assert NEXT[S.FAILED] == {S.QUARANTINED, S.RELEASED}
    assert NEXT[S.QUARANTINED] == {S.RELEASED}
    assert NEXT[S.RUNNING] == NEXT[S.RELEASED] == frozenset()


def test_queued_reserved_arriving_running_matches_mixed_greedy(engine, hooks, aloop):
    total = engine.num_free_pages()
    prefill = LocalPrefill()
    rec = _register(engine, hooks, aloop)
    assert rec.state is S.QUEUED and hooks.num_prealloc == 1 and not rec.ticket_future.done()
    _step(engine, hooks)
    run_loop(aloop)
    assert rec.state is S.RESERVED and hooks.num_prealloc == 0
    ticket = rec.ticket_future.result()
    assert ticket.num_tokens == len(engine.tokenize(PROMPT)) and engine.num_free_pages() == total - ticket.num_pages
    hooks.send(engine, rec.request_id)
    assert rec.state is S.ARRIVING
    first = prefill.prefill_into(engine, ticket.dst_pages, engine.tokenize(PROMPT), GREEDY)
    hooks.receiver.complete(rec.request_id, first)
    hooks.poll(engine)
    run_loop(aloop)
    assert rec.state is S.RUNNING and rec.kv_future.result().transfer_id == ticket.transfer_id
    assert rec.history == [S.QUEUED, S.RESERVED, S.ARRIVING, S.RUNNING]
    assert hooks.get(rec.request_id) is None  # the engine owns a running request
    tokens = None
    for _ in range(100):
        for d in _step(engine, hooks):
            if d.finished:
                tokens = d.new_token_ids
        if tokens is not None:
            break
    mixed = LLMEngine(config_from_kwargs(page_size=16, num_pages=40))
    mixed.add_request("m", PROMPT, GREEDY)
    want = None
    while want is None:
        want = next((d.new_token_ids for d in mixed.step().deltas if d.finished), None)
    assert tokens == want and len(tokens) == 12
    assert engine.num_free_pages() == total and not engine.requests


def test_failure_while_queued_releases_at_once(engine, hooks, aloop):
    total = engine.num_free_pages()
    rec = _register(engine, hooks, aloop)
    hooks.abort(engine, rec.request_id, "the client went away")
    run_loop(aloop)
    assert rec.history == [S.QUEUED, S.FAILED, S.RELEASED]
    assert isinstance(_error_of(rec.ticket_future), RequestAborted)
    assert isinstance(_error_of(rec.kv_future), RequestAborted)
    _step(engine, hooks)
    assert engine.num_free_pages() == total and not engine.requests and hooks.get("r1") is None
    assert hooks.receiver.calls == []  # no ticket existed


def test_failure_while_reserved_withdraws_and_releases_at_once(engine, hooks, aloop):
    """The handler failed before the ticket left (e.g. the body could not be encoded): nothing can be written."""
    total = engine.num_free_pages()
    rec = _reserved(engine, hooks, aloop)
    assert engine.num_free_pages() < total
    hooks.fail(engine, rec.request_id, ValueError("temperature: NaN is not JSON"))
    run_loop(aloop)
    assert rec.history == [S.QUEUED, S.RESERVED, S.FAILED, S.RELEASED]
    assert hooks.receiver.kinds() == ["expect", "withdraw"]
    assert engine.num_free_pages() == total and hooks.get("r1") is None
    assert isinstance(_error_of(rec.kv_future), ValueError)


def test_abort_while_arriving_quarantines_until_the_receiver_releases(engine, hooks, aloop):
    total = engine.num_free_pages()
    rec = _reserved(engine, hooks, aloop)
    hooks.send(engine, rec.request_id)
    hooks.abort(engine, rec.request_id, "the client went away")
    run_loop(aloop)
    assert rec.state is S.QUARANTINED and hooks.receiver.kinds() == ["expect", "abort"]
    for _ in range(3):  # WRITEs may still land: the pages stay out of the pool
        _step(engine, hooks)
        assert engine.num_free_pages() == total - rec.ticket.num_pages
    hooks.receiver.release(rec.request_id, "sender stopped")
    hooks.poll(engine)
    assert rec.history == [S.QUEUED, S.RESERVED, S.ARRIVING, S.FAILED, S.QUARANTINED, S.RELEASED]
    assert engine.num_free_pages() == total and not engine.requests and hooks.get("r1") is None


def test_refused_before_any_push_releases_at_once(engine, hooks, aloop):
    total = engine.num_free_pages()
    rec = _reserved(engine, hooks, aloop)
    hooks.send(engine, rec.request_id)
    hooks.fail(engine, rec.request_id, RuntimeError("prefill answered 400"), refused=True)
    assert rec.history[-2:] == [S.FAILED, S.RELEASED]
    assert hooks.receiver.kinds() == ["expect", "withdraw"] and engine.num_free_pages() == total


def test_refused_after_a_push_goes_through_quarantine(engine, hooks, aloop):
    total = engine.num_free_pages()
    rec = _reserved(engine, hooks, aloop)
    hooks.send(engine, rec.request_id)
    hooks.receiver.pushed.add(rec.transfer_id)
    hooks.fail(engine, rec.request_id, RuntimeError("prefill answered 409"), refused=True)
    assert rec.state is S.QUARANTINED and hooks.receiver.kinds() == ["expect", "withdraw", "abort"]
    assert engine.num_free_pages() == total - rec.ticket.num_pages
    hooks.receiver.release(rec.request_id)
    hooks.poll(engine)
    assert rec.state is S.RELEASED and engine.num_free_pages() == total


def test_peer_gone_fails_the_peer_and_quarantines(engine, hooks, aloop):
    total = engine.num_free_pages()
    rec = _reserved(engine, hooks, aloop)
    hooks.send(engine, rec.request_id)
    hooks.fail(engine, rec.request_id, RuntimeError("connection reset"), peer_gone=True)
    assert rec.state is S.QUARANTINED and hooks.receiver.calls[-1] == ("peer_failed", PREFILL_AGENT)
    hooks.receiver.release(rec.request_id, "sender process gone")
    hooks.poll(engine)
    assert rec.state is S.RELEASED and engine.num_free_pages() == total


def test_receiver_failure_then_release(engine, hooks, aloop):
    total = engine.num_free_pages()
    rec = _reserved(engine, hooks, aloop)
    hooks.send(engine, rec.request_id)
    err = TransferTimeoutError("no push for 30 s", transfer_id=rec.transfer_id, peer=PREFILL_AGENT)
    hooks.receiver.fail(rec.request_id, err)
    hooks.poll(engine)
    run_loop(aloop)
    assert rec.state is S.QUARANTINED and _error_of(rec.kv_future) is err
    hooks.fail(engine, rec.request_id, RuntimeError("the handler's own view"))  # an echo: nothing happens
    assert rec.state is S.QUARANTINED and rec.error is err
    hooks.receiver.release(rec.request_id, "quarantine expired")
    hooks.poll(engine)
    assert rec.history[-3:] == [S.FAILED, S.QUARANTINED, S.RELEASED] and engine.num_free_pages() == total


def test_a_push_seen_while_reserved_implies_arriving(engine, hooks, aloop):
    """The engine thread may see the transfer end before it ran the handler's `send` command."""
    rec = _reserved(engine, hooks, aloop)
    hooks.receiver.fail(rec.request_id, PeerDiedError("gone", transfer_id=rec.transfer_id))
    hooks.poll(engine)
    assert rec.history == [S.QUEUED, S.RESERVED, S.ARRIVING, S.FAILED, S.QUARANTINED]
    hooks.send(engine, rec.request_id)  # the late command: a no-op once failed
    assert rec.state is S.QUARANTINED


def test_receiver_refusing_the_ticket_releases_at_once(engine, hooks, aloop):
    total = engine.num_free_pages()
    hooks.receiver.refuse_expect = ValueError("decode page id 99 is outside 1..40")
    rec = _register(engine, hooks, aloop)
    _step(engine, hooks)
    run_loop(aloop)
    assert rec.history == [S.QUEUED, S.FAILED, S.RELEASED]
    assert isinstance(_error_of(rec.ticket_future), ValueError)
    _step(engine, hooks)
    assert engine.num_free_pages() == total and not engine.requests


def test_kv_without_a_first_token_fails_and_releases(engine, hooks, aloop):
    total = engine.num_free_pages()
    rec = _reserved(engine, hooks, aloop)
    hooks.send(engine, rec.request_id)
    hooks.receiver.complete(rec.request_id, None)
    hooks.poll(engine)
    run_loop(aloop)
    assert rec.history[-2:] == [S.FAILED, S.RELEASED] and "no first token" in str(_error_of(rec.kv_future))
    _step(engine, hooks)
    assert engine.num_free_pages() == total and not engine.requests


def test_illegal_transitions_raise(engine, hooks, aloop):
    rec = _register(engine, hooks, aloop)
    done = type("Done", (), {"wait_s": 0.0})()
    with pytest.raises(IllegalTransition):
        rec.complete(engine, done, 1, None)  # QUEUED -> RUNNING
    with pytest.raises(IllegalTransition):
        rec.send()  # QUEUED -> ARRIVING
    _step(engine, hooks)
    with pytest.raises(IllegalTransition):
        rec.reserve(engine, hooks.receiver, [1])  # reserved twice
    hooks.send(engine, rec.request_id)
    first = LocalPrefill().prefill_into(engine, rec.ticket.dst_pages, engine.tokenize(PROMPT), GREEDY)
    hooks.receiver.complete(rec.request_id, first)
    hooks.poll(engine)
    assert rec.state is S.RUNNING
    with pytest.raises(IllegalTransition):
        rec.fail(engine, hooks.receiver, RuntimeError("late"))
    with pytest.raises(IllegalTransition):
        rec.on_pages_released(engine, None)
    assert rec.state is S.RUNNING
    hooks.abort(engine, rec.request_id, "the client went away")  # a running request is aborted in the engine
    _step(engine, hooks)
    assert not engine.requests


def test_failed_futures_leave_no_unretrieved_exception(engine, hooks, aloop):
    """A handler that went away never awaits its futures: asyncio must not complain about them."""
    complaints = []
    aloop.set_exception_handler(lambda loop, ctx: complaints.append(ctx.get("message")))
    rec = _reserved(engine, hooks, aloop)
    hooks.send(engine, rec.request_id)
    hooks.abort(engine, rec.request_id, "the client went away")
    hooks.receiver.release(rec.request_id)
    hooks.poll(engine)
    run_loop(aloop)
    assert rec.state is S.RELEASED and hooks.get(rec.request_id) is None
    del rec
    gc.collect()
    run_loop(aloop)
    assert complaints == []
