"""The GPU benchmark's FlashInfer part on CPU: the page-table conversion, the not-installed row, and the plumbing.

FlashInfer needs CUDA, so the plumbing runs against a stand-in module written
from FlashInfer's documented decode API (``BatchDecodeWithPagedKVCacheWrapper``:
``plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
page_size, *, q_data_type, kv_data_type, sm_scale)`` and ``run(q, (k, v),
*, k_scale, v_scale)``, HND pages ``[pages, kv_heads, page_size, head_dim]``).
That checks our side (conversion, arguments, the reference check, the rows),
not FlashInfer itself; the real library is exercised on a GPU only.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from pd_cluster.launch.interpreter import use_triton_interpreter_without_cuda

use_triton_interpreter_without_cuda()  # before the Triton kernels are imported (the decode table runs them)

from pd_cluster.bench.scripts import gpu, gpu_attention, gpu_flashinfer  # noqa: E402
from pd_cluster.bench.scripts.gpu_common import Ceilings  # noqa: E402
from pd_cluster.bench.scripts.gpu_flashinfer import paged_kv_indices  # noqa: E402

SMOKE_PARTS_SKIPPED = "layout,prefill_kernel,decode_step,prefill,nixl,quant_moe,verify"


def _ints(t: torch.Tensor) -> list[int]:
    assert t.dtype == torch.int32
    return t.tolist()


def test_block_tables_to_indptr_indices_last_page_len_page_64():
    # 130 tokens = 64 + 64 + 2 (3 pages, 2 in the last); 64 = one full page; 193 = 3 * 64 + 1 (4 pages, 1 in the last)
    tables = torch.tensor([[7, 3, 9, 0], [5, 0, 0, 0], [2, 8, 4, 6]], dtype=torch.int32)
    indptr, indices, last = paged_kv_indices(tables, torch.tensor([130, 64, 193], dtype=torch.int32), 64)
    assert _ints(indptr) == [0, 3, 4, 8]
    assert _ints(indices) == [7, 3, 9, 5, 2, 8, 4, 6]
    assert _ints(last) == [2, 64, 1]


def test_block_tables_to_indptr_indices_last_page_len_page_16():
    # the padding past a request's pages (here real-looking ids, not just 0) must not leak into indices
    tables = torch.tensor([[11, 99, 98], [12, 97, 0], [13, 14, 15], [21, 22, 0]], dtype=torch.int32)
    seq = torch.tensor([1, 16, 33, 17], dtype=torch.int64)
    indptr, indices, last = paged_kv_indices(tables, seq, 16)
    assert _ints(indptr) == [0, 1, 2, 5, 7]
    assert _ints(indices) == [11, 12, 13, 14, 15, 21, 22]
    assert _ints(last) == [1, 16, 1, 1]


def test_empty_request_and_too_narrow_table():
    indptr, indices, last = paged_kv_indices(torch.tensor([[4, 5], [6, 0]], dtype=torch.int32),
                                             torch.tensor([0, 3]), 4)
    assert _ints(indptr) == [0, 0, 1] and _ints(indices) == [6] and _ints(last) == [0, 3]
    with pytest.raises(ValueError, match="needs 3 pages"):
        paged_kv_indices(torch.tensor([[1, 2]], dtype=torch.int32), torch.tensor([9]), 4)


@pytest.mark.slow
def test_smoke_run_reports_flashinfer_not_installed(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import flashinfer -> ModuleNotFoundError
    out = tmp_path / "gpu-bench.md"
    assert gpu.main(["--smoke", "--skip", SMOKE_PARTS_SKIPPED, "--output", str(out)]) == 0
    text = out.read_text()
    assert "### " + gpu_flashinfer.TITLE in text
    assert "| FlashInfer: not installed (pip install flashinfer-python" in text
    # the rest of the decode part still ran
    assert "### FP8 paged decode attention" in text and "### Summary against the targets" in text
    assert "FlashInfer: not installed" in capsys.readouterr().out


def test_flashinfer_row_on_this_machine():
    """Whatever is installed here, the probe gives a status, and no CUDA means it is not run."""
    module, status = gpu_flashinfer.probe(torch.device("cpu"))
    assert module is None
    assert status.startswith("not installed (pip install flashinfer-python") or "not run (no CUDA device)" in status


# ---- a stand-in for flashinfer, from its documented API -------------------------------------------------------

def _fake_flashinfer(fp8_ok: bool = True, read_as_nhd: bool = False):
    calls = []

    class Wrapper:
        def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False):
            assert kv_layout in ("NHD", "HND")
            self.layout = "NHD" if read_as_nhd else kv_layout

        def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
                 q_data_type="float16", kv_data_type=None, sm_scale=None):
            if kv_data_type == torch.float8_e4m3fn and not fp8_ok:
                raise NotImplementedError("no fp8 decode in this build")
            assert indptr.dtype == indices.dtype == last_page_len.dtype == torch.int32
            assert len(indptr) == len(last_page_len) + 1 and int(indptr[-1]) == len(indices)
            self.p = (indptr.tolist(), indices.long(), last_page_len.tolist(), num_qo_heads, num_kv_heads,
                      head_dim, page_size, q_data_type, kv_data_type, sm_scale)
            calls.append(kv_data_type)

        def run(self, q, paged_kv_cache, *, q_scale=None, k_scale=None, v_scale=None):
            indptr, indices, last, hq, hkv, d, ps, q_dt, kv_dt, sm_scale = self.p
            k_cache, v_cache = paged_kv_cache
            assert q.dtype == q_dt and k_cache.dtype == v_cache.dtype == kv_dt
            assert k_cache.stride() == v_cache.stride()
            out = torch.empty(q.shape, dtype=torch.float32)
            for b in range(q.shape[0]):
                pages = indices[indptr[b]:indptr[b + 1]]
                n = len(pages)
                length = (n - 1) * ps + last[b]

                def tokens(cache):
                    x = cache[pages].float()  # HND: [n, hkv, ps, d]
                    x = x.reshape(n, ps, hkv, d).permute(0, 2, 1, 3) if self.layout == "NHD" else x
                    return x.permute(1, 0, 2, 3).reshape(hkv, n * ps, d)[:, :length]

                k, v = tokens(k_cache), tokens(v_cache)
                qg = q[b].float().view(hkv, hq // hkv, d)
                p = torch.softmax(qg @ k.transpose(-1, -2) * (sm_scale * (k_scale or 1.0)), dim=-1)
                out[b] = (p @ v).reshape(hq, d) * (v_scale or 1.0)
            return out.to(q.dtype)

    return types.SimpleNamespace(__version__="0.0-fake", BatchDecodeWithPagedKVCacheWrapper=Wrapper), calls


def _decode_table_with(module, monkeypatch):
    monkeypatch.setattr(gpu_flashinfer, "WORKSPACE_BYTES", 1024)
    cpu = torch.device("cpu")
    ceil = Ceilings(copy_gbps=50.0, matmul_tflops=1.0, copy_bytes=0, matmul_n=0)
    fi = gpu_flashinfer.FlashInferDecode(cpu, ceil, module=module)
    gpu_attention.decode_table(cpu, ceil, gpu_attention.DecodeKernelConfig(block_n=64), 8, True, fi)
    return fi.section


def test_fp8_pages_checked_and_timed_on_every_shape(monkeypatch):
    module, calls = _fake_flashinfer()
    sec = _decode_table_with(module, monkeypatch)
    rows = [r.cells for r in sec.rows]
    # smoke shapes: batch 1, 2 x context 64, 128; both variants on FP8 pages
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [
        (b, c, name, "FP8 E4M3") for b in (1, 2) for c in (64, 128) for name in ("CUDA-core decode",
                                                                                  "tensor-core decode")]
    for r in rows:
        assert all(isinstance(x, float) and x > 0 for x in (r[4], r[5], r[6], r[7], r[8]))
        assert r[5] == pytest.approx(gpu_attention.decode_bytes(r[0], r[1], gpu_attention.Shape(4, 2, 32), 1)
                                     / (r[4] * 1e-6) / 1e9)
    assert set(calls) == {torch.float8_e4m3fn}
    notes = "\n".join(sec.notes)
    assert "matches the float64 torch reference" in notes and "0.0-fake" in notes


def test_bf16_pages_when_fp8_is_not_supported(monkeypatch):
    module, calls = _fake_flashinfer(fp8_ok=False)
    sec = _decode_table_with(module, monkeypatch)
    assert {r.cells[3] for r in sec.rows} == {"bf16 (FP8 failed, see notes)"} and len(sec.rows) == 8
    assert set(calls) == {torch.bfloat16}
    assert "FP8 E4M3 pages failed: NotImplementedError('no fp8 decode in this build')" in "\n".join(sec.notes)


def test_layout_mistake_is_caught_before_timing(monkeypatch):
    module, calls = _fake_flashinfer(read_as_nhd=True)
    sec = _decode_table_with(module, monkeypatch)
    assert [r.cells[2:5] for r in sec.rows] == [["CUDA-core decode", "-", "not timed (see notes)"],
                                                ["tensor-core decode", "-", "not timed (see notes)"]]
    assert "output differs from the torch reference" in "\n".join(sec.notes)
    assert gpu_flashinfer.summary_rows(sec) == []
