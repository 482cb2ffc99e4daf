"""Admission control: a concurrency limit with a bounded FIFO queue, counted by cost.

As SGLang router's ``--max-concurrent-requests`` / ``--queue-size`` /
``--queue-timeout-secs``: a request runs when it has its slots, else waits in a
queue of bounded length for at most the queue timeout; past the queue, or on
timeout, it is rejected (the router answers 429 with ``Retry-After``). A request
takes one slot per sequence it asks for (its *cost*: prompts × ``n``), so a
1,000-prompt request counts as 1,000 one-prompt requests do; a cost above the
limit takes every slot (it runs alone). Waiters are admitted in arrival order
as their cost fits; one that does not fit yet does not hold back smaller ones
behind it that do (backfilling: a large request waits for room at most its
queue timeout, instead of every small request waiting behind it).
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
        self.running = 0  # slots held
        self._waiters: deque[tuple[asyncio.Future[None], int]] = deque()

    @property
    def queued(self) -> int:
        """Requests waiting for their slots."""
        return len(self._waiters)

    def _slots(self, cost: int) -> int:
        return max(1, cost) if self.max_running <= 0 else min(max(1, cost), self.max_running)

    def try_acquire(self, cost: int = 1) -> bool:
        """Take `cost` slots at once if they are free; False: call `acquire`."""
        slots = self._slots(cost)
        if self.max_running <= 0 or self.running + slots <= self.max_running:
            self.running += slots
            return True
        return False

    async def acquire(self, cost: int = 1) -> None:
        """Take `cost` slots, waiting in the queue if needed. Raises :class:`Overloaded`."""
        if self.try_acquire(cost):
            return
        if len(self._waiters) >= self.queue_size:
            raise Overloaded("queue_full")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        slots = self._slots(cost)
        self._waiters.append((fut, slots))
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.queue_timeout_secs)
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
            if fut.done() and not fut.cancelled():
                self.release(cost)  # the slots were handed over as we gave up: pass them on
            else:
                fut.cancel()
                self._remove(fut)
                self._wake()  # a large head that gave up may let smaller ones in
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise Overloaded("queue_timeout") from None

    def release(self, cost: int = 1) -> None:
        """Return `cost` slots; waiters get them in arrival order, each once its own cost fits."""
        self.running -= self._slots(cost)
        self._wake()

    def _wake(self) -> None:
        """Admit, in arrival order, every waiter whose cost fits now."""
        for item in list(self._waiters):
            fut, slots = item
            if not fut.done() and self.running + slots > self.max_running > 0:
                continue
            self._waiters.remove(item)
            if not fut.done():
                self.running += slots
                fut.set_result(None)

    def _remove(self, fut: asyncio.Future[None]) -> None:
        for item in self._waiters:
            if item[0] is fut:
                self._waiters.remove(item)
                return
