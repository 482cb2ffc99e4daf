"""The sender's and receiver's rules, with two real NIXL agents in one process and a controllable clock.

Pushes are checked before completion is declared (all indices, exact page
coverage, in any arrival order); malformed or foreign notifications never
complete a transfer; deadlines and the page quarantine follow the clock;
metrics count bytes actually moved.
"""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry

from pd_cluster.engine.kv.pool import KVLayout, KVPool
from pd_cluster.transfer import protocol
from pd_cluster.transfer.agent import TransferAgent
from pd_cluster.transfer.config import TransferConfig
from pd_cluster.transfer.errors import PeerNotConnectedError, StalePeerError
from pd_cluster.transfer.metrics import TransferMetrics
from pd_cluster.transfer.receiver import KVReceiver
from pd_cluster.transfer.sender import KVSender

T = 2.0
LAYOUT = KVLayout(5, 4, 8, 16, "fp8_e4m3", (0.5,) * 5, (0.25,) * 5)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Side:
    def __init__(self, role: str, clock: Clock, cfg: TransferConfig) -> None:
        self.pool = KVPool(LAYOUT, 32, "cpu", torch.float32)
        self.registry = CollectorRegistry()
        self.agent = TransferAgent(self.pool, "model-x", role, cfg)
        m = TransferMetrics(self.registry)
        self.sender = KVSender(self.agent, m, clock) if role == "prefill" else None
        self.receiver = KVReceiver(self.agent, m, clock) if role != "prefill" else None

    def metric(self, name: str, labels: dict | None = None) -> float:
        return self.registry.get_sample_value(name, labels or {}) or 0.0


@pytest.fixture(scope="module")
def sides():
    clock = Clock()
    cfg = TransferConfig(kv_transfer_timeout=T, heartbeat_interval=0.5)
    p, d = Side("prefill", clock, cfg), Side("decode", clock, cfg)
    p.agent.connect(d.agent.info)
    d.agent.connect(p.agent.info)
    yield clock, p, d
    p.agent.close()
    d.agent.close()


def drain(side: Side, n: int = 50, *others: Side):
    """Poll until something happens (bounded). Like workers' loops, the other sides progress too
    (a first message to a peer needs both sides' progress to set up the connection)."""
    for _ in range(n):
        for other in others:
            other.agent.take()  # progress only; its messages stay for its own poll
        ev = side.receiver.poll() if side.receiver else side.sender.poll()
        if ev.completed or ev.failed or getattr(ev, "released", None):
            return ev
    return ev


def push_msg(tid, index, start, n, total=0):
    return protocol.Push(tid, index, start, n, n * LAYOUT.page_nbytes, total, {"first_token_id": 7} if total else None)


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
    done = None
    for _ in range(100):
        p.sender.poll()
        ev = d.receiver.poll()
        if ev.completed:
            done = ev.completed[0]
            break
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
    for _ in range(100):
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
    for _ in range(50):
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
    for _ in range(100):
        ev = p.sender.poll()
        sent = sent or (ev.completed and ev.completed[0])
        if sent:
            break
    assert sent and sent.transfer_id == t.transfer_id
    assert p.sender.has_work and p.sender.num_inflight == 0  # done, but the Ack is still to come
    for _ in range(200):
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
    for _ in range(100):
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
    for _ in range(100):
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


# ---- heartbeats: a long chunk is not a silence; a frozen or hung step loop still is --------------------------
def _deliver(d: Side, p: Side, t) -> None:
    """Decode's step loop polls while prefill's is busy computing (only its heartbeat thread sends)."""
    for _ in range(20):
        p.agent.take()  # UCX progress of the prefill side's endpoint, as its heartbeat thread's sends do
        assert not d.receiver.poll().failed


def test_heartbeats_keep_a_chunk_longer_than_the_timeout_alive(sides):
    """A chunk computes for 1.5 T (the step loop polls nothing): heartbeats every T/4 keep both deadlines, the
    next push is posted and the transfer completes with the right bytes."""
    clock, p, d = sides
    p.pool.kv[3:5] = 5
    t = d.receiver.expect("long-chunk", [20, 21], 32, p.agent.name)
    p.sender.add_request(t)
    assert p.sender.push(t.transfer_id, [3, 4], 16) == 1
    for _ in range(100):
        p.sender.poll()
        d.receiver.poll()
        if d.receiver.progress(t.transfer_id):
            break
    for _ in range(6):  # 6 x T/4: the next chunk computes longer than decode's deadline
        clock.t += T / 4
        assert p.sender.heartbeat() == 1
        _deliver(d, p, t)
    assert p.sender.push(t.transfer_id, [3, 4], 32, meta={"first_token_id": 9}) == 1  # posted, not refused
    done = None
    for _ in range(200):
        ev = p.sender.poll()
        assert not ev.failed, ev.failed
        got = d.receiver.poll()
        assert not got.failed, got.failed
        if got.completed:
            done = got.completed[0]
            break
    assert done is not None and done.meta == {"first_token_id": 9}
    assert torch.equal(d.pool.read_pages([20, 21]), p.pool.read_pages([3, 4]))


