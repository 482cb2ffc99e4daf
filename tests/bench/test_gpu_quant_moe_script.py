"""`bench/scripts/gpu_quant_moe.py --smoke` on CPU (Triton's interpreter, tiny shapes): both formats are checked
against the torch path, then timed beside the bf16 kernel; the table has a row per shape and token count."""

from __future__ import annotations

import pytest

from pd_cluster.launch.interpreter import use_triton_interpreter_without_cuda

use_triton_interpreter_without_cuda()  # before the Triton kernels are imported

from pd_cluster.bench.scripts import gpu_quant_moe  # noqa: E402
from pd_cluster.bench.scripts.gpu_common import Ceilings  # noqa: E402


@pytest.mark.slow  # about 20 s of interpreted kernels
@pytest.mark.timeout(600)
def test_smoke_table_checks_then_times_both_formats():
    ceil = Ceilings(copy_gbps=2.0, matmul_tflops=1.0, copy_bytes=0, matmul_n=0)
    sec = gpu_quant_moe.quant_moe_table("cpu", smoke=True, ceil=ceil)
    assert [(r.cells[0].rsplit(", ", 1)[1], r.cells[1]) for r in sec.rows] == [
        ("fp8_block", 1), ("fp8_block", 16), ("mxfp4", 1), ("mxfp4", 16)]
    assert all(isinstance(r.cells[2], float) and r.cells[2] > 0 for r in sec.rows)  # timed, not "NOT TIMED"
    fp8_1, mx_1 = sec.rows[0].cells, sec.rows[2].cells
    # weight bytes read: used experts x (3 H I values + scales); 1 token, top-2 -> 2 experts
    assert fp8_1[3] == pytest.approx(2 * (3 * 64 * 32 + 4 * (2 * 2 + 2 * 1)) / 1e6)  # FP8 + 32x32 float32 scales
    assert mx_1[3] == pytest.approx(2 * (3 * 64 * 64 // 2 + 2 * 64 * 2 + 64 * 2) / 1e6)  # two codes a byte + E8M0
    assert fp8_1[4] == pytest.approx(2 * fp8_1[3] * 1e6 / 2e9 * 1e3)  # floor at the read half of the copy rate
    assert sum("relative row error median" in n for n in sec.notes) == 2
