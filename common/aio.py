"""Small asyncio helpers shared by the roles."""

from __future__ import annotations

import asyncio


def mark_retrieved(fut: asyncio.Future) -> None:
    """A done callback: read a future's exception, so that one nobody awaits any more (its waiter was cancelled)
    is not logged as "exception was never retrieved" when it is collected."""
    if not fut.cancelled():
        fut.exception()
