"""One step's results in the GPU first contact (`first_contact`): tables, targets, skips and errors, kept as they come.

Each step of ``python -m pd_cluster.bench.scripts.first_contact`` is a child process that records what it measures
in a `Part`: a JSON file in the run's work folder, rewritten (atomically) after every entry, so a step stopped at
its time share, or a run cut off by the machine's own limit, keeps everything recorded before the stop. The driver
merges the parts into the run's one JSON and one markdown file (`first_contact_report`).

A part holds:

- ``sections``: result tables (`gpu_common.Section`: title, columns, rows, notes);
- ``targets``: one row per target checked (`TARGETS`): the measured value, the bound, met or missed, and for a
  miss the top kernels by device time from ``torch.profiler`` (`profile_top`);
- ``checks``: correctness verdicts (``what``, passed, detail): a failed one fails the step;
- ``skips``: what was not run, each with its reason (a hook for something not built, a module absent, no
  device);
- ``errors``: what failed (exception type, message, the traceback's last lines), the step going on with its
  next item (`Part.guard`);
- ``info``: free key-value facts (versions, sizes, settings).

Every step takes the same flags (`step_args`): ``--part FILE`` (where to write), ``--work DIR`` (files shared
between steps, such as the measured ceilings), ``--budget-s`` (its time share, so it can leave out its least
valuable items when time runs short) and ``--dry-run`` (toy sizes on any machine; numbers mean nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from pd_cluster.bench.scripts.gpu_common import Section


@dataclass(frozen=True)
class Target:
    """A raised acceptance target: ``measured <op> bound`` (``>=`` or ``<=``), in `unit`."""

    metric: str
    op: str
    bound: float
    unit: str

    def met(self, value: float) -> bool:
        return value >= self.bound if self.op == ">=" else value <= self.bound


# The targets of the second contact (raised after the first: 75% -> 85%, 1.3x -> 1.15x, 55% -> 80%, 70% -> 80%).
TARGETS: dict[str, Target] = {
    "attention": Target("FP8 decode attention, worst % of copy bandwidth at batch >= 32, context >= 4k", ">=", 85.0,
                        "%"),
    "decode_step": Target("Llama-3.1-8B decode step with CUDA graphs, batch 64, context 2k, FP8 KV, x its memory floor",
                          "<=", 1.15, "x"),
    "prefill": Target("Llama-3.1-8B prefill of one 8k chunk, % of the measured bf16 matmul rate", ">=", 80.0, "%"),
    "nixl": Target("NIXL VRAM->VRAM WRITE with a real transfer's descriptors, % of copy (bytes once)", ">=", 80.0, "%"),
    "handover": Target("8k prompt: 1P1D TTFT - colocated TTFT - KV transfer time", "<=", 5.0, "ms"),
    "moe": Target("fused MoE kernel at batch 64, % of its memory floor", ">=", 70.0, "%"),
    "mla": Target("MLA decode kernel at batch 64, % of its memory floor", ">=", 70.0, "%"),
}


class Part:
    """The results of one step, rewritten to `path` after every entry.

    Args:
        path: the part's JSON file (None: keep in memory only).
        step: the step's name.
        budget_s: the step's time share in seconds (`left_s` counts down from it).
        dry_run: toy sizes; recorded so that the report can say the numbers mean nothing.
    """

    def __init__(self, path: Path | None, step: str, budget_s: float = float("inf"), dry_run: bool = False) -> None:
        self.path = path
        self.started = time.monotonic()
        self.budget_s = budget_s
        self.data: dict = {"step": step, "dry_run": dry_run, "sections": [], "targets": [], "checks": [],
                           "skips": [], "errors": [], "info": {}}
        self.write()

    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def section(self, sec: Section) -> Section:
        print(sec.markdown(), flush=True)
        self.data["sections"].append(sec.to_dict())
        self.write()
        return sec

    def target(self, key: str, measured: float | None, where: str = "", top: list[str] | None = None,
               note: str = "") -> bool | None:
        """Record target `key` (`TARGETS`) at `measured` (None: not measured); returns met (None if not measured)."""
        t = TARGETS[key]
        met = None if measured is None else t.met(float(measured))
        row = {"key": key, "metric": t.metric, "where": where, "measured": measured, "op": t.op, "bound": t.bound,
               "unit": t.unit, "met": met, "note": note, "top_kernels": list(top or []) if met is False else []}
        self.data["targets"].append(row)
        verdict = {True: "met", False: "MISSED", None: "not measured"}[met]
        print(f"[target] {t.metric} ({where}): {measured} {t.op} {t.bound} {t.unit}: {verdict}", flush=True)
        self.write()
        return met

    @staticmethod
    def misses(key: str, measured: float | None) -> bool:
        """Whether `measured` misses target `key` (so that a caller profiles only what missed)."""
        return measured is not None and not TARGETS[key].met(float(measured))

    def check(self, what: str, passed: bool, detail: str = "") -> bool:
        """Record a correctness verdict (a failed one fails the step, `finish`)."""
        self.data["checks"].append({"what": what, "passed": bool(passed), "detail": detail})
        print(f"[check] {what}: {'PASS' if passed else 'FAIL'} {detail}", flush=True)
        self.write()
        return bool(passed)

    def skip(self, what: str, reason: str) -> None:
        self.data["skips"].append({"what": what, "reason": reason})
        print(f"[skip] {what}: {reason}", flush=True)
        self.write()

    def error(self, what: str, exc: BaseException) -> None:
        tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
        self.data["errors"].append({"what": what, "error": f"{type(exc).__name__}: {exc}"[:600],
                                    "traceback": "".join(tb)[-1500:]})
        print(f"[error] {what}: {''.join(tb)}", file=sys.stderr, flush=True)
        self.write()

    def info(self, key: str, value) -> None:
        self.data["info"][key] = value
        self.write()

    @contextlib.contextmanager
    def guard(self, what: str):
        """Run the block; an exception in it is recorded as an error of `what` and the step goes on."""
        t0 = time.monotonic()
        print(f"[{self.data['step']}] {what}: start ({self.left_s():.0f} s of the share left)", flush=True)
        try:
            yield
        except Exception as e:  # noqa: BLE001 - one item's failure must not stop the next
            self.error(what, e)
        finally:
            print(f"[{self.data['step']}] {what}: {time.monotonic() - t0:.1f} s", flush=True)

    def write(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


def profile_top(fn, device, n: int = 8) -> list[str]:
    """The `n` kernels (CUDA; on CPU: operators) with the most time in one call of `fn`, from ``torch.profiler``:
    ``name: microseconds (calls)`` each, largest first, then the total."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    fn()
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize(device)
    want = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    totals: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == want:
            t = totals.setdefault(e.name, [0.0, 0])
            t[0] += e.time_range.elapsed_us() if cuda else e.self_cpu_time_total
            t[1] += 1
    whole = sum(t for t, _ in totals.values())
    top = sorted(totals.items(), key=lambda kv: -kv[1][0])[:n]
    return [f"{name[:90]}: {us:.0f} us ({count})" for name, (us, count) in top] + [f"all: {whole:.0f} us"]


