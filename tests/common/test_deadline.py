"""The PD path's deadline and backoff (`pd_cluster.common.deadline`): slowness is retried until the deadline,
anything else at once."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from pd_cluster.common.deadline import Deadline, backoff_delays, retry_until


def test_the_header_value_is_relative_and_bad_values_read_as_absent():
    d = Deadline.from_header("1500", default_secs=99)
    assert 1.3 < d.left() <= 1.5 and 1300 <= int(d.header_value()) <= 1500
    for bad in (None, "", "-5", "1.5", "x", "9" * 20):
        assert 98 < Deadline.from_header(bad, default_secs=99).left() <= 99


def test_backoff_grows_to_its_cap_with_jitter():
    delays = backoff_delays(initial=0.05, maximum=2.0, rng=random.Random(0))
    got = [next(delays) for _ in range(12)]
    assert 0.04 <= got[0] <= 0.06 and all(d <= 2.4 for d in got) and got[-1] >= 1.6
    assert all(b >= a * 1.3 for a, b in zip(got[:5], got[1:6]))  # doubling, within the jitter


def test_retry_until_retries_slowness_within_the_deadline_and_nothing_else():
    async def main():
        calls = []

        async def slow_then_ok(timeout: float):
            calls.append(timeout)
            if len(calls) < 3:
                raise TimeoutError("slow")
            return "ok"

        assert await retry_until(Deadline.after(5), slow_then_ok, lambda e: isinstance(e, TimeoutError)) == "ok"
        assert len(calls) == 3 and all(0 < t <= 5 for t in calls)

        async def refused(timeout: float):
            raise ConnectionRefusedError()

        started = time.monotonic()
        with pytest.raises(ConnectionRefusedError):  # not retriable: at once
            await retry_until(Deadline.after(5), refused, lambda e: isinstance(e, TimeoutError))
        assert time.monotonic() - started < 0.5

        async def always_slow(timeout: float):
            raise TimeoutError("slow")

        started = time.monotonic()
        with pytest.raises(TimeoutError):  # retried until the deadline, not past it
            await retry_until(Deadline.after(0.5), always_slow, lambda e: True)
        assert time.monotonic() - started < 1.0

    asyncio.run(main())
