"""CPU cost of the fake OpenAI server per request, i.e. how many requests/s one core can serve.

Starts ``pd_cluster.bench.fake_server`` with zero delays, drives it with pd-bench's HTTP
client at a fixed concurrency, and reads the server process's CPU time (user +
system, ``/proc/PID/stat``) before and after. The client's speed does not
matter: the server's CPU seconds per request give its capacity on one core.

    python -m pd_cluster.bench.scripts.fake_server_cpu --requests 6000 --concurrency 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

from pd_cluster.bench.fake_process import FakeServerProcess
from pd_cluster.bench.http_client import HttpPool
from pd_cluster.common.process import cpu_seconds


class _Sink:
    def __init__(self) -> None:
        self.status = 0

    def on_head(self, status: int, headers: dict[str, str]) -> None:
        self.status = status

    def on_body(self, data: bytes, now: float) -> None:
        pass


async def drive(url: str, n: int, concurrency: int, stream: bool, tokens: int) -> tuple[float, int]:
    pool = HttpPool(url)
    body = json.dumps({"model": "stories260K", "prompt": "Once upon a time", "max_tokens": tokens,
                       "stream": stream}).encode()
    req = pool.request_bytes("POST", "/v1/completions", "Content-Type: application/json\r\n", body)
    left, bad = n, 0

    async def worker() -> None:
        nonlocal left, bad
        while left > 0:
            left -= 1
            sink = _Sink()
            await pool.send(req, sink, 30.0)
            bad += sink.status != 200

    t0 = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    pool.close()
    return n / (time.monotonic() - t0), bad


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=6000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-tokens", type=int, default=4)
    a = p.parse_args(argv)
    rows = []
    with FakeServerProcess(["--ttft-ms", "0", "--itl-ms", "0", "--num-tokens", str(a.num_tokens)]) as fake:
        asyncio.run(drive(fake.url, 200, a.concurrency, False, a.num_tokens))  # warm up
        for stream in (False, True):
            c0 = cpu_seconds(fake.proc.pid)
            rate, bad = asyncio.run(drive(fake.url, a.requests, a.concurrency, stream, a.num_tokens))
            cpu = cpu_seconds(fake.proc.pid) - c0
            rows.append(("streamed" if stream else "non-streamed", a.requests, bad, rate,
                         cpu / a.requests * 1e6, a.requests / cpu if cpu else float("inf")))
    print(f"fake server, {a.num_tokens} tokens per answer, concurrency {a.concurrency}; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'mode':>13} {'requests':>9} {'errors':>7} {'client-bound req/s':>19} "
          f"{'server CPU us/req':>18} {'req/s per core':>15}")
    for mode, n, bad, rate, us, per_core in rows:
        print(f"{mode:>13} {n:>9} {bad:>7} {rate:>19.0f} {us:>18.0f} {per_core:>15.0f}")


if __name__ == "__main__":
    main()