def load_ceilings(work: Path, device, smoke: bool):
    """The device's copy and matmul ceilings (`gpu_common.Ceilings`): measured once per run, then read back from
    ``work/ceilings.json`` by the later steps."""
    from pd_cluster.bench.scripts.gpu_common import Ceilings, measure_ceilings

    path = work / "ceilings.json"
    if path.exists():
        return Ceilings(**json.loads(path.read_text()))
    ceil = measure_ceilings(device, smoke)
    path.write_text(json.dumps(ceil.__dict__))
    return ceil


def step_args(argv: list[str] | None, doc: str) -> argparse.Namespace:
    """The flags every step takes (module docstring)."""
    p = argparse.ArgumentParser(allow_abbrev=False, description=doc.split("\n")[0])
    p.add_argument("--part", required=True, help="the step's JSON part file")
    p.add_argument("--work", default=None, help="the run's work folder (default: the part's folder)")
    p.add_argument("--budget-s", type=float, default=float("inf"), help="the step's time share in seconds")
    p.add_argument("--dry-run", action="store_true", help="toy sizes on any machine; numbers mean nothing")
    args = p.parse_args(argv)
    args.work = Path(args.work or Path(args.part).parent)
    return args


def start_part(argv: list[str] | None, step: str, doc: str) -> tuple[argparse.Namespace, Part]:
    """Parse the step flags and open its `Part`; ``args.device`` is CUDA unless there is none or it is a dry run
    (then the CPU, with Triton in its interpreter, set before Triton loads)."""
    args = step_args(argv, doc)
    import torch
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    args.device = torch.device("cuda" if cuda else "cpu")
    return args, Part(Path(args.part), step, args.budget_s, args.dry_run)


def finish(part: Part) -> int:
    """Exit status of a step: 1 when an item failed or a check did not pass, 0 otherwise (a missed target is a
    finding, not a failure)."""
    return 1 if part.data["errors"] or not all(c["passed"] for c in part.data["checks"]) else 0
