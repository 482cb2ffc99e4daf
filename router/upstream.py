"""HTTP client sessions to the workers (aiohttp, keep-alive pools).

Two sessions: ``data`` carries generate requests, ``control`` carries health
checks and load polls, so probe traffic never waits behind the data path.
Pooled connections idle for ``upstream_keepalive_secs`` are closed; keeping
that below the workers' own keep-alive timeout (uvicorn: 5 s) means the
router never writes a request into a connection the worker is closing, and a
router that idles for hours (behind NATs or load balancers that silently drop
idle flows) opens fresh connections instead of reusing dead ones.
aiohttp is used because its C HTTP parser keeps the client side cheap; a
minimal proxy on httpx's pool used ten times the CPU per request under
concurrency (``docs/perf/router.md``).
"""

from __future__ import annotations

import aiohttp

from pd_cluster.router.config import LimitsConfig


def _session(keepalive_secs: float, connect_timeout_secs: float,
             headers: dict[str, str] | None = None) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(
        limit=0, limit_per_host=0, keepalive_timeout=keepalive_secs,
        ttl_dns_cache=10, enable_cleanup_closed=True)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_secs)
    # DummyCookieJar: the router keeps no cookies from workers (and skips the jar's
    # per-request work).
    return aiohttp.ClientSession(
        connector=connector, timeout=timeout, auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(), headers=headers,
        skip_auto_headers=("User-Agent", "Accept-Encoding"), raise_for_status=False)


class Upstreams:
    """Owns the two sessions; open them inside the running event loop.

    `internal_api_key`: the cluster's internal key, sent on every worker call (``X-PD-Internal-Key``).
    """

    def __init__(self, limits: LimitsConfig, internal_api_key: str | None = None) -> None:
        self._limits = limits
        self._headers = {"X-PD-Internal-Key": internal_api_key} if internal_api_key else None
        self._data: aiohttp.ClientSession | None = None
        self._control: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        lim = self._limits
        self._data = _session(lim.upstream_keepalive_secs, lim.connect_timeout_secs, self._headers)
        self._control = _session(lim.upstream_keepalive_secs, lim.connect_timeout_secs, self._headers)

    @property
    def data(self) -> aiohttp.ClientSession:
        if self._data is None:
            raise RuntimeError("upstream sessions are not started")
        return self._data

    @property
    def control(self) -> aiohttp.ClientSession:
        if self._control is None:
            raise RuntimeError("upstream sessions are not started")
        return self._control

    async def close(self) -> None:
        for session in (self._data, self._control):
            if session is not None:
                await session.close()
        self._data = self._control = None
