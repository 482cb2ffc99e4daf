"""The test step of the GPU first contact (`first_contact`): the kernel tests compiled for the device and every
``gpu``-marked test, most valuable first; also the pytest plugin that records each test's outcome as it ends.

Groups, each a pytest run (over ``pytest-xdist`` when it is installed), within the step's time share:

1. every ``gpu``-marked test (``tests/kernels`` and the files elsewhere that hold one: the overlap schedule's
   never-waiting step, NIXL VRAM pages between two processes);
2. the files first run on a device now, compiled (`FIRST_FILES`): the two tests fixed after the first run (the
   RoPE kernel tests and the bf16 greedy comparison), MoE, MLA, hybrid windows, chunks and sinks;
3. the other kernel tests.

Loaded as a pytest plugin (``-p pd_cluster.bench.scripts.first_contact_kernels``) it appends one JSON line per
test to ``$PD_FC_TESTS_JSONL`` (node id, outcome, seconds, the failure's last lines) from the controlling process
as each test ends, so a group stopped at its share keeps the outcomes it reached. The step then writes, per
area (`AREAS`), how many passed, failed, were skipped or were not reached, and each failure's message.

``--dry-run``: one small file or test of each group (group 1's skip without CUDA), in the interpreter.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest

from pd_cluster.bench.scripts.first_contact_part import Part, finish, start_part
from pd_cluster.bench.scripts.first_contact_proc import REPO, run_command
from pd_cluster.bench.scripts.gpu_common import Row, Section

JSONL_ENV, GROUP_ENV = "PD_FC_TESTS_JSONL", "PD_FC_TESTS_GROUP"
PLUGIN = "pd_cluster.bench.scripts.first_contact_kernels"  # this module, by its import name (not __main__)
FIRST_FILES = ("tests/kernels/test_fused_ops.py", "tests/kernels/test_model_greedy.py",
               "tests/kernels/test_fused_moe.py", "tests/kernels/test_moe_model_greedy.py",
               "tests/kernels/test_mla_decode.py", "tests/kernels/test_mla_model.py",
               "tests/kernels/test_hybrid_kernels.py", "tests/kernels/test_hybrid_model_greedy.py")
# area: node-id fragments (a test belongs to the first area whose fragment it contains)
AREAS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("RoPE kernel tests (13 failed in run 1; tests fixed)", ("test_fused_ops.py::test_rope_qk",)),
    ("greedy bf16 pool, page 64 (failed in run 1; bound fixed)",
     ("test_model_greedy.py::test_greedy_triton_equals_reference[bf16-64]",)),
    ("MoE: fused kernel, greedy Mixtral / Qwen3-MoE", ("test_fused_moe.py", "test_moe_model_greedy.py")),
    ("MLA: decode kernel, greedy DeepSeek-V3", ("test_mla_decode.py", "test_mla_model.py")),
    ("hybrid: windows, chunks, sinks, softcap; greedy Gemma 2/3, gpt-oss, Llama 4",
     ("test_hybrid_kernels.py", "test_hybrid_model_greedy.py")),
    ("overlap schedule never waits (gpu)", ("tests/engine/test_overlap_schedule.py",)),
    ("NIXL VRAM pages between processes (gpu)", ("tests/transfer/",)),
    ("other kernel tests", ("tests/kernels/",)),
)


# ---- the pytest plugin (runs inside pytest) ---------------------------------------------------------------------

_controller = True


def pytest_configure(config) -> None:
    global _controller
    _controller = not hasattr(config, "workerinput")  # xdist workers report through the controller


def _record(rec: dict) -> None:
    path = os.environ.get(JSONL_ENV)
    if path and _controller:
        with open(path, "a") as fh:
            fh.write(json.dumps({**rec, "group": os.environ.get(GROUP_ENV, "")}) + "\n")


def pytest_collection_finish(session) -> None:
    if not hasattr(session.config, "workerinput"):
        _record({"collected": [item.nodeid for item in session.items]})


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids) -> None:
    _record({"collected": list(ids)})


def pytest_runtest_logreport(report) -> None:
    if report.when == "call" or report.outcome != "passed":  # a call's outcome, or a set-up skip or error
        _record({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                 "seconds": round(report.duration, 2), "message": str(report.longrepr)[-1200:] if report.failed else ""})


# ---- the step ---------------------------------------------------------------------------------------------------

def gpu_test_files(root: Path = REPO / "tests") -> list[str]:
    """Test files outside ``tests/kernels`` that hold a ``gpu``-marked test (repository-relative)."""
    out = []
    for path in sorted(root.rglob("test_*.py")):
        if "kernels" in path.parts:
            continue
        if "pytest.mark.gpu" in path.read_text(errors="replace"):
            out.append(str(path.relative_to(REPO)))
    return out


def groups(dry: bool) -> list[tuple[str, list[str]]]:
    """``(name, pytest arguments)`` of each group, most valuable first."""
    first = list(FIRST_FILES) if not dry else ["tests/kernels/test_fused_ops.py::test_rope_qk_every_scaling_type"]
    rest = (["tests/kernels", *[f"--ignore={f}" for f in FIRST_FILES]] if not dry
            else ["tests/kernels/test_selfcheck.py"])
    gpu = ["tests/kernels", *gpu_test_files()] if not dry else ["tests/kernels/test_cuda_graph.py"]
    return [("gpu-marked", ["-m", "gpu", *gpu]),
            ("first on a device: fixed tests, MoE, MLA, hybrid", ["-m", "not gpu", *first]),
            ("other kernel tests", ["-m", "not gpu", *rest])]


def command(dry: bool) -> list[str]:
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", PLUGIN, "-o", "addopts=", "-q",
            "-rfE", "--timeout", "300", "--durations", "10"]
    if not dry and importlib.util.find_spec("xdist") is not None:  # Triton compiles on the host: spread the tests
        argv += ["-n", str(max(1, min(8, (os.cpu_count() or 2) // 2)))]
    return argv


def read_records(path: Path) -> tuple[dict[str, dict], list[str]]:
    """Each test's last record by node id, and every node id collected."""
    tests: dict[str, dict] = {}
    collected: list[str] = []
    if path.exists():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if "collected" in rec:
                collected += [n for n in rec["collected"] if n not in collected]
            elif rec["nodeid"] not in tests or rec["outcome"] != "passed":
                tests[rec["nodeid"]] = rec
    return tests, collected


