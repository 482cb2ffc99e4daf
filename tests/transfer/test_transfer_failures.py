"""Acceptance 4: failures end fast and clean.

Each case runs a real transfer between two processes and breaks it: the
prefill process is killed, or stopped (SIGSTOP) so decode's deadline passes,
or the decode process is stopped so a push cannot complete and times out on
the sender, or either side aborts. Each case must end within its deadline
with a typed error, and both pools must come back to all-free (the pages of
a failed transfer are reused only once the sender provably stopped).
"""

from __future__ import annotations

import signal
import time

import pytest
from conftest import connect_pair
from kv_peer import PeerCallError, PeerSpec

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py: the fast tier starts none)

TIMEOUT = 4.0  # --kv-transfer-timeout of these workers (the sender's push timeout is a quarter of it)
HEARTBEAT = 0.2
NUM_PAGES = 64
PROMPT = 300  # 19 pages of 16 tokens: 5 chunks of 64


def specs(**kw):
    common = dict(kv_cache_dtype="fp8_e4m3", page_size=16, num_pages=NUM_PAGES, kv_transfer_timeout=TIMEOUT,
                  heartbeat_interval=HEARTBEAT)
    common.update(kw)
    return PeerSpec("prefill", **common), PeerSpec("decode", **common)


def ended(kinds):
    return lambda ev: {e["kind"] for e in ev} >= set(kinds)


def first(events, kind):
    return next(e for e in events if e["kind"] == kind)


def start_transfer(pre, dec, tokenizer, request_id):
    """Handshake, ticket, and the first chunk pushed and arrived; returns the transfer id."""
    connect_pair(pre, dec)
    ids = (tokenizer("Once upon a time there was a big red ball. ").input_ids * 40)[:PROMPT]
    ticket = dec.call("expect", request_id, PROMPT, pre.agent)
    pre.call("start", ticket, ids, 64, False)
    pre.call("chunk", ticket["transfer_id"])
    deadline = time.monotonic() + 10
    while not dec.call("progress", ticket["transfer_id"]):
        assert time.monotonic() < deadline, "the first push never arrived"
        time.sleep(0.005)
    return ticket["transfer_id"]


def assert_all_free(*peers):
    for p in peers:
        st = p.call("state")
        assert st["free"] == NUM_PAGES and st.get("quarantined", 0) == 0 and st.get("inflight", 0) == 0, st


@pytest.mark.timeout(120)
def test_prefill_killed_mid_transfer(launcher, tokenizer):
    pre, dec = launcher.start(*specs())
    tid = start_transfer(pre, dec, tokenizer, "req-kill-prefill")
    t0 = time.monotonic()
    pre.signal(signal.SIGKILL)
    events = dec.wait_events(ended(["failed", "released"]), TIMEOUT + 5)
    elapsed = time.monotonic() - t0
    f = first(events, "failed")
    assert (f["tid"], f["type"], f["reason"]) == (tid, "PeerDiedError", "peer_died")
    assert first(events, "released")["why"] == "sender process gone"
    assert elapsed < TIMEOUT, f"took {elapsed:.2f} s: the liveness probe, not the deadline, must catch a dead peer"
    assert_all_free(dec)


@pytest.mark.timeout(120)
def test_decode_killed_mid_transfer(launcher, tokenizer):
    pre, dec = launcher.start(*specs())
    tid = start_transfer(pre, dec, tokenizer, "req-kill-decode")
    t0 = time.monotonic()
    dec.signal(signal.SIGKILL)
    events = pre.wait_events(ended(["failed"]), TIMEOUT + 5)
    f = first(events, "failed")
    assert (f["tid"], f["type"]) == (tid, "PeerDiedError")
    assert time.monotonic() - t0 < TIMEOUT
    assert_all_free(pre)


@pytest.mark.timeout(120)
def test_prefill_hangs_decode_deadline(launcher, tokenizer):
    """The prefill process freezes after one push: decode fails the request at its deadline, keeps the
    pages out of use while the sender could still write, and frees them when the sender confirms it stopped."""
    pre, dec = launcher.start(*specs())
    tid = start_transfer(pre, dec, tokenizer, "req-hang")
    t0 = time.monotonic()
    pre.signal(signal.SIGSTOP)
    events = dec.wait_events(ended(["failed"]), TIMEOUT + 5)
    waited = time.monotonic() - t0
    f = first(events, "failed")
    assert (f["tid"], f["type"], f["reason"]) == (tid, "TransferTimeoutError", "timeout")
    assert "--kv-transfer-timeout" in f["message"]
    assert TIMEOUT - 0.5 < waited < TIMEOUT + 2.0, waited
    st = dec.call("state")
    assert st["quarantined"] == 1 and st["free"] < NUM_PAGES  # not reusable while the sender may still write
    pre.signal(signal.SIGCONT)
    events = dec.wait_events(ended(["released"]), 10)
    assert first(events, "released")["why"] == "sender stopped"
    sent = pre.wait_events(ended(["failed"]), 10)
    assert first(sent, "failed")["tid"] == tid
    assert_all_free(pre, dec)


