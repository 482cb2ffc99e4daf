"""The router's added latency and its sustained requests/s on one core.

Starts a fast fake prefill and decode worker (``pd_cluster.bench.fake_server``, zero
delays) and ``pd-router`` in front of them, pins the router to one CPU and
the fake workers and the load generator to the others, then measures with a
lean closed-loop HTTP/1.1 keep-alive client (raw asyncio streams, so the
client is not the bottleneck):

* added latency: one request at a time, direct to the decode worker versus
  through the router; p50/p99 of the difference;
* throughput: ``--concurrency`` connections through the router for
  ``--seconds``; requests/s, latency and the router's CPU use.

Both for short non-streamed requests (``max_tokens`` 1) and streamed ones
(``--stream-tokens`` SSE events). Prints one table per measurement.

    python -m pd_cluster.bench.scripts.router_overhead --seconds 10 --concurrency 16 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

from pd_cluster.common.net import free_port

from pd_cluster.bench.fake_process import FakeServerProcess

MODEL = "stories260K"


@dataclass
class Result:
    requests: int
    seconds: float
    latencies: list[float]
    errors: int

    def pct(self, q: float) -> float:
        lat = sorted(self.latencies)
        return lat[min(len(lat) - 1, int(q / 100 * len(lat)))] * 1e3 if lat else float("nan")


def build_request(host: str, stream: bool, tokens: int) -> bytes:
    body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": tokens,
                       "stream": stream}).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


async def read_response(reader: asyncio.StreamReader) -> int:
    """Read one response (Content-Length or chunked); returns the status."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    lower = head.lower()
    i = lower.find(b"content-length:")
    if i >= 0:
        await reader.readexactly(int(lower[i + 15:lower.index(b"\r\n", i)]))
        return status
    while True:  # chunked
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        await reader.readexactly(size + 2)
        if size == 0:
            return status


async def closed_loop(port: int, request: bytes, concurrency: int, seconds: float,
                      warmup: float) -> Result:
    latencies: list[float] = []
    errors = 0
    start = time.perf_counter() + warmup
    stop = start + seconds

    async def conn() -> int:
        nonlocal errors
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        done = 0
        try:
            while (now := time.perf_counter()) < stop:
                writer.write(request)
                status = await read_response(reader)
                end = time.perf_counter()
                if now >= start:
                    done += 1
                    if status == 200:
                        latencies.append(end - now)
                    else:
                        errors += 1
        finally:
            writer.close()
        return done

    counts = await asyncio.gather(*(conn() for _ in range(concurrency)))
    return Result(sum(counts), seconds, latencies, errors)


def baseline_app(kind: str, upstream: str):
    """A minimal forwarding proxy (no routing logic) to show what the stack costs.

    ``raw_aiohttp``: raw ASGI + aiohttp client (the router's stack);
    ``fastapi_aiohttp``: a FastAPI route + aiohttp; ``raw_httpx``: raw ASGI + httpx.
    """
    state: dict = {}

    async def client():
        if "c" not in state:
            if kind.endswith("httpx"):
                state["c"] = httpx.AsyncClient(limits=httpx.Limits(max_connections=None))
            else:
                import aiohttp

                state["c"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return state["c"]

    async def forward(path: str, body: bytes) -> tuple[int, bytes]:
        c = await client()
        if kind.endswith("httpx"):
            r = await c.post(upstream + path, content=body,
                             headers={"content-type": "application/json"})
            return r.status_code, r.content
        async with c.post(upstream + path, data=body,
                          headers={"content-type": "application/json"}) as r:
            return r.status, await r.read()

    if kind == "fastapi_aiohttp":
        from fastapi import FastAPI
        from fastapi.responses import Response

        app = FastAPI()

        async def completions(request) -> Response:
            status, data = await forward("/v1/completions", await request.body())
            return Response(data, status_code=status, media_type="application/json")

        from fastapi import Request

        completions.__annotations__ = {"request": Request, "return": Response}
        app.post("/v1/completions")(completions)
        return app

    async def raw(scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        status, data = await forward(scope["path"], body)
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    return raw


def start_baseline(kind: str, port: int, upstream: str, cpu: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pd_cluster.bench.scripts.router_overhead", "--serve-baseline", kind,
           "--port", str(port), "--upstream", upstream]
    proc = subprocess.Popen(cmd, preexec_fn=pinned({cpu}))
    wait_port(port, proc)
    return proc


def wait_port(port: int, proc: subprocess.Popen) -> None:
    import socket

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"nothing listens on {port}")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pinned(cpus: set[int]):
    return lambda: os.sched_setaffinity(0, cpus)


def start_router(port: int, prefill: list[str], decode: list[str], cpu: int,
                 extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pd_cluster.router.main", "--host", "127.0.0.1", "--port", str(port),
           "--prefill", *prefill, "--decode", *decode, "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, preexec_fn=pinned({cpu}))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readiness", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("router did not become ready")


def table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    for r in rows:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths)))


