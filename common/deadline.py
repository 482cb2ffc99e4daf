"""A request's deadline across the processes of the PD path, and the backoff of the calls made within it.

Slow is not dead. On a loaded host a timer fires late and a peer answers late, so one timed-out call proves
nothing about the peer; a refused connection does (nothing listens on its port). The internal calls of the PD
path (a peer's transfer info, ``POST /prefill``, the first handshake with a peer) therefore retry failures of
slowness (timeouts, a 503) with exponential backoff and jitter until the request's deadline, and give up at once
on a refused connection.

The deadline travels as ``X-PD-Deadline-Ms``: the milliseconds its sender still waits for the answer (relative,
so that hosts' clocks need not agree). The router sets it on each attempt (its first-byte timeout, at most what
is left of the request's timeout); the decode worker passes what is left on to ``/prefill``.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

DEADLINE_HEADER = "x-pd-deadline-ms"
"""Milliseconds the caller still waits for this call's answer (an integer)."""

T = TypeVar("T")


@dataclass(frozen=True)
class Deadline:
    """A point in ``time.monotonic()`` time after which nobody waits for the answer."""

    at: float

    @classmethod
    def after(cls, secs: float) -> "Deadline":
        return cls(time.monotonic() + secs)

    @classmethod
    def from_header(cls, value: str | None, default_secs: float) -> "Deadline":
        """The deadline an ``X-PD-Deadline-Ms`` value names, else `default_secs` from now; a value that is not a
        non-negative integer reads as absent."""
        if value is not None and value.strip().isdigit() and len(value.strip()) <= 12:
            return cls.after(int(value.strip()) / 1000.0)
        return cls.after(default_secs)

    def left(self) -> float:
        """Seconds left (0 once passed)."""
        return max(0.0, self.at - time.monotonic())

    def header_value(self) -> str:
        """What is left, as an ``X-PD-Deadline-Ms`` value."""
        return str(int(self.left() * 1000))


def backoff_delays(initial: float = 0.05, maximum: float = 2.0, multiplier: float = 2.0, jitter: float = 0.2,
                   rng: random.Random | None = None) -> Iterator[float]:
    """Seconds to wait before each retry: ``initial × multiplier^k``, capped at `maximum`, each scaled by a
    random factor in ``1 ± jitter`` (so that callers that failed together do not retry together)."""
    draw = (rng or random).uniform
    delay = initial
    while True:
        yield delay * draw(1 - jitter, 1 + jitter)
        delay = min(maximum, delay * multiplier)


async def retry_until(deadline: Deadline, call: Callable[[float], Awaitable[T]],
                      retriable: Callable[[BaseException], bool],
                      on_retry: Callable[[BaseException, int, float], None] | None = None,
                      per_try: float | None = None) -> T:
    """``await call(timeout)`` until it returns, retrying the exceptions `retriable` accepts while the deadline
    allows; each try gets ``min(per_try, time left)`` seconds (`timeout`). ``on_retry(error, attempt, delay)``
    is told of each retry (logging).

    Raises:
        The last error: not retriable, or no time left for another try.
    """
    delays = backoff_delays()
    attempt = 0
    while True:
        attempt += 1
        left = max(0.05, deadline.left())  # a passed deadline still gets one short try
        try:
            return await call(left if per_try is None else min(per_try, left))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - sorted by `retriable`
            delay = next(delays)
            if not retriable(e) or deadline.left() <= delay:
                raise
            if on_retry is not None:
                on_retry(e, attempt, delay)
            await asyncio.sleep(delay)
