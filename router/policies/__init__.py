"""Routing policies (pure, no I/O) and their factory."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from pd_cluster.router.config import CacheAwareConfig, KvRoutingConfig
from pd_cluster.router.kv_index import KvIndex
from pd_cluster.router.policies.base import Candidate, Policy, RouteRequest, effective_load, live_load
from pd_cluster.router.policies.cache_aware import CacheAware
from pd_cluster.router.policies.simple import LeastKvUsage, PowerOfTwo, RandomPolicy, RoundRobin
from pd_cluster.router.text_map import TextMap

__all__ = ["Candidate", "Policy", "RouteRequest", "effective_load", "live_load", "make_policy",
           "CacheAware", "LeastKvUsage", "PowerOfTwo", "RandomPolicy", "RoundRobin"]


def make_policy(name: str, cache_aware: CacheAwareConfig, rng: random.Random,
                clock: Callable[[], float] = time.monotonic, index: KvIndex | None = None,
                kv: KvRoutingConfig | None = None, text_map: TextMap | None = None) -> Policy:
    """Build the policy called ``name``; raises ``ValueError`` on an unknown name.

    ``index`` and ``kv``: the workers' KV event index and its settings, for ``cache_aware`` (None: the
    approximate tree only); ``text_map``: the workers' text-to-page maps (untokenized prompts on the index)."""
    if name == "round_robin":
        return RoundRobin()
    if name == "random":
        return RandomPolicy(rng)
    if name == "power_of_two":
        return PowerOfTwo(rng)
    if name == "least_kv_usage":
        return LeastKvUsage()
    if name == "cache_aware":
        return CacheAware(cache_aware, clock, index, kv, text_map)
    raise ValueError(f"unknown policy {name!r}")
