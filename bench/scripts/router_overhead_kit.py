"""Processes, ``/proc`` CPU accounting and `wrk` for ``router_overhead.py`` (the side-by-side router benchmark)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pd_cluster.common.process import cpu_ticks as process_cpu_ticks

MODEL = "stories260K"


# ---- processes and /proc ----------------------------------------------------------------------------------
def pinned(cpus: set[int]):
    return lambda: os.sched_setaffinity(0, cpus)


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            out.setdefault(ppid, []).append(int(entry))
    return out


def cpu_ticks(pid: int) -> int:
    """User + system clock ticks of ``pid`` (all its threads) and of its live descendants."""
    tree, todo, total = _children(), [pid], 0
    while todo:
        p = todo.pop()
        ticks = process_cpu_ticks(p)
        if ticks is None:
            continue
        total += ticks
        todo.extend(tree.get(p, ()))
    return total


def busy_ticks() -> int:
    """Busy clock ticks of the whole machine, all CPUs (``/proc/stat``: all but idle and iowait)."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    return sum(values) - values[3] - values[4]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the router exited with {proc.returncode}")
        try:
            r = httpx.post(url + "/v1/completions", timeout=2,
                           json={"model": MODEL, "prompt": "warm up", "max_tokens": 1})
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{url} did not answer a completion within {timeout} s")


def start(cmd: list[str], cpu: int, log: Path, env: dict | None = None) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, preexec_fn=pinned({cpu}), stdout=out, stderr=subprocess.STDOUT, env=env)


def tree_env(tree: str, scratch: Path) -> dict:
    """An environment whose ``import pd_cluster`` loads the source tree ``tree``."""
    link = scratch / "base-tree" / "pd_cluster"
    link.parent.mkdir(exist_ok=True)
    if not link.exists():
        link.symlink_to(Path(tree).resolve())
    return dict(os.environ, PYTHONPATH=str(link.parent))


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


# ---- wrk ------------------------------------------------------------------------------------------------------
_UNITS = {"us": 1.0, "ms": 1e3, "s": 1e6, "m": 60e6}


def _micros(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text.strip())
    return float(m.group(1)) * _UNITS[m.group(2)] if m else float("nan")


@dataclass
class Run:
    router: str
    case: str
    conns: int
    round: int
    requests: int
    seconds: float
    p50_us: float
    p99_us: float
    non_2xx: int
    socket_errors: int
    cpu_s: float
    others_cpu_s: float
    load1: float
    extra: dict = field(default_factory=dict)

    @property
    def us_per_req(self) -> float:
        return self.cpu_s / self.requests * 1e6 if self.requests else float("nan")


def parse_wrk(out: str) -> dict:
    got = {"requests": 0, "seconds": 0.0, "p50_us": float("nan"), "p99_us": float("nan"),
           "non_2xx": 0, "socket_errors": 0}
    m = re.search(r"(\d+) requests in ([\d.]+)(\w+)", out)
    if m:
        got["requests"] = int(m.group(1))
        got["seconds"] = _micros(m.group(2) + m.group(3)) / 1e6
    for q, key in (("50%", "p50_us"), ("99%", "p99_us")):
        m = re.search(rf"^\s+{q}\s+(\S+)", out, re.M)
        if m:
            got[key] = _micros(m.group(1))
    m = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if m:
        got["non_2xx"] = int(m.group(1))
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if m:
        got["socket_errors"] = sum(int(g) for g in m.groups())
    return got


def run_wrk(port: int, conns: int, seconds: float, script: Path, env: dict, cpu: int) -> str:
    cmd = ["wrk", "-t1", f"-c{conns}", f"-d{seconds:g}s", "--latency", "--timeout", "10s", "-s", str(script),
           f"http://127.0.0.1:{port}/v1/completions"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, preexec_fn=pinned({cpu}),
                          timeout=seconds + 60).stdout


def make_prompt(path: str, tokens: int) -> str:
    """Story text cut to exactly ``tokens`` tokens of ``path``'s tokenizer (special tokens included)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    words = ("Once upon a time there was a little girl named Lily who loved to play in the park with her "
             "dog Max . One day they found a shiny red ball under a big tree and ").split()
    text, i = "", 0
    while len(tok(text).input_ids) < tokens:
        text += (" " if text else "") + words[i % len(words)]
        i += 1
    while len(tok(text).input_ids) > tokens:
        text = text[:-1]
    return text
