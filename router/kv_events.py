"""Polling the workers' ``GET /kv_events`` into the router's :class:`~pd_cluster.router.kv_index.KvIndex`.

Every ``--kv-events-interval-ms`` (100 ms) each healthy worker whose role routes on KV events is asked for the
events after the last sequence number applied (``since``), or for a snapshot while its index is unsynced. The
answer is applied at once (``KvIndex.apply``); a batch cut at the worker's limit (``more``) is followed by
another poll straight away. A poll that fails (connection error, non-200, malformed answer) drops the worker's
index, so routing falls back to the approximate tree until a snapshot is applied again. A worker that turns
unhealthy is dropped too (it may be restarting). Calls carry the internal key, as every router->worker call.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

import aiohttp

from pd_cluster.router.config import KvRoutingConfig, Role
from pd_cluster.router.kv_index import BadBatch, KvIndex
from pd_cluster.router.upstream import Upstreams
from pd_cluster.router.workers import Worker, WorkerRegistry

log = logging.getLogger("pd_cluster.router.kv_events")

MAX_FOLLOW_UPS = 64
"""Polls in a row for one worker when each answer says ``more`` (bounds one round's work)."""


class KvEventsPoller:
    """Owns the polls; `index` is written only here (and read by ``cache_aware``).

    Args:
        polled_roles: which roles route on KV events.
        clock: monotonic seconds (the index compares poll start times with request end times).
    """

    def __init__(self, registry: WorkerRegistry, upstreams: Upstreams, index: KvIndex, config: KvRoutingConfig,
                 polled_roles: Callable[[Role], bool], clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry
        self.upstreams = upstreams
        self.index = index
        self.config = config
        self._polled_roles = polled_roles
        self._clock = clock
        self._polling: set[str] = set()
        self._tasks: set[asyncio.Task] = set()
        self._timeout = aiohttp.ClientTimeout(total=max(2.0, 10 * config.poll_interval_secs))

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
                params = {} if since is None else {"since": str(since)}
                async with self.upstreams.control.get(url + "/kv_events", params=params,
                                                      timeout=self._timeout) as resp:
                    raw = await resp.read()
                if resp.status != 200:
                    self._failed(worker, f"status {resp.status}")
                    return
                batch = json.loads(raw)
                was_synced = since is not None
                applied = self.index.apply(url, batch, started)
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
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as exc:  # BadBatch included
            self._failed(worker, repr(exc) if not isinstance(exc, BadBatch) else str(exc))
        finally:
            self._polling.discard(url)

    def _failed(self, worker: Worker, why: str) -> None:
        if self.index.fresh(worker.url, self._clock()) or self.index.since(worker.url) is not None:
            log.warning("kv events poll failed; the approximate tree routes until resynced",
                        extra={"worker": worker.url, "role": worker.role.value, "reason": why})
        self.index.drop(worker.url, "unreachable")

    def on_unhealthy(self, worker: Worker) -> None:
        """A worker turned unhealthy: its cache may be gone by the time it is back."""
        self.index.drop(worker.url, "unhealthy")

    async def run(self) -> None:
        """Loop: one poll of each healthy worker whose role routes on KV events, every interval."""
        while True:
            for worker in self.registry.all():
                if worker.healthy and self._polled_roles(worker.role):
                    task = asyncio.ensure_future(self.poll(worker))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
            await asyncio.sleep(self.config.poll_interval_secs)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