def run(a: argparse.Namespace) -> None:
    ncpu = os.cpu_count() or 1
    router_cpu = a.router_cpu
    others = {c for c in range(ncpu) if c != router_cpu} or {router_cpu}
    os.sched_setaffinity(0, others)  # the load generator and (inherited) the fakes
    fake = ["--ttft-ms", "0", "--itl-ms", "0", "--num-tokens", str(a.stream_tokens)]
    print(f"CPUs: {ncpu}; router on CPU {router_cpu}, client and fakes on {sorted(others)}; "
          f"load average before: {os.getloadavg()[0]:.2f}")
    with FakeServerProcess(["--role", "prefill"]) as prefill, \
            FakeServerProcess(["--role", "decode", *fake]) as decode:
        port = free_port()
        router = start_router(port, [prefill.url], [decode.url], router_cpu, a.router_args)
        try:
            direct_port = int(decode.url.rsplit(":", 1)[1])
            latency_rows, tput_rows = [], []
            for stream in (False, True):
                kind = "streamed" if stream else "non-streamed"
                tokens = a.stream_tokens if stream else 1
                req = build_request("x", stream, tokens)
                run_loop = lambda p, c, s: asyncio.run(closed_loop(p, req, c, s, a.warmup))  # noqa
                direct = run_loop(direct_port, 1, a.seconds)
                routed = run_loop(port, 1, a.seconds)
                latency_rows.append([
                    kind, f"{direct.pct(50):.3f}", f"{direct.pct(99):.3f}",
                    f"{routed.pct(50):.3f}", f"{routed.pct(99):.3f}",
                    f"{routed.pct(50) - direct.pct(50):.3f}",
                    f"{routed.pct(99) - direct.pct(99):.3f}"])
                for c in a.concurrency:
                    cpu0 = cpu_seconds(router.pid)
                    t0 = time.perf_counter()
                    res = run_loop(port, c, a.seconds)
                    cpu = cpu_seconds(router.pid) - cpu0
                    wall = time.perf_counter() - t0
                    sent = res.requests * (a.seconds + a.warmup) / a.seconds
                    tput_rows.append([kind, str(c), f"{res.requests / res.seconds:.0f}",
                                      f"{res.pct(50):.2f}", f"{res.pct(99):.2f}",
                                      str(res.errors), f"{cpu / wall * 100:.0f}",
                                      f"{cpu / sent * 1e6:.0f}", f"{sent / cpu:.0f}"])
                direct_tput = run_loop(direct_port, max(a.concurrency), a.seconds)
                tput_rows.append([kind + " (direct)", str(max(a.concurrency)),
                                  f"{direct_tput.requests / direct_tput.seconds:.0f}",
                                  f"{direct_tput.pct(50):.2f}", f"{direct_tput.pct(99):.2f}",
                                  str(direct_tput.errors), "-", "-", "-"])
            for kind in a.baselines:
                bport = free_port()
                proc = start_baseline(kind, bport, decode.url, router_cpu)
                try:
                    req = build_request("x", False, 1)
                    c = max(a.concurrency)
                    cpu0, t0 = cpu_seconds(proc.pid), time.perf_counter()
                    res = asyncio.run(closed_loop(bport, req, c, a.seconds, a.warmup))
                    cpu, wall = cpu_seconds(proc.pid) - cpu0, time.perf_counter() - t0
                    sent = res.requests * (a.seconds + a.warmup) / a.seconds
                    tput_rows.append([f"baseline {kind}", str(c),
                                      f"{res.requests / res.seconds:.0f}", f"{res.pct(50):.2f}",
                                      f"{res.pct(99):.2f}", str(res.errors),
                                      f"{cpu / wall * 100:.0f}", f"{cpu / sent * 1e6:.0f}",
                                      f"{sent / cpu:.0f}"])
                finally:
                    proc.terminate()
                    proc.wait(timeout=30)
        finally:
            router.terminate()
            router.wait(timeout=30)
    table("Added latency, one request at a time (ms)",
          ["request", "direct p50", "direct p99", "router p50", "router p99", "added p50",
           "added p99"], latency_rows)
    table(f"Throughput through the router on one core ({a.seconds:g} s per row)",
          ["request", "conns", "req/s", "p50 ms", "p99 ms", "errors", "router CPU %",
           "CPU us/req", "req/CPU-s"], tput_rows)
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


