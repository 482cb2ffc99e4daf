"""Heartbeats, with two real NIXL agents in one process and a controllable clock: a long chunk is not a silence;
a frozen or hung step loop still is, and a ticket that waits for a long step is named until it is added or
withdrawn."""

from __future__ import annotations

import time

import torch
from protocol_kit import T, Side, drain, polls, sides, until_completed  # noqa: F401  (sides: the module's fixture)

from pd_cluster.transfer import protocol
from pd_cluster.transfer.config import TransferConfig


# ---- heartbeats: a long chunk is not a silence; a frozen or hung step loop still is --------------------------
def _heard(d: Side, t) -> int:
    """Heartbeats decode's receiver has counted for ticket `t` (-1 once the transfer is gone)."""
    job = d.receiver._jobs.get(t.transfer_id)
    return -1 if job is None else job.heartbeats


def _deliver(d: Side, p: Side, t, *others: Side) -> None:
    """Decode's step loop polls while prefill's is busy computing (only its heartbeat thread sends), until the
    heartbeat just sent is counted: over real UCX a loaded host may take more than a few polls to carry it (bounded
    by 10 s of real time); nothing fails meanwhile."""
    want = _heard(d, t) + 1
    deadline = time.monotonic() + 10
    while _heard(d, t) < want:
        assert time.monotonic() < deadline, "the heartbeat never arrived"
        for side in (p, *others):
            side.agent.take()  # UCX progress of the prefill side's endpoint, as its heartbeat thread's sends do
        assert not d.receiver.poll().failed


def test_heartbeats_keep_a_chunk_longer_than_the_timeout_alive(sides):
    """A chunk computes for 1.5 T (the step loop polls nothing): heartbeats every T/4 keep both deadlines, the
    next push is posted and the transfer completes with the right bytes."""
    clock, p, d = sides
    p.pool.kv[3:5] = 5
    t = d.receiver.expect("long-chunk", [20, 21], 32, p.agent.name)
    p.sender.add_request(t)
    assert p.sender.push(t.transfer_id, [3, 4], 16) == 1
    for _ in polls(100):
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
    for _ in polls(200):
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
            if vouched[-1]:
                _deliver(d, q, t, p)
            ev = drain(d, 20, q, p)
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
    for _ in polls(200):
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


def _fails(side: Side, p: Side, tid: str) -> list:
    failed = []
    for _ in range(20):
        p.agent.take()
        failed += [f for f in side.receiver.poll().failed if f.transfer_id == tid]
    return failed


def test_a_ticket_the_sender_has_not_read_yet_lives_while_the_sender_lives(sides):
    """One request hands out many tickets at once: the last ones wait in the prefill worker's HTTP queue (or in
    decode's own) before anyone announces them. The sender names them nowhere, but its heartbeat reaches decode
    every period naming none, so decode waits past T and the transfer then completes. A sender silent for T
    (frozen) still fails such a ticket; so does a live sender that has not taken it within the step timeout."""
    clock, p, d = sides
    p.pool.kv[14] = 6
    t = d.receiver.expect("queued-in-http", [27], 10, p.agent.name)
    for _ in range(8):  # 2 T in the sender's HTTP queue
        clock.t += T / 4
        assert p.sender.heartbeat() == 0  # it vouches for no transfer, yet tells decode the process lives
        assert not _fails(d, p, t.transfer_id)
    p.sender.announce(t)
    p.sender.add_request(t)
    assert p.sender.push(t.transfer_id, [14], 10, meta={"first_token_id": 3}) == 1
    done = until_completed(p, d)
    assert done is not None and done.transfer_id == t.transfer_id
    assert torch.equal(d.pool.read_pages([27]), p.pool.read_pages([14]))

    frozen = d.receiver.expect("sender-frozen", [28], 10, p.agent.name)
    clock.t += T + 0.1  # no heartbeat at all
    failed = _fails(d, p, frozen.transfer_id)
    assert [type(f.error).__name__ for f in failed] == ["TransferTimeoutError"]
    assert "no push or heartbeat" in str(failed[0].error) and "0 heartbeats" in str(failed[0].error)
    p.sender.poll()  # woken: reads decode's cancel and confirms (nothing of it in flight)
    assert [r.pages for r in drain(d, 50, p).released] == [(28,)]

    e = Side("decode", clock, TransferConfig(kv_transfer_timeout=T, heartbeat_interval=0.5, step_timeout=3 * T))
    p.agent.connect(e.agent.info)
    e.agent.connect(p.agent.info)
    try:
        lost = e.receiver.expect("never-taken", [29], 10, p.agent.name)
        beats, failed = 0, []
        while not failed and beats < 20:
            clock.t += T / 4
            p.sender.poll()  # the sender's step loop is alive
            p.sender.heartbeat()
            beats += 1
            failed = _fails(e, p, lost.transfer_id)
        assert beats == 13, beats  # past 3 T (the step timeout), not at T: the sender lived meanwhile
        assert [type(f.error).__name__ for f in failed] == ["TransferTimeoutError"]
        assert "did not take the ticket in 6.5 s" in str(failed[0].error), failed[0].error
    finally:
        p.agent.disconnect(e.agent.name)
        e.agent.close()
