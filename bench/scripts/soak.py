"""Soak under faults: a trace at a fraction of measured capacity on a local `pd-serve`, a random worker killed
(SIGKILL) or frozen (SIGSTOP, then SIGCONT) every interval.

Reports requests sent, failures seen by the client (each with whether a migration or retry could have saved it:
every request here is a plain greedy stream, which the router can migrate), router migrations and retries
(`pd_router_*` metrics), pd-serve's restarts (its manifest), pages leaked at the end (each worker's free pages vs
total once idle) and the RSS of every process over time (a table, and a PNG with `--plot`). Issue 12's
acceptance: no client-visible failure a migration could have saved, 0 leaked pages, RSS flat within 5%.

    python -m pd_cluster.bench.scripts.soak --duration 1800 --fault-interval 120 --plot docs/perf/resilience_rss.png

Capacity is measured first: `--capacity-concurrency` closed-loop clients for `--capacity-secs`, completed
requests per second; the soak then sends Poisson arrivals at `--load-fraction` of it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pd_cluster.bench.config import DatasetConfig, LengthScaling
from pd_cluster.bench.datasets import load_dataset
from pd_cluster.bench.tokenizer import load_tokenizer
from pd_cluster.launch.cluster import free_port

INTERNAL_KEY_HEADER = "X-PD-Internal-Key"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="soak", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--duration", type=float, default=1800.0, help="seconds of soak after the capacity run")
    p.add_argument("--fault-interval", type=float, default=120.0, help="seconds between faults")
    p.add_argument("--first-fault-at", type=float, default=None, help="seconds into the soak (default: interval)")
    p.add_argument("--freeze-secs", type=float, default=20.0, help="how long a frozen worker stays stopped")
    p.add_argument("--faults", default="kill,freeze", help="kinds to draw from: kill, freeze")
    p.add_argument("--load-fraction", type=float, default=0.7)
    p.add_argument("--capacity-concurrency", type=int, default=16)
    p.add_argument("--capacity-secs", type=float, default=30.0)
    p.add_argument("--dataset-name", default="mooncake-trace", choices=("mooncake-trace", "azure-trace"))
    p.add_argument("--input-len-scale", type=float, default=0.04)
    p.add_argument("--max-input-len", type=int, default=300)
    p.add_argument("--output-len-scale", type=float, default=0.1)
    p.add_argument("--max-output-len", type=int, default=64)
    p.add_argument("--num-prefill", type=int, default=2)
    p.add_argument("--num-decode", type=int, default=2)
    p.add_argument("--rss-every", type=float, default=5.0, help="seconds between RSS samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, help="write the RSS plot (PNG) here")
    p.add_argument("--json", default=None, help="write every number of the report here")
    p.add_argument("--serve-arg", action="append", default=[], help="a flag for pd-serve (repeatable)")
    return p.parse_args(argv)


class Serve:
    """One `pd-serve` child: the manifest names every process; the internal key reads the workers' loads."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.key = secrets.token_urlsafe(24)
        self.manifest_path = workdir / "manifest.json"
        self.log_path = workdir / "pd-serve.log"
        self.port = free_port()
        argv = [sys.executable, "-m", "pd_cluster.launch.serve", "--port", str(self.port),
                "--num-prefill", str(args.num_prefill), "--num-decode", str(args.num_decode),
                "--manifest", str(self.manifest_path), "--log-level", "warning",
                "--kv-cache-memory", "64MiB", "--cpu-threads", "1",
                "--router-arg=--upstream-idle-timeout-secs=5", "--router-arg=--upstream-first-byte-timeout-secs=30",
                *args.serve_arg]
        env = dict(os.environ, PD_INTERNAL_API_KEY=self.key)
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pd-serve exited ({self.proc.returncode}); see {self.log_path}")
            if self.manifest_path.exists():
                try:
                    if httpx.get(self.url + "/readiness", timeout=2).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.5)
        raise RuntimeError(f"pd-serve not ready in {timeout} s")

    def manifest(self) -> dict:
        return json.loads(self.manifest_path.read_text())

    def pids(self) -> dict[str, int]:
        m = self.manifest()
        out = {"pd-serve": self.proc.pid, "router": m["router"]["pid"]}
        out.update({w["name"]: w["pid"] for w in m["workers"] if w["pid"]})
        return out

    def loads(self) -> dict[str, dict]:
        out = {}
        with httpx.Client(timeout=5, headers={INTERNAL_KEY_HEADER: self.key}) as c:
            for w in self.manifest()["workers"]:
                try:
                    out[w["name"]] = c.get(w["url"] + "/get_load").json()
                except (httpx.HTTPError, ValueError) as e:
                    out[w["name"]] = {"error": repr(e)}
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def one_request(client: httpx.AsyncClient, url: str, body: dict, out: list[dict]) -> None:
    rec = {"sent_at": time.monotonic(), "tokens": 0, "error": None, "status": None}
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            rec["status"] = resp.status_code
            if resp.status_code != 200:
                rec["error"] = (await resp.aread()).decode(errors="replace")[:300]
            else:
                done = False
                async for line in resp.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: {"):
                        data = json.loads(line[6:])
                        if "error" in data:
                            rec["error"] = data["error"].get("code") or data["error"].get("message")
                        elif data["choices"] and data["choices"][0]["text"]:
                            rec["tokens"] += 1
                if not done and rec["error"] is None:
                    rec["error"] = "stream ended without [DONE]"
    except (httpx.HTTPError, asyncio.TimeoutError) as e:
        rec["error"] = f"client: {type(e).__name__}"
    rec["ended_at"] = time.monotonic()
    out.append(rec)


def bodies(args: argparse.Namespace) -> list[dict]:
    scaling = LengthScaling(args.input_len_scale, args.output_len_scale, args.max_input_len, args.max_output_len)
    ds = load_dataset(DatasetConfig(name=args.dataset_name, seed=args.seed, scaling=scaling),
                      load_tokenizer(str(Path(__file__).resolve().parents[2] / "engine" / "assets" / "stories260K")))
    return [{"model": "stories260K", "prompt": r.prompt, "max_tokens": r.output_len, "temperature": 0,
             "ignore_eos": True, "stream": True} for r in ds.requests]


async def measure_capacity(url: str, reqs: list[dict], concurrency: int, secs: float) -> float:
    out: list[dict] = []
    end = time.monotonic() + secs
    async with httpx.AsyncClient(timeout=120) as client:
        async def lane(i: int) -> None:
            j = i
            while time.monotonic() < end:
                await one_request(client, url, reqs[j % len(reqs)], out)
                j += concurrency
        await asyncio.gather(*(lane(i) for i in range(concurrency)))
    ok = [r for r in out if r["error"] is None]
    return len(ok) / secs


async def soak(args, serve: Serve, reqs: list[dict], rate: float) -> dict:
    rng = random.Random(args.seed)
    out: list[dict] = []
    faults: list[dict] = []
    rss: dict[str, list[tuple[float, float]]] = {}
    t0 = time.monotonic()
    end = t0 + args.duration
    kinds = [k.strip() for k in args.faults.split(",") if k.strip()]

    async def sample_rss() -> None:
        while time.monotonic() < end:
            for name, pid in serve.pids().items():
                v = rss_mib(pid)
                if v is not None:
                    rss.setdefault(f"{name}:{pid}", []).append((time.monotonic() - t0, v))
            await asyncio.sleep(args.rss_every)

    async def inject() -> None:
        at = t0 + (args.first_fault_at if args.first_fault_at is not None else args.fault_interval)
        while at < end:
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            workers = [w for w in serve.manifest()["workers"] if w["pid"]]
            w, kind = rng.choice(workers), rng.choice(kinds)
            faults.append({"at": round(time.monotonic() - t0, 1), "kind": kind, "worker": w["name"],
                           "pid": w["pid"]})
            print(f"[{time.monotonic() - t0:7.1f} s] {kind} {w['name']} (pid {w['pid']})", flush=True)
            if kind == "kill":
                os.kill(w["pid"], signal.SIGKILL)
            else:
                os.kill(w["pid"], signal.SIGSTOP)
                await asyncio.sleep(args.freeze_secs)
                os.kill(w["pid"], signal.SIGCONT)
            at += args.fault_interval

    async def send() -> None:
        tasks = []
        i = 0
        async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=10),
                                     limits=httpx.Limits(max_connections=1000)) as client:
            while time.monotonic() < end:
                tasks.append(asyncio.ensure_future(one_request(client, serve.url, reqs[i % len(reqs)], out)))
                i += 1
                await asyncio.sleep(rng.expovariate(rate))
            await asyncio.gather(*tasks)

    await asyncio.gather(sample_rss(), inject(), send())
    return {"requests": out, "faults": faults, "rss": rss, "elapsed": time.monotonic() - t0}


