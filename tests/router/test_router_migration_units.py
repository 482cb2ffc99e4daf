"""Units of migration and blame: the stream tracker, the continuation body, the blame table."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from pd_cluster.router.blame import blame_status
from pd_cluster.router.circuit import CircuitBreaker
from pd_cluster.router.config import CircuitBreakerConfig, Role
from pd_cluster.router.migration import plan_body
from pd_cluster.router.supervisor import Supervisor


def ev(obj) -> bytes:
    return json.dumps(obj).encode()


def chunk(text, ids, finish=None, prompt=None, chat=False):
    choice = {"index": 0, "logprobs": None, "finish_reason": finish, "token_ids": ids}
    if chat:
        choice["delta"] = {"content": text} if text else {}
    else:
        choice["text"] = text
    out = {"id": "c1", "object": "chat.completion.chunk" if chat else "text_completion",
           "created": 7, "model": "m", "choices": [choice]}
    if prompt is not None:
        if chat:
            out["prompt_token_ids"] = prompt
        else:
            choice["prompt_token_ids"] = prompt
    return out


def test_plan_asks_for_ids_and_skips_what_cannot_migrate():
    body, tracker = plan_body({"prompt": "x", "stream": True, "max_tokens": 5, "presence_penalty": 0,
                               "repetition_penalty": 1.2}, chat=False)
    assert json.loads(body)["return_token_ids"] is True and not tracker.client_wants_ids
    for extra in ({"echo": True}, {"stream": False}, {"best_of": 3}, {"suffix": "x"}, {"prompt_logprobs": 1},
                  {"n": 2, "resume_token_ids": [[1], [2]]}):
        assert plan_body({"prompt": "x", "stream": True, **extra}, chat=False) is None
    # what the new worker replays from resume_token_ids migrates
    for extra in ({"logprobs": 1}, {"response_format": {"type": "json_object"}}, {"presence_penalty": 0.5},
                  {"frequency_penalty": -1}, {"guided_choice": ["a"]}, {"tool_choice": "required"},
                  {"best_of": 1}, {"echo": False}, {"seed": 3, "temperature": 1.0}, {"prompt": ["x"]},
                  {"prompt": [1, 2, 3]}, {"n": 2}, {"prompt": ["x", "y"]}, {"prompt": [[1, 2], [3]]}):
        assert plan_body({"prompt": "x", "stream": True, **extra}, chat=False) is not None, extra


def test_completion_stream_is_tracked_stripped_and_continued():
    data = {"prompt": "hi", "stream": True, "max_tokens": 5, "min_tokens": 3, "temperature": 0,
            "presence_penalty": 0.5}
    _, t = plan_body(data, chat=False)
    out = t.feed(ev(chunk(" a", [11], prompt=[1, 2])))
    assert b"token_ids" not in out and json.loads(out[6:])["choices"][0]["text"] == " a"
    t.feed(ev(chunk(" b", [12])))
    assert t.can_migrate and t.prompt_ids == [1, 2] and t.generated == [11, 12]
    cont = json.loads(t.continuation_body())
    # the same request, continuing after the relayed ids: the worker counts them against the limits
    assert cont == dict(data, resume_token_ids=[11, 12], return_token_ids=True)
    t.continuing = True
    moved = json.loads(t.feed(ev({"id": "other", "object": "text_completion", "created": 9,
                                  "model": "m", "choices": [{"index": 0, "text": " c",
                                                             "token_ids": [13], "logprobs": None,
                                                             "prompt_token_ids": [1, 2],
                                                             "finish_reason": None}]}))[6:])
    assert moved["id"] == "c1" and moved["created"] == 7 and moved["choices"][0]["text"] == " c"
    assert "token_ids" not in moved["choices"][0] and "prompt_token_ids" not in moved["choices"][0]
    assert t.generated == [11, 12, 13]
    # a second migration continues after everything relayed, the client's own resumed ids first
    assert json.loads(t.continuation_body())["resume_token_ids"] == [11, 12, 13]
    assert t.feed(b"[DONE]") == b"data: [DONE]\n\n" and t.ended and not t.can_migrate


def test_chat_continuation_keeps_chat_chunks_without_a_second_role_or_prompt():
    data = {"messages": [{"role": "user", "content": "q"}], "stream": True, "max_completion_tokens": 4,
            "stream_options": {"include_usage": True}, "return_token_ids": True, "resume_token_ids": [4],
            "response_format": {"type": "json_object"}, "logprobs": True}
    _, t = plan_body(data, chat=True)
    first = json.loads(t.feed(ev(chunk("A", [5], prompt=[1, 2, 3], chat=True)))[6:])
    assert first["prompt_token_ids"] == [1, 2, 3]  # the client asked for them
    cont = json.loads(t.continuation_body())
    assert cont == dict(data, resume_token_ids=[4, 5])  # messages, limits, format: all as sent
    t.continuing = True
    role = {"id": "x", "prompt_token_ids": [1, 2, 3], "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}
    assert t.feed(ev(role)) is None  # the continuation's role-only first chunk is not relayed
    got = json.loads(t.feed(ev({"id": "x", "object": "chat.completion.chunk", "created": 9, "model": "m",
                                "choices": [{"index": 0, "delta": {"role": "assistant", "content": "B"},
                                             "token_ids": [6], "logprobs": {"content": [{"token": "B"}]},
                                             "finish_reason": None}]}))[6:])
    assert got["object"] == "chat.completion.chunk" and got["choices"][0]["delta"] == {"content": "B"}
    assert got["choices"][0]["token_ids"] == [6] and "prompt_token_ids" not in got
    assert got["choices"][0]["logprobs"] == {"content": [{"token": "B"}]} and got["id"] == "c1"
    usage = {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert json.loads(t.feed(ev({"id": "x", "choices": [], "usage": usage}))[6:])["usage"] == usage


def test_the_clients_own_resumed_ids_count_against_max_tokens():
    _, t = plan_body({"prompt": "hi", "stream": True, "max_tokens": 5, "resume_token_ids": [7, 8, 9],
                      "stream_options": {"include_usage": True}}, chat=False)
    t.feed(ev(chunk(" a", [11], prompt=[1])))
    assert t.remaining_max_tokens() == 1
    t.feed(ev(chunk(" b", [12])))
    assert t.remaining_max_tokens() == 0  # 3 resumed by the client + 2 relayed: nothing to migrate
    usage = [json.loads(x[6:]) for x in t.synthetic_end().decode().split("\n\n") if x.startswith("data: {")]
    assert usage[-1]["usage"]["completion_tokens"] == 5


def test_all_tokens_relayed_ends_without_another_token():
    _, t = plan_body({"prompt": "hi", "stream": True, "max_tokens": 2}, chat=False)
    t.feed(ev(chunk(" a", [11], prompt=[1])))
    t.feed(ev(chunk(" b", [12])))
    assert t.remaining_max_tokens() == 0
    tail = t.synthetic_end().decode().split("\n\n")
    assert json.loads(tail[0][6:])["choices"][0]["finish_reason"] == "length"
    assert tail[1] == "data: [DONE]"


@pytest.mark.parametrize("status,code,peer,pd,role,ambiguous", [
    (502, "prefill_unreachable", None, True, Role.PREFILL, False),
    (502, "kv_transfer_peer_died", None, True, Role.PREFILL, False),
    (504, "kv_transfer_timeout", None, True, None, True),
    (502, "kv_transfer_nixl_error", "decode", True, Role.DECODE, False),
    (502, "kv_transfer_timeout", "prefill", True, Role.PREFILL, False),
    (502, "kv_transfer_protocol", None, True, Role.DECODE, False),
    (502, "overloaded", None, True, None, False),
    (503, "overloaded", "decode", True, None, False),
    (502, "whatever", None, False, Role.DECODE, False),  # a mixed worker's own fault
    (502, None, None, True, None, True),
])
def test_blame_table(status, code, peer, pd, role, ambiguous):
    body = json.dumps({"error": {"message": "m", "type": "server_error", "param": None,
                                 "code": code}}).encode()
    blame = blame_status(status, body, peer, pd)
    assert (blame.role, blame.ambiguous) == (role, ambiguous)


@pytest.mark.parametrize("code,peer,role,ambiguous", [
    ("kv_transfer_peer_died", None, None, True),  # the frozen first decode may have broken the prefill's side
    ("prefill_unreachable", None, None, True),
    ("kv_transfer_timeout", "prefill", None, True),
    ("kv_transfer_protocol", None, Role.DECODE, False),  # the continuing decode's own fault is still its own
    ("kv_transfer_nixl_error", "decode", Role.DECODE, False),
    ("overloaded", None, None, False),
])
def test_during_a_migration_no_breaker_counts_a_decode_blaming_its_prefill(code, peer, role, ambiguous):
    body = json.dumps({"error": {"message": "m", "type": "server_error", "param": None, "code": code}}).encode()
    blame = blame_status(502, body, peer, True, migrating=True)
    assert (blame.role, blame.ambiguous) == (role, ambiguous)


def test_breaker_transitions_are_logged(caplog):
    b = CircuitBreaker(CircuitBreakerConfig(failure_threshold=2, success_threshold=1,
                                            timeout_duration_secs=5), "http://w:1", "prefill")
    with caplog.at_level(logging.INFO, logger="pd_cluster.router.circuit"):
        b.record_failure(0.0)
        b.record_failure(1.0)
        assert not b.allows(2.0)
        assert b.allows(6.5)
        b.record_success(7.0)
    got = [(r.levelname, r.from_state, r.to_state, r.worker) for r in caplog.records]
    assert got == [("WARNING", "closed", "open", "http://w:1"),
                   ("INFO", "open", "half_open", "http://w:1"),
                   ("INFO", "half_open", "closed", "http://w:1")]


def test_supervisor_cancels_a_silent_attempt_and_a_dead_worker_attempt():
    async def main():
        sup = Supervisor()
        out = {}

        async def request(name, url, idle):
            _, entry = sup.enter(60)
            entry.upstream, entry.idle_limit, entry.last_byte = url, idle, 0.0
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                out[name] = entry.stall

        a = asyncio.ensure_future(request("silent", "http://a:1", 1.0))
        b = asyncio.ensure_future(request("dead", "http://b:1", float("inf")))
        await asyncio.sleep(0)
        sup.tick(0.5)
        assert not out
        sup.tick(1.5)
        assert sup.fail_upstream("http://b:1") == 1
        await asyncio.gather(a, b)
        return out

    assert asyncio.run(main()) == {"silent": "idle_timeout", "dead": "worker_dead"}


def test_a_worker_without_token_ids_turns_tracking_off():
    _, t = plan_body({"messages": [{"role": "user", "content": "q"}], "stream": True}, chat=True)
    role = {"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    t.feed(ev(role))
    assert not t.no_ids  # the role chunk carries no token
    t.feed(ev({"id": "c", "choices": [{"index": 0, "delta": {"content": "A"}}]}))
    assert t.no_ids and not t.can_migrate


def _compact(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("client_ids", [False, True])
def test_events_read_from_the_bytes_equal_the_parsed_path(chat, client_ids):
    """After a stream's first event the tracker reads token ids and the finish from the bytes: what it relays
    and learns equals what parsing each event gives, compact JSON (our workers, vLLM) or not."""
    body = {"stream": True, "max_tokens": 9, "return_token_ids": client_ids, "n": 1}
    body.update({"messages": [{"role": "user", "content": "q"}]} if chat else {"prompt": "q"})
    events = [chunk("A", [5], prompt=[1, 2, 3], chat=chat), chunk(' "x" \\"token_ids\\":[9]', [6, 7], chat=chat),
              chunk("", [], chat=chat), chunk("Z", [8], finish="length", chat=chat),
              {"id": "c1", "object": "x", "created": 7, "model": "m", "choices": [],
               "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}]
    for encode in (_compact, ev):  # ev: json.dumps' default ", " / ": " separators go the parsed way
        fast, slow = plan_body(dict(body), chat)[1], plan_body(dict(body), chat)[1]
        for e in events:
            got = fast.feed(encode(e))
            slow._scan = lambda payload: None  # noqa: B023 - this one always parses
            want = slow.feed(encode(e))
            assert json.loads(got[6:]) == json.loads(want[6:]), (got, want)
        assert fast.generated == slow.generated == [5, 6, 7, 8]
        assert fast.finished and slow.finished and fast.prompt_ids == [1, 2, 3]
        assert fast.feed(b"[DONE]") == b"data: [DONE]\n\n" and fast.ended


def test_plan_puts_its_field_in_front_of_the_clients_bytes():
    raw = b' {"prompt": "x",  "stream": true, "seed": 12345678901234567890123}'
    data = json.loads(raw)
    body, _ = plan_body(data, chat=False, raw=raw)
    assert body == b' {"return_token_ids":true,"prompt": "x",  "stream": true, "seed": 12345678901234567890123}'
    assert json.loads(body) == dict(data, return_token_ids=True)
    own = b'{"prompt": "x", "stream": true, "return_token_ids": true}'
    assert plan_body(json.loads(own), chat=False, raw=own)[0] == own  # the client asked: its body as it came
