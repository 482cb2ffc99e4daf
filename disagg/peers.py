"""Meeting a KV-transfer peer: its transfer info and the handshake, retried within a deadline; and readiness.

Both roles meet their peers the same way (`connect_peer`): fetch the peer's ``GET /kv_transfer/info`` (cached per
incarnation, `transfer.http.PeerDirectory`), then load it into the agent (the layout handshake,
`transfer.http.aapply`). A fetch that timed out or found the peer answering 503 is slowness, not death, and is
retried with backoff until the deadline (`pd_cluster.common.deadline`); so is a handshake NIXL refused. A refused
connection is not retried: nothing listens there, the peer is gone. A layout mismatch is never retried.

Readiness (`PeerLinks`): a decode worker meets the prefill workers it knows (``--prefill-urls``,
``--prefill-url``) before its ``/health`` turns 200, both ways: it handshakes with each one, then asks each to
handshake with it (``POST /kv_transfer/connect``, `connect_route`), so that the first requests of a cold cluster
pay no first contact. A prefill worker that keeps refusing the connection (gone) holds readiness back only for a
grace period once another one is met; it is met in the background, and any other peer on a request's first
contact (the request path retries within the request's deadline). Kubernetes separates readiness from liveness the same way: a worker takes no new
work until it can serve it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pd_cluster.common.deadline import DEADLINE_HEADER, Deadline, retry_until
from pd_cluster.disagg.errors import transfer_http_error
from pd_cluster.serving.errors import HTTPError
from pd_cluster.transfer.errors import LayoutMismatchError, MetadataFetchError, StalePeerError, TransferError
from pd_cluster.transfer.http import PeerDirectory, Resolved, aapply, connection_refused
from pd_cluster.transfer.interfaces import Agent

logger = logging.getLogger("pd.peers")

CONNECT_PATH = "/kv_transfer/connect"
"""``POST {"url": <a worker>}``: handshake with that worker now (its transfer info, then NIXL); 200 when done."""

EngineCall = Callable[[Callable[[], None]], Awaitable[None]]
"""Runs a callable in the engine thread and awaits it (``lambda fn: loop.call(lambda engine: fn())``)."""

FETCH_TIMEOUT_S = 5.0
"""Seconds one fetch of a peer's transfer info may take before it is retried (within the deadline)."""


def slow_error(e: BaseException) -> bool:
    """True for a failure of slowness that a retry within the deadline may fix: a fetch that timed out or met a
    503, or a handshake NIXL refused. False for a refused connection (the peer is gone), a layout mismatch, a
    stale incarnation, or anything else."""
    if isinstance(e, MetadataFetchError):
        return e.slow and not e.refused
    if isinstance(e, (LayoutMismatchError, StalePeerError, ValueError)):
        return False
    return isinstance(e, TransferError)


async def connect_peer(agent: Agent, directory: PeerDirectory, url: str, deadline: Deadline,
                       in_engine_thread: EngineCall, expected_agent: str | None = None,
                       client: httpx.AsyncClient | None = None) -> Resolved:
    """Fetch `url`'s transfer info (or take it from the cache) and handshake, retrying slowness until `deadline`.

    Raises:
        MetadataFetchError: the peer refused the connection (``refused``), or stayed slow past the deadline.
        StalePeerError: `expected_agent` names an incarnation the peer no longer runs.
        LayoutMismatchError: the layouts disagree (nothing is loaded).
    """

    async def once(timeout: float) -> Resolved:
        resolved = await directory.aresolve(url, expected_agent=expected_agent, client=client,
                                            timeout=max(0.05, min(FETCH_TIMEOUT_S, timeout)))
        if resolved.fetched or not agent.is_connected(resolved.info.agent_name):
            await aapply(agent, resolved, in_engine_thread)
        return resolved

    def on_retry(e: BaseException, attempt: int, delay: float) -> None:
        logger.info("KV transfer peer %s: %s; retrying in %.2f s (try %d, %.1f s left)", url, e, delay, attempt,
                    deadline.left())

    return await retry_until(deadline, once, slow_error, on_retry)


def connect_failure(e: BaseException, peer_role: str) -> HTTPError:
    """The HTTP answer to a failed `connect_peer` with a `peer_role` worker: a refused connection is
    ``{peer_role}_unreachable`` (the peer is gone: the router blames it), slowness past the deadline 504
    ``kv_transfer_metadata_unreachable`` (nobody's fault: no breaker counts it), the rest as
    `transfer_http_error`."""
    if isinstance(e, MetadataFetchError) and e.refused:
        return HTTPError(502, f"{peer_role} worker unreachable (connection refused): {e}", None,
                         f"{peer_role}_unreachable")
    if isinstance(e, MetadataFetchError):
        return HTTPError(504 if e.slow else 502, str(e), None, "kv_transfer_metadata_unreachable")
    return transfer_http_error(e)