def area_of(nodeid: str) -> str:
    return next((name for name, frags in AREAS if any(f in nodeid for f in frags)), "other")


def summarise(part: Part, tests: dict[str, dict], collected: list[str]) -> None:
    counts: dict[str, dict[str, int]] = {}
    for nodeid in dict.fromkeys([*collected, *tests]):
        outcome = tests[nodeid]["outcome"] if nodeid in tests else "not reached"
        c = counts.setdefault(area_of(nodeid), {"passed": 0, "failed": 0, "skipped": 0, "not reached": 0})
        c[outcome] = c.get(outcome, 0) + 1
    sec = Section("Tests compiled for the device, by area", ["area", "passed", "failed", "skipped", "not reached"])
    for name in [a for a, _ in AREAS] + ["other"]:
        if name in counts:
            c = counts[name]
            sec.rows.append(Row([name, c["passed"], c["failed"], c["skipped"], c["not reached"]]))
    part.section(sec)
    failed = [r for r in tests.values() if r["outcome"] == "failed"]
    if failed:
        fails = Section("Failed tests", ["test", "phase", "s", "message (last lines)"])
        for r in failed:
            tail = " / ".join(line.strip() for line in r["message"].splitlines()[-4:] if line.strip())
            fails.rows.append(Row([r["nodeid"], r["when"], r["seconds"], tail[-400:].replace("|", "\\|")]))
        part.section(fails)
    part.info("tests", {"passed": sum(c["passed"] for c in counts.values()),
                        "failed": sum(c["failed"] for c in counts.values()),
                        "skipped": sum(c["skipped"] for c in counts.values()),
                        "not_reached": sum(c["not reached"] for c in counts.values())})


def main(argv: list[str] | None = None) -> int:
    args, part = start_part(argv, "kernels", __doc__)
    jsonl = args.work / "tests.jsonl"
    jsonl.unlink(missing_ok=True)
    deadline = time.monotonic() + part.left_s()
    statuses = []
    for name, group_args in groups(args.dry_run):
        if time.monotonic() >= deadline:
            part.skip(f"tests: {name}", "no time left in the step's share")
            continue
        env = dict(os.environ, **{JSONL_ENV: str(jsonl), GROUP_ENV: name})
        rc, wall = run_command(command(args.dry_run) + group_args, deadline, env=env)
        statuses.append(f"{name}: {'stopped at the share' if rc is None else f'exit {rc}'} in {wall:.0f} s")
        if rc not in (0, 1, 5) and rc is not None:  # 1: tests failed (counted below); 5: nothing collected
            part.error(f"tests: {name}", RuntimeError(f"pytest exited with {rc}"))
    part.info("groups", statuses)
    tests, collected = read_records(jsonl)
    summarise(part, tests, collected)
    return 1 if part.data["info"]["tests"]["failed"] else finish(part)  # a failed test fails the step


if __name__ == "__main__":
    sys.exit(main())
