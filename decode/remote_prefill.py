"""The decode worker's `PromptSource`: the prompt is prefilled by a prefill worker and its KV pushed here.

Per request: load the prefill agent's metadata (cached per incarnation; the
handshake checks layouts and runs off the engine thread), queue the request
until its prompt pages are reserved, send the job with the ticket to
``POST {prefill}/prefill`` (`PrefillRequest`), and wait until every push has
arrived (the receiver's poll) or something fails. The metadata fetch, the
handshake and the connection of the ``/prefill`` call are retried with backoff
while they fail for slowness (a timeout, a 503), until the request's deadline
(the router's ``X-PD-Deadline-Ms``, passed on to ``/prefill``;
`pd_cluster.common.deadline`); a refused connection is not retried: the prefill
worker is gone (502 ``prefill_unreachable``, and every transfer from it fails),
and slowness past the deadline is nobody's fault (504 ``kv_transfer_metadata_unreachable``
or ``prefill_timeout``), nor is one ``/prefill`` connection that closed before its
answer while the worker may be alive (502 ``prefill_connection_lost``: only this
request fails; the router's probes decide whether the prefill worker is gone). The ticket covers only the
pages this worker's prefix cache lacks (its ``first_page``); when the engine
decides to prefill the short uncached rest itself (``--max-local-prefill-length``)
no ticket exists and no ``/prefill`` call is made. The request's life, and
when its pages come back, is its `RemoteRequest`'s (``decode/request.py``):
every failure here, whatever its kind, ends in `DecodeHooks.fail`, which
applies the page rule. Failures before the first token raise `HTTPError`
(400, 502, 504; 409 from a stale prefill incarnation is retried once with
fresh metadata, and so is a transfer whose prefill agent died when the worker's
URL already serves a new incarnation: its supervisor restarted it), so the
router can retry on another pair. A client that goes
away aborts the request here and at the prefill worker.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from pd_cluster.common.aio import mark_retrieved
from pd_cluster.common.deadline import DEADLINE_HEADER, Deadline, retry_until
from pd_cluster.decode.handover import DecodeHooks, RequestAborted
from pd_cluster.decode.request import RemoteRequest
from pd_cluster.disagg.errors import transfer_http_error
from pd_cluster.disagg.peers import connect_failure, connect_peer
from pd_cluster.disagg.prefill_api import ABORT_PATH, PATH, PrefillRequest, PrefillResponse, first_token_params
from pd_cluster.engine.sampling.params import SamplingParams
from pd_cluster.serving.engine_loop import EngineLoop
from pd_cluster.serving.errors import HTTPError, to_http_error
from pd_cluster.serving.openai_serving import PromptSource
from pd_cluster.serving.worker_app import INTERNAL_KEY_HEADER, key_matches, presented_key
from pd_cluster.transfer.errors import PeerDiedError, TransferError
from pd_cluster.transfer.http import PeerDirectory, connection_refused
from pd_cluster.transfer.interfaces import Agent

logger = logging.getLogger("pd.decode")

PREFILL_HEADER = "x-pd-prefill-url"
AGENT_GONE_RELEASE_WAIT_S = 5.0  # the most a request waits for its failed attempt's pages before trying again


class _StalePrefill(Exception):
    """The prefill worker restarted since its metadata was cached."""


class _PrefillAgentGone(Exception):
    """The prefill agent this request was sent to is gone (its process died); the worker's URL may already serve
    a new incarnation (a supervisor restarted it), which a fresh resolve finds. `http`: the error to give when
    it does not."""

    def __init__(self, http: HTTPError, agent: str) -> None:
        super().__init__(http.message)
        self.http = http
        self.agent = agent


class _PrefillFailed(Exception):
    """The ``/prefill`` call ended without the KV: how the request failed, and what the client gets."""

    def __init__(self, http: HTTPError, refused: bool = False, peer_gone: bool = False) -> None:
        super().__init__(http.message)
        self.http = http
        self.refused = refused
        self.peer_gone = peer_gone



class RemotePrefill(PromptSource):
    """Prefill on a remote worker, KV over NIXL.

    Args:
        loop: the engine loop (decode role).
        hooks: the decode hooks in that loop.
        agent: this worker's transfer agent (`Agent`: a `TransferAgent`, or a `TPAgent` under TP).
        directory: peers' metadata cache.
        self_url: this worker's URL (prefill fetches our metadata from it).
        default_prefill_url: used when a request names none (``--prefill-url``).
        http_timeout: seconds for the whole ``/prefill`` call (queueing and prefill included).
        internal_api_key: the cluster's internal key: sent to prefill workers, and a request carrying it
            (the router's) may name any prefill worker.
        prefill_urls: the prefill workers a request without the key may name (``--prefill-urls``). With
            neither these, `default_prefill_url` nor a key, any URL is accepted (a trusted network only).
    """

    def __init__(self, loop: EngineLoop, hooks: DecodeHooks, agent: Agent, directory: PeerDirectory,
                 self_url: str, default_prefill_url: str | None = None, http_timeout: float = 600.0,
                 internal_api_key: str | None = None, prefill_urls: tuple[str, ...] = ()) -> None:
        self.loop = loop
        self.hooks = hooks
        self.agent = agent
        self.directory = directory
        self.self_url = self_url
        self.default_prefill_url = default_prefill_url
        self.internal_api_key = internal_api_key
        self.allowed = {u.rstrip("/") for u in (*prefill_urls, default_prefill_url) if u}
        if not self.allowed and not internal_api_key:
            logger.warning("decode accepts any X-PD-Prefill-Url: set --prefill-urls or an internal key "
                           "(PD_INTERNAL_API_KEY) so that it contacts only the cluster's prefill workers")
        self.http_timeout = http_timeout
        # No pool limit: the /prefill calls in flight are bounded by the requests holding reserved pages, and a
        # call waiting for a pooled connection would wait behind other requests' whole prefills. Idle
        # connections expire well before the prefill server's keep-alive timeout (uvicorn: 5 s), so a call is
        # never written into a connection the server is closing.
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(http_timeout, connect=5.0), headers=(
            {INTERNAL_KEY_HEADER: internal_api_key} if internal_api_key else None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=2.0))
        self._notices: set[asyncio.Task] = set()  # `/abort` notices in flight

    def _check_allowed(self, url: str, headers: dict[str, str]) -> None:
        """Refuse (403) a named prefill worker this decode worker was not told about, unless the request
        carries the internal key (the router names only the prefill workers it discovered)."""
        if url.rstrip("/") in self.allowed or key_matches(presented_key(headers), self.internal_api_key):
            return
        if not self.allowed and not self.internal_api_key:
            return
        raise HTTPError(403, f"X-PD-Prefill-Url {url!r} is not a prefill worker of this cluster",
                        None, "prefill_url_not_allowed")

    async def close(self) -> None:
        await self.client.aclose()

    async def start(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    headers: dict[str, str], resumed: list[int] | None = None) -> asyncio.Queue:
        url = headers.get(PREFILL_HEADER) or self.default_prefill_url
        if not url:
            raise HTTPError(400, "a decode worker needs the prefill worker: set the X-PD-Prefill-Url header "
                                 "(the router does) or --prefill-url", None, "missing_prefill")
        if headers.get(PREFILL_HEADER):
            self._check_allowed(url, headers)
        deadline = Deadline.from_header(headers.get(DEADLINE_HEADER), self.http_timeout)
        try:
            for attempt in range(2):
                try:
                    return await self._attempt(request_id, prompt_ids, params, url.rstrip("/"), resumed or [],
                                               deadline)
                except _StalePrefill:
                    self.directory.invalidate(url)
                    logger.info("request %s: prefill %s restarted; refreshing its metadata (attempt %d)",
                                request_id, url, attempt + 1)
                except _PrefillAgentGone as gone:
                    await self._after_agent_gone(request_id, url, gone, deadline, last=attempt == 1)
        except asyncio.CancelledError:  # the client went away before the first token: one line, no traceback
            logger.info("request %s: aborted before its first token (the client went away)", request_id)
            raise
        raise HTTPError(502, f"prefill worker {url} kept refusing our tickets as stale", None, "stale_peer")

    async def _after_agent_gone(self, request_id: str, url: str, gone: _PrefillAgentGone, deadline: Deadline,
                                last: bool) -> None:
        """The agent the request was sent to died before its KV was complete. Returns when `url` now serves
        another incarnation of the prefill worker (restarted by its supervisor: the request is tried there,
        with fresh metadata); raises `gone.http` when it serves none, the same agent, or this was the last try."""
        self.directory.invalidate(url)  # every later request resolves the worker afresh, too
        if last:
            raise gone.http
        try:
            agent = await self._connect(url, deadline)
        except HTTPError:
            raise gone.http from None  # the worker is gone, not restarted: what the transfer said
        if agent == gone.agent:
            raise gone.http
        # the failed attempt's pages come back once the receiver's probe confirms the process is gone (at its next
        # poll); the request id is free for the second attempt then
        wait_until = min(deadline.at, time.monotonic() + AGENT_GONE_RELEASE_WAIT_S)
        while await self.loop.call(lambda e: self.hooks.get(request_id) is not None):
            if time.monotonic() > wait_until:
                raise gone.http
            await asyncio.sleep(0.01)
        logger.info("request %s: prefill %s restarted (agent %s gone, now %s); sending it there again",
                    request_id, url, gone.agent, agent)

    async def _connect(self, url: str, deadline: Deadline) -> str:
        """Load the prefill agent (cached per incarnation; the handshake runs off the engine thread), retrying
        slowness until `deadline` (`connect_peer`).

        Returns:
            The prefill agent's name.
        """
        try:
            resolved = await connect_peer(self.agent, self.directory, url, deadline,
                                          lambda fn: self.loop.call(lambda e: fn()), client=self.client)
        except TransferError as e:  # gone, slow past the deadline, or our handshake refused it (a bad pair)
            err = connect_failure(e, "prefill")
            raise HTTPError(502 if err.status < 500 else err.status, err.message, None, err.code) from e
        return resolved.info.agent_name

    async def _attempt(self, request_id: str, prompt_ids: list[int], params: SamplingParams, url: str,
                       resumed: list[int], deadline: Deadline):
        prefill_agent = await self._connect(url, deadline)
        rec = RemoteRequest(request_id, url, prefill_agent, asyncio.get_running_loop())
        stream = self.loop.open_stream(request_id)
        try:
            await self.loop.call(lambda e: self.hooks.register(e, rec, prompt_ids, params, stream=True,
                                                               resumed=resumed))
        except BaseException:  # refused by the engine, or cancelled while the command was queued
            self.loop.close_stream(request_id)
            self.loop.call_soon(lambda e: self.hooks.abort(e, request_id, "the client went away"))
            raise
        try:
            ticket = await rec.ticket_future
            if ticket is None:  # prefilled here (the engine logged and counted it); it runs like a local request
                return stream
            body = PrefillRequest(request_id, tuple(prompt_ids), self.self_url, ticket,
                                  first_token_params(params, len(resumed)), tuple(resumed)).to_json()
            self.loop.call_soon(lambda e: self.hooks.send(e, request_id))  # before the post: WRITEs may follow
            rec.post = asyncio.ensure_future(self._post(url, request_id, body, deadline))
            rec.post.add_done_callback(mark_retrieved)
            done, _ = await asyncio.wait({rec.kv_future, rec.post}, return_when=asyncio.FIRST_COMPLETED)
            if rec.kv_future not in done:
                self._check_prefill_answer(request_id, rec.post)
            await rec.kv_future  # raises the transfer's error
            rec.post.add_done_callback(lambda f: self._on_prefill_answer(request_id, f))
            return stream
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        except BaseException as e:
            self.loop.close_stream(request_id)
            if rec.post is not None and not rec.post.done():
                rec.post.cancel()
            raise self._failed(rec, e) from e

    def _failed(self, rec: RemoteRequest, e: BaseException) -> BaseException:
        """End `rec` after `e` (its pages by the record's rule) and return what the handler raises."""
        rid = rec.request_id
        if isinstance(e, _PrefillFailed):
            failure = e
        else:
            failure = _PrefillFailed(transfer_http_error(e) if isinstance(e, TransferError) else to_http_error(e))
        self.loop.call_soon(lambda eng: self.hooks.fail(eng, rid, failure, refused=failure.refused,
                                                        peer_gone=failure.peer_gone))
        if failure.http.code == "stale_peer" and failure.refused:
            return _StalePrefill()
        if isinstance(e, PeerDiedError) and e.peer == rec.prefill_agent:
            return _PrefillAgentGone(failure.http, rec.prefill_agent)
        return failure.http

    async def _post(self, url: str, request_id: str, body: bytes, deadline: Deadline) -> httpx.Response:
        """``POST /prefill``; a connection that could not be opened in time (never sent) is tried again until
        `deadline`, a refused one is not (the prefill worker is gone)."""

        async def once(timeout: float) -> httpx.Response:
            return await self.client.post(f"{url}{PATH}", content=body, headers={
                "X-Request-Id": request_id, "Content-Type": "application/json",
                DEADLINE_HEADER: deadline.header_value()})

        def on_retry(e: BaseException, attempt: int, delay: float) -> None:
            logger.info("request %s: POST %s%s: %r; retrying in %.2f s (try %d)", request_id, url, PATH, e, delay,
                        attempt)

        return await retry_until(deadline, once, _not_sent, on_retry)

    def _check_prefill_answer(self, request_id: str, post: asyncio.Future) -> None:
        """The prefill call ended before the KV was complete: raise `_PrefillFailed` unless it said OK."""
        try:
            resp = post.result()
        except httpx.TimeoutException as e:  # slow, not gone: nobody's fault (the router's breakers skip it)
            msg = f"the prefill worker did not answer in time: {e!r}"
            raise _PrefillFailed(HTTPError(504, msg, None, "prefill_timeout")) from e
        except httpx.HTTPError as e:
            if connection_refused(e, reset=True):  # a fact: the prefill worker is gone; fail all its transfers
                msg = f"prefill worker unreachable or died: {e!r}"
                raise _PrefillFailed(HTTPError(502, msg, None, "prefill_unreachable"), peer_gone=True) from e
            # this one connection closed: the prefill worker may be alive (its other transfers go on; the
            # receiver's heartbeat finds a dead one), so nobody is blamed before the router's probes decide
            msg = f"the connection to the prefill worker closed before its answer: {e!r}"
            raise _PrefillFailed(HTTPError(502, msg, None, "prefill_connection_lost")) from e
        if resp.status_code == 200:
            self._record_timings(request_id, resp)
            return
        err = _error_of(resp)
        if err.status in (400, 409):  # refused before any push: the pages are free at once
            if err.status == 400:
                raise _PrefillFailed(err, refused=True)
            if err.code == "stale_peer":
                raise _PrefillFailed(err, refused=True)
            raise _PrefillFailed(HTTPError(502, f"prefill failed: {err.message}", None, err.code), refused=True)
        status = 504 if err.status == 504 else 502
        # the prefill worker's own failure: never this worker's `internal_error` (which the router blames on decode)
        code = "prefill_error" if err.code in (None, "", "internal_error") else err.code
        raise _PrefillFailed(HTTPError(status, f"prefill failed: {err.message}", None, code))

    def _on_prefill_answer(self, request_id: str, f: asyncio.Future) -> None:
        if f.cancelled() or f.exception() is not None:
            return
        resp = f.result()
        if resp.status_code == 200:
            self._record_timings(request_id, resp)

    def _record_timings(self, request_id: str, resp: httpx.Response) -> None:
        try:
            timings = PrefillResponse.from_dict(resp.json()).timings
        except ValueError as e:
            logger.warning("request %s: %s", request_id, e)
            return

        def record(engine):
            req = engine.requests.get(request_id)
            if req is not None:
                req.times.remote_queue_s = timings.queue_s
                req.times.remote_prefill_s = timings.prefill_s

        self.loop.call_soon(record)

    def abort(self, request_id: str) -> None:
        self.loop.close_stream(request_id)
        rec = self.hooks.get(request_id)
        self.loop.call_soon(lambda e: self.hooks.abort(e, request_id, "the client went away"))
        if rec is None or rec.aborted:  # running (the engine aborts it), unknown, or aborted already
            return
        rec.aborted = True
        if rec.post is not None:  # the prefill worker may have the job
            if not rec.post.done():
                rec.post.cancel()
            task = asyncio.ensure_future(self._post_abort(rec.prefill_url, request_id))
            self._notices.add(task)  # a reference until done (the loop keeps only weak ones)
            task.add_done_callback(self._notices.discard)

    async def _post_abort(self, url: str, request_id: str) -> None:
        """Tell the prefill worker to stop a job: a notice nobody awaits, so it never ends in an exception."""
        try:
            await self.client.post(f"{url}{ABORT_PATH}", json={"request_id": request_id}, timeout=2.0)
        except Exception as e:  # noqa: BLE001 - httpx errors, or a client closed while the notice was in flight
            logger.info("request %s: could not tell prefill %s to abort: %r", request_id, url, e)


def _not_sent(e: BaseException) -> bool:
    """A ``/prefill`` call that never reached the prefill worker for slowness: no connection in time."""
    return isinstance(e, (httpx.ConnectTimeout, httpx.PoolTimeout)) and not connection_refused(e)


def _error_of(resp: httpx.Response) -> HTTPError:
    try:
        e = resp.json()["error"]
        return HTTPError(resp.status_code, e.get("message", resp.text), e.get("param"), e.get("code"))
    except (ValueError, KeyError, TypeError):
        return to_http_error(RuntimeError(f"prefill answered HTTP {resp.status_code}: {resp.text[:200]}"))
