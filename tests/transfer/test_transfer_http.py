"""The HTTP side of the handshake: a real uvicorn server on loopback and `PeerDirectory` fetching from it."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from agent_infos import info as make_info

from pd_cluster.transfer.errors import MetadataFetchError, StalePeerError
from pd_cluster.transfer.http import INFO_PATH, PeerDirectory, apply, make_router


class Server:
    """A worker-like server whose agent can "restart" (serve another incarnation) or answer garbage."""

    def __init__(self) -> None:
        self.current = make_info("decode-h-1-tp0-inc1")
        self.garbage = False
        self.hits = 0
        app = FastAPI()

        @app.get(INFO_PATH)
        def kv_info():
            self.hits += 1
            if self.garbage:
                return JSONResponse({"agent_name": "x"})
            return self.current.to_dict()

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def server():
    s = Server()
    yield s
    s.stop()


class FakeAgent:
    def __init__(self) -> None:
        self.connected: list[str] = []
        self.dropped: list[str] = []

    def connect(self, info) -> None:
        self.connected.append(info.agent_name)

    def disconnect(self, name) -> None:
        self.dropped.append(name)


def test_fetch_once_then_cache(server):
    d = PeerDirectory(timeout=5)
    r = d.resolve(server.url)
    assert r.fetched and r.info == server.current and r.superseded == ()
    for _ in range(3):
        assert not d.resolve(server.url + "/").fetched  # same worker, trailing slash or not
        assert not d.resolve(server.url, "decode-h-1-tp0-inc1").fetched
    assert server.hits == 1 and d.num_fetches == 1


def test_restart_is_detected_by_the_name_a_ticket_carries(server):
    d = PeerDirectory(timeout=5)
    agent = FakeAgent()
    apply(agent, d.resolve(server.url))
    server.current = make_info("decode-h-1-tp0-inc2")  # the worker restarted on the same URL
    assert not d.resolve(server.url).fetched  # nothing says so yet: the cache answers
    r = d.resolve(server.url, "decode-h-1-tp0-inc2")  # a ticket names the new incarnation
    assert r.fetched and r.info.incarnation == "inc2" and r.superseded == ("decode-h-1-tp0-inc1",)
    apply(agent, r)
    assert agent.connected == ["decode-h-1-tp0-inc1", "decode-h-1-tp0-inc2"]
    assert agent.dropped == ["decode-h-1-tp0-inc1"]
    assert d.num_restarts_seen == 1


def test_ticket_naming_a_dead_incarnation_is_stale(server):
    d = PeerDirectory(timeout=5)
    d.resolve(server.url)
    with pytest.raises(StalePeerError, match="runs agent decode-h-1-tp0-inc1, not decode-h-1-tp0-inc0"):
        d.resolve(server.url, "decode-h-1-tp0-inc0")


def test_invalidate_refetches_and_reports_the_old_incarnation(server):
    d = PeerDirectory(timeout=5)
    d.resolve(server.url)
    server.current = make_info("decode-h-1-tp0-inc3")
    d.invalidate(server.url)
    r = d.resolve(server.url)
    assert r.fetched and r.superseded == ("decode-h-1-tp0-inc1",)


def test_unreachable_and_garbage_are_typed_errors(server):
    d = PeerDirectory(timeout=2)
    server.garbage = True
    with pytest.raises(MetadataFetchError, match="malformed"):
        d.resolve(server.url)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: refused
    with pytest.raises(MetadataFetchError, match="cannot fetch"):
        d.resolve(dead)
    with pytest.raises(MetadataFetchError, match="HTTP 404"):
        d.resolve(server.url + "/nope")


def test_async_resolve(server):
    d = PeerDirectory(timeout=5)

    async def go():
        import httpx

        async with httpx.AsyncClient() as client:
            a = await d.aresolve(server.url, client=client)
            b = await d.aresolve(server.url)
        return a, b

    a, b = asyncio.run(go())
    assert a.fetched and not b.fetched and a.info == server.current


def test_router_serves_the_payload_unchanged():
    from fastapi.testclient import TestClient

    i = make_info()
    app = FastAPI()
    app.include_router(make_router(i))
    body = TestClient(app).get(INFO_PATH).json()
    assert body == i.to_dict()
