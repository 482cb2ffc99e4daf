"""Load-balancing policies without state about prompts.

``round_robin`` and ``random`` are the classic ones; ``power_of_two`` is the
"power of two choices" of Mitzenmacher (2001), as in SGLang's router;
``least_kv_usage`` is the decode default: the lowest estimated KV usage among
workers with admission room.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from pd_cluster.router.policies.base import (
    Candidate,
    Policy,
    RouteRequest,
    effective_load,
    estimated_usage,
    has_admission_room,
    require_candidates,
)


class RoundRobin(Policy):
    """Cycles over the candidates in the order given.

    Only first attempts move the cursor, so a retry (which picks among the
    workers not tried yet) does not make the next request start on a worker
    that just failed.
    """

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def select(self, candidates: Sequence[Candidate], request: RouteRequest) -> Candidate:
        require_candidates(candidates)
        choice = candidates[self._next % len(candidates)]
        if request.attempt == 1:
            self._next = (self._next + 1) % (1 << 30)
        return choice


class RandomPolicy(Policy):
    """Uniformly random candidate."""

    name = "random"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def select(self, candidates: Sequence[Candidate], request: RouteRequest) -> Candidate:
        require_candidates(candidates)
        return candidates[self._rng.randrange(len(candidates))]


class PowerOfTwo(Policy):
    """Samples two distinct candidates and keeps the one with less load.

    Load is :func:`effective_load` (reported running + queued, plus requests
    sent since the report); ties go to the lower estimated KV usage.
    """

    name = "power_of_two"
    needs_load = True

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def select(self, candidates: Sequence[Candidate], request: RouteRequest) -> Candidate:
        require_candidates(candidates)
        if len(candidates) == 1:
            return candidates[0]
        i, j = self._rng.sample(range(len(candidates)), 2)
        a, b = candidates[i], candidates[j]
        key_a = (effective_load(a), estimated_usage(a))
        key_b = (effective_load(b), estimated_usage(b))
        return b if key_b < key_a else a


class LeastKvUsage(Policy):
    """Lowest estimated KV usage among workers with admission room.

    When no worker has room, the lowest usage overall (the worker will answer
    503 if it truly is full, and the router retries elsewhere). Ties go to the
    lower :func:`effective_load`, then rotate over the tied workers, so idle
    workers share a light load instead of the first one taking all of it.
    """

    name = "least_kv_usage"
    needs_load = True

    def __init__(self) -> None:
        self._rotation = 0

    def select(self, candidates: Sequence[Candidate], request: RouteRequest) -> Candidate:
        require_candidates(candidates)
        pool = [c for c in candidates if has_admission_room(c)] or list(candidates)
        keys = [(estimated_usage(c), effective_load(c)) for c in pool]
        best = min(keys)
        tied = [c for c, k in zip(pool, keys) if k == best]
        self._rotation = (self._rotation + 1) % (1 << 30)
        return tied[self._rotation % len(tied)]
