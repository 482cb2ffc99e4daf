"""The engine thread does not spin when its steps can do nothing.

A decode worker handed one request of 1,000 prompts holds ~1,000 waiting requests and no free pages while their
KV arrives: every step then schedules nothing. Stepping again at once walked the scheduler's and the hooks'
per-request bookkeeping without a pause, held the GIL, and starved the worker's event loop: its ``/prefill``
calls closed with ``ReadError`` and it missed the router's health checks. The loop now sleeps between steps that
do nothing, doubling from ``idle_poll_s`` up to ``max_idle_poll_s``, and wakes at once for a command, a step
that does something or a transfer event.
"""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from pd_cluster.engine.outputs import StepOutput
from pd_cluster.serving.engine_loop import EngineLoop, StepHooks


class _Engine:
    """Always has work; `productive[i]` says whether step i computes tokens."""

    def __init__(self, productive: list[bool]) -> None:
        self.productive = productive
        self.steps = 0
        self.overlap = SimpleNamespace(in_flight=None)

    def has_work(self) -> bool:
        return True

    def step(self) -> StepOutput:
        busy = self.productive[self.steps] if self.steps < len(self.productive) else False
        self.steps += 1
        return StepOutput(num_tokens=4 if busy else 0)


class _Hooks(StepHooks):
    """A transfer event arrives at the poll before step `event_at`."""

    def __init__(self, engine: _Engine, event_at: int) -> None:
        self.engine, self.event_at = engine, event_at

    def poll(self, engine) -> None:
        if engine.steps == self.event_at:
            self.transfer_events += 1


class _RecordingWake:
    """Stands in for the loop's wake event: records each sleep, stops the loop after `limit` of them."""

    def __init__(self, loop: EngineLoop, limit: int) -> None:
        self.loop, self.limit, self.sleeps = loop, limit, []

    def wait(self, timeout: float) -> bool:
        self.sleeps.append((self.loop.engine.steps, timeout))
        if len(self.sleeps) >= self.limit:
            self.loop._stop.set()
        return False

    def clear(self) -> None:
        pass

    def set(self) -> None:
        pass


def _run(productive: list[bool], limit: int, event_at: int = -1) -> tuple[_Engine, list[tuple[int, float]]]:
    engine = _Engine(productive)
    loop = EngineLoop(engine, _Hooks(engine, event_at), idle_poll_s=0.001, max_idle_poll_s=0.008)
    wake = loop._wake = _RecordingWake(loop, limit)
    loop._run()
    assert loop.fatal is None
    return engine, wake.sleeps


def test_steps_that_do_nothing_back_off_to_the_cap():
    engine, sleeps = _run([], limit=8)
    assert [t for _, t in sleeps] == [0.001, 0.002, 0.004, 0.008, 0.008, 0.008, 0.008, 0.008]
    assert engine.steps == 8  # one step per sleep: no step ran without a pause


def test_a_step_that_computes_is_followed_at_once_and_resets_the_backoff():
    engine, sleeps = _run([False, False, False, True, True, False, False], limit=5)
    # steps 1-3 idle (sleeps 1, 2, 4 ms), steps 4-5 compute (no sleep), steps 6-7 idle from 1 ms again
    assert sleeps == [(1, 0.001), (2, 0.002), (3, 0.004), (6, 0.001), (7, 0.002)]


def test_a_transfer_event_resets_the_backoff():
    _, sleeps = _run([], limit=6, event_at=4)
    assert [t for _, t in sleeps] == [0.001, 0.002, 0.004, 0.008, 0.001, 0.002]


def test_a_command_wakes_the_loop_from_its_sleep():
    """With the real wake event and idle sleeps of 30 s: a command sent while the loop sleeps after its first
    idle step runs at once, before any other step."""
    engine = _Engine([])
    loop = EngineLoop(engine, StepHooks(), idle_poll_s=30.0, max_idle_poll_s=30.0)

    async def main() -> int:
        loop.start(asyncio.get_running_loop())
        await asyncio.sleep(0.2)
        return await asyncio.wait_for(loop.call(lambda e: e.steps), timeout=10.0)

    try:
        steps = asyncio.run(main())
    finally:
        loop.stop()
    assert steps == 1
    assert not loop.alive
