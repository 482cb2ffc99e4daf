"""First contact with a GPU: one prepared run, every step within its own time share, each result kept at once.

Run on a CUDA machine (one command; the budget covers everything after the
install)::

    python -m pd_cluster.bench.scripts.first_contact --out DIR --budget-s 480

The steps, most valuable first (`STEPS`):

1. ``env``: ``nvidia-smi``, Python, torch, Triton, NIXL, transformers, the C
   compiler, ``Python.h``, and a Triton compile-and-run self-check
   (`first_contact_env`). Writes ``env.md``.
2. ``kernels``: the ``gpu``-marked tests, then every kernel test, compiled for
   the device (no interpreter: bf16 ``tl.dot`` and the device's FP8 rounding).
   Writes ``kernels.log``.
3. ``e2e``: greedy text on the embedded stories260K, Triton backend with CUDA
   graphs and overlap scheduling against the torch reference backend,
   offline and through a local 1P1D cluster on the one GPU
   (`first_contact_e2e`). Writes ``e2e.md`` and ``e2e.log``.
4. ``bench``: the GPU benchmark at Llama-3.1-8B shapes (`pd_cluster.bench.scripts.gpu`):
   ceilings, FP8 paged decode attention, the decode step with and without
   graphs, the 8k prefill, NIXL VRAM-to-VRAM. Writes ``bench.md``,
   ``bench.json`` and ``bench.log``; each table is written as soon as it is
   measured.

Each step is a child process. Its share of the budget is the time left,
split by the weights of the steps not run yet, so time a step does not use
goes to the steps after it. A step that outlives its share is stopped
(SIGTERM to its process group, SIGKILL 5 s later) and the next step starts;
the files a step wrote before that stay. ``summary.md`` is rewritten after
every step with each step's status and wall time. The whole run writes at
most 8 files into DIR.

``--dry-run`` runs the same steps on any machine at toy sizes (kernel tests
only collect and skip, the model runs on CPU, the benchmark runs ``--smoke``):
it proves the script starts, writes its files and stays within the budget
(`tests/bench/test_first_contact_script.py`). Its numbers mean nothing.

Exit status: 0 when every step passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KILL_GRACE_S = 5.0


@dataclass(frozen=True)
class Step:
    """One step: its name, its weight in the budget, and the files it writes into the output folder."""

    name: str
    weight: float
    files: tuple[str, ...]
    what: str


STEPS: tuple[Step, ...] = (
    Step("env", 0.04, ("env.md",), "environment and Triton self-check"),
    Step("kernels", 0.30, ("kernels.log",), "gpu-marked tests, then the kernel tests compiled for the device"),
    Step("e2e", 0.26, ("e2e.md", "e2e.log"), "greedy text: Triton + graphs + overlap vs torch, offline and 1P1D"),
    Step("bench", 0.40, ("bench.md", "bench.json", "bench.log"), "GPU benchmark at Llama-3.1-8B shapes"),
)


@dataclass
class StepResult:
    name: str
    status: str = "not run"
    share_s: float = 0.0
    wall_s: float = 0.0
    detail: str = ""


@dataclass
class Run:
    out: Path
    budget_s: float
    dry_run: bool
    bench_args: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    results: list[StepResult] = field(default_factory=list)

    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)


def gpu_test_files(root: Path = REPO / "tests") -> list[str]:
    """Test files outside ``tests/kernels`` that hold a ``gpu``-marked test (repository-relative)."""
    out = []
    for path in sorted(root.rglob("test_*.py")):
        if "kernels" in path.parts:
            continue
        if "pytest.mark.gpu" in path.read_text(errors="replace"):
            out.append(str(path.relative_to(REPO)))
    return out


def step_commands(name: str, run: Run) -> list[tuple[list[str], str, bool]]:
    """The commands of step `name`: ``(argv, log file name, append)`` each, run one after the other."""
    py = sys.executable
    dry = ["--dry-run"] if run.dry_run else []
    out = str(run.out)
    if name == "env":
        return [([py, "-m", "pd_cluster.bench.scripts.first_contact_env", "--out", out], "env.md", False)]
    if name == "kernels":
        pytest = [py, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=", "-rfEs", "-v",
                  "--timeout", "300", "--durations", "15"]
        if not run.dry_run and importlib.util.find_spec("xdist") is not None:
            # Triton compiles each kernel variant on the host: spread the tests over processes (one device)
            pytest += ["-n", str(max(1, min(8, (os.cpu_count() or 2) // 2)))]
        gpu_marked = [pytest + ["-m", "gpu", "tests/kernels", *gpu_test_files()], "kernels.log", False]
        rest = [pytest + ["-m", "not gpu", "tests/kernels"], "kernels.log", True]
        if run.dry_run:  # the gpu-marked ones skip; of the rest only the self-check (the interpreter takes minutes)
            rest[0] = pytest + ["-m", "not gpu", "tests/kernels/test_selfcheck.py"]
        return [tuple(gpu_marked), tuple(rest)]  # type: ignore[list-item]
    if name == "e2e":
        return [([py, "-m", "pd_cluster.bench.scripts.first_contact_e2e", "--out", out, *dry], "e2e.log", False)]
    if name == "bench":
        argv = [py, "-m", "pd_cluster.bench.scripts.gpu", "--output", str(run.out / "bench.md")]
        if run.dry_run:
            argv += ["--smoke", "--skip", "layout,prefill_kernel,decode_sweep,moe,mla"]
        return [(argv + run.bench_args, "bench.log", False)]
    raise ValueError(f"unknown step {name!r}")


def run_command(argv: list[str], log: Path, append: bool, deadline: float) -> tuple[int | None, float]:
    """Run `argv` in its own process group with output into `log` until it exits or `deadline` (monotonic) passes.

    Returns:
        (exit status, or None when it was stopped at the deadline; seconds it ran).
    """
    t0 = time.monotonic()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log, "a" if append else "w") as fh:
        fh.write(f"$ {' '.join(argv)}\n")
        fh.flush()
        proc = subprocess.Popen(argv, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            return rc, time.monotonic() - t0
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            fh.write(f"\n[first_contact] stopped at its time share after {time.monotonic() - t0:.0f} s\n")
            return None, time.monotonic() - t0


def _stop_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, KILL_GRACE_S)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_step(step: Step, run: Run, weights_left: float) -> StepResult:
    # the share keeps back what the stop of an overrunning step can take (SIGTERM, then SIGKILL)
    share = max(0.0, run.left_s() - 2 * KILL_GRACE_S) * step.weight / weights_left
    res = StepResult(step.name, share_s=share)
    deadline = time.monotonic() + share
    codes: list[str] = []
    t0 = time.monotonic()
    for argv, log, append in step_commands(step.name, run):
        if time.monotonic() >= deadline:
            codes.append("no time left")
            break
        rc, _ = run_command(argv, run.out / log, append, deadline)
        codes.append("stopped at share" if rc is None else f"exit {rc}")
    res.wall_s = time.monotonic() - t0
    res.detail = ", ".join(codes)
    res.status = "ok" if codes and all(c == "exit 0" for c in codes) else "FAILED"
    return res


def write_summary(run: Run) -> None:
    lines = ["# First contact: summary", "",
             f"- started: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}"
             f" (rewritten after each step)",
             f"- command: `python -m pd_cluster.bench.scripts.first_contact {' '.join(sys.argv[1:])}`",
             f"- budget {run.budget_s:.0f} s, used {time.monotonic() - run.started:.0f} s"
             + (" (dry run: toy sizes, numbers mean nothing)" if run.dry_run else ""), "",
             "| step | what | status | share (s) | wall (s) | detail | files |", "|---|---|---|---|---|---|---|"]
    by_name = {r.name: r for r in run.results}
    for step in STEPS:
        r = by_name.get(step.name, StepResult(step.name))
        lines.append(f"| {step.name} | {step.what} | {r.status} | {r.share_s:.0f} | {r.wall_s:.0f} | {r.detail} | "
                     f"{', '.join(step.files)} |")
    (run.out / "summary.md").write_text("\n".join(lines) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pd_cluster.bench.scripts.first_contact", allow_abbrev=False,
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for the results (created)")
    p.add_argument("--budget-s", type=float, default=480.0, help="seconds for all steps together (default 480)")
    p.add_argument("--steps", default=",".join(s.name for s in STEPS),
                   help="comma-separated steps to run, in the order given (default: all, most valuable first)")
    p.add_argument("--dry-run", action="store_true", help="toy sizes on any machine: checks the script only")
    p.add_argument("--bench-args", default="", help="extra flags for the benchmark step, e.g. \"--skip layout\"")
    args = p.parse_args(argv)
    unknown = set(args.steps.split(",")) - {s.name for s in STEPS}
    if unknown:
        p.error(f"unknown steps: {', '.join(sorted(unknown))}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    run = Run(out, args.budget_s, args.dry_run, args.bench_args.split())
    by_name = {s.name: s for s in STEPS}
    chosen = [by_name[name] for name in dict.fromkeys(args.steps.split(","))]
    write_summary(run)
    for i, step in enumerate(chosen):
        print(f"[first_contact] step {step.name}: {run.left_s():.0f} s of budget left", flush=True)
        res = run_step(step, run, sum(s.weight for s in chosen[i:]))
        run.results.append(res)
        write_summary(run)
        print(f"[first_contact] step {step.name}: {res.status} ({res.detail}) in {res.wall_s:.0f} s of "
              f"{res.share_s:.0f}", flush=True)
    print((out / "summary.md").read_text(), flush=True)
    return 0 if all(r.status == "ok" for r in run.results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
