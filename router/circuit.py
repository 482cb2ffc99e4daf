"""Per-worker circuit breaker (closed -> open -> half-open -> closed).

The state machine of SGLang router's ``--cb-*`` flags and of the classic
pattern (Nygard, "Release It!"). Time is passed in; the only I/O is one log
line per transition (WARNING on opening, INFO otherwise).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from enum import Enum

from pd_cluster.router.config import CircuitBreakerConfig


class CircuitState(str, Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


log = logging.getLogger("pd_cluster.router.circuit")

STATE_CODES = {CircuitState.CLOSED: 0, CircuitState.OPEN: 1, CircuitState.HALF_OPEN: 2}


class CircuitBreaker:
    """Counts request outcomes of one worker and says whether it may be used.

    Closed: ``failure_threshold`` consecutive failures (each within
    ``window_duration_secs`` of the previous) open it. Open: refuses for
    ``timeout_duration_secs``, then turns half-open. Half-open: lets requests
    through; ``success_threshold`` consecutive successes close it, one failure
    opens it again. Disabled (``enabled=False``): always closed.
    """

    def __init__(self, config: CircuitBreakerConfig, worker: str = "", role: str = "",
                 on_transition: Callable[[str, str], None] | None = None) -> None:
        """``on_transition(role, to_state)``: told of every transition (the router's metrics)."""
        self.config = config
        self.worker = worker
        self.role = role
        self.on_transition = on_transition
        self._state = CircuitState.CLOSED
        self._failures = 0
        self._successes = 0
        self._last_failure = float("-inf")
        self._opened_at = 0.0
        self.opened_count = 0

    def state(self, now: float) -> CircuitState:
        """Current state; an open breaker whose timeout passed reads half-open."""
        if (self._state is CircuitState.OPEN
                and now - self._opened_at >= self.config.timeout_duration_secs):
            self._state = CircuitState.HALF_OPEN
            self._successes = 0
            self._log(CircuitState.OPEN, CircuitState.HALF_OPEN)
        return self._state

    def allows(self, now: float) -> bool:
        """True unless the breaker is open."""
        return self.state(now) is not CircuitState.OPEN

    def record_success(self, now: float) -> None:
        state = self.state(now)
        self._failures = 0
        if state is CircuitState.HALF_OPEN:
            self._successes += 1
            if self._successes >= self.config.success_threshold:
                self._state = CircuitState.CLOSED
                self._log(CircuitState.HALF_OPEN, CircuitState.CLOSED)

    def record_failure(self, now: float) -> None:
        if not self.config.enabled:
            return
        state = self.state(now)
        if state is CircuitState.HALF_OPEN:
            self._open(now)
            return
        if now - self._last_failure > self.config.window_duration_secs:
            self._failures = 0
        self._failures += 1
        self._last_failure = now
        if state is CircuitState.CLOSED and self._failures >= self.config.failure_threshold:
            self._open(now)

    def reset(self) -> None:
        """Close the breaker (the worker was seen healthy again after being down)."""
        if self._state is not CircuitState.CLOSED:
            self._log(self._state, CircuitState.CLOSED, "health check passed")
        self._state = CircuitState.CLOSED
        self._failures = 0
        self._successes = 0

    def _open(self, now: float) -> None:
        self._log(self._state, CircuitState.OPEN)
        self._state = CircuitState.OPEN
        self._opened_at = now
        self._failures = 0
        self._successes = 0
        self.opened_count += 1

    def _log(self, old: CircuitState, new: CircuitState, why: str = "") -> None:
        if self.on_transition is not None:
            self.on_transition(self.role, new.value)
        level = logging.WARNING if new is CircuitState.OPEN else logging.INFO
        log.log(level, "circuit breaker %s -> %s", old.value, new.value, extra={
            "worker": self.worker, "role": self.role, "from_state": old.value,
            "to_state": new.value, "reason": why or None,
            "open_secs": self.config.timeout_duration_secs if new is CircuitState.OPEN else None})
