"""The Triton start-up self-check: passes where kernels run, and stops engine start-up with a clear message where not."""

from __future__ import annotations

import pytest

from pd_cluster.engine.attention.triton import selfcheck
from pd_cluster.engine.attention.triton.selfcheck import TritonRuntimeError, check_triton_runtime
from pd_cluster.engine.config import CacheConfig, DeviceConfig, EngineConfig
from pd_cluster.engine.executor.shard import build_shard
from pd_cluster.engine.parallel.group import SINGLE
from kernel_cases import device


class _FailingLaunch:
    """Stands in for a kernel whose launcher does not build (what Triton raises without Python.h)."""

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise RuntimeError("/tmp/main.c:5:10: fatal error: Python.h: No such file or directory")
        return launch


class _WrongKernel:
    def __getitem__(self, grid):
        def launch(x, y, n, BLOCK):
            y.zero_()
        return launch


def test_self_check_passes_where_triton_runs():
    check_triton_runtime(device())


def test_a_compile_failure_names_compiler_headers_and_cache(monkeypatch, tmp_path):
    monkeypatch.setattr(selfcheck, "_selfcheck_kernel", _FailingLaunch())
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    with pytest.raises(TritonRuntimeError) as e:
        check_triton_runtime(device())
    msg = str(e.value)
    assert "Python.h: No such file" in msg  # the compiler's own error
    assert "C compiler:" in msg and "install python3-dev" in msg
    assert f"TRITON_CACHE_DIR: {tmp_path / 'triton'} (writable)" in msg
    assert "--attention-backend torch" in msg
    assert isinstance(e.value.__cause__, RuntimeError)


def test_wrong_values_are_caught(monkeypatch):
    monkeypatch.setattr(selfcheck, "_selfcheck_kernel", _WrongKernel())
    with pytest.raises(TritonRuntimeError, match="wrote wrong values"):
        check_triton_runtime(device())


def _config(backend: str) -> EngineConfig:
    return EngineConfig(cache=CacheConfig(page_size=16, num_pages=8),
                        device=DeviceConfig(device=str(device()), attention_backend=backend))


def test_engine_start_up_runs_the_check_for_triton_only(monkeypatch):
    monkeypatch.setattr(selfcheck, "_selfcheck_kernel", _FailingLaunch())
    with pytest.raises(TritonRuntimeError, match="Python.h"):
        build_shard(_config("triton"), device(), SINGLE)
    shard = build_shard(_config("torch"), device(), SINGLE)  # other backends need no compiler
    assert shard.backend_name == "torch"


def test_engine_start_up_passes_the_check(caplog):
    caplog.set_level("INFO", logger="pd_cluster.engine.executor.shard")
    shard = build_shard(_config("triton"), device(), SINGLE)
    assert shard.backend_name == "triton"
    assert any("Triton self-check passed" in r.getMessage() for r in caplog.records)
