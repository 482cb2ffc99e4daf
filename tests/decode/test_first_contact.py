"""First contact with a new prefill worker does not stall the running decode batch.

The handshake with a new peer (loading its NIXL metadata, setting up the connection) blocks for as long as
the peer takes to answer. Here it is a stand-in agent whose `connect` takes 0.8 s, while 8 streams decode on
a real engine: the connect must run on a thread other than the engine thread, and the streams must keep
getting tokens meanwhile. The strict bound (no inter-token gap over 50 ms with real NIXL between processes)
is measured by ``bench/scripts/peer_handshake.py``; the bound here is loose, for a loaded CI machine.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
from scripted import FakePrefill, ScriptedReceiver, decode_engine

from pd_cluster.decode.handover import DecodeHooks
from pd_cluster.decode.remote_prefill import RemotePrefill
from pd_cluster.engine.sampling.params import SamplingParams
from pd_cluster.serving.engine_loop import EngineLoop
from pd_cluster.transfer.http import Resolved

CONNECT_S = 0.8
NEW_PEER = "prefill-new-1-tp0-cccc"


class SlowNewPeerAgent:
    """An agent meeting `NEW_PEER` for the first time; its handshake blocks for `CONNECT_S`."""

    name = "decode-test-1-tp0-bbbb"

    def __init__(self, off_thread: bool) -> None:
        self.connects_off_thread = off_thread
        self.connected: set[str] = set()
        self.connect_threads: list[int] = []

    def is_connected(self, name: str) -> bool:
        return name in self.connected

    def connect(self, info) -> None:
        self.connect_threads.append(threading.get_ident())
        time.sleep(CONNECT_S)
        self.connected.add(info.agent_name)

    def disconnect(self, name: str) -> None:
        self.connected.discard(name)


class NewPeerDirectory:
    async def aresolve(self, url, expected_agent=None, client=None, timeout=None):
        return Resolved(SimpleNamespace(agent_name=NEW_PEER), fetched=True)

    def invalidate(self, url) -> None:
        pass


@pytest.fixture(scope="module")
def prefill():
    p = FakePrefill()
    p.mode = "400"  # answers at once: the test is about what happens before
    yield p
    p.stop()


def _first_contact(prefill_url: str, off_thread: bool) -> tuple[list[int], int, float]:
    """8 streams decode; a request to a new prefill worker arrives. Returns the connect threads, the engine
    thread and the largest gap between two tokens of any stream while the connect ran (seconds)."""
    engine = decode_engine(num_pages=200)
    step = engine.step

    def paced_step():  # 5 ms a step, as a real model's: the 400-token streams outlast the handshake on a busy host
        time.sleep(0.005)
        return step()

    engine.step = paced_step
    hooks = DecodeHooks(ScriptedReceiver(engine.layout.page_size, peers=(NEW_PEER,)))
    loop = EngineLoop(engine, hooks)
    agent = SlowNewPeerAgent(off_thread)
    source = RemotePrefill(loop, hooks, agent, NewPeerDirectory(), "http://127.0.0.1:2", prefill_url)
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def main():
        loop.start(asyncio.get_running_loop())
        arrivals: dict[str, list[float]] = {}

        async def stream(i: int) -> None:
            rid = f"s{i}"
            q = loop.open_stream(rid)
            await loop.call(lambda e: e.add_request(rid, list(range(10 + i, 30 + i)), params, stream=True))
            times = arrivals.setdefault(rid, [])
            while True:
                d = await q.get()
                times.append(time.monotonic())
                if d.finished:
                    return

        streams = [asyncio.ensure_future(stream(i)) for i in range(8)]
        while sum(len(t) for t in arrivals.values()) < 8 * 20:  # every stream is decoding
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        with pytest.raises(Exception) as e:  # the fake prefill refuses the job once the handshake is done
            await source.start("first", list(range(5, 45)), SamplingParams(max_tokens=4), {})
        assert getattr(e.value, "status", None) == 400
        t1 = t0 + CONNECT_S
        gaps = [b - a for times in arrivals.values() for a, b in zip(times, times[1:]) if b > t0 and a < t1]
        for s in streams:
            s.cancel()
        await loop.call(lambda e: [e.abort_request(f"s{i}") for i in range(8)])
        await source.close()
        loop.stop()
        assert gaps, "every stream ended before the handshake began"
        return max(gaps)

    gap = asyncio.run(main())
    return agent.connect_threads, loop._thread.ident, gap


def test_connect_to_a_new_prefill_runs_off_the_engine_thread(prefill):
    threads, engine_thread, gap = _first_contact(prefill.url, off_thread=True)
    assert len(threads) == 1 and threads[0] != engine_thread and threads[0] != threading.get_ident()
    # a connect on the engine thread stalls every stream for CONNECT_S or more (the test below); 0.75 of it leaves
    # room for a loaded 2-core machine's scheduling without letting a stall pass
    assert gap < CONNECT_S * 0.75, f"a stream waited {gap * 1e3:.0f} ms for a token while the handshake ran"


def test_an_agent_that_must_connect_in_the_engine_thread_does_stall(prefill):
    """The measurement above can see a stall: the TP proxies connect in the engine thread, and it shows."""
    threads, engine_thread, gap = _first_contact(prefill.url, off_thread=False)
    assert threads == [engine_thread]
    assert gap >= CONNECT_S * 0.9