def router_counter(text: str, name: str) -> dict[str, float]:
    """The samples of the router's counter `name`, summed by their ``reason`` label ("" when none)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                label = sample.labels.get("reason", "")
                out[label] = out.get(label, 0.0) + float(sample.value)
    return out


def wait_idle(serve: Serve, timeout: float) -> dict[str, dict]:
    deadline = time.monotonic() + timeout
    while True:
        loads = serve.loads()
        idle = all("error" not in v and v["num_free_pages"] == v["num_total_pages"] and v["num_running_reqs"] == 0
                   for v in loads.values())
        if idle or time.monotonic() > deadline:
            return loads
        time.sleep(1)


def rss_table(rss: dict[str, list[tuple[float, float]]], skip: float) -> list[dict]:
    """One row per process (a restarted worker is a new row); `first_mib` is its first sample at least `skip`
    seconds after its own first one (start-up and warm-up left out), `change_pct` from there to its last."""
    rows = []
    for key, pts in sorted(rss.items()):
        steady = [v for t, v in pts if t >= pts[0][0] + skip] or [v for _, v in pts]
        first, last = steady[0], steady[-1]
        rows.append({"process": key, "samples": len(pts), "from_s": pts[0][0], "to_s": pts[-1][0],
                     "first_mib": first, "last_mib": last, "max_mib": max(steady),
                     "change_pct": 100 * (last - first) / first})
    return rows


def plot(rss: dict[str, list[tuple[float, float]]], faults: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5))
    for key, pts in sorted(rss.items()):
        ax.plot([t for t, _ in pts], [v for _, v in pts], label=key)
    for f in faults:
        ax.axvline(f["at"], color="red" if f["kind"] == "kill" else "blue", alpha=0.3)
    ax.set_xlabel("seconds into the soak (red: SIGKILL, blue: SIGSTOP)")
    ax.set_ylabel("RSS (MiB)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    args = parse_args(argv)
    reqs = bodies(args)
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        serve = Serve(args, Path(tmp))
        try:
            serve.wait_ready()
            capacity = asyncio.run(measure_capacity(serve.url, reqs, args.capacity_concurrency, args.capacity_secs))
            rate = args.load_fraction * capacity
            print(f"capacity {capacity:.2f} req/s; soak at {rate:.2f} req/s for {args.duration:.0f} s", flush=True)
            got = asyncio.run(soak(args, serve, reqs, rate))
            loads = wait_idle(serve, 90)
            metrics = httpx.get(serve.url + "/metrics", timeout=10).text
            manifest = serve.manifest()
        finally:
            serve.stop()
    failed = [r for r in got["requests"] if r["error"] is not None]
    leaked = {n: (v["num_total_pages"] - v["num_free_pages"]) if "error" not in v else None for n, v in loads.items()}
    report = {
        "capacity_req_s": capacity, "rate_req_s": rate, "duration_s": got["elapsed"],
        "requests": len(got["requests"]), "completed": len(got["requests"]) - len(failed),
        "failures": [{"error": r["error"], "status": r["status"], "tokens_before": r["tokens"],
                      "saveable": True} for r in failed],
        "migrations": router_counter(metrics, "pd_router_migrations_total"),
        "retries": router_counter(metrics, "pd_router_retries_total"),
        "restarts": {w["name"]: w["restarts"] for w in manifest["workers"]},
        "faults": got["faults"], "leaked_pages": leaked,
        "rss": rss_table(got["rss"], skip=min(60.0, args.duration / 4)),
        "rss_series": {k: [[round(t, 1), round(v, 1)] for t, v in pts] for k, pts in got["rss"].items()},
    }
    print_report(report)
    if args.plot:
        plot(got["rss"], got["faults"], args.plot)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def print_report(r: dict) -> None:
    print(f"\ncapacity {r['capacity_req_s']:.2f} req/s, soak at {r['rate_req_s']:.2f} req/s for {r['duration_s']:.0f} s")
    print(f"requests sent {r['requests']}, completed {r['completed']}, client-visible failures {len(r['failures'])}")
    for f in r["failures"]:
        print(f"  failure: {f['error']!s:.80} (status {f['status']}, {f['tokens_before']} tokens before; "
              f"a migration or retry could have saved it: {'yes' if f['saveable'] else 'no'})")
    faults = ", ".join(f"{x['at']} s {x['kind']} {x['worker']}" for x in r["faults"]) or "none"
    print(f"faults: {faults}")
    print(f"migrations {r['migrations']}; retries {r['retries']}; restarts {r['restarts']}")
    print(f"leaked pages {r['leaked_pages']}")
    print("\nRSS per process (first: its first sample past its warm-up, min(60 s, duration / 4) after its start)")
    print("| process:pid | samples | from s | to s | first MiB | last MiB | max MiB | change |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in r["rss"]:
        print(f"| {row['process']} | {row['samples']} | {row['from_s']:.0f} | {row['to_s']:.0f} | "
              f"{row['first_mib']:.1f} | {row['last_mib']:.1f} | {row['max_mib']:.1f} | {row['change_pct']:+.1f}% |")


if __name__ == "__main__":
    sys.exit(main())
