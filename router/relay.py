"""One attempt on one pair: send the body to the decode (or mixed) worker and relay its answer.

The body goes to the same path on the worker, with ``X-PD-Prefill-Url`` (PD only) and ``X-Request-Id``,
over the worker's connection pool (``router.upstream``). Workers send the status only once the first
token exists (``docs/worker-api.md``), so every failure seen before the response starts, a retriable status
(502/503/504), a connection error or a worker that stays silent past ``--upstream-first-byte-timeout-secs``
(streams), is returned as an :class:`AttemptFailure` for the caller to retry on a fresh pair. A
non-streamed body that breaks while being read is also retriable: nothing has reached the client yet. A
stream that breaks, or stays silent past ``--upstream-idle-timeout-secs``, after it started is returned as
an :class:`AttemptFailure` with ``after_start`` set: the caller migrates it (``router.migration``) or ends it
with an error event.

Every answer relayed from a worker carries ``X-Request-Id`` and ``X-PD-Retries``: how many times the router
sent the request to a fresh pair after a failed attempt before answering (the events that
``pd_router_retries_total`` counts by reason; ``0``: the first attempt answered).

A streamed answer is relayed from the connection's callbacks: each piece of the body the worker sends is
written to the client as it arrives, as bytes, without parsing it, unless the stream may migrate (then its
events go through the :class:`~router.migration.StreamTracker`, which reads the token ids). When the client
reads slower than the worker writes, reading from the worker stops until the client catches up.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass

from pd_cluster.common.deadline import DEADLINE_HEADER

from pd_cluster.router.blame import FAILED_PEER_HEADER, blame_status, error_param
from pd_cluster.router.config import LimitsConfig, Role
from pd_cluster.router.exchange import Exchange, running_loop
from pd_cluster.router.kv_index import PromptTokens
from pd_cluster.router.metrics import RouterMetrics
from pd_cluster.router.migration import StreamTracker
from pd_cluster.router.request import ParsedRequest
from pd_cluster.router.retry import is_retriable_status
from pd_cluster.router.selection import Pair
from pd_cluster.router.supervisor import Supervised
from pd_cluster.router.upstream import Reply, UpstreamError, Upstreams

_PASS_HEADERS = (b"content-type", b"cache-control")
_FAILED_PEER = FAILED_PEER_HEADER.encode()
_DEADLINE = DEADLINE_HEADER.encode()
RETRIES_HEADER = b"x-pd-retries"
_CODE = re.compile(r"[a-z][a-z0-9_]{0,47}")


@dataclass
class RequestState:
    """Per-request facts shared by the handler, the relay and the supervisor."""

    request_id: str
    path: str
    body: bytes
    parsed: ParsedRequest
    arrived: float
    supervised: Supervised | None = None
    response_started: bool = False
    finished: bool = False
    prefill_url: str | None = None   # the pair of the last attempt, for the request log
    decode_url: str | None = None
    attempts: int = 0
    retries: int = 0  # fresh pairs tried after a failed attempt, before the response (X-PD-Retries)
    tracker: StreamTracker | None = None  # set when the stream may migrate
    upstream_body: bytes | None = None    # what goes to the worker (None: ``body`` unchanged)
    prompt: PromptTokens | None = None    # token ids for routing on KV events (``--tokenizer-path``)

    last_chunk_at: float = 0.0   # perf_counter of the last chunk relayed (ITL across migrations)
    clean: bool = True           # the last raw chunk relayed ended an SSE event
    delivered: bool = False      # the stream's ``data: [DONE]`` was relayed: the client has the whole answer

    def id_headers(self) -> tuple[tuple[bytes, bytes], ...]:
        """``X-Request-Id`` and ``X-PD-Retries`` for the client's response."""
        return (b"x-request-id", self.request_id.encode()), (RETRIES_HEADER, b"%d" % self.retries)

    def mark_finished(self) -> None:
        """The last byte is about to go out: a disconnect from now on is normal."""
        self.finished = True
        if self.supervised is not None:
            self.supervised.finished = True


