"""One attempt on one pair: send the body to the decode (or mixed) worker and relay.

The body goes to the same path on the worker, with ``X-PD-Prefill-Url`` (PD
only) and ``X-Request-Id``. Workers send the status only once the first token
exists (``docs/worker-api.md``), so every failure seen before the response
starts, a retriable status (502/503/504), a connection error or a worker that
stays silent past ``--upstream-first-byte-timeout-secs`` (streams), is returned as an
:class:`AttemptFailure` for the caller to retry on a fresh pair. A
non-streamed body that breaks while being read is also retriable: nothing has
reached the client yet. A stream that breaks, or stays silent past
``--upstream-idle-timeout-secs``, after it started is returned as an
:class:`AttemptFailure` with ``after_start`` set: the caller migrates it
(``router.migration``) or ends it with an error event.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp

from pd_cluster.router.asgi import Send
from pd_cluster.router.blame import FAILED_PEER_HEADER, blame_status, error_param
from pd_cluster.router.config import LimitsConfig, Role
from pd_cluster.router.metrics import RouterMetrics
from pd_cluster.router.migration import StreamTracker
from pd_cluster.router.kv_index import PromptTokens
from pd_cluster.router.request import ParsedRequest
from pd_cluster.router.retry import is_retriable_status
from pd_cluster.router.selection import Pair
from pd_cluster.router.supervisor import Supervised

_PASS_HEADERS = ("content-type", "cache-control")
_ERRORS = (aiohttp.ClientError, OSError, asyncio.TimeoutError)


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
    stream_broken: str | None = None
    prefill_url: str | None = None   # the pair of the last attempt, for the request log
    decode_url: str | None = None
    attempts: int = 0
    tracker: StreamTracker | None = None  # set when the stream may migrate
    upstream_body: bytes | None = None    # what goes to the worker (None: ``body`` unchanged)
    prompt: PromptTokens | None = None    # token ids for routing on KV events (``--tokenizer-path``)

    last_chunk_at: float = 0.0   # perf_counter of the last chunk relayed (ITL across migrations)
    clean: bool = True           # the last raw chunk relayed ended an SSE event

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

    ``ambiguous``: no breaker counts it, both workers get a health check now
    (``router.blame``). ``after_start``: the client's response had started.
    """

    reason: str
    blame: Role | None
    status: int | None = None
    body: bytes | None = None
    detail: str = ""
    ambiguous: bool = False
    after_start: bool = False