@pytest.mark.timeout(120)
def test_push_times_out_on_sender(launcher):
    """Decode freezes while a 64 MiB push is on TCP: the push times out on the sender, which cancels it
    and frees its pages; when decode wakes it learns the sender stopped and frees its own."""
    pre, dec = launcher.start(*specs(page_size=64, num_pages=3300, ucx_tls="tcp"))
    connect_pair(pre, dec)
    n = 3200 * 64  # 3,200 pages of 20 KiB: 62.5 MiB
    ticket = dec.call("expect", "req-push-timeout", n, pre.agent)
    dec.signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        pre.call("start", ticket, None, n, True)  # one push of every page, posted by the next step
        events = pre.wait_events(ended(["failed"]), TIMEOUT + 10)
        waited = time.monotonic() - t0
    finally:
        dec.signal(signal.SIGCONT)
    f = first(events, "failed")
    assert (f["tid"], f["type"], f["reason"]) == (ticket["transfer_id"], "TransferTimeoutError", "timeout"), f
    assert "did not complete" in f["message"]
    assert waited < TIMEOUT, waited  # the push timeout is TIMEOUT / 4
    events = dec.wait_events(ended(["failed", "released"]), 10)
    assert first(events, "released")["why"] == "sender stopped"
    for p in (pre, dec):
        st = p.call("state")
        assert st["free"] == 3300 and st.get("quarantined", 0) == 0, st


@pytest.mark.timeout(120)
def test_abort_from_prefill(launcher, tokenizer):
    pre, dec = launcher.start(*specs())
    tid = start_transfer(pre, dec, tokenizer, "req-abort-p")
    assert pre.call("abort", tid) is True
    sent = pre.wait_events(ended(["failed"]), 5)
    assert (first(sent, "failed")["type"], first(sent, "failed")["side"]) == ("TransferAbortedError", "prefill")
    events = dec.wait_events(ended(["failed", "released"]), 5)
    f = first(events, "failed")
    assert (f["type"], f["side"]) == ("TransferAbortedError", "prefill")
    assert first(events, "released")["why"] == "sender stopped"
    assert_all_free(pre, dec)


@pytest.mark.timeout(120)
def test_abort_from_decode(launcher, tokenizer):
    pre, dec = launcher.start(*specs())
    tid = start_transfer(pre, dec, tokenizer, "req-abort-d")
    assert dec.call("abort", tid) is True
    events = dec.wait_events(ended(["failed", "released"]), 5)
    f = first(events, "failed")
    assert (f["type"], f["side"]) == ("TransferAbortedError", "decode")
    assert first(events, "released")["why"] == "sender stopped"  # the sender's confirmation, not the quarantine
    sent = pre.wait_events(ended(["failed"]), 5)
    assert (first(sent, "failed")["type"], first(sent, "failed")["side"]) == ("TransferAbortedError", "decode")
    with pytest.raises(PeerCallError):  # the prefill job is gone: nothing more is pushed
        pre.call("chunk", tid)
    assert_all_free(pre, dec)


@pytest.mark.timeout(120)
def test_decode_abort_before_the_ticket_arrives(launcher, tokenizer):
    """Decode gives up before prefill saw the ticket: prefill confirms at once and refuses the late ticket."""
    pre, dec = launcher.start(*specs())
    connect_pair(pre, dec)
    ticket = dec.call("expect", "req-early-abort", 40, pre.agent)
    assert dec.call("abort", ticket["transfer_id"]) is True
    events = dec.wait_events(ended(["failed", "released"]), 5)
    assert first(events, "released")["why"] == "sender stopped"
    with pytest.raises(PeerCallError) as err:
        pre.call("start", ticket, list(range(1, 41)), 16)
    assert err.value.type == "TransferAbortedError"
    assert_all_free(pre, dec)