@dataclass(frozen=True)
class AttemptFailure:
    """A failed attempt.

    ``blame``: the role whose circuit breaker counts it (``None``: overload or
    not known). ``status``/``body``: the worker's answer, when it gave one.
    ``retry_after``: the worker's ``Retry-After`` (seconds) on a refusal for capacity.

    ``ambiguous``: no breaker counts it, both workers get a health check now
    (``router.blame``). ``after_start``: the client's response had started.
    ``detail``: the worker's error ``code`` for a failed status, else what broke.
    ``refused``: the worker refused or reset the connection before answering (it
    is gone: a fact the health monitor acts on at once).

    Circuit breakers count connection failures, not slowness (`counts`): a
    timeout, a stall or a worker found dead meanwhile is never counted.
    """

    reason: str
    blame: Role | None
    status: int | None = None
    body: bytes | None = None
    detail: str = ""
    ambiguous: bool = False
    after_start: bool = False
    overloaded: bool = False
    retry_after: float | None = None
    refused: bool = False

    @property
    def counts(self) -> bool:
        """True when the blamed worker's circuit breaker counts this failure: a refused, reset or broken
        connection, or a failure its peer named (``router.blame``); never slowness (``idle_timeout``, a
        connect timeout) nor ``worker_dead`` (the death was counted by what revealed it)."""
        if self.blame is None or self.overloaded:
            return False
        if self.status is not None:
            return True
        return self.reason in ("decode_unreachable", "decode_disconnected", "stream_broken", "decode_engine_dead")

    @property
    def code(self) -> str:
        """The worker's error code for a failed status (``kv_transfer_timeout``, ``prefill_unreachable``...), as
        a metric label: ``""`` when the worker named none or the attempt got no status, ``"other"`` when the
        code is not a short lower-case name (a label's values stay few whatever a worker sends)."""
        if self.status is None or not self.detail:
            return ""
        return self.detail if _CODE.fullmatch(self.detail) else "other"


