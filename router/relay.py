"""One attempt on one pair: send the body to the decode (or mixed) worker and relay.

The body goes unchanged to the same path on the worker, with
``X-PD-Prefill-Url`` (PD only) and ``X-Request-Id``. Workers send the status
only once the first token exists (``docs/worker-api.md``), so every failure
seen before the response starts, a retriable status (502/503/504) or a
connection error, is returned as an :class:`AttemptFailure` for the caller to
retry on a fresh pair. A non-streamed body that breaks while being read is
also retriable: nothing has reached the client yet.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp

from pd_cluster.router.asgi import Send
from pd_cluster.router.config import Role
from pd_cluster.router.errors import sse_error_event
from pd_cluster.router.metrics import RouterMetrics
from pd_cluster.router.request import ParsedRequest
from pd_cluster.router.retry import is_retriable_status
from pd_cluster.router.selection import Pair
from pd_cluster.router.supervisor import Supervised

_PASS_HEADERS = ("content-type", "cache-control")


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

    def mark_finished(self) -> None:
        """The last byte is about to go out: a disconnect from now on is normal."""
        self.finished = True
        if self.supervised is not None:
            self.supervised.finished = True


@dataclass(frozen=True)
class AttemptFailure:
    """A failure before anything reached the client.

    ``blame``: the role whose circuit breaker counts it (``None``: overload,
    not a fault). ``status``/``body``: the worker's answer, when it gave one.
    """

    reason: str
    blame: Role | None
    status: int | None = None
    body: bytes | None = None
    detail: str = ""


def _blame_for_status(status: int) -> Role | None:
    # 502: prefill unreachable/died or transfer failed; 504: transfer deadline;
    # 503: the decode worker's admission queue is full (overload, not a fault).
    return None if status == 503 else Role.PREFILL


class Relay:
    """Sends one attempt upstream and relays the answer to the client."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self._metrics = metrics

    async def attempt(self, session: aiohttp.ClientSession, state: RequestState, pair: Pair,
                      send: Send) -> int | AttemptFailure:
        """Try ``pair``; the relayed HTTP status, or the failure to retry."""
        headers = {"content-type": "application/json", "x-request-id": state.request_id}
        if pair.prefill is not None:
            headers["x-pd-prefill-url"] = pair.prefill.url
        try:
            resp = await session.post(pair.decode.url_for(state.path), data=state.body,
                                      headers=headers)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            return AttemptFailure("decode_unreachable", Role.DECODE,
                                  detail=f"{type(exc).__name__}: {exc}")
        pair.release_prefill()  # a response exists: the prefill's part is over
        try:
            if is_retriable_status(resp.status):
                body = await _read_quietly(resp)
                return AttemptFailure(f"status_{resp.status}", _blame_for_status(resp.status),
                                      resp.status, body)
            if state.parsed.stream and resp.status == 200:
                return await self._relay_stream(state, resp, send)
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
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            return AttemptFailure("decode_disconnected", Role.DECODE,
                                  detail=f"{type(exc).__name__}: {exc}")
        ctype = resp.headers.get("content-type", "application/json").encode()
        state.mark_finished()
        state.response_started = True
        await send({"type": "http.response.start", "status": resp.status, "headers": [
            (b"content-type", ctype), (b"content-length", str(len(data)).encode()),
            (b"x-request-id", state.request_id.encode())]})
        await send({"type": "http.response.body", "body": data})
        return resp.status

    async def _relay_stream(self, state: RequestState, resp: aiohttp.ClientResponse,
                            send: Send) -> int:
        headers = [(b"x-request-id", state.request_id.encode())]
        for name in _PASS_HEADERS:
            value = resp.headers.get(name)
            if value is not None:
                headers.append((name.encode(), value.encode()))
        await send({"type": "http.response.start", "status": resp.status, "headers": headers})
        state.response_started = True
        ttft, itl = self._metrics.ttft, self._metrics.itl
        last = 0.0
        clean = True
        try:
            async for chunk in resp.content.iter_any():
                now = time.perf_counter()
                if last:
                    itl.observe(now - last)
                else:
                    ttft.observe(now - state.arrived)
                last = now
                clean = chunk.endswith(b"\n\n")
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            state.stream_broken = f"{type(exc).__name__}: {exc}"
            event = sse_error_event(502, f"the worker failed mid-stream: {type(exc).__name__}")
            await send({"type": "http.response.body", "more_body": True,
                        "body": event if clean else b"\n\n" + event})
        state.mark_finished()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return resp.status


async def _read_quietly(resp: aiohttp.ClientResponse) -> bytes | None:
    try:
        return await resp.read()
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
        return None
