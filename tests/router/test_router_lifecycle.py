"""Graceful shutdown, and a router that idles (pooled connections silently dropped)."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import httpx
import pytest
from router_testkit import FakeWorker, RouterProc, free_port, wait_http

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def stream_tokens(url: str, body: dict, out: dict) -> None:
    """Read a streamed completion into ``out`` (events, error, first-token time)."""
    events: list[str] = []
    out["events"] = events
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line:
                    events.append(line)
                    out.setdefault("first", time.monotonic())
    except httpx.HTTPError as exc:
        out["error"] = repr(exc)


def start_stream(router: RouterProc, tokens: int) -> tuple[threading.Thread, dict]:
    out: dict = {}
    body = {"model": "stories260K", "prompt": "x", "max_tokens": tokens, "stream": True}
    t = threading.Thread(target=stream_tokens, args=(router.url, body, out), daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while "first" not in out and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "first" in out, out
    return t, out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_drains_in_flight_streams_and_refuses_new_work(sig):
    with FakeWorker("prefill") as p, \
            FakeWorker("decode", ["--ttft-ms", "10", "--itl-ms", "150", "--num-tokens", "12"]) as d, \
            RouterProc(["--prefill", p.url, "--decode", d.url,
                        "--shutdown-grace-period-secs", "30"]) as router:
        thread, out = start_stream(router, 12)
        router.proc.send_signal(sig)
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):
            httpx.post(router.url + "/v1/completions", timeout=5,
                       json={"model": "stories260K", "prompt": "x", "max_tokens": 1})
        thread.join(30)
        assert out["status"] == 200 and "error" not in out
        assert out["events"][-1] == "data: [DONE]"
        assert sum('"text":" ' in e for e in out["events"]) == 12
        assert router.proc.wait(timeout=10) == 0  # drained: a clean exit, not death by the re-raised signal
        log = router.log()
        assert "draining" in log and "router stopped" in log and "Traceback" not in log


def test_grace_period_ends_streams_that_run_too_long():
    with FakeWorker("prefill") as p, \
            FakeWorker("decode", ["--ttft-ms", "10", "--itl-ms", "200", "--num-tokens", "100"]) as d, \
            RouterProc(["--prefill", p.url, "--decode", d.url,
                        "--shutdown-grace-period-secs", "1"]) as router:
        thread, out = start_stream(router, 100)
        started = time.monotonic()
        router.proc.send_signal(signal.SIGTERM)
        router.proc.wait(timeout=15)
        assert time.monotonic() - started < 6
        thread.join(10)
        assert not thread.is_alive()
        assert "data: [DONE]" not in out["events"]
        # The cancelled relay closed its upstream connection: the worker aborted.
        wait_http(d.url + "/get_load", 5, ok=lambda r: r.json()["num_running_reqs"] == 0)


class BlackholeProxy:
    """TCP proxy on loopback; a connection idle longer than ``idle_secs`` is blackholed:
    its later bytes are dropped and it is never closed, as a NAT or load balancer that
    forgot an idle flow behaves."""

    def __init__(self, target_port: int, idle_secs: float) -> None:
        self.target_port = target_port
        self.idle_secs = idle_secs
        self.port = free_port()
        self.blackholed = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "BlackholeProxy":
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        async def shutdown() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._loop.stop()

        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(shutdown()))
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", self.port))
        self._ready.set()
        self._loop.run_forever()

    async def _handle(self, reader, writer) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        state = {"last": time.monotonic(), "dead": False}
        await asyncio.gather(self._pump(reader, up_writer, state),
                             self._pump(up_reader, writer, state), return_exceptions=True)
        for w in (writer, up_writer):
            w.close()

    async def _pump(self, reader, writer, state) -> None:
        while data := await reader.read(65536):
            now = time.monotonic()
            if not state["dead"] and now - state["last"] > self.idle_secs:
                state["dead"] = True
                self.blackholed += 1
            if state["dead"]:
                continue
            state["last"] = now
            writer.write(data)
            await writer.drain()
        if not state["dead"]:
            writer.close()


BODY = {"model": "stories260K", "prompt": "x", "max_tokens": 2}


@pytest.mark.parametrize("keepalive, expect_ok", [("0.3", True), ("60", False)])
def test_idle_router_does_not_reuse_dropped_connections(keepalive, expect_ok):
    """With a keep-alive shorter than the path's idle timeout the router opens a fresh
    connection after idling; with a long one (the control case) it writes into a
    dropped flow and only the request timeout ends the wait."""
    with FakeWorker("prefill") as p, \
            FakeWorker("decode", ["--ttft-ms", "5", "--itl-ms", "1"]) as d, \
            BlackholeProxy(d.port, idle_secs=1.0) as proxy, \
            RouterProc(["--prefill", p.url, "--decode", f"http://127.0.0.1:{proxy.port}",
                        "--upstream-keepalive-secs", keepalive, "--request-timeout-secs", "3",
                        "--disable-retries", "--no-kv-events"]) as router:  # no KV polls share the data path
        url = router.url + "/v1/completions"
        assert httpx.post(url, json=BODY, timeout=10).status_code == 200
        time.sleep(2.0)  # longer than the proxy's idle timeout
        started = time.monotonic()
        r = httpx.post(url, json=BODY, timeout=10)
        took = time.monotonic() - started
        if expect_ok:
            assert r.status_code == 200 and took < 1.0
            assert r.json()["choices"][0]["text"] == " Once upon"
        else:
            assert r.status_code == 504 and proxy.blackholed >= 1
