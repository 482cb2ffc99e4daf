"""Rank 0's merge of the ranks' transfer events under tensor parallelism (`TPSender.poll`, `TPReceiver._merge`).

A scripted driver stands in for the rank processes: each test says what every rank's sender or receiver
reports, and checks what rank 0 makes of it. The rule: a transfer is complete when every rank's part is,
failed as soon as one part fails (the other parts are aborted, once), and its pages are reusable only when
every part has ended.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from pd_cluster.transfer.errors import PeerDiedError, StalePeerError, TransferAbortedError, TransferTimeoutError
from pd_cluster.transfer.interfaces import Receiver, Sender
from pd_cluster.transfer.metrics import TransferMetrics
from pd_cluster.transfer.receiver_events import PagesReleased, ReceiverEvents, RecvDone, RecvFailed
from pd_cluster.transfer.sender import SendDone, SenderEvents, SendFailed
from pd_cluster.transfer.ticket import KVTicket, TPTicket
from pd_cluster.transfer.tp import EXTENSION, RankTransfer, TPReceiver, TPSender, on_ranks

SIZE = 2
PAGES = (3, 4)


class ScriptedDriver:
    """`TPDriver.call` for ``ext`` calls: records them; polls answer from per-rank scripts."""

    def __init__(self, size: int = SIZE) -> None:
        self.tp = type("TP", (), {"size": size})()
        self.size = size
        self.calls: list[tuple] = []
        self.next_events: list = [None] * size
        # rank 0's own RankTransfer: its metrics are read (the worker serves them); announcements are recorded
        self.metrics = TransferMetrics(CollectorRegistry())
        self.rank0_calls: list[tuple] = []
        rank0 = SimpleNamespace(sender=SimpleNamespace(metrics=self.metrics),
                                receiver=SimpleNamespace(metrics=self.metrics),
                                sender_announce=lambda parts: self.rank0_calls.append(("sender_announce", parts)),
                                sender_withdraw_announced=lambda tids: self.rank0_calls.append(
                                    ("sender_withdraw_announced", tids)))
        self.local = SimpleNamespace(extensions={EXTENSION: rank0})
        self.posts: list[tuple] = []

    def post(self, ext, method, *args):
        """`TPDriver.post`: what goes to ranks 1..N-1 over the side channel."""
        assert ext == EXTENSION and method in RankTransfer.SIDE_METHODS
        self.posts.append((method, args))

    def call(self, name, ext, method, *args, gather=False):
        assert name == "ext" and ext == EXTENSION
        self.calls.append((method, args, gather))
        if method in ("sender_poll", "receiver_poll"):
            empty = SenderEvents() if method == "sender_poll" else ReceiverEvents()
            evs = [e if e is not None else empty for e in self.next_events]
            self.next_events = [None] * self.size
            return [(ev, True, 0) for ev in evs]
        if method == "receiver_expect":
            rid, pages, n, prefill0, first_page, group_first_pages = args
            return [[KVTicket(f"{rid}@r{r}", rid, f"decode-r{r}", f"prefill-r{r}", tuple(pages), n, 16, first_page,
                              group_first_pages)]
                    for r in range(self.size)]
        if method == "receiver_withdraw":
            return [PAGES] * self.size
        if method == "sender_push":
            return 1
        return [None] * self.size if gather else None

    def methods(self, name: str) -> list[tuple]:
        return [c for c in self.calls if c[0] == name]


def _poll(proxy):
    proxy._last_poll = 0.0  # polls are rate-limited to one per millisecond; the script decides instead
    return proxy.poll()


def _tp_ticket(rid: str = "r") -> TPTicket:
    return TPTicket(tuple(KVTicket(f"{rid}@r{r}", rid, f"decode-r{r}", f"prefill-r{r}", PAGES, 20, 16)
                          for r in range(SIZE)))


# ---- the sender ------------------------------------------------------------------------------
@pytest.fixture
def sender():
    d = ScriptedDriver()
    s = TPSender(d)
    s.add_request(_tp_ticket())
    return d, s


def test_the_proxies_implement_the_protocols():
    d = ScriptedDriver()
    assert isinstance(TPSender(d), Sender) and isinstance(TPReceiver(d), Receiver)


def test_sender_complete_only_when_every_rank_is(sender):
    d, s = sender
    d.next_events[0] = SenderEvents(completed=[SendDone("r@r0", "r", 2, 100, 0.5)])
    assert _poll(s).completed == [] and "r@r0" in s.parts
    d.next_events[1] = SenderEvents(completed=[SendDone("r@r1", "r", 2, 120, 0.7)])
    ev = _poll(s)
    assert ev.completed == [SendDone("r@r0", "r", 2, 220, 0.7)] and ev.failed == []
    assert s.parts == {} and d.methods("sender_abort") == []
    # rank 0's KVSender counted its own 100 bytes as it pushed them; the merge adds rank 1's 120
    assert d.metrics.bytes._value.get() == 120


def test_sender_one_rank_fails_the_rest_are_aborted_once_and_failure_waits_for_all(sender):
    d, s = sender
    err = PeerDiedError("decode rank 1 is gone", transfer_id="r@r1")
    d.next_events[1] = SenderEvents(failed=[SendFailed("r@r1", "r", err)])
    ev = _poll(s)
    assert ev.failed == [] and ev.completed == []  # rank 0 may still hold a handle: not over yet
    aborts = d.methods("sender_abort")
    assert len(aborts) == 1 and aborts[0][1] == (("r@r0", "r@r1"), "part 1 failed")
    assert _poll(s).failed == [] and len(d.methods("sender_abort")) == 1  # never twice
    d.next_events[0] = SenderEvents(failed=[SendFailed("r@r0", "r", TransferAbortedError("aborted", side="prefill"))])
    ev = _poll(s)
    assert ev.failed == [SendFailed("r@r0", "r", err)] and s.parts == {}


def test_sender_done_on_one_rank_failed_on_the_other_is_a_failure(sender):
    d, s = sender
    err = TransferTimeoutError("push 0 did not complete")
    d.next_events[0] = SenderEvents(completed=[SendDone("r@r0", "r", 1, 100, 0.1)])
    d.next_events[1] = SenderEvents(failed=[SendFailed("r@r1", "r", err)])
    ev = _poll(s)
    assert ev.completed == [] and [f.error for f in ev.failed] == [err]


def test_sender_ignores_unknown_transfers_and_refuses_a_plain_ticket(sender):
    d, s = sender
    d.next_events[0] = SenderEvents(completed=[SendDone("other@r0", "other", 1, 10, 0.1)])
    assert _poll(s).completed == [] and list(s.parts) == ["r@r0"]
    with pytest.raises(ValueError, match="one ticket per rank"):
        s.add_request(KVTicket("x", "x", "d", "p", PAGES, 20, 16))


def test_sender_push_honours_ready_event(sender):
    """None posts at once on every rank; an event asks every rank to gate on its own forward pass."""
    d, s = sender
    s.push("r@r0", [7, 8], 16, ready_event=None)
    s.push("r@r0", [7, 8], 20, meta={"first_token_id": 5}, ready_event=object())
    pushes = d.methods("sender_push")
    assert [c[1][-1] for c in pushes] == [False, True]
    assert pushes[1][1][:4] == (("r@r0", "r@r1"), [7, 8], 20, {"first_token_id": 5})


def test_announce_reaches_every_rank_off_the_step_loop_until_added_or_withdrawn():
    """A ticket waiting for a long step: rank 0 announces its own part at once and posts every rank's (id, decode
    agent) to the others (no block table crosses the side channel); a withdrawal follows the same way, and an
    added ticket is not withdrawn later (nothing is posted)."""
    d = ScriptedDriver()
    s = TPSender(d)
    waiting, added = _tp_ticket("w"), _tp_ticket("a")
    parts = (("w@r0", "decode-r0", "prefill-r0"), ("w@r1", "decode-r1", "prefill-r1"))
    s.announce(waiting)
    s.announce(added)
    assert d.rank0_calls[0] == ("sender_announce", parts) and d.posts[0] == ("sender_announce", (parts,))
    assert d.calls == []  # nothing went through the step loop's channel
    s.add_request(added)
    s.withdraw_announced(added.transfer_id)  # already added: nothing to withdraw
    s.withdraw_announced(waiting.transfer_id)
    s.withdraw_announced(waiting.transfer_id)  # once only
    withdrawn = [c for c in d.posts if c[0] == "sender_withdraw_announced"]
    assert withdrawn == [("sender_withdraw_announced", (("w@r0", "w@r1"),))]
    assert d.rank0_calls[-1] == ("sender_withdraw_announced", ("w@r0", "w@r1")) and len(d.rank0_calls) == 3
    with pytest.raises(ValueError, match="one ticket per rank"):
        s.announce(KVTicket("x", "x", "d", "p", PAGES, 20, 16))


def test_rank_calls_name_real_methods():
    d = ScriptedDriver()
    with pytest.raises(TypeError):
        on_ranks(d, TPSender.poll)
    on_ranks(d, RankTransfer.close)
    assert d.calls[-1] == ("close", (), True)


# ---- the receiver ----------------------------------------------------------------------------
@pytest.fixture
def receiver():
    d = ScriptedDriver()
    r = TPReceiver(d)
    t = r.expect("r", list(PAGES), 20, "prefill-r0")
    assert t.transfer_id == "r@r0" and t.dst_pages == PAGES and r.num_waiting == 1
    return d, r


def _done(r: int) -> RecvDone:
    return RecvDone(f"r@r{r}", "r", PAGES, {"first_token_id": 9} if r == 0 else {}, (), 100 + r, 0.2 + r, 0.1)


def test_receiver_complete_only_when_every_rank_is(receiver):
    d, r = receiver
    d.next_events[1] = ReceiverEvents(completed=[_done(1)])
    assert _poll(r).completed == []
    d.next_events[0] = ReceiverEvents(completed=[_done(0)])
    ev = _poll(r)
    assert ev.completed == [RecvDone("r@r0", "r", PAGES, {"first_token_id": 9}, (), 201, 1.2, 0.1)]
    assert d.metrics.received_bytes._value.get() == 101  # rank 1's; rank 0's KVReceiver counts its own
    assert r.parts == {} and ev.failed == [] and ev.released == []


def test_receiver_failure_is_reported_at_once_and_pages_wait_for_every_part(receiver):
    d, r = receiver
    err = PeerDiedError("prefill rank 0 gone", transfer_id="r@r0")
    d.next_events[0] = ReceiverEvents(failed=[RecvFailed("r@r0", "r", err)])
    ev = _poll(r)
    assert ev.failed == [RecvFailed("r@r0", "r", err)] and ev.released == []
    aborts = d.methods("receiver_abort")
    assert len(aborts) == 1 and aborts[0][1][0] == ("r@r0", "r@r1") and r.num_waiting == 0
    d.next_events[0] = ReceiverEvents(released=[PagesReleased("r@r0", "r", PAGES, "sender process gone")])
    ev = _poll(r)
    assert ev.failed == [] and ev.released == []  # rank 1's sender may still write
    d.next_events[1] = ReceiverEvents(failed=[RecvFailed("r@r1", "r", TransferAbortedError("aborted", side="decode"))])
    assert _poll(r).failed == []  # reported once
    d.next_events[1] = ReceiverEvents(released=[PagesReleased("r@r1", "r", PAGES, "sender stopped")])
    ev = _poll(r)
    assert ev.released == [PagesReleased("r@r0", "r", PAGES, "every rank's part ended")] and r.parts == {}
    assert len(d.methods("receiver_abort")) == 1


def test_receiver_done_part_counts_as_ended_after_a_failure(receiver):
    d, r = receiver
    d.next_events[0] = ReceiverEvents(completed=[_done(0)])
    d.next_events[1] = ReceiverEvents(failed=[RecvFailed("r@r1", "r", TransferTimeoutError("no push"))])
    ev = _poll(r)
    assert ev.completed == [] and len(ev.failed) == 1 and ev.released == []
    d.next_events[1] = ReceiverEvents(released=[PagesReleased("r@r1", "r", PAGES, "quarantine expired")])
    assert _poll(r).released == [PagesReleased("r@r0", "r", PAGES, "every rank's part ended")]


def test_receiver_abort_and_withdraw(receiver):
    d, r = receiver
    assert r.abort("r@r0", "client went away") is True
    assert r.abort("r@r0", "again") is False and len(d.methods("receiver_abort")) == 1
    assert r.withdraw("r@r0") == PAGES and r.parts == {}
    assert r.withdraw("r@r0") == () and r.abort("unknown") is False


def test_a_ticket_for_an_earlier_incarnation_of_a_rank_is_stale_not_malformed():
    """A decode whose metadata of this worker predates its restart names the old agents: StalePeerError, which
    the decode answers by refreshing the metadata and retrying (a 409 ``stale_peer``), as a lone sender's did;
    nothing is announced or added."""
    d = ScriptedDriver()
    s = TPSender(d, tuple(f"prefill-r{r}-new" for r in range(SIZE)))
    with pytest.raises(StalePeerError, match="names prefill agent prefill-r0, not a rank of this .*restarted"):
        s.announce(_tp_ticket("old"))
    with pytest.raises(StalePeerError):
        s.add_request(_tp_ticket("old"))
    assert not s.parts and not s._announced
