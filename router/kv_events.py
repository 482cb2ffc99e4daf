"""Polling the workers' ``GET /kv_events`` into the router's :class:`~pd_cluster.router.kv_index.KvIndex`, and
their ``GET /kv_text_map`` into its :class:`~pd_cluster.router.text_map.TextMap`.

Every ``--kv-events-interval-ms`` (100 ms; every `IDLE_POLL_SECS` while the router routes nothing and the last
polls brought nothing new) each healthy worker whose role routes on KV events is asked for the
events after the last sequence number applied (``since``), or for a snapshot while its index is unsynced. The
answer is applied at once (``KvIndex.apply``); a batch cut at the worker's limit (``more``) is followed by
another poll straight away. A poll that fails (connection error, non-200, malformed answer) drops the worker's
index, so routing falls back to the approximate tree until a snapshot is applied again. A worker that turns
unhealthy is dropped too (it may be restarting). Calls carry the internal key, as every router->worker call, and
go over the worker's keep-alive pool of the data path (``router.upstream``), not the probes' aiohttp session: they
run every interval, and a generic client costs several times the CPU per call.

Workers that tokenize (decode and mixed) are asked, in the same rounds, for the text-to-page map entries after the
last one applied (``since``); a failed poll only makes that source stale (its entries stay true).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

from pd_cluster.router.config import KvRoutingConfig, Role
from pd_cluster.router.kv_index import BadBatch, KvIndex
from pd_cluster.router.text_map import TextMap
from pd_cluster.router.upstream import Reply, UpstreamError, Upstreams
from pd_cluster.router.workers import Worker, WorkerRegistry

log = logging.getLogger("pd_cluster.router.kv_events")

MAX_FOLLOW_UPS = 64
"""Polls in a row for one worker when each answer says ``more`` (bounds one round's work)."""
IDLE_POLL_SECS = 0.5
"""Poll period while the router routes nothing and the last polls brought nothing new (below the index's
``--kv-events-stale-secs``, 2 s by default, so the view stays usable)."""


class KvEventsPoller:
    """Owns the polls; `index` is written only here (and read by ``cache_aware``).

    Args:
        polled_roles: which roles route on KV events.
        clock: monotonic seconds (the index compares poll start times with request end times).
    """

    def __init__(self, registry: WorkerRegistry, upstreams: Upstreams, index: KvIndex, config: KvRoutingConfig,
                 polled_roles: Callable[[Role], bool], clock: Callable[[], float] = time.monotonic,
                 text_map: TextMap | None = None, mapped_roles: Callable[[Role], bool] = lambda role: False,
                 activity: Callable[[], int] = lambda: 0) -> None:
        """``text_map`` and ``mapped_roles``: where text-to-page map entries go, and which roles publish them;
        ``activity()``: a count that changes whenever the router routes (polls slow down while it does not)."""
        self._activity = activity
        self._news = True
        self.registry = registry
        self.upstreams = upstreams
        self.index = index
        self.text_map = text_map
        self._mapped_roles = mapped_roles
        self.config = config
        self._polled_roles = polled_roles
        self._clock = clock
        self._polling: set[str] = set()
        self._tasks: set[asyncio.Task] = set()
        self._timeout = max(2.0, 10 * config.poll_interval_secs)

    async def poll(self, worker: Worker) -> None:
        """Poll `worker` until its answer has no ``more`` (at most `MAX_FOLLOW_UPS` times); skipped if a poll of
        it is already running."""
        url = worker.url
        if url in self._polling:
            return
        self._polling.add(url)
        resynced = False
        try:
            for _ in range(MAX_FOLLOW_UPS):
                started = self._clock()
                since = self.index.since(url)
                query = "token_ids=false&hashes=packed" + ("" if since is None else f"&since={since}")
                status, raw = await self._get(url, "/kv_events?" + query)
                if status != 200:
                    self._failed(worker, f"status {status}")
                    return
                batch = json.loads(raw)
                was_synced = since is not None
                applied = self.index.apply(url, batch, started)
                self._news = self._news or applied > 0
                if not was_synced and self.index.since(url) is not None:
                    log.info("kv index synced", extra={"worker": url, "role": worker.role.value,
                                                       "pages": self.index.num_pages(url)})
                if applied == 0 and self.index.since(url) is None:
                    log.warning("kv index dropped; resyncing", extra={"worker": url, "role": worker.role.value})
                    if not resynced:  # ask for the snapshot now, once per round
                        resynced = True
                        continue
                    return
                if not batch.get("more"):
                    return
        except (UpstreamError, OSError, asyncio.TimeoutError, ValueError) as exc:  # BadBatch included
            self._failed(worker, repr(exc) if not isinstance(exc, BadBatch) else str(exc))
        finally:
            self._polling.discard(url)

    async def poll_text_map(self, worker: Worker) -> None:
        """Poll `worker`'s ``/kv_text_map`` until its answer has no ``more`` (at most `MAX_FOLLOW_UPS` times)."""
        key = "map " + worker.url
        if key in self._polling or self.text_map is None:
            return
        self._polling.add(key)
        try:
            for _ in range(MAX_FOLLOW_UPS):
                started = self._clock()
                since = self.text_map.since(worker.url)
                status, raw = await self._get(worker.url, "/kv_text_map" if since is None else
                                              f"/kv_text_map?since={since}")
                if status != 200:
                    self.text_map.stale(worker.url)
                    return
                batch = json.loads(raw)
                if self.text_map.apply(worker.url, batch, started):
                    self._news = True
                if not batch.get("more"):
                    return
        except (UpstreamError, OSError, asyncio.TimeoutError, ValueError, KeyError, TypeError) as exc:
            log.debug("text map poll failed", extra={"worker": worker.url, "reason": repr(exc)})
            self.text_map.stale(worker.url)
        finally:
            self._polling.discard(key)

    async def _get(self, url: str, target: str) -> tuple[int, bytes]:
        """``GET target`` on the worker's data-path pool (`router.upstream`: a keep-alive connection and
        httptools, a fraction of a generic client's CPU per poll; these polls run every interval).

        Raises:
            UpstreamError: no connection, or no whole answer within the poll timeout.
        """
        pool = self.upstreams.pool(url)
        loop = asyncio.get_running_loop()
        reply = Reply(loop)
        request = b"".join((b"GET ", target.encode(), b" HTTP/1.1\r\n", pool.head_lines, b"\r\n"))
        if not pool.send_pooled(request, reply):
            await pool.send(request, reply)
        late = loop.call_later(self._timeout, reply.abort)  # closes the connection: the reply fails
        try:
            await reply.done
        finally:
            late.cancel()
        return reply.status, reply.body()

    def _failed(self, worker: Worker, why: str) -> None:
        if self.index.fresh(worker.url, self._clock()) or self.index.since(worker.url) is not None:
            log.warning("kv events poll failed; the approximate tree routes until resynced",
                        extra={"worker": worker.url, "role": worker.role.value, "reason": why})
        self.index.drop(worker.url, "unreachable")

    def on_unhealthy(self, worker: Worker) -> None:
        """A worker turned unhealthy: its cache may be gone by the time it is back."""
        self.index.drop(worker.url, "unhealthy")
        if self.text_map is not None:
            self.text_map.stale(worker.url)

    async def run(self) -> None:
        """Loop: one poll of each healthy worker whose role routes on KV events (and of each that publishes a
        text map), every interval while the router routes or the last polls brought news; every
        `IDLE_POLL_SECS` otherwise (an idle router keeps its view fresh without burning CPU)."""
        last_activity, last_round = None, float("-inf")
        while True:
            now, activity = self._clock(), self._activity()
            if activity != last_activity or self._news or now - last_round >= IDLE_POLL_SECS:
                last_activity, last_round, self._news = activity, now, False
                for worker in self.registry.all():
                    if not worker.healthy:
                        continue
                    if self._polled_roles(worker.role):
                        self._spawn(self.poll(worker))
                    if self._mapped_roles(worker.role):
                        self._spawn(self.poll_text_map(worker))
            await asyncio.sleep(self.config.poll_interval_secs)

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