def test_without_heartbeats_a_frozen_sender_is_cut_off_and_cannot_revive_its_transfer(sides):
    """Frozen (SIGSTOP: the heartbeat thread is frozen too) for more than T after a heartbeat: decode fails the
    transfer; on waking, the heartbeat thread vouches for nothing (idle past T/2) and the push is not posted."""
    clock, p, d = sides
    p.pool.kv[10:12] = 3
    t = d.receiver.expect("frozen", [22, 23], 32, p.agent.name)
    p.sender.add_request(t)
    clock.t += T / 4
    assert p.sender.heartbeat() == 1
    _deliver(d, p, t)
    d.pool.kv[22:24] = 0
    clock.t += T + 0.1  # frozen: no heartbeat
    ev = d.receiver.poll()
    assert [type(f.error).__name__ for f in ev.failed] == ["TransferTimeoutError"]
    assert "no push or heartbeat" in str(ev.failed[0].error) and "1 heartbeats" in str(ev.failed[0].error)
    assert p.sender.heartbeat() == 0  # woken: the heartbeat thread ran first, and vouched for nothing
    assert p.sender.push(t.transfer_id, [10, 11], 32, meta={"first_token_id": 1}) == 2  # accepted, not posted
    ev = p.sender.poll()
    assert [f.error.reason for f in ev.failed] == ["timeout"] and "not posted" in str(ev.failed[0].error)
    ev = drain(d, 50, p)
    assert [r.why for r in ev.released] == ["sender stopped"]
    assert torch.count_nonzero(d.pool.read_pages([22, 23])) == 0


def test_a_hung_step_loop_is_vouched_for_only_up_to_the_step_timeout(sides):
    """A process alive but whose step loop stopped polling: its heartbeats stop after --kv-transfer-step-timeout,
    then decode's deadline ends the transfer; an Alive from another agent or for a failed transfer changes nothing."""
    clock, p, d = sides
    q = Side("prefill", clock, TransferConfig(kv_transfer_timeout=T, heartbeat_interval=0.5, step_timeout=T))
    q.agent.connect(d.agent.info)
    d.agent.connect(q.agent.info)
    try:
        t = d.receiver.expect("hung", [24], 10, q.agent.name)
        q.sender.add_request(t)
        q.sender.poll()
        vouched = []
        for _ in range(12):  # 3 T with no poll: vouched for while the step may still be computing (T)
            clock.t += T / 4
            vouched.append(q.sender.heartbeat())
            p.agent.send(d.agent.name, protocol.Alive((t.transfer_id,)))  # another agent's: ignored
            for _ in range(20):
                q.agent.take()
                p.agent.take()
                ev = d.receiver.poll()
                if ev.failed:
                    break
            if ev.failed:
                break
        assert vouched[:4] == [1, 1, 1, 1] and vouched[4:] == [0] * len(vouched[4:]), vouched
        assert [type(f.error).__name__ for f in ev.failed] == ["TransferTimeoutError"]
        assert T * 2 - 0.01 <= T / 4 * len(vouched) <= 2 * T + T / 4  # the last heartbeat (at T) + T
        q.agent.send(d.agent.name, protocol.Alive((t.transfer_id,)))  # a failed transfer stays failed
        ev = drain(d, 50, q, p)
        assert not ev.completed and not ev.failed and d.receiver.num_quarantined == 1
        ev = q.sender.poll()  # the step loop resumes: it reads decode's cancel, stops and says so
        assert [(f.error.reason, f.error.side) for f in ev.failed] == [("aborted", "decode")]
        ev = drain(d, 50, q, p)
        assert [r.why for r in ev.released] == ["sender stopped"]
    finally:
        d.agent.disconnect(q.agent.name)
        q.agent.close()


def test_a_ticket_waiting_for_a_long_step_is_named_by_heartbeats_until_added_or_withdrawn(sides):
    """A ticket arrives while the step loop computes a long chunk (it is added between steps): the HTTP handler
    announces it, heartbeats name it meanwhile, and decode waits past T; once added, the transfer completes.
    A withdrawn announcement is named no more, and decode's deadline ends that transfer."""
    clock, p, d = sides
    p.pool.kv[13] = 4
    t = d.receiver.expect("queued-behind", [25], 10, p.agent.name)
    gone = d.receiver.expect("refused-later", [26], 10, p.agent.name)
    p.sender.announce(t)
    p.sender.announce(gone)
    for _ in range(6):  # 1.5 T: the step that runs when the tickets arrive
        clock.t += T / 4
        assert p.sender.heartbeat() == 2
        _deliver(d, p, t)
    p.sender.withdraw_announced(gone.transfer_id)  # e.g. the engine refused the prompt
    p.sender.add_request(t)
    assert p.sender.push(t.transfer_id, [13], 10, meta={"first_token_id": 2}) == 1
    done, failed = None, []
    for _ in range(200):
        p.sender.poll()
        ev = d.receiver.poll()
        failed += ev.failed
        done = done or (ev.completed[0] if ev.completed else None)
        if done:
            break
    assert done is not None and done.transfer_id == t.transfer_id and not failed
    for _ in range(5):  # the withdrawn ticket: no heartbeat names it; decode gives up after T
        clock.t += T / 4
        assert p.sender.heartbeat() == 0
        failed += d.receiver.poll().failed
    assert [(f.transfer_id, type(f.error).__name__) for f in failed] == [(gone.transfer_id, "TransferTimeoutError")]
    p.sender.poll()  # reads decode's cancel and confirms (no transfer of it in flight)
    ev = drain(d, 50, p)
    assert [r.pages for r in ev.released] == [(26,)]
    p.sender.announce(t)  # late (under TP it travels apart from add_request): a finished transfer is not named
    p.sender.announce_id(gone.transfer_id, d.agent.name)  # nor one that ended by a cancel
    assert p.sender.heartbeat() == 0
    p.sender.announce_id("never-added", d.agent.name)  # neither added nor withdrawn (a lost add)
    assert p.sender.heartbeat() == 1
    clock.t += p.sender.config.step_timeout + 1
    p.sender.poll()  # the step loop is alive; no step waits that long: the announcement is dropped
    assert p.sender.heartbeat() == 0
