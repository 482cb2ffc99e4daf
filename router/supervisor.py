"""Per-request deadlines, upstream silence and client disconnects, off the hot path.

A per-request ``asyncio.timeout`` costs about as much as the rest of the router's own work on a short
request. Instead one supervisor task ticks every ``tick_secs`` and cancels the task of each request past
its deadline (``--request-timeout-secs``); a request's timeout fires at most one tick late. A client that
disconnects is seen at once by its connection (``router.http_server``), which calls
:meth:`Supervisor.client_lost`: no watcher task per request either.

The same tick enforces the upstream timeouts of the attempt in progress, and
never fails an attempt on a worker that is alive and making progress:

- before the response starts, ``--upstream-first-byte-timeout-secs`` without
  the first byte (it bounds queueing and prefill), or ``--upstream-idle-timeout-secs``
  without a sign of life from the decode worker (no byte on any of its
  connections, no probe answer, no advance of its step or transfer counters:
  a frozen or hung process);
- after it started, ``--upstream-idle-timeout-secs`` without a byte of this
  stream *and* without a byte on the worker's other connections or an advance
  of its counters (a worker that keeps stepping is busy, not stuck; the request
  timeout still bounds the stream);

cancel the attempt with ``stall = "idle_timeout"``, and
:meth:`Supervisor.fail_upstream` cancels every attempt on a worker found dead
(its connection refused or reset, ``stall = "worker_dead"``). The request's
handler catches that cancellation and retries or migrates the request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(eq=False)
class Supervised:
    """One request's task, deadline and flags; created by :meth:`Supervisor.enter`."""

    task: asyncio.Task
    started: float
    deadline: float
    finished: bool = False
    timed_out: bool = False
    client_gone: bool = False
    upstream: str | None = None      # the decode (or mixed) worker of the attempt in progress
    idle_limit: float = float("inf")  # seconds without a byte from ``upstream`` (first byte, or between chunks)
    stall_limit: float = float("inf")  # seconds without any sign of life from ``upstream``
    last_byte: float = 0.0           # time.monotonic() of the last byte (or of the attempt's start)
    stall: str | None = None         # why the attempt was cancelled: idle_timeout, worker_dead
    answered: bool = False           # the attempt in progress has its worker's first byte


class Supervisor:
    """Deadline and disconnect supervision of all in-flight requests."""

    def __init__(self, tick_secs: float = 0.1, life: Callable[[str, bool], float] | None = None) -> None:
        """``life(url, answered)``: ``time.monotonic()`` of the last sign of life of the worker at ``url``
        (``answered``: the attempt's response started, so a probe answer no longer counts: only bytes and
        progress do); None: only the attempt's own bytes count."""
        self.tick_secs = tick_secs
        self.life = life
        self._live: dict[int, Supervised] = {}
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._live)

    def enter(self, timeout_secs: float, loop: asyncio.AbstractEventLoop | None = None) -> tuple[int, Supervised]:
        """Start supervising the current task (of `loop`, the running loop: naming it spares
        ``asyncio.get_running_loop()``'s ``getpid`` system call)."""
        task = asyncio.current_task(loop)
        if task is None:
            raise RuntimeError("Supervisor.enter needs a running task")
        now = time.monotonic()
        entry = Supervised(task, now, now + timeout_secs)
        self._next_id += 1
        self._live[self._next_id] = entry
        return self._next_id, entry

    def leave(self, key: int) -> None:
        """Stop supervising (call in ``finally``)."""
        entry = self._live.pop(key, None)
        if entry is not None:
            entry.finished = True

    @staticmethod
    def client_lost(entry: Supervised) -> None:
        """The client disconnected: cancel its request (unless it already ended)."""
        if not entry.finished and not entry.timed_out and not entry.client_gone:
            entry.client_gone = True
            entry.task.cancel()

    def tick(self, now: float) -> None:
        """One pass: cancel overdue requests and attempts on silent workers."""
        for entry in list(self._live.values()):
            if entry.finished or entry.timed_out or entry.client_gone:
                continue
            if now >= entry.deadline:
                entry.timed_out = True
                entry.task.cancel()
            elif entry.stall is None and self._stalled(entry, now):
                entry.stall = "idle_timeout"
                entry.task.cancel()

    def _stalled(self, entry: Supervised, now: float) -> bool:
        silent = now - entry.last_byte
        if entry.answered:
            limit = entry.idle_limit
        else:
            if silent > entry.idle_limit:  # no first byte: the hard bound on queueing and prefill
                return True
            limit = entry.stall_limit
        if silent <= limit:
            return False
        if self.life is None or entry.upstream is None:
            return True
        return now - self.life(entry.upstream, entry.answered) > limit

    def fail_upstream(self, url: str) -> int:
        """Cancel every attempt in progress on worker ``url`` (found dead); returns how many."""
        count = 0
        for entry in list(self._live.values()):
            if (entry.upstream == url and entry.stall is None and not entry.finished
                    and not entry.timed_out and not entry.client_gone):
                entry.stall = "worker_dead"
                entry.task.cancel()
                count += 1
        return count

    async def run(self) -> None:
        """Tick forever."""
        while True:
            await asyncio.sleep(self.tick_secs)
            self.tick(time.monotonic())