class Relay:
    """Sends one attempt upstream and relays the answer to the client."""

    def __init__(self, metrics: RouterMetrics, limits: LimitsConfig) -> None:
        self._metrics = metrics
        self._first_byte = limits.upstream_first_byte_timeout_secs
        self._idle = limits.upstream_idle_timeout_secs

    async def attempt(self, upstreams: Upstreams, state: RequestState, pair: Pair, ex: Exchange,
                      path: str | None = None, body: bytes | None = None) -> int | AttemptFailure:
        """Try ``pair``; the relayed HTTP status, or the failure to retry or migrate.

        ``path``/``body``: what to send (default: the request's own; a migration sends the request again
        with ``resume_token_ids``).
        """
        rid = state.request_id
        if state.tracker is not None and state.tracker.migrations:
            rid = f"{rid}:m{state.tracker.migrations}"  # a fresh id at the workers
        headers = b"content-type: application/json\r\nx-request-id: " + rid.encode() + b"\r\n"
        if pair.prefill is not None:
            headers += b"x-pd-prefill-url: " + pair.prefill.url.encode() + b"\r\n"
        sup = state.supervised
        stream = state.parsed.stream
        now = time.monotonic()
        # what the decode worker's internal calls (transfer info, /prefill, handshakes) may retry within
        wait = self._first_byte if sup is None else min(self._first_byte, max(0.0, sup.deadline - now))
        headers += _DEADLINE + b": %d\r\n" % int(wait * 1000)
        if sup is not None:
            sup.upstream, sup.stall, sup.answered = pair.decode.url, None, False
            # A non-streamed answer is silent until it is complete: only a worker silent on every channel
            # (router.supervisor) and the request timeout bound it.
            sup.idle_limit = self._first_byte if stream else float("inf")
            sup.stall_limit = self._idle
            sup.last_byte = now
        data = body if body is not None else (state.upstream_body or state.body)
        pool = pair.decode.pool
        if pool is None or pool.closed:
            pool = pair.decode.pool = upstreams.pool(pair.decode.url)
        sink = _StreamSink(self, state, ex, pair) if stream else None
        reply = Reply(running_loop(ex), sink.on_head if sink is not None else _release_prefill(pair))
        try:
            request = pool.frame((path or state.path).encode(), headers, data)
            try:
                if not pool.send_pooled(request, reply):
                    await pool.send(request, reply)
            except UpstreamError as exc:
                return _unreachable(exc, state)
            return await self._outcome(state, pair, reply, sink, ex)
        except asyncio.CancelledError:
            if sup is None or sup.stall is None or sup.timed_out or sup.client_gone:
                raise
            sup.task.uncancel()
            if sup.stall == "idle_timeout" and not sup.answered and pair.prefill is not None:
                # Silent before its first byte: the decode worker waits for its prefill, or is stuck itself.
                # Which one is not known, so no breaker counts it and both get a health check now
                # (router.blame); blaming the decode made a frozen prefill take healthy decodes down.
                return AttemptFailure("idle_timeout", None, ambiguous=True, after_start=state.response_started,
                                      detail=f"no first byte for {sup.idle_limit:g} s (prefill or decode)")
            return AttemptFailure(sup.stall, Role.DECODE, after_start=state.response_started,
                                  detail=f"no byte for {sup.idle_limit:g} s" if
                                  sup.stall == "idle_timeout" else "the health check found it dead")
        finally:
            reply.abort()  # a no-op once complete; else the worker sees the connection close and aborts
            if sup is not None:
                sup.upstream, sup.idle_limit, sup.stall_limit, sup.stall = None, float("inf"), float("inf"), None

    async def _outcome(self, state: RequestState, pair: Pair, reply: Reply, sink: "_StreamSink | None",
                       ex: Exchange) -> int | AttemptFailure:
        try:
            await reply.done
        except UpstreamError as exc:
            if not reply.status:
                return _unreachable(exc, state)
            if state.delivered and sink is not None:  # closed after [DONE]: nothing was lost
                return sink.finish()
            if sink is not None and sink.relaying:
                return AttemptFailure("stream_broken", Role.DECODE, after_start=True, detail=str(exc))
            return AttemptFailure("decode_disconnected", Role.DECODE, after_start=state.response_started,
                                  detail=str(exc))
        status = reply.status
        if sink is not None and sink.relaying:
            return sink.finish()
        if status == 429:  # a refusal for capacity: another worker with room, or a wait (router.capacity)
            return AttemptFailure("status_429", None, status, reply.body(), after_start=state.response_started,
                                  overloaded=True, retry_after=_retry_after(reply.header(b"retry-after")))
        if is_retriable_status(status):
            raw = reply.body()
            blame = blame_status(status, raw, _text(reply.header(_FAILED_PEER)), pair.prefill is not None,
                                 migrating=state.response_started)
            overloaded = blame.role is None and not blame.ambiguous and (status == 503 or blame.code == "overloaded")
            return AttemptFailure(f"status_{status}", blame.role, status, raw, detail=blame.code or "",
                                  ambiguous=blame.ambiguous, after_start=state.response_started,
                                  overloaded=overloaded, retry_after=_retry_after(reply.header(b"retry-after")))
        if state.response_started:  # a continuation refused (4xx): nothing more to relay
            return AttemptFailure(f"status_{status}", None, status, reply.body(), after_start=True)
        return self._relay_whole(state, reply, ex)

    @staticmethod
    def _relay_whole(state: RequestState, reply: Reply, ex: Exchange) -> int | AttemptFailure:
        data = reply.body()
        if (reply.status == 400 and state.tracker is not None and not state.tracker.client_wants_ids
                and b"return_token_ids" in data and error_param(data) == "return_token_ids"):
            # the router asked for token ids and this worker refuses the field: not the client's
            # error; the caller resends the client's own body
            return AttemptFailure("token_ids_refused", None, 400, data)
        state.mark_finished()
        state.response_started = True
        ex.respond(reply.status, data, reply.header(b"content-type") or b"application/json", state.id_headers())
        return reply.status


