"""The router's parts, wired together: registry, policies, health, relay, control plane.

``POST /v1/completions`` and ``POST /v1/chat/completions`` go to :class:`router.proxy.GenerateHandler`;
every other path goes to the FastAPI control plane. :meth:`RouterApp.server` builds the HTTP server that
dispatches between them (``router.http_server``); ``router.main`` runs it. :meth:`RouterApp.startup` opens
the upstream connections, registers the static workers and checks them once, then starts the health, load,
eviction and discovery loops; :meth:`RouterApp.shutdown` stops them in reverse.
"""

from __future__ import annotations

import asyncio
import logging
import time

from pd_cluster.router.capacity import CapacityGate
from pd_cluster.router.config import Role, RouterConfig
from pd_cluster.router.control import ControlPlane
from pd_cluster.router.discovery.base import DiscoverySource, RegistrySink
from pd_cluster.router.health import HealthMonitor
from pd_cluster.router.http_server import HttpServer
from pd_cluster.router.kv_events import KvEventsPoller
from pd_cluster.router.limiter import ConcurrencyLimiter
from pd_cluster.router.metrics import RouterMetrics, StateCollector
from pd_cluster.router.models import ModelNames
from pd_cluster.router.proxy import GenerateHandler
from pd_cluster.router.relay import AttemptFailure
from pd_cluster.router.selection import PairSelector
from pd_cluster.router.tokenizer import RouterTokenizer
from pd_cluster.router.upstream import Upstreams
from pd_cluster.router.workers import Worker, WorkerRegistry

log = logging.getLogger("pd_cluster.router.app")


