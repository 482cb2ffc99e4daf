"""What the router learns from each attempt's outcome: breakers, busy marks, metrics and log lines.

Kept apart from the request flow (``router.proxy``): a success closes nothing and costs two breaker calls;
a failure is counted by the breaker of the role it is blamed on (``router.blame``) when it is a connection
failure, not slowness (`AttemptFailure.counts`), reported to the health monitor (``on_failure``: a refused or
reset connection is death, anything else gets the worker checked now), and logged; a refusal for capacity (or a
connection that could not be opened in time) marks the worker busy for its ``Retry-After``
(``router.capacity``) and counts against nobody.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pd_cluster.router.capacity import DEFAULT_BUSY_SECS, CapacityGate
from pd_cluster.router.config import Role
from pd_cluster.router.metrics import RouterMetrics
from pd_cluster.router.relay import AttemptFailure, RequestState
from pd_cluster.router.selection import Pair
from pd_cluster.router.workers import Worker

log = logging.getLogger("pd_cluster.router.proxy")

MIN_BUSY_SECS = 0.1
"""A worker that refused for capacity is left alone at least this long (a ``Retry-After: 0`` included)."""


class Outcomes:
    """Books attempt outcomes; ``on_failure(worker, failure)``, the app's, tells the health checks."""

    def __init__(self, metrics: RouterMetrics, gate: CapacityGate,
                 on_failure: Callable[[Worker, AttemptFailure], None] | None = None) -> None:
        self.metrics = metrics
        self.gate = gate
        self.on_failure = on_failure

    def chosen(self, pair: Pair) -> None:
        count = self.metrics.count_choice
        count(pair.decode.role.value, pair.decode.url)
        if pair.prefill is not None:
            count(Role.PREFILL.value, pair.prefill.url)

    @staticmethod
    def success(pair: Pair) -> None:
        now = time.monotonic()
        pair.decode.breaker.record_success(now)
        if pair.prefill is not None:
            pair.prefill.breaker.record_success(now)

    def failure(self, pair: Pair, failure: AttemptFailure, state: RequestState) -> None:
        if failure.overloaded:
            self._busy(pair, failure, state)
            return
        now = time.monotonic()
        blamed = None
        if failure.blame is Role.DECODE:
            blamed = pair.decode
        elif failure.blame is Role.PREFILL:
            blamed = pair.prefill or pair.decode  # a mixed worker fails on its own
        if blamed is not None and failure.counts:
            blamed.breaker.record_failure(now)
        if self.on_failure is not None:
            suspects = [blamed] if blamed is not None else \
                [w for w in (pair.decode, pair.prefill) if w is not None and failure.ambiguous]
            for worker in suspects:
                self.on_failure(worker, failure)
        role = failure.blame.value if failure.blame is not None else "none"
        self.metrics.upstream_failures.labels(role, failure.reason).inc()
        log.warning("stream broke after the first token" if failure.after_start
                    else "attempt failed", extra={
            "request_id": state.request_id, "attempt": state.attempts, "reason": failure.reason,
            "blamed": role, "code": failure.detail if failure.status else None,
            "decode": pair.decode.url, "prefill": pair.prefill.url if pair.prefill else None,
            "detail": failure.detail})

    def _busy(self, pair: Pair, failure: AttemptFailure, state: RequestState) -> None:
        """The worker that refused for capacity is left alone for its ``Retry-After``."""
        # a decode worker relays its prefill's refusal as 502 "overloaded"; its own is a 503 (or 429)
        worker = pair.prefill if failure.status == 502 and pair.prefill is not None else pair.decode
        until = time.monotonic() + max(MIN_BUSY_SECS, failure.retry_after if failure.retry_after is not None
                                       else DEFAULT_BUSY_SECS)
        worker.busy_until = max(worker.busy_until, until)
        self.gate.notify_at(worker.busy_until)
        self.metrics.upstream_failures.labels("none", "overloaded").inc()
        log.info("worker refused a request for capacity; left alone until its Retry-After", extra={
            "request_id": state.request_id, "worker": worker.url, "role": worker.role.value,
            "status": failure.status, "busy_secs": round(worker.busy_until - time.monotonic(), 3)})
