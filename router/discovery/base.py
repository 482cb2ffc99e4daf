"""What a discovery source is, and how it feeds the registry.

A source owns a set of workers (URL -> role) and reconciles the registry to
it: it adds what appeared and removes only what it added itself. Sources run
their blocking clients (kubernetes, ray) in threads, so every change is
handed to the event loop with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod

from pd_cluster.router.config import Role
from pd_cluster.router.workers import WorkerRegistry

log = logging.getLogger("pd_cluster.router.discovery")


class RegistrySink:
    """Applies one source's view to the registry, on the event loop's thread."""

    def __init__(self, registry: WorkerRegistry, source: str,
                 loop: asyncio.AbstractEventLoop, healthy_on_add: bool) -> None:
        self.registry = registry
        self.source = source
        self.loop = loop
        self.healthy_on_add = healthy_on_add

    def _upsert(self, url: str, role: Role) -> None:
        existing = self.registry.get(url)
        if existing is not None:
            if existing.source == self.source and existing.role is not role:
                self.registry.remove(url, self.source)
            else:
                return
        try:
            self.registry.add(url, role, self.source, healthy=self.healthy_on_add)
            log.info("worker discovered", extra={"worker": url, "role": role.value,
                                                 "source": self.source})
        except ValueError as exc:
            log.error("discovered worker rejected", extra={"worker": url, "error": str(exc)})

    def _remove(self, url: str) -> None:
        if self.registry.remove(url, self.source) is not None:
            log.info("worker gone", extra={"worker": url, "source": self.source})

    def _replace(self, wanted: dict[str, Role], scope: set[Role]) -> None:
        for worker in self.registry.from_source(self.source):
            if worker.role in scope and worker.url not in wanted:
                self._remove(worker.url)
        for url, role in wanted.items():
            self._upsert(url, role)

    def upsert(self, url: str, role: Role) -> None:
        """Thread-safe: make ``url`` a worker of ``role``."""
        self.loop.call_soon_threadsafe(self._upsert, url, role)

    def remove(self, url: str) -> None:
        """Thread-safe: drop ``url`` if this source added it."""
        self.loop.call_soon_threadsafe(self._remove, url)

    def replace(self, wanted: dict[str, Role], scope: set[Role]) -> None:
        """Thread-safe: this source's workers of roles ``scope`` become exactly ``wanted``."""
        self.loop.call_soon_threadsafe(self._replace, dict(wanted), set(scope))


class DiscoverySource(ABC):
    """A long-running source of workers.

    ``ready_means_healthy``: the source only reports workers already known to
    serve (Kubernetes Ready pods), so they are usable before the first check.
    """

    ready_means_healthy: bool = False

    @abstractmethod
    def start(self, sink: RegistrySink) -> None:
        """Begin discovering (non-blocking)."""

    @abstractmethod
    def stop(self) -> None:
        """Stop; may return before the background thread has exited."""
