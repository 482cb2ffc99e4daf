"""`RemotePrefill` (the decode worker's prompt source) against a scripted prefill worker on loopback HTTP.

A real decode-role engine runs in its `EngineLoop`; the receiver is scripted (no NIXL, no processes); the
prefill worker is a real HTTP server on 127.0.0.1 whose answers each test chooses. Every way the ``/prefill``
call can fail must give the client an error and give the reserved pages back (issue: a request that failed
inside the remote-prefill path kept its reservation).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from types import SimpleNamespace

import pytest
from scripted import PREFILL_AGENT, FakePrefill, ScriptedReceiver, decode_engine

from pd_cluster.decode.handover import DecodeHooks
from pd_cluster.decode.remote_prefill import RemotePrefill
from pd_cluster.engine.sampling.params import SamplingParams
from pd_cluster.serving.engine_loop import EngineLoop
from pd_cluster.transfer.http import Resolved

PROMPT_IDS = list(range(5, 5 + 40))  # 3 pages of 16


class KnownPeer:
    """The prefill agent is already loaded (no handshake in these tests)."""

    name = "decode-test-1-tp0-bbbb"
    connects_off_thread = True

    def is_connected(self, name: str) -> bool:
        return name == PREFILL_AGENT


class CachedDirectory:
    async def aresolve(self, url, expected_agent=None, client=None, timeout=None):
        return Resolved(SimpleNamespace(agent_name=PREFILL_AGENT), fetched=False)

    def invalidate(self, url) -> None:
        pass


@pytest.fixture(scope="module")
def prefill():
    p = FakePrefill()
    yield p
    p.stop()


def _worker(prefill_url):
    engine = decode_engine()
    hooks = DecodeHooks(ScriptedReceiver(engine.layout.page_size))
    loop = EngineLoop(engine, hooks)
    source = RemotePrefill(loop, hooks, KnownPeer(), CachedDirectory(), "http://127.0.0.1:2", prefill_url)
    return engine, hooks, loop, source


async def _free_pages_after(loop: EngineLoop, seconds: float) -> int:
    deadline = time.monotonic() + seconds
    while True:
        free = await loop.call(lambda e: e.num_free_pages())
        if free == loop.engine.allocator.num_pages or time.monotonic() > deadline:
            return free
        await asyncio.sleep(0.02)


def _run(prefill_url, body):
    engine, hooks, loop, source = _worker(prefill_url)

    async def main():
        loop.start(asyncio.get_running_loop())
        try:
            return await body(engine, hooks, loop, source)
        finally:
            await source.close()
            loop.stop()

    return asyncio.run(main())


def test_a_400_from_prefill_is_a_400_and_frees_the_reservation(prefill):
    prefill.mode = "400"

    async def body(engine, hooks, loop, source):
        with pytest.raises(Exception) as e:
            await asyncio.wait_for(source.start("r400", PROMPT_IDS, SamplingParams(max_tokens=4), {}), 10)
        assert getattr(e.value, "status", None) == 400 and getattr(e.value, "param", None) == "prompt"
        assert await _free_pages_after(loop, 2.0) == engine.allocator.num_pages
        assert ("withdraw" in hooks.receiver.kinds())

    _run(prefill.url, body)


def test_a_job_that_cannot_be_sent_frees_the_reservation(prefill):
    """NaN cannot be written as JSON: the call fails inside the decode worker, after the pages were reserved."""
    prefill.mode = "400"
    sent_before = len(prefill.jobs)

    async def body(engine, hooks, loop, source):
        params = SamplingParams(max_tokens=4, temperature=0.7)
        params.temperature = float("nan")  # past validation, as a value that slips through would be
        with pytest.raises(Exception) as e:
            await asyncio.wait_for(source.start("rnan", PROMPT_IDS, params, {}), 10)
        assert await _free_pages_after(loop, 2.0) == engine.allocator.num_pages
        assert len(prefill.jobs) == sent_before  # the job never left
        assert getattr(e.value, "status", None) == 400 and ("JSON" in str(e.value) or "temperature" in str(e.value))

    _run(prefill.url, body)


def test_a_500_from_prefill_is_a_502_and_the_pages_wait_for_the_sender(prefill):
    prefill.mode = "500"

    async def body(engine, hooks, loop, source):
        with pytest.raises(Exception) as e:
            await asyncio.wait_for(source.start("r500", PROMPT_IDS, SamplingParams(max_tokens=4), {}), 10)
        assert getattr(e.value, "status", None) == 502
        await asyncio.sleep(0.1)
        rec = hooks.get("r500")
        assert rec is not None and rec.state.value == "quarantined"  # the sender may still write
        assert "abort" in hooks.receiver.kinds()
        await loop.call(lambda e: (hooks.receiver.release("r500"), None))
        assert await _free_pages_after(loop, 2.0) == engine.allocator.num_pages

    _run(prefill.url, body)


def test_client_going_away_aborts_quietly_once(prefill, caplog):
    prefill.mode = "hang"
    complaints = []

    async def body(engine, hooks, loop, source):
        asyncio.get_running_loop().set_exception_handler(
            lambda lp, ctx: complaints.append(f"{ctx.get('message')}: {ctx.get('exception')!r} {ctx.get('future')!r}"))
        task = asyncio.ensure_future(source.start("rgone", PROMPT_IDS, SamplingParams(max_tokens=4), {}))
        deadline = time.monotonic() + 10
        while not any(j["request_id"] == "rgone" for j in prefill.jobs):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        task.cancel()  # what the serving layer does when the client disconnects
        with pytest.raises(asyncio.CancelledError):
            await task
        source.abort("rgone")  # ... and then it aborts the request
        deadline = time.monotonic() + 5
        while "rgone" not in prefill.aborts:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        await loop.call(lambda e: (hooks.receiver.release("rgone"), None))
        assert await _free_pages_after(loop, 2.0) == engine.allocator.num_pages
        gc.collect()
        await asyncio.sleep(0.05)

    with caplog.at_level(logging.INFO):
        _run(prefill.url, body)
    lines = [r for r in caplog.records if "rgone" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO and lines[0].exc_info is None, \
        [r.getMessage() for r in lines]
    assert prefill.aborts.count("rgone") == 1
    # No future or task of ours ends unretrieved (a task's repr names the file that defines its coroutine;
    # a plain future's names nothing, so every future complaint counts).
    # In a full run, `gc.collect()` here also finalises HTTP clients that earlier tests left open in their own,
    # closed event loops ("Event loop is closed" from the library's own code): those are not this request's.
    ours = [c for c in complaints if not (c.startswith("Task exception") and "site-packages" in c)]
    assert ours == [], complaints
