"""What one `KVReceiver.poll` costs with many transfers waiting: the decode's engine thread polls between steps,
often, and a poll that walked every transfer each time held the GIL long enough, with a thousand tickets of one
request waiting, to starve the worker's event loop. A poll now checks completion only for the transfers a push
named, and walks every transfer (deadlines, quarantines) at most every `SCAN_INTERVAL_S` of its clock.
Two real NIXL agents in one process, a controllable clock."""

from __future__ import annotations

import torch
from protocol_kit import T, drain, sides, until_completed  # noqa: F401  (sides: the module's fixture)

from pd_cluster.transfer.receiver import SCAN_INTERVAL_S, KVReceiver


def test_polls_walk_every_transfer_only_once_per_scan_interval_and_still_complete_and_time_out(sides, monkeypatch):
    clock, p, d = sides
    walked = []
    real = KVReceiver._silent_since
    monkeypatch.setattr(KVReceiver, "_silent_since", lambda self, job, now: walked.append(job) or real(self, job, now))
    tickets = [d.receiver.expect(f"many-{i}", [i + 1], 10, p.agent.name) for i in range(24)]
    for _ in range(100):  # the clock does not move: one walk
        assert not d.receiver.poll().failed
    assert len(walked) == 24
    clock.t += SCAN_INTERVAL_S + 0.001
    d.receiver.poll()
    assert len(walked) == 48

    # a push completes its transfer at the poll that reads it, without a walk
    p.pool.kv[30] = 5
    first = tickets[0]
    p.sender.announce(first)
    p.sender.add_request(first)
    assert p.sender.push(first.transfer_id, [30], 10, meta={"first_token_id": 3}) == 1
    done = until_completed(p, d)
    assert done is not None and done.transfer_id == first.transfer_id
    assert len(walked) == 48  # the clock has not moved
    assert torch.equal(d.pool.read_pages([1]), p.pool.read_pages([30]))

    # the others still time out once the sender is silent for T: at the first poll past it
    clock.t += T + 0.1
    ev = d.receiver.poll()
    assert sorted(f.transfer_id for f in ev.failed) == sorted(t.transfer_id for t in tickets[1:])
    released = set()
    for _ in range(5):
        p.sender.poll()  # reads the cancels; confirms nothing of them is in flight
        released |= {r for ev in [drain(d, 50, p)] for rel in ev.released for r in rel.pages}
        if len(released) == 23:
            break
    assert released == set(range(2, 25))
