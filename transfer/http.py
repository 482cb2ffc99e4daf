"""Serving and fetching agent info over the workers' HTTP control plane.

Each worker mounts `make_router(agent)`: ``GET /kv_transfer/info`` answers the
agent's `AgentInfo` as JSON (NIXL metadata in base64; about 1 KB). Peers
fetch it with a `PeerDirectory`, which caches one info per worker URL and
fetches again only when a ticket names an agent the cache does not hold,
i.e. when the peer restarted with a new incarnation (vllm #49238).

HTTP runs outside the step loop (in the server's handlers). Loading the
fetched info into NIXL (`aapply`) runs on a worker thread when the agent
allows it (`Agent.connects_off_thread`): the NIXL connection setup waits for
the peer, and in the step-loop thread it would stall every running request on
first contact with a new peer.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx
from fastapi import APIRouter

from pd_cluster.transfer.errors import MetadataFetchError, StalePeerError
from pd_cluster.transfer.interfaces import Agent
from pd_cluster.transfer.layout import AgentInfo

logger = logging.getLogger(__name__)

INFO_PATH = "/kv_transfer/info"


def make_router(info: AgentInfo) -> APIRouter:
    """A router serving `info` at ``GET /kv_transfer/info`` (the payload is computed once)."""
    payload = info.to_dict()
    router = APIRouter()

    @router.get(INFO_PATH)
    def kv_transfer_info() -> dict:
        return payload

    return router


@dataclass(frozen=True)
class Resolved:
    """A peer's info as the directory knows it.

    Attributes:
        info: the live agent's info.
        fetched: True when this call fetched it over HTTP (else from the cache).
        superseded: agent names that restarted peers had before (their metadata is
            stale); `apply` drops them from the agent.
    """

    info: AgentInfo
    fetched: bool
    superseded: tuple[str, ...] = ()


class PeerDirectory:
    """Fetches and caches peers' `AgentInfo` by worker URL (thread-safe; sync and async).

    Args:
        timeout: seconds for one fetch.
        headers: sent on every fetch (the cluster's internal key: ``/kv_transfer/*`` requires it when the
            peer has one, see `pd_cluster.serving.worker_app.InternalAuth`).
    """

    def __init__(self, timeout: float = 5.0, headers: dict[str, str] | None = None) -> None:
        self.timeout = timeout
        self.headers = dict(headers or {})
        self._by_url: dict[str, AgentInfo] = {}
        self._lock = threading.Lock()
        self._dropped: list[str] = []
        self._invalidated: dict[str, AgentInfo] = {}
        self.num_fetches = 0
        self.num_restarts_seen = 0

    def cached(self, url: str) -> AgentInfo | None:
        with self._lock:
            return self._by_url.get(_norm(url))

    def invalidate(self, url: str) -> None:
        """Forget the cached info of `url`; the next resolve fetches it (and reports the old agent as
        superseded if the peer turns out to have restarted)."""
        with self._lock:
            old = self._by_url.pop(_norm(url), None)
            if old is not None:
                self._invalidated[_norm(url)] = old

    def resolve(self, url: str, expected_agent: str | None = None) -> Resolved:
        """The info of the worker at `url`; fetched unless cached and matching `expected_agent`.

        Raises:
            MetadataFetchError: the peer is unreachable or answered garbage.
            StalePeerError: `expected_agent` is given and the peer now runs another incarnation.
        """
        hit = self._hit(url, expected_agent)
        if hit is not None:
            return hit
        try:
            with httpx.Client(timeout=self.timeout, headers=self.headers) as client:
                resp = client.get(_norm(url) + INFO_PATH)
        except httpx.HTTPError as e:
            raise fetch_error(url, e) from e
        return self._store(url, resp, expected_agent)

    async def aresolve(self, url: str, expected_agent: str | None = None,
                       client: httpx.AsyncClient | None = None, timeout: float | None = None) -> Resolved:
        """`resolve` for async callers (a FastAPI handler); reuses `client` when given. `timeout`: seconds for
        this fetch (default: the directory's)."""
        hit = self._hit(url, expected_agent)
        if hit is not None:
            return hit
        timeout = self.timeout if timeout is None else timeout
        try:
            if client is None:
                async with httpx.AsyncClient(timeout=timeout, headers=self.headers) as own:
                    resp = await own.get(_norm(url) + INFO_PATH)
            else:
                resp = await client.get(_norm(url) + INFO_PATH, timeout=timeout, headers=self.headers)
        except httpx.HTTPError as e:
            raise fetch_error(url, e) from e
        return self._store(url, resp, expected_agent)

    def _hit(self, url: str, expected_agent: str | None) -> Resolved | None:
        info = self.cached(url)
        if info is not None and (expected_agent is None or info.agent_name == expected_agent):
            return Resolved(info, fetched=False, superseded=self._take_dropped())
        return None

    def _take_dropped(self) -> tuple[str, ...]:
        with self._lock:
            out, self._dropped = tuple(self._dropped), []
        return out

    def _store(self, url: str, resp: httpx.Response, expected_agent: str | None) -> Resolved:
        if resp.status_code != 200:
            raise MetadataFetchError(f"{url}{INFO_PATH} answered HTTP {resp.status_code}: {resp.text[:200]}",
                                     slow=resp.status_code == 503)
        try:
            info = AgentInfo.from_dict(resp.json())
        except ValueError as e:
            raise MetadataFetchError(f"{url}{INFO_PATH}: {e}") from e
        key = _norm(url)
        with self._lock:
            old = self._by_url.get(key) or self._invalidated.pop(key, None)
            self._by_url[key] = info
            self.num_fetches += 1
            if old is not None and old.agent_name != info.agent_name:
                self._dropped.append(old.agent_name)
                self.num_restarts_seen += 1
        if old is not None and old.agent_name != info.agent_name:
            logger.info("KV transfer: peer at %s restarted: incarnation %s -> %s (cached metadata dropped)",
                        url, old.incarnation, info.incarnation)
        if expected_agent is not None and info.agent_name != expected_agent:
            raise StalePeerError(f"the peer at {url} runs agent {info.agent_name}, not {expected_agent} "
                                 "(it restarted after naming it)", peer=expected_agent)
        return Resolved(info, fetched=True, superseded=self._take_dropped())


def fetch_error(url: str, e: httpx.HTTPError) -> MetadataFetchError:
    """The `MetadataFetchError` of a failed fetch from `url`: ``refused`` when nothing listens there (the peer is
    gone), ``slow`` when it timed out (on a loaded host a late answer, not a dead peer)."""
    return MetadataFetchError(f"cannot fetch KV transfer info from {url}: {e!r}", refused=connection_refused(e),
                              slow=isinstance(e, httpx.TimeoutException))


def connection_refused(e: BaseException, reset: bool = False) -> bool:
    """True when `e` (an httpx error) is a refused connection: nothing listens on the peer's port. With `reset`,
    a connection the peer reset counts too (its process went away mid-call)."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, ConnectionRefusedError) or (reset and isinstance(e, ConnectionResetError)):
            return True
        text = str(e).lower()
        if isinstance(e, httpx.ConnectError) and "refused" in text:
            return True
        if reset and isinstance(e, httpx.ReadError) and "reset" in text:
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def apply(agent, resolved: Resolved) -> None:
    """Load a resolved peer into `agent` (the handshake) and drop the incarnation it replaced.

    Raises:
        LayoutMismatchError: from the handshake; nothing is loaded.
    """
    for name in resolved.superseded:
        if name != resolved.info.agent_name:
            agent.disconnect(name)
    agent.connect(resolved.info)


def _norm(url: str) -> str:
    return url.rstrip("/")


async def aapply(agent: Agent, resolved: Resolved, in_engine_thread: Callable[[Callable[[], None]], Awaitable[None]]) -> None:
    """`apply` for async handlers, keeping the handshake off the engine thread.

    Superseded incarnations are dropped in the engine thread (quick; the sender or receiver there may still
    name them). The handshake (`Agent.connect`) runs on a worker thread when `agent.connects_off_thread`,
    else in the engine thread (the TP proxies, whose calls must not interleave with a step's).

    Args:
        agent: the worker's `Agent`.
        resolved: from `PeerDirectory.aresolve`.
        in_engine_thread: runs a callable in the engine thread and awaits it
            (``lambda fn: loop.call(lambda engine: fn())``).

    Raises:
        LayoutMismatchError: from the handshake; nothing is loaded.
    """
    stale = [n for n in resolved.superseded if n != resolved.info.agent_name]
    if stale:
        await in_engine_thread(lambda: [agent.disconnect(n) for n in stale])
    if agent.connects_off_thread:
        await asyncio.to_thread(agent.connect, resolved.info)
    else:
        await in_engine_thread(lambda: agent.connect(resolved.info))
