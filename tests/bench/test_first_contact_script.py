"""The GPU first-contact script (`bench/scripts/first_contact.py`): it starts, writes its files, stays in budget.

The real run needs a GPU; ``--dry-run`` runs the same steps at toy sizes here
(the kernel tests only collect and skip, the model runs on CPU, the benchmark
runs ``--smoke``), including the 1P1D cluster of the end-to-end step.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from pd_cluster.bench.scripts import first_contact as fc

FILES = {"summary.md", "env.md", "kernels.log", "e2e.md", "e2e.log", "bench.md", "bench.json", "bench.log"}


def _run(out: Path, *args: str, timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pd_cluster.bench.scripts.first_contact", "--out", str(out),
                           "--dry-run", *args], capture_output=True, text=True, timeout=timeout)
    return done, time.monotonic() - t0


def _statuses(out: Path) -> dict[str, str]:
    rows = [line.split("|") for line in (out / "summary.md").read_text().splitlines() if line.startswith("| ")]
    return {r[1].strip(): r[3].strip() for r in rows[1:]}


def test_the_step_table_is_what_the_device_run_expects():
    assert [s.name for s in fc.STEPS] == ["env", "kernels", "e2e", "bench"]
    assert abs(sum(s.weight for s in fc.STEPS) - 1.0) < 1e-9
    files = [f for s in fc.STEPS for f in s.files] + ["summary.md"]
    assert set(files) == FILES and len(files) == len(FILES) <= 8  # the device returns at most 8 files
    gpu_files = fc.gpu_test_files()
    assert "tests/transfer/test_transfer_gpu.py" in gpu_files
    assert not any("kernels" in f for f in gpu_files)  # tests/kernels runs whole, gpu-marked first


@pytest.mark.slow
@pytest.mark.timeout(560)
def test_dry_run_writes_every_file_within_its_budget(tmp_path):
    budget = 400  # steps end early on a quiet machine (about 180 s); the shares leave room for a loaded one
    done, wall = _run(tmp_path, "--budget-s", str(budget), timeout=budget + 60)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert {p.name for p in tmp_path.iterdir()} == FILES
    assert _statuses(tmp_path) == {"env": "ok", "kernels": "ok", "e2e": "ok", "bench": "ok"}
    assert wall <= budget + 15  # the budget plus interpreter start-up and the summary
    e2e = (tmp_path / "e2e.md").read_text()
    assert "1. Offline" in e2e and "3. PD: 1P1D" in e2e and "FAIL" not in e2e
    assert "texts equal to the offline torch reference: 8 of 8" in e2e
    assert "### Ceilings" in (tmp_path / "bench.md").read_text()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_step_past_its_share_is_stopped_with_its_children_and_the_next_still_runs(tmp_path, monkeypatch):
    marker = tmp_path / "grandchild.pid"
    hang = [sys.executable, "-c", "import subprocess, sys, time; "
            f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            f"open({str(marker)!r}, 'w').write(str(p.pid)); print('hanging', flush=True); time.sleep(120)"]
    quick = [sys.executable, "-c", "print('# env', flush=True)"]

    def commands(name, run):
        return [(hang, "bench.log", False)] if name == "bench" else [(quick, "env.md", False)]

    monkeypatch.setattr(fc, "step_commands", commands)
    t0 = time.monotonic()
    rc = fc.main(["--out", str(tmp_path), "--budget-s", "16", "--steps", "bench,env"])
    assert rc == 1
    assert time.monotonic() - t0 <= 16 + 5
    statuses = _statuses(tmp_path)
    assert statuses == {"env": "ok", "kernels": "not run", "e2e": "not run", "bench": "FAILED"}
    assert "stopped at share" in (tmp_path / "summary.md").read_text()
    log = (tmp_path / "bench.log").read_text()
    assert "hanging" in log and "stopped at its time share" in log  # what it printed before the stop is kept
    assert (tmp_path / "env.md").read_text().strip().endswith("# env")
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