class Relay:
    """Sends one attempt upstream and relays the answer to the client."""

    def __init__(self, metrics: RouterMetrics, limits: LimitsConfig) -> None:
        self._metrics = metrics
        self._first_byte = limits.upstream_first_byte_timeout_secs
        self._idle = limits.upstream_idle_timeout_secs

    async def attempt(self, session: aiohttp.ClientSession, state: RequestState, pair: Pair,
                      send: Send, path: str | None = None,
                      body: bytes | None = None) -> int | AttemptFailure:
        """Try ``pair``; the relayed HTTP status, or the failure to retry or migrate.

        ``path``/``body``: what to send (default: the request's own; a
        migration sends the request again with ``resume_token_ids``).
        """
        rid = state.request_id
        if state.tracker is not None and state.tracker.migrations:
            rid = f"{rid}:m{state.tracker.migrations}"  # a fresh id at the workers
        headers = {"content-type": "application/json", "x-request-id": rid}
        if pair.prefill is not None:
            headers["x-pd-prefill-url"] = pair.prefill.url
        sup = state.supervised
        if sup is not None:
            sup.upstream, sup.stall, sup.answered = pair.decode.url, None, False
            # A non-streamed answer is silent until it is complete: only the health check
            # and the request timeout bound it.
            sup.idle_limit = self._first_byte if state.parsed.stream else float("inf")
            sup.last_byte = time.monotonic()
        data = body if body is not None else (state.upstream_body or state.body)
        try:
            return await self._attempt(session, state, pair, send, path or state.path, data,
                                       headers)
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
            if sup is not None:
                sup.upstream, sup.idle_limit, sup.stall = None, float("inf"), None

    async def _attempt(self, session: aiohttp.ClientSession, state: RequestState, pair: Pair,
                       send: Send, path: str, data: bytes,
                       headers: dict[str, str]) -> int | AttemptFailure:
        try:
            resp = await session.post(pair.decode.url_for(path), data=data, headers=headers)
        except _ERRORS as exc:
            return AttemptFailure("decode_unreachable", Role.DECODE,
                                  after_start=state.response_started,
                                  detail=f"{type(exc).__name__}: {exc}")
        pair.release_prefill()  # a response exists: the prefill's part is over
        try:
            if is_retriable_status(resp.status):
                raw = await _read_quietly(resp)
                blame = blame_status(resp.status, raw, resp.headers.get(FAILED_PEER_HEADER),
                                     pair.prefill is not None)
                return AttemptFailure(f"status_{resp.status}", blame.role, resp.status, raw,
                                      detail=blame.code or "", ambiguous=blame.ambiguous,
                                      after_start=state.response_started)
            if state.parsed.stream and resp.status == 200:
                return await self._relay_stream(state, resp, send)
            if state.response_started:  # a continuation refused (4xx): nothing more to relay
                raw = await _read_quietly(resp)
                return AttemptFailure(f"status_{resp.status}", None, resp.status, raw,
                                      after_start=True)
            return await self._relay_whole(state, resp, send)
        except BaseException:
            resp.close()
            raise
        finally:
            resp.release()

    async def _relay_whole(self, state: RequestState, resp: aiohttp.ClientResponse,
                           send: Send) -> int | AttemptFailure:
        try:
            data = await resp.read()
        except _ERRORS as exc:
            return AttemptFailure("decode_disconnected", Role.DECODE,
                                  detail=f"{type(exc).__name__}: {exc}")
        if (resp.status == 400 and state.tracker is not None
                and not state.tracker.client_wants_ids and b"return_token_ids" in data
                and error_param(data) == "return_token_ids"):
            # the router asked for token ids and this worker refuses the field: not the client's
            # error; the caller resends the client's own body
            return AttemptFailure("token_ids_refused", None, 400, data)
        ctype = resp.headers.get("content-type", "application/json").encode()
        state.mark_finished()
        state.response_started = True
        await send({"type": "http.response.start", "status": resp.status, "headers": [
            (b"content-type", ctype), (b"content-length", str(len(data)).encode()),
            (b"x-request-id", state.request_id.encode())]})
        await send({"type": "http.response.body", "body": data})
        return resp.status

    async def _relay_stream(self, state: RequestState, resp: aiohttp.ClientResponse,
                            send: Send) -> int | AttemptFailure:
        if not state.response_started:
            headers = [(b"x-request-id", state.request_id.encode())]
            for name in _PASS_HEADERS:
                value = resp.headers.get(name)
                if value is not None:
                    headers.append((name.encode(), value.encode()))
            await send({"type": "http.response.start", "status": resp.status,
                        "headers": headers})
            state.response_started = True
        sup = state.supervised
        if sup is not None:
            sup.idle_limit, sup.last_byte, sup.answered = self._idle, time.monotonic(), True
        ttft, itl = self._metrics.ttft, self._metrics.itl
        tracker = state.tracker
        pending = b""
        last = state.last_chunk_at
        try:
            async for chunk in resp.content.iter_any():
                now = time.perf_counter()
                if last:
                    itl.observe(now - last)
                else:
                    ttft.observe(now - state.arrived)
                last = state.last_chunk_at = now
                if tracker is None:
                    state.clean = chunk.endswith(b"\n\n")
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                else:
                    pending += chunk
                    out, pending = _events(tracker, pending)
                    if tracker.no_ids:  # a worker without token ids: relay raw from here on
                        state.tracker = tracker = None
                        out += pending
                        state.clean = not pending or pending.endswith(b"\n\n")
                    if out:
                        await send({"type": "http.response.body", "body": out,
                                    "more_body": True})
                if sup is not None:  # after the send: a slow client is not a silent worker
                    sup.last_byte = time.monotonic()
        except _ERRORS as exc:
            return AttemptFailure("stream_broken", Role.DECODE, after_start=True,
                                  detail=f"{type(exc).__name__}: {exc}")
        if tracker is not None and not tracker.ended:
            return AttemptFailure("stream_broken", Role.DECODE, after_start=True,
                                  detail="the stream ended without [DONE]")
        state.mark_finished()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return resp.status


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


async def _read_quietly(resp: aiohttp.ClientResponse) -> bytes | None:
    try:
        return await resp.read()
    except _ERRORS:
        return None
