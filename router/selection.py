"""Choosing a (prefill, decode) pair, or a mixed worker, for one request.

Policies are chosen per role (``--prefill-policy``, ``--decode-policy``,
``--policy`` for mixed workers). PD pairs are preferred when both roles have
usable workers; otherwise a mixed worker serves the request alone. Only
workers with room are candidates (``router.capacity``): when every usable
worker of a role is at capacity there is no pair, and the request waits in the
router. A retry excludes every worker already tried by the request when others
are usable, so each retry goes to a fresh pair.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pd_cluster.router.capacity import has_room
from pd_cluster.router.config import PolicyConfig, Role
from pd_cluster.router.kv_index import KvIndex
from pd_cluster.router.policies import CacheAware, Policy, RouteRequest, make_policy
from pd_cluster.router.text_map import TextMap
from pd_cluster.router.workers import Worker, WorkerRegistry


@dataclass(eq=False)
class Pair:
    """Where one attempt goes: ``decode`` (a decode or mixed worker) and its prefill.

    Holds one in-flight count on each worker from :meth:`PairSelector.choose`
    until released: the prefill's at the first response byte (its work is
    done), the decode's at the end of the attempt.
    """

    decode: Worker
    prefill: Worker | None = None
    extra: int = 0  # sequences of the request beyond its first (``router.capacity``)
    _prefill_held: bool = True
    _decode_held: bool = True
    on_prefill_done: Callable[[], None] | None = field(default=None, repr=False)
    on_decode_done: Callable[[], None] | None = field(default=None, repr=False)

    on_release: Callable[[], None] | None = field(default=None, repr=False)

    def release_prefill(self) -> None:
        if self.prefill is not None and self._prefill_held:
            self._prefill_held = False
            self.prefill.inflight -= 1
            self.prefill.inflight_extra -= self.extra
            if self.on_prefill_done is not None:
                self.on_prefill_done()
            if self.on_release is not None:
                self.on_release()

    def release(self) -> None:
        self.release_prefill()
        if self._decode_held:
            self._decode_held = False
            self.decode.inflight -= 1
            self.decode.inflight_extra -= self.extra
            if self.on_decode_done is not None:
                self.on_decode_done()
            if self.on_release is not None:
                self.on_release()

    def urls(self) -> tuple[str, ...]:
        return (self.decode.url,) if self.prefill is None else (self.decode.url, self.prefill.url)


class PairSelector:
    """Applies the per-role policies to the registry's usable workers.

    ``index``: the workers' KV event index, given to ``cache_aware`` when ``config.kv.enabled``
    (``--kv-events``); None makes one then. ``text_map``: the workers' text-to-page maps, unless the router
    tokenizes (``--tokenizer-path``). ``on_release``: called when a chosen pair is
    released, since room may have appeared (``CapacityGate.notify``).
    """

    def __init__(self, registry: WorkerRegistry, config: PolicyConfig,
                 clock: Callable[[], float] = time.monotonic, index: KvIndex | None = None,
                 on_release: Callable[[], None] | None = None) -> None:
        self.registry = registry
        rng = random.Random(config.seed)
        kv = config.kv
        self.text_map = TextMap(kv.text_map_max_entries, kv.stale_secs) if kv.enabled and not kv.tokenized else None
        if kv.enabled:
            self.index = index or KvIndex(kv.max_pages, kv.stale_secs,
                                          self.text_map.polled_since if self.text_map is not None else None)
        else:
            self.index = None
        self.policies: dict[Role, Policy] = {
            role: make_policy(name, config.cache_aware, rng, clock, self.index, kv, self.text_map)
            for role, name in ((Role.PREFILL, config.prefill), (Role.DECODE, config.decode),
                               (Role.MIXED, config.mixed))}
        self.on_release = on_release
        self._clock = clock
        registry.subscribe(on_removed=self._forget)

    def _forget(self, worker: Worker) -> None:
        self.policies[worker.role].on_worker_removed(worker.url)

    def needs_load(self, role: Role) -> bool:
        return self.policies[role].needs_load

    def uses_kv_events(self, role: Role) -> bool:
        """True when `role`'s policy routes on the workers' KV events (poll their ``/kv_events``)."""
        return self.index is not None and isinstance(self.policies[role], CacheAware)

    @property
    def needs_text(self) -> bool:
        """True when some role routes by ``cache_aware``'s tree, which reads each prompt's text."""
        return any(isinstance(p, CacheAware) for p in self.policies.values())

    @property
    def needs_tokens(self) -> bool:
        """True when some role routes on KV events with the router's own tokenizer (``--tokenizer-path``)."""
        return self.text_map is None and any(self.uses_kv_events(role) for role in Role)

    def maps_text(self, role: Role) -> bool:
        """True when `role`'s workers tokenize prompts and a policy reads their text-to-page maps (poll their
        ``/kv_text_map``): decode and mixed workers, while some role routes on KV events without a tokenizer."""
        return (self.text_map is not None and role in (Role.DECODE, Role.MIXED)
                and any(self.uses_kv_events(r) for r in Role))

    def _pick(self, role: Role, request: RouteRequest, tried: set[str]) -> Worker | None:
        usable = self.registry.usable(role)
        if not usable:
            return None
        now = self._clock()
        roomy = [w for w in usable if has_room(w, now)]
        if not roomy:
            return None
        fresh = [w for w in roomy if w.url not in tried] if tried else roomy
        return self.policies[role].select(fresh or roomy, request)

    def can_pair(self) -> bool:
        """True when a prefill+decode pair or a mixed worker is usable, room or not."""
        usable = self.registry.usable
        return bool((usable(Role.PREFILL) and usable(Role.DECODE)) or usable(Role.MIXED))

    def may_pair(self) -> bool:
        """True when a pair may become usable without a restart: each role has a worker that is not dead (it is
        starting, not ready for a moment, or its breaker is open); a request then waits for it (within the
        queue timeout) instead of being refused."""
        def alive(role: Role) -> bool:
            return any(not w.dead for w in self.registry.of_role(role))
        return (alive(Role.PREFILL) and alive(Role.DECODE)) or alive(Role.MIXED)

    def choose(self, request: RouteRequest, tried: set[str], cost: int = 1) -> Pair | None:
        """A pair for ``request`` avoiding ``tried`` URLs when possible; ``None`` if none usable. ``cost``: the
        request's sequences (``router.capacity`` counts a request once for room, whatever its cost)."""
        decode = self._pick(Role.DECODE, request, tried)
        prefill = self._pick(Role.PREFILL, request, tried) if decode is not None else None
        if decode is not None and prefill is not None:
            pair = Pair(decode=decode, prefill=prefill)
        else:
            mixed = self._pick(Role.MIXED, request, tried)
            if mixed is None:
                return None
            pair = Pair(decode=mixed)
        pair.extra = max(0, cost - 1)
        for w in (pair.decode, pair.prefill):
            if w is not None:
                w.inflight += 1
                w.inflight_extra += pair.extra
                w.sent_since_report += 1
        pair.on_decode_done = self.policies[pair.decode.role].track(pair.decode, request)
        if pair.prefill is not None:
            pair.on_prefill_done = self.policies[Role.PREFILL].track(pair.prefill, request)
        pair.on_release = self.on_release
        return pair

    def evict(self) -> None:
        for policy in self.policies.values():
            policy.evict()
