"""Runs an `LLMEngine` in its own thread and connects it to asyncio handlers.

The engine is single-threaded. Handlers on the event loop send it commands
(`call`), which run between steps; the thread runs `step()` while there is work
and hands each request's deltas to an `asyncio.Queue` (`open_stream`). Role
plug-ins (`StepHooks`) run in the same thread after every step: the prefill
worker pushes the chunk just computed, the decode worker polls arriving KV.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from pd_cluster.engine.executor.dp import DPLockstep
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.engine.outputs import RequestDelta, StepOutput
from pd_cluster.serving.errors import EngineDeadError

logger = logging.getLogger(__name__)


class StepHooks:
    """Role-specific work in the engine thread. The default does nothing."""

    def after_step(self, engine: LLMEngine, out: StepOutput) -> None:
        """Called after every `step()` (also steps that ran no forward pass)."""

    def poll(self, engine: LLMEngine) -> None:
        """Called on every loop iteration, busy or idle (transfer polling)."""

    def has_pending(self) -> bool:
        """True while the hooks wait on something (e.g. transfers) and need `poll` soon."""
        return False

    transfer_events = 0
    """KV transfer events handled so far (pushes completed or failed, pages released): a progress counter that
    role hooks advance; read by ``/health`` and ``/get_load`` (`EngineLoop.progress`)."""


class EngineLoop:
    """The engine's thread.

    Args:
        engine: the engine (used only from the loop's thread once started).
        hooks: role plug-ins.
        idle_poll_s: sleep between polls while only `hooks` have pending work (seconds).
        max_idle_poll_s: the longest sleep between steps that do nothing (seconds): waiting requests that cannot
            be admitted yet (no free pages, ``--max-running-requests``) make the engine step without computing;
            from `idle_poll_s` the sleep doubles after each such step up to this, and a command, a step that
            does something or a transfer event ends it.
        on_step: optional callback after each step (metrics), in the engine thread.
        on_fatal: called on the event loop once the loop has died and every request in flight has been
            failed (the worker app exits the process from it).

    If the thread dies (an exception from `step` or a hook), every open stream receives an
    `EngineDeadError` in place of its next delta, every pending and later `call` raises it, and
    `alive` turns False (``/health`` answers 503).
    """

    def __init__(self, engine: LLMEngine, hooks: StepHooks | None = None, idle_poll_s: float = 0.0005,
                 max_idle_poll_s: float = 0.005,
                 on_step: Callable[[LLMEngine, StepOutput, float], None] | None = None,
                 on_fatal: Callable[[BaseException], Any] | None = None) -> None:
        self.engine = engine
        self.hooks = hooks or StepHooks()
        self.idle_poll_s = idle_poll_s
        self.max_idle_poll_s = max(max_idle_poll_s, idle_poll_s)
        self.on_step = on_step
        self.on_fatal = on_fatal
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, asyncio.Queue] = {}
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.fatal: BaseException | None = None
        self.num_steps = 0  # engine steps run: with `StepHooks.transfer_events`, what `progress` reports
        # a DP attention rank: every iteration agrees with the other ranks whether to step (`DPLockstep`)
        self.lockstep = DPLockstep.of(engine)

    # ---- lifecycle ---------------------------------------------------------------
    def start(self, aloop: asyncio.AbstractEventLoop) -> None:
        self._aloop = aloop
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.fatal is None

    @property
    def progress(self) -> dict[str, int]:
        """Counters that advance while the engine thread does work: ``num_steps`` (engine steps) and
        ``num_kv_transfer_events`` (KV pushes completed or failed, pages released). A router reads them from
        ``/health`` and ``/get_load`` to tell a busy worker (they advance) from a stalled one (they do not)."""
        return {"num_steps": self.num_steps, "num_kv_transfer_events": self.hooks.transfer_events}

    # ---- from the event loop -------------------------------------------------------
    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` in the engine thread between steps; return or raise its result.

        Raises:
            EngineDeadError: the loop has died (before or while the command waited).
        """
        if self.fatal is not None:
            raise self._dead_error()
        fut = asyncio.get_running_loop().create_future()
        self._commands.put((fn, fut))
        self._wake.set()
        return await fut

    def call_soon(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Run ``fn(engine)`` in the engine thread, without waiting (thread-safe); dropped once the loop died."""
        if self.fatal is not None:
            return
        self._commands.put((fn, None))
        self._wake.set()

    def open_stream(self, request_id: str) -> asyncio.Queue:
        """A queue that receives the request's `RequestDelta`s. Call before adding the request."""
        q: asyncio.Queue = asyncio.Queue()
        if self.fatal is not None:
            q.put_nowait(self._dead_error())
        else:
            self._streams[request_id] = q
        return q

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    # ---- the thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            backoff = self.idle_poll_s
            while not self._stop.is_set():
                events = self.hooks.transfer_events
                commands = self._drain_commands()
                self.hooks.poll(self.engine)
                if commands or self.hooks.transfer_events != events:
                    backoff = self.idle_poll_s
                work = self.engine.has_work()
                if self.lockstep is not None:  # every DP rank steps when any has work (its MoE layers pair up)
                    work = self.lockstep.any_work(work)
                if work:
                    if self._step():
                        backoff = self.idle_poll_s
                        continue
                    # Nothing could run (e.g. waiting requests and no free pages): stepping again at once would
                    # spin on the scheduler's and hooks' per-request bookkeeping and starve this process's event
                    # loop of the GIL (its /prefill calls and health checks) until pages come back.
                    self._wake.wait(backoff)
                    self._wake.clear()
                    backoff = min(backoff * 2, self.max_idle_poll_s)
                elif self.hooks.has_pending():
                    self._wake.wait(self.idle_poll_s)
                    self._wake.clear()
                else:
                    self._wake.wait(0.05)
                    self._wake.clear()
        except BaseException as e:  # noqa: BLE001 - the worker must learn the loop died
            self.fatal = e
            logger.critical("engine loop died: %s: %s; failing every request in flight", type(e).__name__, e,
                            exc_info=True)
            self._fail_pending_commands()
            if self._aloop is not None and not self._aloop.is_closed():
                try:
                    self._aloop.call_soon_threadsafe(self._fail_streams)
                except RuntimeError:  # the event loop closed meanwhile
                    pass

    def _dead_error(self) -> EngineDeadError:
        e = self.fatal
        return EngineDeadError(f"the engine loop died ({type(e).__name__}: {e}); the worker is restarting")

    def _fail_pending_commands(self) -> None:
        error = self._dead_error()
        while True:
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if fut is not None:
                self._aloop.call_soon_threadsafe(settle_future, fut, None, error)

    def _fail_streams(self) -> None:
        """On the event loop: every open stream gets the error; then `on_fatal`."""
        error = self._dead_error()
        streams, self._streams = self._streams, {}
        for q in streams.values():
            q.put_nowait(error)
        self._fail_pending_commands()  # commands queued while the loop was dying
        logger.error("engine loop died: failed %d request(s) in flight", len(streams))
        if self.on_fatal is not None:
            self.on_fatal(self.fatal)

    def _drain_commands(self) -> int:
        """Run every queued command; returns how many ran."""
        n = 0
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return n
            n += 1
            try:
                result, error = fn(self.engine), None
            except Exception as e:  # noqa: BLE001 - handed to the caller
                result, error = None, e
            if fut is not None:
                self._aloop.call_soon_threadsafe(settle_future, fut, result, error)
            elif error is not None:
                logger.error("engine command failed: %s", error)

    def _step(self) -> bool:
        """One engine step and its hooks; returns whether it did anything (computed, reserved pages, produced
        output, or left a step in flight)."""
        t = time.monotonic()
        try:
            out = self.engine.step()
        finally:  # a step that failed before its forward still pairs the other DP ranks' collectives
            if self.lockstep is not None:
                self.lockstep.end_step()
        self.num_steps += 1
        self.hooks.after_step(self.engine, out)
        if self.on_step is not None:
            self.on_step(self.engine, out, time.monotonic() - t)
        if out.deltas:
            self._aloop.call_soon_threadsafe(self._dispatch, out.deltas)
        return bool(out.num_tokens or out.deltas or out.reserved or out.local_prefills or out.prefill_progress
                    or self.engine.overlap.in_flight is not None)

    def _dispatch(self, deltas: list[RequestDelta]) -> None:
        for d in deltas:
            q = self._streams.get(d.request_id)
            if q is not None:
                q.put_nowait(d)
            if d.finished:
                self._streams.pop(d.request_id, None)


def settle_future(fut: asyncio.Future, result: Any, error: BaseException | None = None) -> None:
    """Set a future's result or exception unless it is already done (call on its event loop)."""
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
