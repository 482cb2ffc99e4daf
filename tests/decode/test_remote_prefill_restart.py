"""A prefill worker restarted under the same URL while a decode worker still holds its old agent's metadata.

The decode's receiver may learn that the old agent is gone (its liveness probe: NIXL reports the remote endpoint
disconnected) before the new process answers ``/prefill`` with its 409 for a stale ticket. Either way the request
is sent again, once, to the new incarnation with fresh metadata, instead of failing with 502
``kv_transfer_peer_died`` (which made the router retry it elsewhere and left the restarted worker unused for as
long as each decode kept the stale metadata: tests/cluster/test_kv_store_pd.py's restart test under load). A
worker that is gone for good still fails the request with the transfer's error. A real decode-role engine in its
`EngineLoop`; the receiver is scripted; the prefill worker is a real HTTP server on loopback that never answers.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from scripted import FakePrefill, ScriptedReceiver, decode_engine

from pd_cluster.decode.handover import DecodeHooks
from pd_cluster.decode.remote_prefill import RemotePrefill
from pd_cluster.engine.sampling.params import SamplingParams
from pd_cluster.serving.engine_loop import EngineLoop
from pd_cluster.transfer.errors import MetadataFetchError, PeerDiedError
from pd_cluster.transfer.http import Resolved

OLD, NEW = "prefill-test-1-tp0-aaaa", "prefill-test-2-tp0-cccc"
PROMPT_IDS = list(range(5, 5 + 40))  # 3 pages of 16


class Agent:
    name = "decode-test-1-tp0-bbbb"
    connects_off_thread = True

    def is_connected(self, name: str) -> bool:
        return name in (OLD, NEW)


class RestartedDirectory:
    """Serves the old agent's cached info until invalidated; then what `after` says: the new agent, or a refused
    connection (the worker is gone for good)."""

    def __init__(self, after: str | None) -> None:
        self.agent, self.after, self.invalidated = OLD, after, 0

    async def aresolve(self, url, expected_agent=None, client=None, timeout=None):
        if self.agent is None:
            raise MetadataFetchError(f"{url}: connection refused", refused=True)
        return Resolved(SimpleNamespace(agent_name=self.agent), fetched=False)

    def invalidate(self, url) -> None:
        self.invalidated += 1
        self.agent = self.after


@pytest.fixture(scope="module")
def prefill():
    p = FakePrefill()
    p.mode = "hang"  # the outcome is the transfer's: the /prefill answer never comes within the test
    yield p
    p.stop()


def _run(prefill_url: str, after: str | None):
    engine = decode_engine()
    receiver = ScriptedReceiver(engine.layout.page_size, peers=(OLD, NEW))
    hooks = DecodeHooks(receiver)
    loop = EngineLoop(engine, hooks)
    directory = RestartedDirectory(after)
    source = RemotePrefill(loop, hooks, Agent(), directory, "http://127.0.0.1:2", prefill_url)

    async def ticket_from(agent: str, seconds: float = 10) -> None:
        deadline = time.monotonic() + seconds
        while not any(t.prefill_agent == agent and t.request_id == "r" for t in receiver.tickets.values()):
            assert time.monotonic() < deadline, f"no ticket naming {agent}"
            await asyncio.sleep(0.01)

    async def main():
        loop.start(asyncio.get_running_loop())
        try:
            task = asyncio.ensure_future(source.start("r", PROMPT_IDS, SamplingParams(max_tokens=4), {}))
            await ticket_from(OLD)
            await loop.call(lambda e: receiver.fail("r", PeerDiedError(f"prefill agent {OLD} is gone", peer=OLD)))
            await asyncio.sleep(0.05)
            # the receiver's probe confirms the process is gone: its pages come back (no WRITE can land)
            await loop.call(lambda e: receiver.release("r", "peer died"))
            if after == NEW:
                await ticket_from(NEW)
                await loop.call(lambda e: receiver.complete("r", 7))
            try:
                outcome = await asyncio.wait_for(task, 10)
            except Exception as e:  # noqa: BLE001 - the test inspects it
                outcome = e
            want = engine.allocator.num_pages - (len(PROMPT_IDS) // 16 + 1 if after == NEW else 0)
            deadline = time.monotonic() + 5  # the released pages come back at the engine's next poll
            while (free := await loop.call(lambda e: e.num_free_pages())) != want and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return outcome, free, directory.invalidated, [t.prefill_agent for t in receiver.tickets.values()]
        finally:
            await source.close()
            loop.stop()

    return asyncio.run(main()), engine


def test_a_request_to_a_restarted_prefill_is_sent_again_to_its_new_agent(prefill):
    (outcome, free, invalidated, _), engine = _run(prefill.url, NEW)
    assert isinstance(outcome, asyncio.Queue), outcome  # the stream: the KV came from the new incarnation
    assert invalidated == 1
    # the first attempt's pages came back at once (no WRITE from a dead process can land); the second holds its own
    assert free == engine.allocator.num_pages - len(PROMPT_IDS) // 16 - 1


def test_a_prefill_gone_for_good_fails_the_request_with_the_transfers_error(prefill):
    (outcome, free, invalidated, tickets), engine = _run(prefill.url, None)
    assert getattr(outcome, "status", None) == 502 and getattr(outcome, "code", None) == "kv_transfer_peer_died"
    assert invalidated == 1 and tickets == []  # no second ticket: the worker's URL refused the connection
    assert free == engine.allocator.num_pages
