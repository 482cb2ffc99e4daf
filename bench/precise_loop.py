"""An asyncio event loop with microsecond timers and arrival stamps, for pd-bench and the fake.

The stock selector loop sleeps in ``epoll_wait``, whose timeout counts whole
milliseconds (rounded up), so every timer fires up to 1 ms late. Here the
wait is done by ``select()`` on the epoll descriptor itself, whose timeout
has microsecond resolution (an hrtimer), and then ``epoll`` collects the
ready events without waiting: timers fire on time and nothing spins.

The selector also remembers when each wait returned (``ready_at``,
``time.monotonic()`` seconds): the moment the loop learnt that sockets were
readable, which is the best arrival time it can give for their bytes.
"""

from __future__ import annotations

import asyncio
import select
import selectors
import time


class PreciseSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """The platform's default selector with a microsecond wait and ``ready_at`` stamps."""

    def __init__(self) -> None:
        super().__init__()
        self.ready_at = time.monotonic()
        self._pollable = hasattr(self, "fileno")  # epoll/kqueue/devpoll: one descriptor to wait on

    def select(self, timeout: float | None = None):  # type: ignore[override]
        if self._pollable and timeout is not None and timeout > 0:
            try:
                select.select([self.fileno()], [], [], timeout)
                timeout = 0
            except InterruptedError:
                timeout = 0
            except ValueError:  # descriptor beyond select()'s FD_SETSIZE: wait the coarse way
                self._pollable = False
        events = super().select(timeout)
        self.ready_at = time.monotonic()
        return events


def new_event_loop() -> tuple[asyncio.AbstractEventLoop, PreciseSelector]:
    """A selector event loop on a fresh :class:`PreciseSelector`, and that selector."""
    sel = PreciseSelector()
    return asyncio.SelectorEventLoop(sel), sel