def connect_route(agent: Agent, directory: PeerDirectory, in_engine_thread: EngineCall,
                  default_secs: float) -> Callable[[Request], Awaitable[Response]]:
    """The handler of ``POST /kv_transfer/connect`` (`CONNECT_PATH`): handshake with the worker the body names,
    within the caller's ``X-PD-Deadline-Ms`` (else `default_secs`)."""

    async def handle(request: Request) -> Response:
        try:
            url = json.loads(await request.body())["url"]
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ValueError(url)
        except (ValueError, KeyError, TypeError):
            return JSONResponse(HTTPError(400, 'the body must be {"url": "http://host:port"}', "url",
                                          "invalid_value").body(), status_code=400)
        deadline = Deadline.from_header(request.headers.get(DEADLINE_HEADER), default_secs)
        try:
            resolved = await connect_peer(agent, directory, url.rstrip("/"), deadline, in_engine_thread)
        except Exception as e:  # noqa: BLE001 - answered in OpenAI's format
            err = connect_failure(e, "peer")
            return JSONResponse(err.body(), status_code=err.status)
        return JSONResponse({"agent": resolved.info.agent_name})

    return handle


class PeerLinks:
    """A worker's readiness on its known peers: each one met (`connect_peer`, then ``POST /kv_transfer/connect``
    on it so that it meets this worker) before ``ready``.

    Peers start at the same time as this worker, so a refused connection is tried again too while readiness
    waits. Readiness stops waiting when every peer is met; when at least one is met and the others have refused
    the connection for `refused_grace` seconds (down: they are met in the background, every `retry_secs`); or
    after `ready_timeout` seconds (logged; the rest meet on a request's first contact, which retries within the
    request's deadline).

    Args:
        agent, directory, in_engine_thread: as `connect_peer`'s.
        self_url: this worker's URL (sent to each peer, which fetches this worker's info from it).
        peers: the known peers' URLs.
        client: for the ``/kv_transfer/connect`` calls (with the cluster's internal key).
    """

    def __init__(self, agent: Agent, directory: PeerDirectory, in_engine_thread: EngineCall, self_url: str,
                 peers: tuple[str, ...], client: httpx.AsyncClient, ready_timeout: float = 60.0,
                 refused_grace: float = 10.0, retry_secs: float = 5.0) -> None:
        self.agent = agent
        self.directory = directory
        self.in_engine_thread = in_engine_thread
        self.self_url = self_url
        self.peers = tuple(dict.fromkeys(u.rstrip("/") for u in peers if u))
        self.client = client
        self.ready_timeout = ready_timeout
        self.refused_grace = refused_grace
        self.retry_secs = retry_secs
        self.met: set[str] = set()
        self.refusing: dict[str, bool] = {}  # the last try of each peer not met yet was refused
        self.ready = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self, on_ready: Callable[[], None]) -> None:
        """Meet every known peer in a task of the running loop; `on_ready` once readiness no longer waits."""
        self._task = asyncio.ensure_future(self._run(on_ready))

    async def _run(self, on_ready: Callable[[], None]) -> None:
        started = time.monotonic()
        deadline = Deadline.after(self.ready_timeout)
        tasks = {url: asyncio.ensure_future(self._meet(url, deadline)) for url in self.peers}
        try:
            while True:
                pending = [u for u, t in tasks.items() if not t.done()]
                if not pending or (self.met and time.monotonic() - started >= self.refused_grace
                                   and all(self.refusing.get(u) for u in pending)):
                    break
                await asyncio.wait([tasks[u] for u in pending], timeout=0.25)
            pending = [u for u in self.peers if u not in self.met]
            if pending:
                logger.warning("KV transfer: not yet connected to %s; ready anyway (they are met in the background "
                               "or on a request's first contact)", ", ".join(pending))
            else:
                logger.info("KV transfer: connected to every known peer (%d)", len(self.peers))
            self.ready.set()
            on_ready()
            await asyncio.gather(*tasks.values())
            while pending := [u for u in self.peers if u not in self.met]:  # peers that were down: now and then
                await asyncio.sleep(self.retry_secs)
                await asyncio.gather(*(self._meet(url, Deadline.after(self.retry_secs)) for url in pending))
        finally:
            for t in tasks.values():
                t.cancel()

    async def _meet(self, url: str, deadline: Deadline) -> None:
        """Both handshakes with `url`, retrying refusals and slowness until `deadline`; logs what stopped it."""

        def retriable(e: BaseException) -> bool:
            refused = (isinstance(e, MetadataFetchError) and e.refused) or connection_refused(e)
            self.refusing[url] = refused
            return refused or slow_error(e) or _retry_back(e)

        try:
            await retry_until(deadline, lambda timeout: connect_peer(
                self.agent, self.directory, url, Deadline.after(timeout), self.in_engine_thread, client=self.client),
                retriable)
            await retry_until(deadline, lambda timeout: self._ask_back(url, timeout, deadline), retriable)
        except Exception as e:  # noqa: BLE001 - logged; the peer is met later
            logger.log(logging.INFO if self.refusing.get(url) else logging.WARNING,
                       "KV transfer: could not meet peer %s yet: %s", url, e)
            return
        self.met.add(url)
        self.refusing.pop(url, None)

    async def _ask_back(self, url: str, timeout: float, deadline: Deadline) -> None:
        resp = await self.client.post(url + CONNECT_PATH, json={"url": self.self_url}, timeout=max(0.05, timeout),
                                      headers={DEADLINE_HEADER: deadline.header_value()})
        if resp.status_code != 200:
            raise _BackRefused(resp.status_code, resp.text[:200])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


class _BackRefused(Exception):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"/kv_transfer/connect answered {status}: {text}")
        self.status = status


def _retry_back(e: BaseException) -> bool:
    """A ``/kv_transfer/connect`` call worth another try: it timed out, or the peer was slow (503, 504)."""
    if isinstance(e, _BackRefused):
        return e.status in (503, 504)
    return isinstance(e, httpx.TimeoutException)
