"""Admission control: a concurrency limit with a bounded FIFO queue.

As SGLang router's ``--max-concurrent-requests`` / ``--queue-size`` /
``--queue-timeout-secs``: a request runs when a slot is free, else waits in a
queue of bounded length for at most the queue timeout; past the queue, or on
timeout, it is rejected (the router answers 429 with ``Retry-After``).
"""

from __future__ import annotations

import asyncio
from collections import deque


class Overloaded(Exception):
    """The request cannot be admitted; ``reason`` is ``queue_full`` or ``queue_timeout``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class ConcurrencyLimiter:
    """``max_running`` slots (``<= 0``: unlimited) and a queue of ``queue_size`` waiters."""

    def __init__(self, max_running: int, queue_size: int, queue_timeout_secs: float) -> None:
        self.max_running = max_running
        self.queue_size = max(0, queue_size)
        self.queue_timeout_secs = queue_timeout_secs
        self.running = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return len(self._waiters)

    def try_acquire(self) -> bool:
        """Take a free slot at once if there is one (nobody queued before); False: call `acquire`."""
        if self.max_running <= 0 or (self.running < self.max_running and not self._waiters):
            self.running += 1
            return True
        return False

    async def acquire(self) -> None:
        """Take a slot, waiting in the queue if needed. Raises :class:`Overloaded`."""
        if self.try_acquire():
            return
        if len(self._waiters) >= self.queue_size:
            raise Overloaded("queue_full")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.queue_timeout_secs)
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
            if fut.done() and not fut.cancelled():
                self.release()  # the slot was handed over as we gave up: pass it on
            else:
                fut.cancel()
                self._remove(fut)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise Overloaded("queue_timeout") from None

    def release(self) -> None:
        """Return a slot; the oldest live waiter gets it."""
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot passes on; running stays the same
                return
        self.running -= 1

    def _remove(self, fut: asyncio.Future[None]) -> None:
        try:
            self._waiters.remove(fut)
        except ValueError:
            pass
