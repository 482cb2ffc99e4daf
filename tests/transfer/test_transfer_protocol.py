"""The sender's and receiver's rules, with two real NIXL agents in one process and a controllable clock.

Pushes are checked before completion is declared (all indices, exact page
coverage, in any arrival order); malformed or foreign notifications never
complete a transfer; deadlines and the page quarantine follow the clock;
metrics count bytes actually moved.
"""

from __future__ import annotations

import pytest
import torch
from protocol_kit import LAYOUT, T, Side, drain, polls, push_msg, sides, until_completed  # noqa: F401  (sides: the module's fixture)

from pd_cluster.transfer import protocol
from pd_cluster.transfer.config import TransferConfig
from pd_cluster.transfer.errors import PeerNotConnectedError, StalePeerError


def test_completion_needs_every_push_in_any_order(sides):
    clock, p, d = sides
    t = d.receiver.expect("ooo", [3, 4, 5], 40, p.agent.name)
    p.agent.send(d.agent.name, push_msg(t.transfer_id, 1, 2, 1, total=2))  # the last push arrives first
    ev = drain(d, 10, p)
    assert not ev.completed and not ev.failed
    assert [x.index for x in d.receiver.progress(t.transfer_id)] == [1]
    p.agent.send(d.agent.name, push_msg(t.transfer_id, 0, 0, 2))
    ev = drain(d, 50, p)
    assert [c.transfer_id for c in ev.completed] == [t.transfer_id]
    assert [x.index for x in ev.completed[0].pushes] == [0, 1] and ev.completed[0].meta == {"first_token_id": 7}


@pytest.mark.parametrize("bad", ["duplicate", "out_of_range", "bytes", "total"])
def test_inconsistent_pushes_fail_the_transfer(sides, bad):
    clock, p, d = sides
    t = d.receiver.expect(f"bad-{bad}", [6, 7, 8], 40, p.agent.name)
    tid = t.transfer_id
    first = push_msg(tid, 0, 0, 1)
    second = {"duplicate": first, "out_of_range": push_msg(tid, 1, 2, 2, total=2),
              "bytes": protocol.Push(tid, 1, 1, 2, 999, 2, {}), "total": push_msg(tid, 3, 1, 2, total=2)}[bad]
    p.agent.send(d.agent.name, first)
    p.agent.send(d.agent.name, second)
    ev = drain(d, 50, p)
    assert [(f.transfer_id, f.error.reason) for f in ev.failed] == [(tid, "protocol")]
    assert not ev.completed and not ev.released  # pages stay out of use until the sender confirms
    cancels = [m for _, m in p.agent.take(protocol.Cancel) if m.transfer_id == tid]
    assert cancels and cancels[0].reason == "protocol"
    p.agent.send(d.agent.name, protocol.Stopped(tid, "aborted", "ok", ack=True))
    assert [r.pages for r in drain(d, 50, p).released] == [(6, 7, 8)]


def test_notifications_from_another_agent_are_ignored(sides, caplog):
    clock, p, d = sides
    other = Side("prefill", clock, TransferConfig(kv_transfer_timeout=T))
    other.agent.connect(d.agent.info)
    d.agent.connect(other.agent.info)
    try:
        t = d.receiver.expect("foreign", [9], 10, p.agent.name)
        other.agent.send(d.agent.name, push_msg(t.transfer_id, 0, 0, 1, total=1))
        other.agent.send(d.agent.name, protocol.Stopped(t.transfer_id, "aborted", "not yours"))
        with caplog.at_level("WARNING", logger="pd_cluster.transfer.receiver"):
            ev = drain(d, 200, p, other)
        assert not ev.completed and not ev.failed and not ev.released
        assert f"ignoring Push from {other.agent.name}" in caplog.text  # it arrived, and was ignored
        assert f"ignoring Stopped from {other.agent.name}" in caplog.text
        p.agent.send(d.agent.name, push_msg(t.transfer_id, 0, 0, 1, total=1))
        assert [c.transfer_id for c in drain(d, 50, p).completed] == [t.transfer_id]
    finally:
        d.agent.disconnect(other.agent.name)
        other.agent.close()


