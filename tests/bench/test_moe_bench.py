"""`bench/scripts/moe_bench.py` on CPU: the layer table has a row per shape and token count, and the fused
kernel's table (Triton's interpreter, smoke shapes) checks the kernel before timing it."""

from __future__ import annotations

from pd_cluster.launch.interpreter import use_triton_interpreter_without_cuda

use_triton_interpreter_without_cuda()  # before the Triton kernels are imported

from pd_cluster.bench.scripts import moe_bench  # noqa: E402
from pd_cluster.bench.scripts.gpu_common import Ceilings  # noqa: E402


def test_cpu_layer_table_rows():
    sec = moe_bench.cpu_layer_table(smoke=True)
    assert [r.cells[1] for r in sec.rows] == [1, 16]
    assert all(r.cells[2] > 0 and r.cells[3] > 0 for r in sec.rows)


def test_fused_moe_table_checks_then_times():
    ceil = Ceilings(copy_gbps=1.0, matmul_tflops=1.0, copy_bytes=0, matmul_n=0)
    sec = moe_bench.fused_moe_table("cpu", smoke=True, ceil=ceil)
    assert [r.cells[1] for r in sec.rows] == [1, 16]
    assert all(isinstance(r.cells[2], float) for r in sec.rows)  # timed, not "NOT TIMED"
    assert any("max relative row error" in n for n in sec.notes)
    assert "| smoke: 64, 32, 8, 2 |" in sec.markdown()
