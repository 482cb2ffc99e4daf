"""Admission by cost and migration of several-choice streams: the router's pure parts.

- A request costs one admission slot per sequence (prompts × ``n``); the queue stays first come, first served.
- ``--max-prompts-per-request`` bounds the prompts of one request.
- Room on a worker counts a many-prompt request once (the engine interleaves its sequences).
- A stream with ``n`` = 2 or two prompts is tracked per choice, continued with one list per choice (``null`` for a
  finished one), and its usage recomputed over every choice.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from pd_cluster.router.args import build_parser, config_from_args
from pd_cluster.router.capacity import has_room
from pd_cluster.router.config import CircuitBreakerConfig, Role
from pd_cluster.router.limiter import ConcurrencyLimiter, Overloaded
from pd_cluster.router.load import LoadReport
from pd_cluster.router.migration import plan_body
from pd_cluster.router.request import parse_request
from pd_cluster.router.workers import WorkerRegistry


@pytest.mark.parametrize("body,prompts,cost", [
    ({"prompt": "x"}, 1, 1),
    ({"prompt": ["a", "b", "c"]}, 3, 3),
    ({"prompt": [[1, 2], [3]], "n": 2}, 2, 4),
    ({"prompt": [1, 2, 3], "n": 3, "best_of": 5}, 1, 5),
    ({"prompt": ["a"] * 1000, "echo": True, "max_tokens": 1}, 1000, 1000),
])
def test_a_request_costs_its_sequences(body, prompts, cost):
    parsed = parse_request(json.dumps(body).encode(), chat=False)
    assert (parsed.num_prompts, parsed.cost) == (prompts, cost)
    chat = parse_request(json.dumps({"messages": [{"role": "user", "content": "q"}], "n": 2}).encode(), chat=True)
    assert (chat.num_prompts, chat.cost) == (1, 2)


def test_the_router_and_the_workers_refuse_the_same_sequence_counts():
    """The router refuses (before admission) exactly the completions requests every worker refuses."""
    from pd_cluster.common.request_limits import MAX_SEQUENCES, too_many_sequences
    from pd_cluster.engine.errors import RequestRejected
    from pd_cluster.serving.protocol import CompletionRequest

    for prompts, n in ((8, 128), (9, 128), (1024, 1), (1025, 1), (3, 1)):
        body = {"prompt": ["a"] * prompts, "n": n, "max_tokens": 1}
        parsed = parse_request(json.dumps(body).encode(), chat=False)
        refused = too_many_sequences(parsed.num_prompts, parsed.num_generated)
        assert (refused is not None) == (prompts * n > MAX_SEQUENCES)
        try:
            CompletionRequest.model_validate(body).prompts()
            worker_refused = None
        except RequestRejected as exc:
            worker_refused = str(exc)
        assert (worker_refused is None) == (refused is None), (prompts, n, worker_refused)


def test_the_prompt_cap_is_a_router_flag():
    parser = build_parser()
    assert config_from_args(parser.parse_args([])).limits.max_prompts_per_request == 1024
    assert config_from_args(parser.parse_args(["--max-prompts-per-request", "8"])).limits.max_prompts_per_request == 8


@pytest.mark.asyncio
async def test_the_limiter_counts_cost_and_a_waiter_that_does_not_fit_holds_back_no_one():
    lim = ConcurrencyLimiter(max_running=1010, queue_size=4, queue_timeout_secs=5)
    assert lim.try_acquire(1000) and lim.running == 1000
    assert lim.try_acquire(1) and lim.running == 1001  # a one-prompt request still fits
    assert not lim.try_acquire(20)  # 1,021 > 1,010: as 20 one-prompt requests would, it waits
    big = asyncio.ensure_future(lim.acquire(20))
    await asyncio.sleep(0.01)
    assert lim.try_acquire(1) and lim.running == 1002  # fits: not held back by the 20-prompt waiter
    bigger = asyncio.ensure_future(lim.acquire(30))
    await asyncio.sleep(0.01)
    assert not big.done() and not bigger.done() and lim.queued == 2
    lim.release(1000)
    await asyncio.sleep(0.01)
    assert big.done() and bigger.done() and lim.running == 2 + 20 + 30  # in arrival order, as they fit
    for cost in (1, 1, 20, 30):
        lim.release(cost)
    assert lim.running == 0
    # a request above the whole limit takes every slot: it runs alone
    assert lim.try_acquire(5000) and lim.running == 1010 and not lim.try_acquire(1)
    lim.release(5000)
    assert lim.running == 0


@pytest.mark.asyncio
async def test_a_waiter_that_gives_up_lets_the_next_in():
    lim = ConcurrencyLimiter(max_running=10, queue_size=4, queue_timeout_secs=0.05)
    assert lim.try_acquire(9)
    with pytest.raises(Overloaded):
        await lim.acquire(5)  # times out at the head of the queue
    assert lim.queued == 0 and lim.running == 9
    assert lim.try_acquire(1)


def test_room_counts_a_many_prompt_request_once():
    registry = WorkerRegistry(CircuitBreakerConfig())
    w = registry.add("http://d:1", Role.DECODE, "static", healthy=True)
    now = 100.0
    # the worker reports 1,000 sequences of this router's one 1,000-prompt request, and a capacity of 256
    w.set_load(LoadReport(num_running_reqs=256, num_queue_reqs=744, max_running_requests=256, received_at=now))
    w.inflight, w.inflight_extra = 1, 999
    assert has_room(w, now)  # a request sent after it is not held back behind all 1,000
    w.inflight_extra = 0  # 1,000 separate requests: full
    assert not has_room(w, now)


def _ev(index, text, ids, finish=None, prompt=None):
    choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish, "token_ids": ids}
    if prompt is not None:
        choice["prompt_token_ids"] = prompt
    return json.dumps({"id": "c1", "object": "text_completion", "created": 7, "model": "m",
                       "choices": [choice]}).encode()


@pytest.mark.parametrize("shape", ["n", "prompts"])
def test_a_several_choice_stream_is_tracked_and_continued_per_choice(shape):
    data = {"prompt": ["p", "q"] if shape == "prompts" else "p", "stream": True, "max_tokens": 4, "temperature": 0,
            "stream_options": {"include_usage": True}, **({"n": 2} if shape == "n" else {})}
    _, t = plan_body(data, chat=False)
    assert t.multi and t.num_choices == 2
    p0, p1 = [1, 2], ([1, 2] if shape == "n" else [3, 4, 5])
    for e in (_ev(0, "a", [10], prompt=p0), _ev(1, "x", [20], prompt=p1), _ev(0, "b", [11]),
              _ev(1, "y", [21], finish="stop")):
        out = json.loads(t.feed(e)[6:])
        assert "token_ids" not in out["choices"][0] and "prompt_token_ids" not in out["choices"][0]
    assert t.can_migrate and t.outputs == {0: [10, 11], 1: [20, 21]} and t.done_choices == {1}
    cont = json.loads(t.continuation_body())
    assert cont["resume_token_ids"] == [[10, 11], None]  # choice 1 finished: not generated again
    t.continuing = True
    moved = json.loads(t.feed(_ev(0, "c", [12], finish="length", prompt=p0))[6:])
    assert moved["id"] == "c1" and moved["choices"][0]["index"] == 0 and moved["choices"][0]["text"] == "c"
    usage = {"id": "z", "object": "text_completion", "created": 9, "model": "m", "choices": [],
             "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}}
    fixed = json.loads(t.feed(json.dumps(usage).encode())[6:])["usage"]
    prompt = 2 if shape == "n" else 5  # each prompt once
    assert fixed == {"prompt_tokens": prompt, "completion_tokens": 5, "total_tokens": prompt + 5}
    assert t.finished and t.feed(b"[DONE]") == b"data: [DONE]\n\n" and t.ended


def test_a_several_choice_stream_whose_tokens_were_all_relayed_ends_each_open_choice():
    _, t = plan_body({"prompt": "p", "stream": True, "max_tokens": 1, "n": 3}, chat=False)
    t.feed(_ev(0, "a", [10], prompt=[1]))
    t.feed(_ev(1, "b", [11], finish="length"))
    t.feed(_ev(2, "c", [12]))
    assert t.remaining_max_tokens() == 0
    events = [json.loads(line[6:]) for line in t.synthetic_end().split(b"\n\n") if line.startswith(b"data: {")]
    assert [e["choices"][0]["index"] for e in events] == [0, 2]
    assert all(e["choices"][0]["finish_reason"] == "length" for e in events)