def test_decode_deadline_then_quarantine(sides):
    clock, p, d = sides
    t = d.receiver.expect("deadline", [10, 11], 20, p.agent.name)
    clock.t += T - 0.1
    assert not drain(d, 3, p).failed
    assert d.metric("pd:num_decode_transfer_queue_reqs") == 1
    clock.t += 0.2
    ev = d.receiver.poll()
    assert [(f.transfer_id, type(f.error).__name__) for f in ev.failed] == [(t.transfer_id, "TransferTimeoutError")]
    assert d.receiver.num_quarantined == 1 and not ev.released
    assert d.metric("pd:num_decode_transfer_queue_reqs") == 0  # failed: no longer waiting for KV
    p.agent.take(protocol.Cancel)  # the sender here is not told to answer: the quarantine must expire
    clock.t += T + 0.1
    ev = d.receiver.poll()
    assert [(r.pages, r.why) for r in ev.released] == [((10, 11), "quarantine expired")]
    assert d.receiver.num_quarantined == 0
    assert d.metric("pd:kv_transfer_failed_total", {"reason": "timeout"}) >= 1


def test_sender_stops_when_idle_and_tells_decode(sides):
    clock, p, d = sides
    t = d.receiver.expect("idle", [12, 13], 20, p.agent.name)
    p.sender.add_request(t)
    clock.t += T / 2 + 0.1
    ev = p.sender.poll()
    assert [(f.transfer_id, f.error.reason) for f in ev.failed] == [(t.transfer_id, "timeout")]
    ev = drain(d, 50, p)
    assert [f.error.reason for f in ev.failed] == ["aborted"] and ev.failed[0].error.side == "prefill"
    assert [r.why for r in ev.released] == ["sender stopped"]


def test_real_push_moves_bytes_and_counts_them(sides):
    clock, p, d = sides
    gen = torch.Generator().manual_seed(3)
    p.pool.kv[1:6] = torch.randint(0, 256, p.pool.kv[1:6].shape, dtype=torch.uint8, generator=gen)
    before = p.metric("pd:kv_transfer_bytes_total")
    t = d.receiver.expect("real", [20, 21, 22, 24, 25], 70, p.agent.name)  # two runs on decode
    p.sender.add_request(t)
    assert p.metric("pd:num_prefill_inflight_queue_reqs") == 1
    assert p.sender.push(t.transfer_id, [1, 2, 3, 4, 5], 15) == 0  # no page complete yet: nothing posted
    assert p.sender.push(t.transfer_id, [1, 2, 3, 4, 5], 40) == 2
    assert p.sender.push(t.transfer_id, [1, 2, 3, 4, 5], 70, meta={"first_token_id": 11}) == 3
    with pytest.raises(ValueError, match="after the last"):
        p.sender.push(t.transfer_id, [1, 2, 3, 4, 5], 70)
    done = until_completed(p, d, 100, allow_failures=True)
    assert done is not None and done.meta == {"first_token_id": 11}
    assert torch.equal(d.pool.read_pages([20, 21, 22, 24, 25]), p.pool.read_pages([1, 2, 3, 4, 5]))
    assert torch.count_nonzero(d.pool.read_pages([23])) == 0  # the gap between the runs is untouched
    moved = p.metric("pd:kv_transfer_bytes_total") - before
    assert moved == 5 * LAYOUT.page_nbytes == done.nbytes
    assert p.metric("pd:kv_transfer_num_descriptors_count") >= 2
    speed_sum, speed_n = p.metric("pd:kv_transfer_speed_gb_s_sum"), p.metric("pd:kv_transfer_speed_gb_s_count")
    assert speed_n >= 2 and 0 < speed_sum / speed_n < 1000  # GB/s: physically plausible for host memory
    ev = p.sender.poll()
    assert p.sender.num_inflight == 0 and p.metric("pd:num_prefill_inflight_queue_reqs") == 0


def test_ready_event_defers_the_post(sides):
    clock, p, d = sides

    class Event:
        ready = False

        def query(self):
            return self.ready

    e = Event()
    t = d.receiver.expect("event", [26], 16, p.agent.name)
    p.sender.add_request(t)
    p.sender.push(t.transfer_id, [6], 16, meta={}, ready_event=e)
    for _ in range(5):
        p.sender.poll()
        assert not d.receiver.poll().completed
    e.ready = True
    for _ in polls(100):
        p.sender.poll()
        ev = d.receiver.poll()
        if ev.completed:
            break
    assert [c.transfer_id for c in ev.completed] == [t.transfer_id]


def test_tickets_are_checked(sides):
    clock, p, d = sides
    t = d.receiver.expect("checks", [27], 16, p.agent.name)
    from dataclasses import replace

    with pytest.raises(StalePeerError, match="restarted"):
        p.sender.add_request(replace(t, prefill_agent="prefill-h-1-tp0-oldincarnation"))
    with pytest.raises(PeerNotConnectedError):
        p.sender.add_request(replace(t, decode_agent="decode-h-9-tp0-unknown"))
    with pytest.raises(ValueError, match="outside 1..32"):
        p.sender.add_request(replace(t, transfer_id="x", dst_pages=(40,)))
    with pytest.raises(PeerNotConnectedError):
        d.receiver.expect("no-peer", [28], 16, "prefill-h-9-tp0-unknown")
    with pytest.raises(ValueError, match="null page"):
        d.receiver.expect("null", [0], 16, p.agent.name)
    assert d.receiver.withdraw(t.transfer_id) == (27,)