class RouterApp:
    """The router of one :class:`RouterConfig`; serve it with :func:`router.main.run`."""

    def __init__(self, config: RouterConfig,
                 sources: list[tuple[str, DiscoverySource]] | None = None) -> None:
        self.config = config
        self.registry = WorkerRegistry(config.circuit)
        self.gate = CapacityGate()  # requests waiting for a worker with room
        self.selector = PairSelector(self.registry, config.policy, on_release=self.gate.notify)
        lim = config.limits
        self.limiter = ConcurrencyLimiter(lim.max_concurrent_requests, lim.queue_size,
                                          lim.queue_timeout_secs)
        self.metrics = RouterMetrics(model_name=lambda: ",".join(self.models.names()))
        self.registry.on_breaker_transition = lambda role, to: self.metrics.cb_transitions.labels(role, to).inc()
        self.tokenizer: RouterTokenizer | None = None
        if self.selector.needs_tokens:
            kv = config.policy.kv
            self.tokenizer = RouterTokenizer(kv.tokenizer_path, kv.max_prompt_chars, kv.tokenizer_threads,
                                             kv.tokenizer_cache_tokens)
        self.models = ModelNames(config.served_model_names, self.registry)
        self.upstreams = Upstreams(lim, config.security.internal_api_key)
        self.generate = GenerateHandler(config, self.selector, self.limiter, self.metrics, self.models,
                                        self.upstreams, self.gate, self.tokenizer, self._on_attempt_failure)
        self.monitor = HealthMonitor(self.registry, self.upstreams, config.health,
                                     self.selector.needs_load, on_room=self.gate.notify,
                                     liveness_secs=lim.upstream_idle_timeout_secs)
        self.generate.supervisor.life = self._life
        self.metrics.attach_state(StateCollector(
            self.registry, lambda: self.generate.queued, lambda: self.limiter.running,
            {r.value: p for r, p in self.selector.policies.items()}, kv_index=self.selector.index,
            tokenizer_loaded=lambda: self.tokenizer is not None and self.tokenizer.loaded,
            tokenizer_counts=self.tokenizer.counts if self.tokenizer is not None else None,
            text_map=self.selector.text_map))
        self.kv_poller: KvEventsPoller | None = None
        if self.selector.index is not None and any(self.selector.uses_kv_events(r) for r in Role):
            text_map = self.selector.text_map
            self.kv_poller = KvEventsPoller(self.registry, self.upstreams, self.selector.index, config.policy.kv,
                                            self.selector.uses_kv_events, text_map=text_map,
                                            mapped_roles=self.selector.maps_text,
                                            activity=lambda: sum(self.metrics.worker_counts.values()))
            self.monitor.on_unhealthy.append(self.kv_poller.on_unhealthy)
            if text_map is not None:
                self.registry.subscribe(on_removed=lambda w: text_map.forget(w.url))
        self.registry.subscribe(on_removed=self.generate.forget_worker)
        self.monitor.on_dead.append(self._fail_inflight)
        self.control = ControlPlane(config, self.registry, self.monitor, self.metrics,
                                    self.models, lambda: self.generate.draining,
                                    self.can_route, self.selector.index, self.selector.text_map).build()
        self.sources = sources or []
        self._loops: list[asyncio.Task] = []

    def can_route(self) -> bool:
        """True when a PD pair or a mixed worker is usable now."""
        usable = self.registry.usable
        return bool((usable(Role.PREFILL) and usable(Role.DECODE)) or usable(Role.MIXED))

    def begin_drain(self) -> None:
        """Refuse new generate requests (503); in-flight ones continue."""
        if not self.generate.draining:
            log.info("draining: new requests are refused, in-flight requests continue")
        self.generate.draining = True

    def _on_attempt_failure(self, worker: Worker, failure: AttemptFailure) -> None:
        """A refused or reset connection is death, at once; after any other failure the worker is checked now
        (the check decides: a refused probe is death, no answer a miss, an answer life)."""
        if failure.refused and worker is not None and worker.role is not Role.PREFILL:
            self.monitor.mark_dead(worker, f"{failure.reason}: {failure.detail}")
        else:
            self.monitor.poke(worker)

    def _life(self, url: str, answered: bool) -> float:
        """The supervisor's view of a worker's last sign of life (``router.supervisor``)."""
        worker = self.registry.get(url)
        if worker is None:
            return self.upstreams.last_seen(url)
        last = max(self.upstreams.last_seen(url), worker.progress_at)
        return last if answered else max(last, worker.probe_seen)

    def _fail_inflight(self, worker: Worker) -> None:
        """A worker is dead: its in-flight attempts fail now and are retried or migrated."""
        self.metrics.worker_deaths.labels(worker.role.value).inc()
        count = self.generate.supervisor.fail_upstream(worker.url)
        self.metrics.inflight_failed.labels(worker.role.value).inc(count)
        if count:
            log.warning("failing in-flight requests of a dead worker", extra={
                "worker": worker.url, "role": worker.role.value, "requests": count})

    def server(self) -> HttpServer:
        """The HTTP server of this router (``router.http_server``); listen with ``await server.listen(...)``."""
        return HttpServer(self.generate, self.control, self.config.limits,
                          on_rejected=lambda reason: self.metrics.rejected.labels(reason).inc())

    def _add_static(self) -> None:
        cfg = self.config
        for urls, role in ((cfg.prefill_urls, Role.PREFILL), (cfg.decode_urls, Role.DECODE),
                           (cfg.worker_urls, Role.MIXED)):
            for url in urls:
                self.registry.add(url, role, "static")

    async def startup(self) -> None:
        """Open sessions, register and check static workers, start the loops and sources."""
        await self.upstreams.start()
        self._add_static()
        self.registry.subscribe(on_added=lambda w: w.healthy or self.monitor.poke(w))
        try:
            await asyncio.wait_for(self.monitor.check_all(), self.config.health.timeout_secs * 2 + 1)
        except TimeoutError:
            log.warning("first health checks did not all answer in time")
        loop = asyncio.get_running_loop()
        for name, source in self.sources:
            source.start(RegistrySink(self.registry, name, loop, source.ready_means_healthy))
        if self.tokenizer is not None:
            self.tokenizer.start_loading()
        self._loops = [asyncio.create_task(c) for c in (
            self.monitor.run_checks(), self.monitor.run_load_polls(), self._run_eviction(),
            self.generate.supervisor.run())]
        if self.kv_poller is not None:
            self._loops.append(asyncio.create_task(self.kv_poller.run()))
        log.info("router started", extra={
            "workers": len(self.registry.all()),
            "healthy": sum(w.healthy for w in self.registry.all()),
            "prefill_policy": self.config.policy.prefill, "decode_policy": self.config.policy.decode})

    async def _run_eviction(self) -> None:
        interval = self.config.policy.cache_aware.eviction_interval_secs
        while True:
            await asyncio.sleep(interval)
            started = time.perf_counter()
            self.selector.evict()
            log.debug("cache-aware eviction", extra={"secs": time.perf_counter() - started})

    async def shutdown(self) -> None:
        """Stop sources and loops, then close the sessions."""
        self.begin_drain()
        for _, source in self.sources:
            source.stop()
        for task in self._loops:
            task.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        await self.monitor.close()
        self.gate.close()
        if self.kv_poller is not None:
            await self.kv_poller.close()
        if self.tokenizer is not None:
            self.tokenizer.close()
        await self.upstreams.close()
        log.info("router stopped")