class _StreamSink:
    """Relays a streamed answer from the connection's callbacks: raw bytes, or events through the tracker."""

    __slots__ = ("relay", "state", "ex", "pair", "reply", "relaying", "pending", "tail")

    def __init__(self, relay: Relay, state: RequestState, ex: Exchange, pair: Pair) -> None:
        self.relay, self.state, self.ex, self.pair = relay, state, ex, pair
        self.reply: Reply | None = None
        self.relaying = False
        self.pending = b""
        self.tail = b""  # the last bytes relayed raw (a [DONE] split across reads)

    def on_head(self, reply: Reply) -> None:
        self.pair.release_prefill()  # a response exists: the prefill's part is over
        if reply.status != 200:
            return
        state, ex = self.state, self.ex
        self.reply, self.relaying = reply, True
        if not state.response_started:
            headers = list(state.id_headers())
            for name in _PASS_HEADERS:
                value = reply.header(name)
                if value is not None:
                    headers.append((name, value))
            ex.start(200, headers)
            state.response_started = True
        sup = state.supervised
        if sup is not None:
            sup.idle_limit, sup.last_byte, sup.answered = self.relay._idle, time.monotonic(), True
        reply.on_chunk = self.on_chunk

    def on_chunk(self, chunk: bytes) -> None:
        state, ex = self.state, self.ex
        now = time.perf_counter()
        metrics = self.relay._metrics
        if state.last_chunk_at:
            metrics.itl.observe(now - state.last_chunk_at)
        else:
            metrics.ttft.observe(now - state.arrived)
        state.last_chunk_at = now
        tracker = state.tracker
        if tracker is None:
            state.clean = chunk.endswith(b"\n\n")
            ex.write(chunk)
            self.tail = (self.tail + chunk)[-16:]
            state.delivered = self.tail.endswith(b"data: [DONE]\n\n")
        else:
            out, self.pending = _events(tracker, self.pending + chunk)
            if tracker.no_ids:  # a worker without token ids: relay raw from here on
                state.tracker = None
                out += self.pending
                state.clean = not self.pending or self.pending.endswith(b"\n\n")
                self.pending = b""
            ex.write(out)
            state.delivered = tracker.ended or out.endswith(b"data: [DONE]\n\n")
        sup = state.supervised
        if sup is not None:  # after the write: a slow client is not a silent worker
            sup.last_byte = time.monotonic()
        if ex.paused and self.reply is not None and self.reply.conn is not None:
            conn = self.reply.conn
            conn.pause()
            ex.on_resume(conn.resume)

    def finish(self) -> int | AttemptFailure:
        state = self.state
        tracker = state.tracker
        if tracker is not None and tracker.worker_died:
            return AttemptFailure("decode_engine_dead", Role.DECODE, after_start=True,
                                  detail="the decode worker's engine died mid-stream (engine_dead)")
        if tracker is not None and not tracker.ended and not state.delivered:
            return AttemptFailure("stream_broken", Role.DECODE, after_start=True,
                                  detail="the stream ended without [DONE]")
        state.mark_finished()
        self.ex.end()
        return 200


def _unreachable(exc: UpstreamError, state: RequestState) -> AttemptFailure:
    """No answer from the decode (or mixed) worker: refused or reset is death (``decode_unreachable``, counted
    by its breaker); a connection that could not be opened in time is slowness: the worker is left alone for a
    moment, as after a refusal for capacity, and the request goes elsewhere or waits (``router.capacity``)."""
    if exc.stage == "connect" and exc.timed_out:
        return AttemptFailure("decode_connect_timeout", None, detail=str(exc), after_start=state.response_started,
                              overloaded=True)
    return AttemptFailure("decode_unreachable", Role.DECODE, after_start=state.response_started, detail=str(exc),
                          refused=exc.refused)


def _release_prefill(pair: Pair):
    def on_head(reply: Reply) -> None:
        pair.release_prefill()  # a response exists: the prefill's part is over
    return on_head


def _text(value: bytes | None) -> str | None:
    return value.decode("latin-1") if value is not None else None


def _retry_after(value: bytes | None) -> float | None:
    try:
        return max(0.0, float(value)) if value else None
    except ValueError:
        return None


def _events(tracker: StreamTracker, pending: bytes) -> tuple[bytes, bytes]:
    """Complete SSE events of ``pending`` through ``tracker``; (bytes to relay, the rest)."""
    out = []
    while True:
        end = pending.find(b"\n\n")
        if end < 0:
            return b"".join(out), pending
        event, pending = pending[:end], pending[end + 2:]
        for line in event.split(b"\n"):
            if line.startswith(b"data:"):
                relayed = tracker.feed(line[5:].lstrip())
                if relayed is not None:
                    out.append(relayed)
        if tracker.no_ids:  # the rest goes out raw (the caller appends it)
            return b"".join(out), pending
