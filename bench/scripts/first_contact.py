"""GPU first contact: one prepared command that runs every device check within its time budget and keeps each
result as soon as it is measured.

Run on a CUDA machine (the budget covers everything after the install; about 9 minutes on an H100)::

    python -m pd_cluster.bench.scripts.first_contact --out DIR --budget-s 500

The steps, most valuable first (`STEPS`; their budgets and what each measures are in ``docs/gpu.md``):

1. ``env``: versions, compiler, ``Python.h``, the device, the worker's Triton self-check (`first_contact_env`);
2. ``kernels``: the kernel tests compiled for the device and every ``gpu``-marked test, the two tests fixed after
   the first run, MoE, MLA and hybrid attention first (`first_contact_kernels`);
3. ``e2e``: greedy text equal to the torch reference on stories260K and tiny Mixtral, DeepSeek-V3 and Gemma 3,
   offline with CUDA graphs and overlap scheduling, and through a 1P1D cluster each (`first_contact_e2e`);
4. ``handover``: 1P1D against colocated TTFT at 2k and 8k tokens on Llama-3.1-8B shapes, and the transfer's own
   share of the difference (`first_contact_handover`);
5. ``decode``: ceilings, FP8 decode attention, the decode step at batch 1/64/256 with graphs, the 8k prefill
   (`first_contact_decode`);
6. ``nixl``: NIXL WRITEs with the descriptors a loaded pool's transfers use, under UCX ``cuda_ipc`` settings
   (`first_contact_nixl`);
7. ``moe_mla``: the fused MoE and MLA decode kernels at batch 64 against their memory floors; DP/EP hooks
   (`first_contact_moe_mla`);
8. ``quant``: hooks for the quantized GEMM and MoE benchmarks, run when their modules exist
   (`first_contact_hooks`).

Each step is a child process. Its share of the budget is the time left, split by the budgets of the steps not
run yet, so time a step does not use goes to the steps after it. A step that outlives its share is stopped
(SIGTERM to its process group, SIGKILL 5 s later) and the next step starts. Each step writes a part
(`first_contact_part`) into a work folder as it goes; the driver merges the parts into ``DIR/results.json`` and
``DIR/results.md`` (`first_contact_report`) every few seconds and after every step, and every step's output goes
to ``DIR/run.log`` (kept under `LOG_CAP` bytes). Those three files are all the run writes into DIR; a step's
failure is recorded there and the next step still runs.

``--dry-run`` runs the same steps on any machine at toy sizes on CPU (`tests/bench/test_first_contact_dry_run.py`):
it proves the script starts, writes its files and stays within its budget. Its numbers mean nothing.

Exit status: 0 when every step ended without an error or a failed check (a missed target is a finding), 1
otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from pd_cluster.bench.scripts import first_contact_report as report
from pd_cluster.bench.scripts.first_contact_proc import KILL_GRACE_S, run_command

LOG_CAP = 12 << 20  # run.log is cut in the middle past this (the device returns files of up to 16 MiB)
FILES = ("results.json", "results.md", "run.log")


@dataclass(frozen=True)
class Step:
    """One step: its name, its budget in seconds on an H100 at the default ``--budget-s`` (the weight of its
    share), its weight in a dry run (what it costs on a 2-core CPU), its module, and what it does."""

    name: str
    budget_s: float
    dry_s: float
    module: str
    what: str


STEPS: tuple[Step, ...] = (
    Step("env", 10, 15, "first_contact_env", "versions, device, Triton self-check"),
    Step("kernels", 130, 70, "first_contact_kernels", "kernel tests compiled + every gpu-marked test"),
    Step("e2e", 95, 100, "first_contact_e2e", "greedy == torch reference: 4 models, offline and 1P1D"),
    Step("handover", 85, 60, "first_contact_handover", "1P1D vs colocated TTFT at 2k/8k; the transfer's share"),
    Step("decode", 65, 45, "first_contact_decode", "FP8 decode attention, decode step at batch 1/64/256, 8k prefill"),
    Step("nixl", 50, 40, "first_contact_nixl", "NIXL WRITEs with a loaded pool's descriptors; UCX settings"),
    Step("moe_mla", 35, 25, "first_contact_moe_mla", "fused MoE and MLA decode at batch 64 vs memory floors"),
    Step("quant", 30, 15, "first_contact_hooks", "hooks: quantized GEMM and MoE benchmarks"),
)
DEFAULT_BUDGET_S = sum(s.budget_s for s in STEPS)


@dataclass
class StepResult:
    name: str
    what: str
    budget_s: float
    status: str = "not run"
    share_s: float = 0.0
    wall_s: float = 0.0
    detail: str = ""


@dataclass
class Run:
    out: Path
    work: Path
    budget_s: float
    dry_run: bool
    command: str
    started: float = field(default_factory=time.monotonic)
    started_at: str = field(default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).strftime(
        "%Y-%m-%d %H:%M UTC"))
    results: dict[str, StepResult] = field(default_factory=dict)

    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def part_path(self, name: str) -> Path:
        return self.work / f"part-{name}.json"


def step_command(step: Step, run: Run, share_s: float) -> list[str]:
    """The command line of `step` (a module of ``pd_cluster.bench.scripts`` taking `first_contact_part` flags)."""
    argv = [sys.executable, "-m", f"pd_cluster.bench.scripts.{step.module}", "--part", str(run.part_path(step.name)),
            "--work", str(run.work), "--budget-s", f"{share_s:.0f}"]
    return argv + (["--dry-run"] if run.dry_run else [])


def write_results(run: Run, chosen: list[Step]) -> None:
    parts = {s.name: p for s in chosen if (p := report.read_part(run.part_path(s.name))) is not None}
    meta = {"command": run.command, "started": run.started_at, "budget_s": run.budget_s,
            "used_s": time.monotonic() - run.started, "dry_run": run.dry_run, "work": str(run.work)}
    steps = [vars(run.results.get(s.name, StepResult(s.name, s.what, weight(s, run)))) for s in chosen]
    report.write(run.out, meta, steps, parts)


def cap_log(path: Path, limit: int = LOG_CAP) -> None:
    """Keep `path` under `limit` bytes: its first eighth and its last part, with a line where it was cut."""
    size = path.stat().st_size if path.exists() else 0
    if size <= limit:
        return
    data = path.read_bytes()
    head, tail = data[: limit // 8], data[-(limit - limit // 8 - 200):]
    path.write_bytes(head + f"\n[first_contact] ... {size - len(head) - len(tail)} bytes cut ...\n".encode() + tail)


def weight(step: Step, run: Run) -> float:
    return step.dry_s if run.dry_run else step.budget_s


def run_step(step: Step, run: Run, weights_left: float, chosen: list[Step]) -> StepResult:
    # the share keeps back what the stop of an overrunning step can take (SIGTERM, then SIGKILL)
    share = max(0.0, run.left_s() - 2 * KILL_GRACE_S) * weight(step, run) / weights_left
    res = run.results[step.name] = StepResult(step.name, step.what, weight(step, run), "running", share)
    log = run.out / "run.log"
    with open(log, "a") as fh:
        fh.write(f"\n===== step {step.name}: {step.what} (share {share:.0f} s) =====\n")
    if share < 1.0:
        res.status, res.detail = "not run", "no time left"
        return res
    rc, res.wall_s = run_command(step_command(step, run, share), time.monotonic() + share, log=log,
                                 tick=lambda: write_results(run, chosen))
    part = report.read_part(run.part_path(step.name))
    if rc is None:
        res.status, res.detail = "stopped at share", f"stopped after {res.wall_s:.0f} s; what it recorded is kept"
    elif rc == 0:
        res.status, res.detail = "ok", "exit 0"
    else:
        res.status, res.detail = "FAILED", f"exit {rc}" + ("" if part else " before it recorded anything")
    cap_log(log)
    return res


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pd_cluster.bench.scripts.first_contact", allow_abbrev=False,
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help=f"folder for the results ({', '.join(FILES)}; created)")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                   help=f"seconds for all steps together (default {DEFAULT_BUDGET_S:.0f})")
    p.add_argument("--steps", default=",".join(s.name for s in STEPS),
                   help="comma-separated steps to run, in the order given (default: all, most valuable first)")
    p.add_argument("--work", default=None, help="folder for the steps' parts and scratch files (default: a new "
                                                "temporary folder; never inside --out)")
    p.add_argument("--dry-run", action="store_true", help="toy sizes on CPU on any machine: checks the script only")
    args = p.parse_args(argv)
    unknown = set(args.steps.split(",")) - {s.name for s in STEPS}
    if unknown:
        p.error(f"unknown steps: {', '.join(sorted(unknown))}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work).resolve() if args.work else Path(tempfile.mkdtemp(prefix="first-contact-"))
    work.mkdir(parents=True, exist_ok=True)
    command = "python -m pd_cluster.bench.scripts.first_contact " + " ".join(sys.argv[1:] if argv is None else argv)
    run = Run(out, work, args.budget_s, args.dry_run, command)
    by_name = {s.name: s for s in STEPS}
    chosen = [by_name[name] for name in dict.fromkeys(args.steps.split(","))]
    (out / "run.log").write_text(f"$ {command}\n(work folder {work})\n")
    write_results(run, chosen)
    for i, step in enumerate(chosen):
        print(f"[first_contact] step {step.name}: {run.left_s():.0f} s of budget left", flush=True)
        res = run_step(step, run, sum(weight(s, run) for s in chosen[i:]), chosen)
        write_results(run, chosen)
        print(f"[first_contact] step {step.name}: {res.status} ({res.detail}) in {res.wall_s:.0f} s of "
              f"{res.share_s:.0f}", flush=True)
    data = json.loads((out / "results.json").read_text())  # the summary: steps, targets, checks, skips, errors
    print(report.markdown(data, summary_only=True)[-10000:], flush=True)
    return 0 if all(r.status == "ok" for r in run.results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
