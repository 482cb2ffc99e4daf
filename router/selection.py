"""Choosing a (prefill, decode) pair, or a mixed worker, for one request.

Policies are chosen per role (``--prefill-policy``, ``--decode-policy``,
``--policy`` for mixed workers). PD pairs are preferred when both roles have
usable workers; otherwise a mixed worker serves the request alone. A retry
excludes every worker already tried by the request when others are usable,
so each retry goes to a fresh pair.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from pd_cluster.router.config import PolicyConfig, Role
from pd_cluster.router.policies import Policy, RouteRequest, make_policy
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
    _prefill_held: bool = True
    _decode_held: bool = True

    def release_prefill(self) -> None:
        if self.prefill is not None and self._prefill_held:
            self._prefill_held = False
            self.prefill.inflight -= 1

    def release(self) -> None:
        self.release_prefill()
        if self._decode_held:
            self._decode_held = False
            self.decode.inflight -= 1

    def urls(self) -> tuple[str, ...]:
        return (self.decode.url,) if self.prefill is None else (self.decode.url, self.prefill.url)


class PairSelector:
    """Applies the per-role policies to the registry's usable workers."""

    def __init__(self, registry: WorkerRegistry, config: PolicyConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry
        rng = random.Random(config.seed)
        self.policies: dict[Role, Policy] = {
            Role.PREFILL: make_policy(config.prefill, config.cache_aware, rng, clock),
            Role.DECODE: make_policy(config.decode, config.cache_aware, rng, clock),
            Role.MIXED: make_policy(config.mixed, config.cache_aware, rng, clock),
        }
        registry.subscribe(on_removed=self._forget)

    def _forget(self, worker: Worker) -> None:
        self.policies[worker.role].on_worker_removed(worker.url)

    def needs_load(self, role: Role) -> bool:
        return self.policies[role].needs_load

    def _pick(self, role: Role, request: RouteRequest, tried: set[str]) -> Worker | None:
        usable = self.registry.usable(role)
        if not usable:
            return None
        fresh = [w for w in usable if w.url not in tried] or usable
        return self.policies[role].select(fresh, request)

    def choose(self, request: RouteRequest, tried: set[str]) -> Pair | None:
        """A pair for ``request`` avoiding ``tried`` URLs when possible; ``None`` if none usable."""
        decode = self._pick(Role.DECODE, request, tried)
        prefill = self._pick(Role.PREFILL, request, tried) if decode is not None else None
        if decode is not None and prefill is not None:
            pair = Pair(decode=decode, prefill=prefill)
        else:
            mixed = self._pick(Role.MIXED, request, tried)
            if mixed is None:
                return None
            pair = Pair(decode=mixed)
        for w in (pair.decode, pair.prefill):
            if w is not None:
                w.inflight += 1
                w.sent_since_report += 1
        return pair

    def evict(self) -> None:
        for policy in self.policies.values():
            policy.evict()