def poll_cost(a: argparse.Namespace) -> None:
    """Idle router CPU spent polling ``--poll-cost`` workers' ``/get_load`` (and health)."""
    n = a.poll_cost
    # One fake per role, reached through n/2 loopback aliases each (127.0.0.1..): the router
    # sees n distinct workers; the fakes answer cheaply from counters.
    with FakeServerProcess(["--role", "prefill", "--host", "0.0.0.0"]) as prefill, \
            FakeServerProcess(["--role", "decode", "--host", "0.0.0.0"]) as decode:
        def aliases(url: str) -> list[str]:
            port = url.rsplit(":", 1)[1]
            return [f"http://127.0.0.{i}:{port}" for i in range(1, n // 2 + 1)]

        port = free_port()
        router = start_router(port, aliases(prefill.url), aliases(decode.url), a.router_cpu,
                              a.router_args)
        try:
            cpu0, t0 = cpu_seconds(router.pid), time.perf_counter()
            time.sleep(a.seconds)
            cpu, wall = cpu_seconds(router.pid) - cpu0, time.perf_counter() - t0
        finally:
            router.terminate()
            router.wait(timeout=30)
    polls = 2 * (n // 2) * wall / 0.1
    table(f"Idle router polling {2 * (n // 2)} workers every 100 ms ({a.seconds:g} s)",
          ["workers", "router CPU %", "CPU us/poll"],
          [[str(2 * (n // 2)), f"{cpu / wall * 100:.1f}", f"{cpu / polls * 1e6:.0f}"]])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=10.0, help="measuring time per row")
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    p.add_argument("--stream-tokens", type=int, default=8, help="SSE events per streamed reply")
    p.add_argument("--router-cpu", type=int, default=0)
    p.add_argument("--baselines", nargs="*", default=["raw_aiohttp", "fastapi_aiohttp",
                                                       "raw_httpx"],
                   help="minimal proxies to compare with (non-streamed, most connections)")
    p.add_argument("--poll-cost", type=int, default=0, metavar="N",
                   help="instead: idle router CPU with N workers polled (loopback aliases)")
    p.add_argument("--serve-baseline", default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--upstream", default="", help=argparse.SUPPRESS)
    p.add_argument("--router-args", nargs=argparse.REMAINDER, default=[],
                   help="extra pd-router flags (last on the line)")
    a = p.parse_args(argv)
    if a.serve_baseline:
        import uvicorn

        uvicorn.run(baseline_app(a.serve_baseline, a.upstream), host="127.0.0.1", port=a.port,
                    loop="uvloop", http="httptools", access_log=False, log_level="warning")
        return
    if a.poll_cost:
        poll_cost(a)
        return
    run(a)


if __name__ == "__main__":
    main()
