"""Overload, cold starts and connection storms on a local `pd-serve` under CPU starvation: does load alone fail an
admitted request?

Three scenarios, each run `--runs` times on a fresh cluster, each printing one table row per run:

- ``trace`` (default): 2P2D, FP8 KV (``fp8_e4m3``), page 16, `--hogs` (10) busy-loop processes on the machine, the
  Mooncake conversation trace (``bench/data``, the FAST'25 slice) replayed at `--speedup` (10x) for `--num-prompts`
  (600), lengths scaled to the 512-token embedded model. Columns: the load average seen (min-max), prompts
  served whole, requests failed after admission (a 5xx, an error event, a broken stream: anything but a whole
  answer or a refusal up front), refused up front (429/503 before any byte, with ``Retry-After``), attempts in
  flight failed by the health checker (``pd_router_inflight_failed_by_health_total``) and breakers opened
  (``pd_router_cb_state_transitions_total{to_state="open"}``).
- ``cold-burst``: a fresh 1P2D cluster under `--hogs` (16) hogs; its first burst of `--streams` (60) concurrent
  greedy streams, each compared with the offline greedy text.
- ``connections``: a 1P1D cluster; `--streams` (48) streaming connections opened at once, each sending one
  request after another for `--duration` seconds.
- ``many-prompts``: a 1P2D cluster under `--hogs` (0) hogs; one non-streamed ``echo`` completions request of
  `--num-prompts` (1000) prompts and one token each, sent `--repeat` (3) times one after another. Columns: the
  request's status and seconds, choices that echo their prompt, and the CPU seconds each worker process used
  during it (``/proc``; a worker that spins while its sequences wait for pages shows here).

    python -m pd_cluster.bench.scripts.overload --runs 5
    python -m pd_cluster.bench.scripts.overload --scenario cold-burst --hogs 16 --streams 60 --runs 3
    python -m pd_cluster.bench.scripts.overload --scenario connections --hogs 0 --streams 48 --duration 60
    python -m pd_cluster.bench.scripts.overload --scenario many-prompts --num-prompts 1000 --runs 1 --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pd_cluster.bench.arrival import trace_plan
from pd_cluster.bench.config import DatasetConfig, LengthScaling
from pd_cluster.bench.datasets import load_dataset
from pd_cluster.bench.scripts.cpu_hogs import cpu_hogs, load_average
from pd_cluster.bench.tokenizer import load_tokenizer
from pd_cluster.common.net import free_port
from pd_cluster.common.process import cpu_seconds

MODEL_DIR = Path(__file__).resolve().parents[2] / "engine" / "assets" / "stories260K"
PROMPTS = ["Once upon a time", "The little dog ran to the park and", "Lily wanted to bake a cake for her mom, so she",
           "Tom and Sue found a big box in the garden. Inside the box there was", "There was a boy named Ben who"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="overload", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--scenario", choices=("trace", "cold-burst", "connections", "many-prompts"), default="trace")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--hogs", type=int, default=None, help="busy-loop processes (default: 10, 16 for cold-burst, 0)")
    p.add_argument("--num-prompts", type=int, default=None, help="trace: 600; many-prompts: 1000")
    p.add_argument("--repeat", type=int, default=3, help="many-prompts: requests per cluster, one after another")
    p.add_argument("--speedup", type=float, default=10.0, help="trace time divided by this")
    p.add_argument("--input-len-scale", type=float, default=0.04)
    p.add_argument("--max-input-len", type=int, default=300)
    p.add_argument("--output-len-scale", type=float, default=0.1)
    p.add_argument("--max-output-len", type=int, default=64)
    p.add_argument("--streams", type=int, default=None, help="cold-burst: the burst (60); connections: 48")
    p.add_argument("--duration", type=float, default=60.0, help="connections: seconds of requests per connection")
    p.add_argument("--serve-arg", action="append", default=[], help="a flag for pd-serve (repeatable)")
    p.add_argument("--json", default=None, help="write every row here")
    p.add_argument("--keep-logs", default=None, help="copy each run's pd-serve log (router and workers) here")
    return p.parse_args(argv)


class Serve:
    """One `pd-serve` child with a manifest; stopped with Ctrl-C (SIGINT)."""

    def __init__(self, prefill: int, decode: int, argv: list[str], workdir: Path) -> None:
        self.manifest = workdir / "manifest.json"
        self.log_path = workdir / "pd-serve.log"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pd_cluster.launch.serve", "--port", str(self.port), "--num-prefill", str(prefill),
               "--num-decode", str(decode), "--manifest", str(self.manifest), "--log-level", "warning",
               "--kv-cache-memory", "64MiB", "--cpu-threads", "1", *argv]
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 600) -> float:
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pd-serve exited ({self.proc.returncode}); see {self.log_path}")
            if self.manifest.exists():
                return time.monotonic() - started
            time.sleep(0.5)
        raise RuntimeError(f"pd-serve not ready in {timeout} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()

    def counts(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=30).text

        def total(name: str, label: str = "") -> float:
            return sum(float(line.split()[-1]) for line in text.splitlines()
                       if line.startswith(name) and label in line)
        return {"inflight_failed_by_health": total("pd_router_inflight_failed_by_health_total"),
                "breakers_opened": total("pd_router_cb_state_transitions_total", 'to_state="open"'),
                "workers_dead": total("pd_router_worker_deaths_total"),
                "migrations": total("pd_router_migrations_total"), "retries": total("pd_router_retries_total"),
                "retry_reasons": sorted({line.split("{")[1].split("}")[0] for line in text.splitlines()
                                         if line.startswith("pd_router_retries_total{")})}


async def one(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    """One streamed request: ``ok`` (whole, [DONE]), ``refused`` (429/503 before any byte) or ``failed``."""
    rec = {"outcome": "failed", "texts": {}, "detail": None}
    try:
        async with client.stream("POST", url + "/v1/completions", json=dict(body, stream=True)) as resp:
            if resp.status_code in (429, 503) and resp.headers.get("retry-after"):
                rec["outcome"], rec["detail"] = "refused", resp.status_code
                await resp.aread()
                return rec
            if resp.status_code != 200:
                rec["detail"] = (await resp.aread())[:200].decode(errors="replace")
                return rec
            done = False
            async for line in resp.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if "error" in event:
                        rec["detail"] = event["error"].get("code")
                    for c in event.get("choices") or ():
                        rec["texts"][c["index"]] = rec["texts"].get(c["index"], "") + c["text"]
            if done and rec["detail"] is None:
                rec["outcome"] = "ok"
    except (httpx.HTTPError, asyncio.TimeoutError) as e:
        rec["detail"] = f"client: {type(e).__name__}"
    return rec


class LoadSampler:
    """The 1-minute load average, sampled every second while a run goes on."""

    def __init__(self) -> None:
        self.seen: list[float] = []
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            self.seen.append(load_average())
            await asyncio.sleep(1.0)

    def __enter__(self) -> "LoadSampler":
        self._task = asyncio.ensure_future(self._run())
        return self

    def __exit__(self, *exc) -> None:
        self._task.cancel()

    def span(self) -> str:
        return f"{min(self.seen):.0f}-{max(self.seen):.0f}" if self.seen else "n/a"


def trace_bodies(args: argparse.Namespace) -> tuple[list[dict], list[float]]:
    scaling = LengthScaling(args.input_len_scale, args.output_len_scale, args.max_input_len, args.max_output_len)
    ds = load_dataset(DatasetConfig(name="mooncake-trace", num_prompts=args.num_prompts, scaling=scaling),
                      load_tokenizer(str(MODEL_DIR)))
    plan = trace_plan([r.timestamp or 0.0 for r in ds.requests], args.speedup)
    bodies = [{"model": "stories260K", "prompt": r.prompt, "max_tokens": r.output_len, "temperature": 0,
               "ignore_eos": True} for r in ds.requests]
    return bodies, list(plan.times)


async def replay(url: str, bodies: list[dict], times: list[float]) -> list[dict]:
    async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=None)) as client:
        t0 = time.monotonic()

        async def at(i: int) -> dict:
            await asyncio.sleep(max(0.0, t0 + times[i] - time.monotonic()))
            return await one(client, url, bodies[i])
        return await asyncio.gather(*(at(i) for i in range(len(bodies))))


def run_trace(args: argparse.Namespace, run: int, workdir: Path) -> dict:
    bodies, times = trace_bodies(args)
    argv = ["--kv-cache-dtype", "fp8_e4m3", "--page-size", "16", *args.serve_arg]
    with cpu_hogs(args.hogs):
        serve = Serve(2, 2, argv, workdir)
        try:
            ready = serve.wait_ready()

            async def main() -> tuple[list[dict], str]:
                with LoadSampler() as load:
                    recs = await replay(serve.url, bodies, times)
                return recs, load.span()
            recs, load = asyncio.run(main())
            counts = serve.counts()
        finally:
            serve.stop()
    row = {"run": run, "load": load, "prompts": len(bodies), "ready_s": round(ready, 1),
           "served": sum(r["outcome"] == "ok" for r in recs),
           "failed_after_admission": sum(r["outcome"] == "failed" for r in recs),
           "refused_up_front": sum(r["outcome"] == "refused" for r in recs), **counts,
           "failures": sorted({str(r["detail"]) for r in recs if r["outcome"] == "failed"})[:5]}
    return row


def reference_texts(prompts: list[str], max_tokens: int) -> list[str]:
    from pd_cluster.engine.llm import LLM
    from pd_cluster.engine.sampling.params import SamplingParams

    llm = LLM(kv_cache_memory="64MiB", disable_radix_cache=True)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return [o.outputs[0].text for o in outs]


def run_cold_burst(args: argparse.Namespace, run: int, workdir: Path) -> dict:
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {run}-{i}" for i in range(args.streams)]
    want = reference_texts(prompts, 16)
    bodies = [{"model": "stories260K", "prompt": p, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
              for p in prompts]
    with cpu_hogs(args.hogs):
        serve = Serve(1, 2, list(args.serve_arg), workdir)
        try:
            ready = serve.wait_ready()

            async def main() -> tuple[list[dict], str]:
                with LoadSampler() as load:
                    async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=None)) as c:
                        recs = await asyncio.gather(*(one(c, serve.url, b) for b in bodies))
                return recs, load.span()
            recs, load = asyncio.run(main())
            counts = serve.counts()
        finally:
            serve.stop()
    exact = sum(r["outcome"] == "ok" and r["texts"].get(0) == w for r, w in zip(recs, want))
    return {"run": run, "load": load, "streams": len(bodies), "ready_s": round(ready, 1), "exact": exact,
            "failed": sum(r["outcome"] == "failed" for r in recs),
            "refused_up_front": sum(r["outcome"] == "refused" for r in recs), **counts,
            "failures": sorted({str(r["detail"]) for r in recs if r["outcome"] == "failed"})[:5]}


def run_connections(args: argparse.Namespace, run: int, workdir: Path) -> dict:
    with cpu_hogs(args.hogs):
        serve = Serve(1, 1, list(args.serve_arg), workdir)
        try:
            ready = serve.wait_ready()

            async def main() -> tuple[list[dict], str]:
                out: list[dict] = []
                end = time.monotonic() + args.duration
                with LoadSampler() as load:
                    async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=None)) as c:
                        async def lane(i: int) -> None:
                            j = 0
                            while time.monotonic() < end:
                                body = {"model": "stories260K", "prompt": f"{PROMPTS[(i + j) % len(PROMPTS)]}",
                                        "max_tokens": 24, "temperature": 0, "ignore_eos": True}
                                out.append(await one(c, serve.url, body))
                                j += 1
                        await asyncio.gather(*(lane(i) for i in range(args.streams)))
                return out, load.span()
            recs, load = asyncio.run(main())
            counts = serve.counts()
        finally:
            serve.stop()
    return {"run": run, "load": load, "connections": args.streams, "ready_s": round(ready, 1), "requests": len(recs),
            "served": sum(r["outcome"] == "ok" for r in recs),
            "failed": sum(r["outcome"] == "failed" for r in recs),
            "refused_up_front": sum(r["outcome"] == "refused" for r in recs), **counts,
            "failures": sorted({str(r["detail"]) for r in recs if r["outcome"] == "failed"})[:5]}


def run_many_prompts(args: argparse.Namespace, run: int, workdir: Path) -> list[dict]:
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(args.num_prompts)]
    body = {"model": "stories260K", "prompt": prompts, "echo": True, "max_tokens": 1, "temperature": 0}
    rows = []
    with cpu_hogs(args.hogs):
        serve = Serve(1, 2, [f"--router-arg=--max-concurrent-requests={max(1024, args.num_prompts + 10)}",
                             "--router-arg=--decode-policy=round_robin", *args.serve_arg], workdir)
        try:
            serve.wait_ready()
            workers = json.loads(serve.manifest.read_text())["workers"]
            for k in range(1, args.repeat + 1):
                before = {w["name"]: cpu_seconds(w["pid"]) for w in workers}
                load = load_average()
                t = time.monotonic()
                r = httpx.post(serve.url + "/v1/completions", json=body, timeout=900)
                took = time.monotonic() - t
                cpu = {w["name"]: round(cpu_seconds(w["pid"]) - before[w["name"]], 1) for w in workers}
                choices = sorted(r.json().get("choices", []), key=lambda c: c["index"]) if r.status_code == 200 else []
                rows.append({"run": f"{run}.{k}", "load": f"{load:.0f}", "prompts": len(prompts),
                             "status": r.status_code, "seconds": round(took, 1),
                             "echoed": sum(c["text"].startswith(p) for c, p in zip(choices, prompts)),
                             "cpu_s": " / ".join(f"{n} {v}" for n, v in cpu.items()),
                             "failures": [] if r.status_code == 200 else [r.text[:200]]})
            counts = serve.counts()
        finally:
            serve.stop()
    for row in rows:
        row["retry_reasons"] = counts["retry_reasons"]
        row["retries"] = counts["retries"]
    return rows


COLUMNS = {
    "trace": ["run", "load", "prompts", "served", "failed_after_admission", "refused_up_front",
              "inflight_failed_by_health", "breakers_opened", "workers_dead", "migrations", "retries"],
    "cold-burst": ["run", "load", "streams", "exact", "failed", "refused_up_front", "inflight_failed_by_health",
                   "breakers_opened", "workers_dead"],
    "connections": ["run", "load", "connections", "requests", "served", "failed", "refused_up_front",
                    "inflight_failed_by_health", "breakers_opened", "workers_dead"],
    "many-prompts": ["run", "load", "prompts", "status", "seconds", "echoed", "cpu_s", "retries"],
}


def main(argv=None) -> int:
    args = parse_args(argv)
    args.hogs = args.hogs if args.hogs is not None else {"trace": 10, "cold-burst": 16}.get(args.scenario, 0)
    args.num_prompts = args.num_prompts or (1000 if args.scenario == "many-prompts" else 600)
    args.streams = args.streams or {"cold-burst": 60, "connections": 48}.get(args.scenario, 0)
    runner = {"trace": run_trace, "cold-burst": run_cold_burst, "connections": run_connections,
              "many-prompts": run_many_prompts}[args.scenario]
    cols = COLUMNS[args.scenario]
    print(f"scenario {args.scenario}, {args.hogs} CPU hogs, {os.cpu_count()} cores; load before: {load_average():.1f}")
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols), flush=True)
    rows = []
    for run in range(1, args.runs + 1):
        with tempfile.TemporaryDirectory(prefix="pd-overload-") as tmp:
            try:
                row = runner(args, run, Path(tmp))
            finally:
                if args.keep_logs:
                    Path(args.keep_logs).mkdir(parents=True, exist_ok=True)
                    shutil.copy(Path(tmp) / "pd-serve.log", Path(args.keep_logs) / f"{args.scenario}-run{run}.log")
        for row in row if isinstance(row, list) else [row]:
            rows.append(row)
            print("| " + " | ".join(str(row[c]) for c in cols) + " |", flush=True)
            if row.get("failures") or row.get("retry_reasons"):
                print(f"  run {row['run']} failures: {row['failures']}; retries: {row['retry_reasons']}",
                      file=sys.stderr, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
