"""A dry run of every step of the GPU first-contact script (`bench/scripts/first_contact.py --dry-run`).

The real run needs a GPU; ``--dry-run`` runs the same steps at toy sizes on CPU (kernel tests of one file a
group, the four models with a 1P1D cluster each, the handover's two clusters, the decode and MoE/MLA kernels in
Triton's interpreter, NIXL DRAM-to-DRAM), and must write its three files within its budget. The budget (600 s)
is several times what the steps take on a 2-core machine shared with another test process (about 90 s alone), so
this module is not `exclusive`; a step stopped at its share of the budget is `test_first_contact_script.py`'s.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pd_cluster.bench.scripts import first_contact as fc
from pd_cluster.bench.scripts.first_contact_part import TARGETS

STEP_NAMES = [s.name for s in fc.STEPS]


def _run(out: Path, *args: str, timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pd_cluster.bench.scripts.first_contact", "--out", str(out),
                           "--dry-run", *args], capture_output=True, text=True, timeout=timeout)
    return done, time.monotonic() - t0


@pytest.mark.slow
@pytest.mark.timeout(720)
def test_dry_run_writes_its_three_files_within_its_budget(tmp_path):
    # the steps end early on a quiet 2-core machine (about 150 s of CPU time in all); the budget is a cap whose
    # shares leave room for a machine loaded by other runs
    budget = 600
    out = tmp_path / "out"
    done, wall = _run(out, "--budget-s", str(budget), "--work", str(tmp_path / "work"), timeout=budget + 90)
    assert {p.name for p in out.iterdir()} == set(fc.FILES), done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    assert {s["name"]: s["status"] for s in data["steps"]} == dict.fromkeys(STEP_NAMES, "ok"), \
        json.dumps([data["steps"], data["errors"]], indent=1)[:8000]  # a loaded machine may stop a step at its share
    assert done.returncode == 0 and wall <= budget + 20
    assert {t["key"] for t in data["targets"]} >= set(TARGETS)  # each target measured (toy numbers)
    assert data["errors"] == [] and all(c["passed"] for c in data["checks"])
    checks = {c["what"] for c in data["checks"]}
    for model in ("stories260K", "tiny-mixtral", "tiny-deepseek-v3", "tiny-gemma3"):
        assert f"{model}: PD 1P1D == offline torch reference" in checks
    skips = " ".join(s["what"] for s in data["skips"])
    for what in ("speculative decoding", "(DP)", "(EP)"):
        assert what in skips
    for hook in ("gpu_quant_gemm", "gpu_quant_moe"):  # both scripts exist: their hooks run, in smoke mode here
        assert hook not in skips
    titles = [s["title"] for p in data["parts"].values() for s in p["sections"]]
    for prefix in ("Tests compiled", "PD: 1P1D", "Handover", "Decode step", "Page runs", "NIXL", "Fused MoE",
                   "MLA decode", "Quantised GEMMs", "Fused MoE on quantised experts"):
        assert any(t.startswith(prefix) for t in titles), prefix
    assert "## Targets" in (out / "results.md").read_text()
