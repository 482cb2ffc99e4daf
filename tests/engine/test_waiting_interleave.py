"""One client request's many sequences do not hold back the requests sent after it (`WaitingQueue`).

The real `Scheduler` over a real `PageManager`, without a model (as ``test_scheduler_rules.py``): a 1,000-prompt
request (one group, ids ``A.<i>``) is queued, one step runs, then a one-prompt request ``B.0`` arrives. It must
finish within its own service time (the steps it takes alone) plus about one step, where first come, first
served over sequences made it wait for hundreds of the big request's sequences.
"""

from __future__ import annotations

import pytest
from test_scheduler_rules import make, request, step

from pd_cluster.engine.request import request_group
from pd_cluster.engine.scheduler.waiting import WaitingQueue


def test_request_group_is_the_client_request():
    assert request_group("abc.1f2e3d4c") == "abc" and request_group("a.b.c9") == "a.b"
    assert request_group("offline-7") == "offline-7"


def test_the_queue_takes_one_sequence_of_each_group_in_turn_retracted_first():
    q = WaitingQueue()
    reqs = {rid: request(rid, 4) for rid in ("A.0", "A.1", "A.2", "B.0", "C.0", "C.1")}
    for rid in ("A.0", "A.1", "A.2", "B.0", "C.0", "C.1"):
        q.append(reqs[rid])
    assert [r.request_id for r in q] == ["A.0", "B.0", "C.0", "A.1", "C.1", "A.2"]
    assert q[0].request_id == "A.0" and q.popleft().request_id == "A.0"
    assert [r.request_id for r in q] == ["B.0", "C.0", "A.1", "C.1", "A.2"]  # A went to the back
    q.appendleft(reqs["A.0"])  # retracted: first of all
    assert q[0].request_id == "A.0" and reqs["A.0"] in q and len(q) == 6
    q.remove(reqs["C.0"])
    assert reqs["C.0"] not in q and [r.request_id for r in q] == ["A.0", "B.0", "C.1", "A.1", "A.2"]
    with pytest.raises(ValueError):
        q.remove(reqs["C.0"])
    out = [q.popleft().request_id for _ in range(len(q))]
    assert out == ["A.0", "B.0", "C.1", "A.1", "A.2"] and not q


def _steps_until_done(s, rid: str, limit: int = 5000) -> int:
    for n in range(1, limit + 1):
        step(s)
        if s.pages is not None and not any(r.request_id == rid for r in list(s.running) + list(s.waiting)):
            return n
    raise AssertionError(f"{rid} not done after {limit} steps")


@pytest.mark.parametrize("role", ["mixed", "decode"])
def test_a_one_prompt_request_after_a_1000_prompt_one_finishes_in_its_own_time_plus_a_step(role):
    def scheduler():
        return make(num_pages=4096, role=role, max_running=16, chunked_prefill_size=32, max_prefill_tokens=64,
                    cache=False)

    alone = scheduler()
    alone.add(request("B.0", 24, max_tokens=6))
    own = _steps_until_done(alone, "B.0")
    s = scheduler()
    for i in range(1000):
        s.add(request(f"A.{i}", 24, max_tokens=2))
    step(s)
    s.add(request("B.0", 24, max_tokens=6))
    took = _steps_until_done(s, "B.0")
    assert took <= own + 2, (took, own)
