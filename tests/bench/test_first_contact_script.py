"""The GPU first-contact script (`bench/scripts/first_contact*.py`): its pieces, and a step stopped at its share
of the budget (its dry run of every step is `test_first_contact_dry_run.py`).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pd_cluster.bench.scripts import first_contact as fc
from pd_cluster.bench.scripts import first_contact_hooks as hooks
from pd_cluster.bench.scripts import first_contact_kernels as kernels
from pd_cluster.bench.scripts import first_contact_report as report
from pd_cluster.bench.scripts.first_contact_part import TARGETS, Part
from pd_cluster.bench.scripts.gpu_common import Row, Section

STEP_NAMES = ["env", "kernels", "e2e", "handover", "decode", "nixl", "moe_mla", "quant"]


def test_the_step_table_is_what_the_device_run_expects():
    assert [s.name for s in fc.STEPS] == STEP_NAMES
    assert fc.DEFAULT_BUDGET_S == 500  # about 9 minutes with the install, inside the device's 10 per command
    assert set(fc.FILES) == {"results.json", "results.md", "run.log"}  # the device returns at most 8 files
    assert "tests/transfer/test_transfer_gpu.py" in kernels.gpu_test_files()
    assert not any("kernels" in f for f in kernels.gpu_test_files())  # tests/kernels runs whole
    assert all(Path(kernels.REPO, f).exists() for f in kernels.FIRST_FILES)


def test_the_targets_are_the_raised_ones():
    bounds = {k: (t.op, t.bound) for k, t in TARGETS.items()}
    assert bounds == {"attention": (">=", 85.0), "decode_step": ("<=", 1.15), "prefill": (">=", 80.0),
                      "nixl": (">=", 80.0), "handover": ("<=", 5.0), "moe": (">=", 70.0), "mla": (">=", 70.0)}


def test_a_part_keeps_every_entry_on_disk_and_a_failure_does_not_stop_the_step(tmp_path):
    part = Part(tmp_path / "p.json", "decode", budget_s=60)
    part.section(Section("t", ["a"], [Row([1.5])]))
    assert part.target("attention", 84.9, "batch 32", top=["k1: 10 us (1)"]) is False
    assert part.target("decode_step", 1.1, "batch 64", top=["not kept: met"]) is True
    part.check("greedy equal", False, "1 of 2")
    with part.guard("an item that fails"):
        raise RuntimeError("boom")
    part.skip("speculative decoding", "not built")
    data = json.loads((tmp_path / "p.json").read_text())
    assert [t["met"] for t in data["targets"]] == [False, True]
    assert data["targets"][0]["top_kernels"] == ["k1: 10 us (1)"] and data["targets"][1]["top_kernels"] == []
    assert data["errors"][0]["what"] == "an item that fails" and "boom" in data["errors"][0]["error"]
    assert data["sections"][0]["rows"][0]["cells"] == [1.5] and data["skips"][0]["reason"] == "not built"
    assert Part.misses("nixl", 79.0) and not Part.misses("nixl", 81.0) and not Part.misses("nixl", None)


def test_the_report_shows_misses_with_their_kernels_failed_checks_and_skips(tmp_path):
    parts = {"decode": {"sections": [], "targets": [
        {"key": "attention", "metric": TARGETS["attention"].metric, "where": "batch 32, context 4096",
         "measured": 80.0, "op": ">=", "bound": 85.0, "unit": "%", "met": False, "note": "",
         "top_kernels": ["_decode_stage1: 100 us (32)"]}], "checks": [{"what": "x", "passed": False, "detail": "d"}],
        "skips": [{"what": "spec", "reason": "not built"}], "errors": [], "info": {}}}
    steps = [{"name": "decode", "what": "w", "status": "ok", "budget_s": 65, "share_s": 60.0, "wall_s": 30.0,
              "detail": "exit 0"}]
    report.write(tmp_path, {"command": "c", "started": "now", "budget_s": 500, "used_s": 30.0, "dry_run": False},
                 steps, parts)
    md = (tmp_path / "results.md").read_text()
    assert "**MISSED**" in md and "_decode_stage1: 100 us (32)" in md and "**FAIL**" in md and "not built" in md
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["targets"][0]["step"] == "decode" and data["parts"]["decode"]["skips"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json", "results.md"]


def test_hooks_skip_an_absent_module_and_run_a_present_one(tmp_path, monkeypatch):
    pkg = tmp_path / "fc_hooks_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "with_fn.py").write_text(
        "from pd_cluster.bench.scripts.gpu_common import Row, Section\n"
        "def first_contact_sections(device, ceilings, smoke):\n"
        "    return [Section('FP8 GEMM', ['M', 'TFLOP/s'], [Row([64, 1.0 if smoke else 2.0])])]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(hooks, "PACKAGE", "fc_hooks_pkg")
    (tmp_path / "ceilings.json").write_text(json.dumps({"copy_gbps": 1.0, "matmul_tflops": 1.0, "copy_bytes": 1,
                                                        "matmul_n": 1}))
    part = Part(None, "quant")
    hooks.run_hook(part, "absent_module", "what", "cpu", tmp_path, True, time.monotonic() + 10)
    hooks.run_hook(part, "with_fn", "what", "cpu", tmp_path, True, time.monotonic() + 10)
    assert part.data["skips"] == [{"what": "what (absent_module)",
                                   "reason": "not on this branch: bench/scripts/absent_module.py is absent"}]
    assert part.data["sections"][0]["title"] == "FP8 GEMM" and part.data["sections"][0]["rows"][0]["cells"] == [64, 1.0]
    text = "noise\n### A table\n\n| a | b |\n|---|---|\n| 1 | x |\n\n- a note\n### empty\n"
    secs = hooks.sections_from_markdown(text)
    assert [(s.title, s.columns, [r.cells for r in s.rows], s.notes) for s in secs] == [
        ("A table", ["a", "b"], [["1", "x"]], ["a note"])]


def test_test_outcomes_are_read_back_and_counted_by_area(tmp_path):
    path = tmp_path / "t.jsonl"
    recs = [{"collected": ["tests/kernels/test_fused_ops.py::test_rope_qk_every_scaling_type[yarn]",
                           "tests/kernels/test_mla_model.py::test_x", "tests/kernels/test_store_kv.py::test_y"]},
            {"nodeid": "tests/kernels/test_fused_ops.py::test_rope_qk_every_scaling_type[yarn]", "when": "call",
             "outcome": "passed", "seconds": 1.0, "message": ""},
            {"nodeid": "tests/kernels/test_mla_model.py::test_x", "when": "call", "outcome": "failed",
             "seconds": 2.0, "message": "E   assert 1 == 2"},
            {"nodeid": "tests/kernels/test_mla_model.py::test_x", "when": "teardown", "outcome": "passed",
             "seconds": 0.0, "message": ""}]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    tests, collected = kernels.read_records(path)
    assert tests["tests/kernels/test_mla_model.py::test_x"]["outcome"] == "failed" and len(collected) == 3
    part = Part(None, "kernels")
    kernels.summarise(part, tests, collected)
    rows = {r["cells"][0]: r["cells"][1:] for r in part.data["sections"][0]["rows"]}
    assert rows[kernels.AREAS[0][0]] == [1, 0, 0, 0] and rows[kernels.AREAS[3][0]] == [0, 1, 0, 0]
    assert rows["other kernel tests"] == [0, 0, 0, 1]  # collected, never reported: not reached
    assert part.data["info"]["tests"] == {"passed": 1, "failed": 1, "skipped": 0, "not_reached": 1}
    assert "assert 1 == 2" in part.data["sections"][1]["rows"][0]["cells"][3]


def test_loaded_pools_give_fragmented_transfers_built_as_the_sender_builds_them():
    from pd_cluster.bench.scripts.first_contact_nixl import _lists
    from pd_cluster.bench.scripts.first_contact_pageruns import simulate

    hist = simulate(512, num_requests=40, warmup=12, probes_each=1, max_output=32)
    assert [t.prompt_tokens for t in hist.probes] == [2048, 8192]
    for t in hist.probes:
        src = [p for s, _ in t.pushes for p in s]
        dst = [p for _, d in t.pushes for p in d]
        assert len(src) == len(dst) == t.prompt_tokens // 64 == t.num_pages
        assert len(set(src)) == len(src) and len(set(dst)) == len(dst) and min(src + dst) >= 1
        assert 1 <= t.num_runs <= t.num_pages
    assert max(hist.runs_per_transfer) > 1  # the pools are fragmented by then
    lists, meta = _lists(hist, 4096)
    assert [k for k, _ in lists] == [f"{n} {kind}" for n in (2048, 8192)
                                     for kind in ("real", "per page", "one descriptor")]
    for key, (src_off, dst_off, lengths) in lists:
        assert len(src_off) == len(dst_off) == len(lengths) == meta[key][0]
        assert int(np.sum(lengths)) == meta[key][2] == int(key.split()[0]) // 64 * 4096


def test_the_log_is_cut_in_the_middle_past_its_cap(tmp_path):
    log = tmp_path / "run.log"
    log.write_bytes(b"A" * 1000 + b"B" * 9000)
    fc.cap_log(log, limit=4000)
    data = log.read_bytes()
    assert len(data) <= 4000 and data.startswith(b"A" * 500) and data.endswith(b"B" * 2000) and b"cut" in data


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_step_past_its_share_is_stopped_with_its_children_and_the_next_still_runs(tmp_path, monkeypatch):
    marker = tmp_path / "grandchild.pid"
    hang = [sys.executable, "-c", "import subprocess, sys, time; "
            f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            f"open({str(marker)!r}, 'w').write(str(p.pid)); print('hanging', flush=True); time.sleep(120)"]

    def command(step, run, share_s):
        if step.name == "decode":
            return hang
        return [sys.executable, "-c", f"open({str(run.part_path(step.name))!r}, 'w').write('{{}}')"]

    monkeypatch.setattr(fc, "step_command", command)
    # equal weights: the hanging step gets (16 s - the 10 s kept for a stop) / 2, the next what is left after it
    monkeypatch.setattr(fc, "STEPS", (fc.Step("decode", 1, 1, "m", "hangs"), fc.Step("env", 1, 1, "m", "quick")))
    t0 = time.monotonic()
    rc = fc.main(["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--budget-s", "16",
                  "--steps", "decode,env"])
    assert rc == 1
    assert time.monotonic() - t0 <= 16 + 5
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert {s["name"]: s["status"] for s in data["steps"]} == {"decode": "stopped at share", "env": "ok"}
    log = (tmp_path / "out" / "run.log").read_text()
    assert "hanging" in log and "stopped at its time share" in log  # what it printed before the stop is kept
    grandchild = int(marker.read_text())
    deadline = time.monotonic() + 10
    while _running(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(grandchild), "the step's own child outlived the stop"


def _running(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie (a killed orphan waits for init to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_hook_module_without_the_function_runs_as_a_script_and_its_tables_are_kept(tmp_path, monkeypatch):
    pkg = tmp_path / "fc_cli_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "cli.py").write_text("import sys\nprint('### MXFP4 MoE\\n\\n| tokens | us |\\n|---|---|\\n| 64 | 12.5 |\\n')\n"
                                "sys.exit(3 if '--smoke' in sys.argv else 0)\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{__import__('os').environ.get('PYTHONPATH', '')}")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(hooks, "PACKAGE", "fc_cli_pkg")
    part = Part(None, "quant")
    hooks.run_hook(part, "cli", "what", "cpu", tmp_path, False, time.monotonic() + 60)
    assert [(s["title"], s["rows"][0]["cells"]) for s in part.data["sections"]] == [("MXFP4 MoE", ["64", "12.5"])]
    with pytest.raises(RuntimeError, match="exited with 3"):  # a failing script is an error; its tables stay
        hooks.run_hook(part, "cli", "what", "cpu", tmp_path, True, time.monotonic() + 60)
    assert len(part.data["sections"]) == 2