def test_peer_failed_by_the_caller_then_confirmed(sides):
    """The worker saw its control connection to prefill break: the transfer fails at once, and its
    pages come back when the (still alive) sender confirms it has nothing in flight."""
    clock, p, d = sides
    t = d.receiver.expect("ctrl-broke", [29, 30], 20, p.agent.name)
    d.receiver.peer_failed(p.agent.name, "control connection to prefill closed")
    ev = d.receiver.poll()
    assert [(f.transfer_id, type(f.error).__name__) for f in ev.failed] == [(t.transfer_id, "PeerDiedError")]
    assert "control connection" in str(ev.failed[0].error) and not ev.released
    for _ in polls(50):
        p.sender.poll()  # answers the cancel of a transfer it never started
        ev = d.receiver.poll()
        if ev.released:
            break
    assert [(r.pages, r.why) for r in ev.released] == [((29, 30), "sender stopped")]
    with pytest.raises(Exception, match="cancelled by decode"):
        p.sender.add_request(t)  # the late ticket is refused


def test_sender_keeps_polling_until_decode_acknowledges(sides, caplog):
    """The sender reports completion when its last WRITE is done, but stays busy (has_work) until decode
    acknowledges the last notification: a worker that went idle at once could strand it."""
    clock, p, d = sides
    t = d.receiver.expect("ack", [31], 16, p.agent.name)
    p.sender.add_request(t)
    p.sender.push(t.transfer_id, [7], 16, meta={"first_token_id": 1})
    sent = None
    for _ in polls(100):
        d.agent.take()  # decode's progress only (a first message to a peer needs both sides); its messages stay queued
        ev = p.sender.poll()
        sent = sent or (ev.completed and ev.completed[0])
        if sent:
            break
    assert sent and sent.transfer_id == t.transfer_id
    assert p.sender.has_work and p.sender.num_inflight == 0  # done, but the Ack is still to come
    for _ in polls(200):
        d.receiver.poll()
        p.sender.poll()
        if not p.sender.has_work:
            break
    assert not p.sender.has_work
    # A last message that is never acknowledged (decode does not know the transfer) is given up on.
    t2 = d.receiver.expect("no-ack", [32], 16, p.agent.name)
    d.receiver.withdraw(t2.transfer_id)
    p.sender.add_request(t2)
    p.sender.push(t2.transfer_id, [8], 16, meta={})
    for _ in polls(100):
        d.receiver.poll()
        if p.sender.poll().completed:
            break
    for _ in range(20):
        d.receiver.poll()
        p.sender.poll()
    assert p.sender.has_work
    clock.t += T / 2 + 0.1
    with caplog.at_level("WARNING", logger="pd_cluster.transfer.sender"):
        p.sender.poll()
    assert not p.sender.has_work and "never acknowledged" in caplog.text


def test_a_sender_stalled_past_its_idle_timeout_posts_nothing_on_waking(sides):
    """A prefill process frozen mid-prefill (SIGSTOP) wakes up and pushes the step it was in: that push must not
    be posted, because decode may have released and reused its pages; decode's pages stay untouched."""
    clock, p, d = sides
    p.pool.kv[7:9] = 1  # non-zero bytes that would show up in decode's pages if posted
    t = d.receiver.expect("stalled", [27, 28], 32, p.agent.name)
    p.sender.add_request(t)
    assert p.sender.push(t.transfer_id, [7, 8], 16) == 1  # the first chunk before the freeze
    for _ in polls(100):
        p.sender.poll()
        d.receiver.poll()
        if d.receiver.progress(t.transfer_id):
            break
    assert [m.index for m in d.receiver.progress(t.transfer_id)] == [0]
    d.pool.kv[27:29] = 0
    clock.t += T / 2 + 0.1  # frozen: no poll ran meanwhile, the step loop goes on with the next push
    assert p.sender.push(t.transfer_id, [7, 8], 32, meta={"first_token_id": 3}) == 1  # accepted, not posted
    ev = p.sender.poll()
    assert [(f.transfer_id, f.error.reason) for f in ev.failed] == [(t.transfer_id, "timeout")]
    assert "not posted" in str(ev.failed[0].error)
    assert torch.count_nonzero(d.pool.read_pages([28])) == 0
    ev = drain(d, 50, p)
    assert [r.why for r in ev.released] == ["sender stopped"]
    assert torch.count_nonzero(d.pool.read_pages([27, 28])) == 0
