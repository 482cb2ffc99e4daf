"""A decode worker whose engine loop dies ends its streams with an ``engine_dead`` error event (HTTP 503 code,
`pd_cluster.serving.errors`) rather than by breaking the connection; a DP-attention decode does so when one of its
ranks dies. The router's stream tracker takes that event as the attempt's failure, not the stream's end: it relays
nothing of it (nor the ``[DONE]`` after it), the stream can still migrate, the continuation is a fresh attempt, and
the relay names the failure ``decode_engine_dead``; when no worker can continue the stream, it ends with the worker's
own event (`tests/cluster/test_multinode_decode.py` sees it end so). Any other error event still ends the stream."""

from __future__ import annotations

import json

from pd_cluster.router.migration import plan_body

ENGINE_DEAD = {"error": {"message": "the engine loop died (RuntimeError: gloo); the worker is restarting",
                         "type": "server_error", "param": None, "code": "engine_dead"}}


def _tracker():
    body, tracker = plan_body({"model": "m", "prompt": "Once upon a time", "max_tokens": 8, "stream": True}, False)
    assert json.loads(body)["return_token_ids"] is True
    first = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
             "choices": [{"index": 0, "text": " there", "token_ids": [727], "finish_reason": None}],
             "prompt_token_ids": [1, 9038, 2501, 263, 931]}
    assert tracker.feed(json.dumps(first).encode()).startswith(b"data: ")
    return tracker


def test_an_engine_dead_event_mid_stream_is_the_attempts_failure_and_the_stream_migrates():
    tracker = _tracker()
    assert tracker.feed(json.dumps(ENGINE_DEAD).encode()) is None
    # kept: if no worker can continue the stream, it ends with this worker's own error (`Proxy._migrate`)
    assert tracker.death_event == b"data: " + json.dumps(ENGINE_DEAD).encode() + b"\n\n"
    assert tracker.feed(b"[DONE]") is None  # the dead attempt's end is not the stream's
    assert tracker.worker_died and not tracker.ended and tracker.can_migrate
    continuation = json.loads(tracker.continuation_body())
    assert continuation["resume_token_ids"] == [727] and not tracker.worker_died


def test_other_error_events_still_end_the_stream():
    tracker = _tracker()
    other = {"error": {"message": "bad", "type": "invalid_request_error", "param": None, "code": "bad_request"}}
    assert tracker.feed(json.dumps(other).encode()) == b"data: " + json.dumps(other).encode() + b"\n\n"
    assert tracker.ended and not tracker.can_migrate and not tracker.worker_died


def test_an_engine_dead_event_before_any_token_id_is_relayed_as_it_is():
    """Without the prompt's token ids the stream cannot continue elsewhere: the error reaches the client."""
    _, tracker = plan_body({"model": "m", "prompt": "Once", "max_tokens": 8, "stream": True}, False)
    assert tracker.feed(json.dumps(ENGINE_DEAD).encode()).startswith(b"data: ")
    assert tracker.ended and not tracker.worker_died
