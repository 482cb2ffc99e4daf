"""`bench/scripts/gpu_quant_gemm.py --smoke` on CPU: the script runs (Triton's interpreter, tiny shapes), checks
each quantised GEMM against its torch reference before timing it, and prints one timed row per token count."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_smoke_run_checks_then_times_every_gemm():
    done = subprocess.run([sys.executable, "-m", "pd_cluster.bench.scripts.gpu_quant_gemm", "--smoke"],
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| smoke (96 x 128)")]
    assert [r[1].strip() for r in rows] == ["1", "16"]
    assert all(float(cell) > 0 for r in rows for cell in (r[2], r[3], r[6], r[9]))  # bf16 and the three GEMMs
    assert "NOT TIMED" not in done.stdout
    errors = [line for line in done.stdout.splitlines() if "max relative row error" in line]
    assert len(errors) == 1 and "fp8 block W8A8" in errors[0] and "int4 W4A16" in errors[0]


def test_without_a_gpu_the_full_run_says_how_to_check_the_script():
    from pd_cluster.bench.scripts import gpu_quant_gemm

    if gpu_quant_gemm.torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert gpu_quant_gemm.main([]) == 2
