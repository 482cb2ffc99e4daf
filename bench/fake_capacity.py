"""A fake worker's admission: at most ``max_running`` requests run, ``max_queued`` wait, the rest are refused.

As an engine's scheduler with ``--max-running-requests`` and ``--max-queued-requests``: a request that finds
every slot taken waits (reported as ``num_queue_reqs``) until one is free, first come first served; past
the queue it is refused with 503 ``overloaded`` and ``Retry-After: 1`` (``docs/worker-api.md``).
"""

from __future__ import annotations

import asyncio
from collections import deque


class FakeCapacity:
    """Slots and a bounded FIFO queue; ``running`` and ``queued`` are the counts ``/get_load`` reports."""

    def __init__(self, max_running: int, max_queued: int) -> None:
        self.max_running = max_running
        self.max_queued = max_queued
        self.running = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    @property
    def full(self) -> bool:
        return self.running >= self.max_running

    async def admit(self) -> bool:
        """Take a slot, waiting in the queue if needed; False (refuse it) when the queue is full too."""
        if self.running < self.max_running and not self._waiters:
            self.running += 1
            return True
        if len(self._waiters) >= self.max_queued:
            return False
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # handed a slot as the client left: pass it on
            else:
                self._waiters.remove(fut)
            raise
        return True

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot passes on
                return
        self.running -= 1
