"""Overload is not death: which workers have room, and where requests wait while none has.

A worker has **room** for one more request when it is not marked busy and its load is below its capacity:

- capacity: the ``max_running_requests`` the worker reports (``/get_load``, else ``/server_info``);
  unknown capacity never blocks;
- load: :func:`~router.policies.base.live_load` when its load is polled (the last report's running and
  queued requests plus this router's requests sent since that are still in flight), else, or when the
  last report is older than `STALE_LOAD_SECS`, this router's in-flight requests to it; in requests, not
  sequences: a many-prompt request in flight counts once (its extra sequences, which the worker reports, are
  taken off), since the workers interleave its sequences with other requests' (``engine/scheduler/waiting.py``)
  and a request sent after it must not wait for all of them. The router's admission counts its sequences
  (``router.limiter``);
- busy: the worker refused a request for capacity (429, or a 503, which ``router.blame`` reads as overload; a
  decode worker relays its prefill's refusal as 502 ``overloaded``): it is left alone for its ``Retry-After``
  (1 s when absent), so a retry never goes back to the worker that just refused while another has room.

Requests that find a usable pair but no room wait in the router, in arrival order (`CapacityGate`), until a
worker has room or their deadline passes; the caller then refuses them with 429 and ``Retry-After``. The
admitted requests are what the workers can run, so a worker at capacity keeps streaming the requests it has
and is never mistaken for a dead one (``router.health``). Field practice: SGLang's router queue with its
timeout (429), llm-d's and Dynamo's saturation filters that stop routing to a full worker.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from pd_cluster.router.policies.base import live_load

DEFAULT_BUSY_SECS = 1.0
STALE_LOAD_SECS = 1.0
"""A load report older than this (its polls time out: a busy worker) no longer counts; in-flight requests do."""


def capacity(worker) -> int:
    """Requests the worker runs at once (0: unknown)."""
    load = worker.load
    if load is not None and load.max_running_requests > 0:
        return load.max_running_requests
    return worker.max_running


def has_room(worker, now: float) -> bool:
    """True when ``worker`` may take one more request now (see the module docstring)."""
    if worker.busy_until > now:
        return False
    cap = capacity(worker)
    if cap <= 0:
        return True
    report = worker.load
    if report is not None and now - report.received_at <= STALE_LOAD_SECS:
        return live_load(worker) - worker.inflight_extra < cap  # the report counts sequences
    return worker.inflight < cap


class CapacityGate:
    """Requests waiting for a worker with room, first come first served.

    `notify` is called whenever room may have appeared (a request ended, a load report or a health change
    arrived, a busy mark expired); it wakes the oldest waiter, which tries to route and, if it finds room,
    wakes the next one (`admitted`), so one event lets in as many requests as there is room for.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._timers: dict[float, asyncio.TimerHandle] = {}

    def __len__(self) -> int:
        return len(self._waiters)

    async def wait(self, deadline: float, first: bool = False) -> bool:
        """Wait for `notify` until ``deadline`` (``time.monotonic()``); False when the deadline passed.

        ``first``: go back to the head of the line (a waiter woken for room that another took).
        """
        left = deadline - self._clock()
        if left <= 0:
            return False
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if first:
            self._waiters.appendleft(fut)
        else:
            self._waiters.append(fut)
        handle = asyncio.get_running_loop().call_later(left, _expire, fut)
        try:
            await fut
            return True
        except TimeoutError:
            return False
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.notify()  # woken as it was cancelled: the room passes on
            raise
        finally:
            handle.cancel()
            if fut in self._waiters:
                self._waiters.remove(fut)

    def notify(self) -> None:
        """Room may have appeared: wake the oldest waiter."""
        waiters = self._waiters
        while waiters:
            fut = waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    admitted = notify  # a woken waiter found room: let the next one try too

    def notify_at(self, when: float) -> None:
        """Call `notify` at ``when`` (``time.monotonic()``), e.g. when a busy mark expires."""
        key = round(when, 2)
        if key in self._timers:
            return
        loop = asyncio.get_running_loop()

        def fire() -> None:
            self._timers.pop(key, None)
            self.notify()

        self._timers[key] = loop.call_later(max(0.0, when - self._clock()), fire)

    def close(self) -> None:
        for handle in self._timers.values():
            handle.cancel()
        self._timers.clear()


def _expire(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())
