"""The GPU benchmark's speculative verify step (`bench/scripts/gpu_model.py::verify_step_table`), run with
``--smoke`` on CPU (Triton's interpreter, the toy Llama, fp32): one row per K = 0, 2, 4, 8, and the verify extend's
first logits row equal to the decode step's for the same token and pages."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pd_cluster.bench.scripts.gpu import PARTS


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_smoke_run_times_the_verify_step_against_the_decode_step(tmp_path):
    out = tmp_path / "gpu.md"
    skip = ",".join(p for p in PARTS if p != "verify")
    done = subprocess.run([sys.executable, "-m", "pd_cluster.bench.scripts.gpu", "--smoke", "--skip", skip,
                           "--output", str(out)], capture_output=True, text=True, timeout=280,
                          env=dict(os.environ, TRITON_INTERPRET="1"))
    assert done.returncode == 0, done.stderr[-2000:]
    text = out.read_text()
    assert "### Speculative verify step" in text
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines()
            if line.startswith("| ") and line.split("|")[1].strip() in ("0", "2", "4", "8")]
    assert [(r[0], r[1]) for r in rows] == [("0", "1"), ("2", "3"), ("4", "5"), ("8", "9")]
    assert all(float(r[2]) > 0 for r in rows)
    assert all(float(r[5]) < 1e-4 for r in rows), rows  # extend's first row == the decode step's logits
    assert all(abs(float(r[4]) - (float(r[3]) - 1)) < 0.01 for r in rows)  # break-even = x decode step - 1
