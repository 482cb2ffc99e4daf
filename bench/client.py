"""Streaming OpenAI requests and what the client saw of each (``RequestRecord``).

Timing follows ``vllm bench serve`` with one fix: TTFT is the time to the
first event that carries content (completion ``text``, chat ``delta.content``
or ``delta.reasoning_content``), not to the first byte or to a role-only chunk.
All timestamps are ``time.monotonic()`` seconds. A response's bytes are stamped
with the moment the event loop learnt they were readable (see
``bench.http_client.ArrivalClock``); events that arrive together share a stamp.

* TTFT: send to first content event. ITL: gaps between content events.
* E2EL (``latency``): send to the end of the stream (``data: [DONE]``).
* Output tokens: the server's ``usage.completion_tokens`` (asked for with
  ``stream_options.include_usage``), else the tokenizer's count of the text,
  else the number of content events.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

from pd_cluster.bench.config import TargetConfig
from pd_cluster.bench.datasets.base import SampledRequest
from pd_cluster.bench.http_client import HttpError, HttpPool, Pending


@dataclass(slots=True)
class RequestRecord:
    """One timed request. Times are seconds; ``planned``, ``started``, ``sent`` count from the run's start.

    ``started - planned`` is the scheduler lag; ``sent - started`` the wait for a
    ``--max-concurrency`` slot. ``reason`` is a short failure category for counting.
    """

    index: int
    prompt_len: int
    max_tokens: int
    planned: float
    request_id: str = ""
    started: float = math.nan
    sent: float = math.nan
    success: bool = False
    status: int = 0
    reason: str = ""
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    output_source: str = ""
    num_chunks: int = 0
    text: str = ""
    parse_s: float = 0.0

    @property
    def tpot(self) -> float:
        """(E2EL - TTFT) / (output tokens - 1); 0 for single-token outputs (vLLM's definition)."""
        if self.output_tokens > 1:
            return (self.latency - self.ttft) / (self.output_tokens - 1)
        return 0.0

    @property
    def end(self) -> float:
        return self.sent + self.latency


def build_payload(target: TargetConfig, model: str, req: SampledRequest) -> bytes:
    """The JSON body for one request (streaming, with usage)."""
    body: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
    if target.chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
        body["max_completion_tokens"] = req.output_len
    else:
        body["prompt"] = req.prompt
    body["max_tokens"] = req.output_len
    if target.ignore_eos:
        body["ignore_eos"] = True
    if target.temperature is not None:
        body["temperature"] = target.temperature
    body.update(target.extra_body)
    return json.dumps(body).encode()


def header_lines(target: TargetConfig, request_id: str) -> str:
    """Request headers as ``Name: value\\r\\n`` lines."""
    lines = ["Content-Type: application/json\r\n", "Accept: text/event-stream\r\n",
             f"X-Request-Id: {request_id}\r\n"]
    if target.api_key:
        lines.append(f"Authorization: Bearer {target.api_key}\r\n")
    return "".join(lines)


class _Stream:
    """Parses SSE lines of one response and keeps the timing of content events."""

    __slots__ = ("rec", "t_send", "last", "last_byte", "buf", "raw", "pieces", "usage", "done",
                 "finished", "error")

    def __init__(self, rec: RequestRecord, t_send: float) -> None:
        self.rec = rec
        self.t_send = t_send
        self.last = self.last_byte = t_send
        self.buf = b""
        self.raw = b""
        self.pieces: list[str] = []
        self.usage: int | None = None
        self.done = self.finished = False
        self.error = ""

    def on_head(self, status: int, headers: dict[str, str]) -> None:
        self.rec.status = status

    def on_body(self, data: bytes, now: float) -> None:
        """Body bytes that arrived at ``now``; the client's parsing time is added to ``parse_s``."""
        t0 = time.monotonic()
        if now < self.t_send:  # a stale selector stamp can never predate the send
            now = t0
        self.last_byte = now
        if self.rec.status != 200:
            self.raw += data[: 4096 - len(self.raw)]
            return
        self.feed(data, now)
        self.rec.parse_s += time.monotonic() - t0

    def feed(self, data: bytes, now: float) -> None:
        self.buf += data
        lines = self.buf.split(b"\n")
        self.buf = lines.pop()
        for line in lines:
            line = line.strip()
            if line.startswith(b"data:"):
                self._event(line[5:].strip(), now)

    def _event(self, payload: bytes, now: float) -> None:
        if payload == b"[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(payload)
        except ValueError:
            self.error = f"bad SSE data: {payload[:80]!r}"
            return
        if not isinstance(obj, dict):
            return
        if obj.get("error"):
            err = obj["error"]
            self.error = str(err.get("message", err) if isinstance(err, dict) else err)[:300]
            return
        choices = obj.get("choices")
        if choices:
            c = choices[0]
            delta = c.get("delta")
            text = delta.get("content") or delta.get("reasoning_content") if delta else c.get("text")
            if text:
                rec = self.rec
                if rec.num_chunks == 0:
                    rec.ttft = now - self.t_send
                else:
                    rec.itl.append(now - self.last)
                rec.num_chunks += 1
                self.last = now
                self.pieces.append(text)
            if c.get("finish_reason"):
                self.finished = True
        usage = obj.get("usage")
        if usage and usage.get("completion_tokens") is not None:
            self.usage = int(usage["completion_tokens"])


def begin_request(pool: HttpPool, request: bytes, rec: RequestRecord, origin: float,
                  timeout_s: float) -> tuple[_Stream, Pending | None]:
    """Stamp the send time and write ``request`` at once if a connection is idle (no await)."""
    t_send = time.monotonic()
    rec.sent = t_send - origin
    st = _Stream(rec, t_send)
    return st, pool.try_start(request, st, timeout_s)


async def finish_request(pool: HttpPool, request: bytes, rec: RequestRecord, st: _Stream,
                         pending: Pending | None, timeout_s: float) -> None:
    """Wait for the answer of a begun request (connecting first if it was not written) and fill
    ``rec``; never raises, except on cancellation."""
    try:
        if pending is None:
            await pool.send(request, st, timeout_s)
        else:
            await pool.wait(pending, request, st)
    except HttpError as exc:
        _fail(rec, exc.reason, str(exc), st.t_send)
        return
    if rec.status != 200:
        _fail(rec, f"HTTP {rec.status}", _error_message(st.raw.decode("utf-8", "replace")), st.t_send)
        return
    rec.latency = st.last_byte - st.t_send
    rec.text = "".join(st.pieces)
    if st.error:
        _fail(rec, "error event", st.error)
    elif not (st.done or st.finished):
        _fail(rec, "stream ended early", "the stream ended without data: [DONE]")
    elif rec.num_chunks == 0:
        _fail(rec, "no output", "the response carried no content")
    else:
        rec.success = True
        if st.usage is not None:
            rec.output_tokens, rec.output_source = st.usage, "usage"


async def send_request(pool: HttpPool, request: bytes, rec: RequestRecord, origin: float,
                       timeout_s: float) -> None:
    """Send one prepared streaming request and fill ``rec`` (:func:`begin_request` + :func:`finish_request`)."""
    st, pending = begin_request(pool, request, rec, origin, timeout_s)
    await finish_request(pool, request, rec, st, pending, timeout_s)


def _fail(rec: RequestRecord, reason: str, message: str, t_send: float | None = None) -> None:
    if t_send is not None:
        rec.latency = time.monotonic() - t_send
    rec.success = False
    rec.reason = reason
    rec.error = message[:500]


def _error_message(body: str) -> str:
    try:
        obj = json.loads(body)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        return str(err.get("message", err) if isinstance(err, dict) else err)
    except ValueError:
        return body[:300]
