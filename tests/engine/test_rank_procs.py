"""Rank processes are forked from one preloaded forkserver and run with their launcher's environment of the moment
they start (`pd_cluster.engine.executor.rank_procs`)."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys

import pytest

from pd_cluster.engine.executor import rank_procs
from pd_cluster.engine.executor.rank_procs import preload_modules, rank_process

needs_forkserver = pytest.mark.skipif("forkserver" not in mp.get_all_start_methods(), reason="no forkserver here")


def report(conn, var: str) -> None:
    """A rank's target: send back what it sees."""
    conn.send({"pid": os.getpid(), "ppid": os.getppid(), "env": os.environ.get(var),
               "torch_preloaded": "torch" in sys.modules})
    conn.close()


def _run(var: str) -> dict:
    reader, writer = mp.Pipe(duplex=False)
    proc = rank_process(report, (writer, var), "test-rank")
    proc.start()
    writer.close()
    try:
        assert reader.poll(120), "the rank sent nothing"
        got = reader.recv()
    finally:
        proc.join(30)
    assert proc.exitcode == 0
    return got


def test_preload_names_torch_and_the_targets_module():
    mods = preload_modules(report)
    assert mods[:2] == ["torch", __name__]


def test_preload_adds_a_main_module_run_by_name(monkeypatch):
    class Spec:
        name = "pd_cluster.launch.worker"

    main = type(sys)("__main__")
    main.__spec__ = Spec()
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert preload_modules(report)[-1] == "pd_cluster.launch.worker"
    Spec.name = "pytest.__main__"  # python -m pytest: nothing of it to preload
    assert preload_modules(report) == ["torch", __name__]


@pytest.mark.slow
@needs_forkserver
def test_ranks_fork_from_one_server_and_see_the_environment_of_their_start(monkeypatch):
    var = "PD_TEST_RANK_ENV"
    monkeypatch.setenv(var, "first")
    a = _run(var)
    monkeypatch.setenv(var, "second")  # the server, already running, still has "first" (or nothing)
    b = _run(var)
    monkeypatch.delenv(var)
    c = _run(var)
    assert (a["env"], b["env"], c["env"]) == ("first", "second", None)
    assert a["ppid"] == b["ppid"] == c["ppid"] != os.getpid()  # the forkserver, not this process
    assert a["torch_preloaded"] and len({a["pid"], b["pid"], c["pid"]}) == 3


def test_without_a_forkserver_ranks_are_spawned(monkeypatch):
    monkeypatch.setattr(rank_procs.mp, "get_all_start_methods", lambda: ["spawn"])
    assert rank_procs.rank_context(report).get_start_method() == "spawn"


_SPY = """
import sys, torch, torch.cuda
calls = []
for name in ("is_available", "device_count", "_lazy_init", "init", "current_device", "get_device_capability",
             "get_device_properties", "mem_get_info", "set_device"):
    def spy(*a, _o=getattr(torch.cuda, name), _n=name, **k):
        calls.append(_n)
        return _o(*a, **k)
    setattr(torch.cuda, name, spy)
for mod in sys.argv[1:]:
    __import__(mod)
print(",".join(calls))
"""


@pytest.mark.slow
def test_the_forkserver_preload_touches_no_device():
    """CUDA must not be initialised in the server before it forks (PyTorch: CUDA and fork do not mix), so importing
    what it preloads (torch, the rank targets' modules and a worker's main module) calls into ``torch.cuda`` not
    once. The same holds for the worker zygote's preload (`pd_cluster.launch.zygote.PRELOAD`)."""
    from pd_cluster.engine.executor import dp, tp

    from pd_cluster.launch.zygote import PRELOAD

    mods = sorted({*preload_modules(tp._rank_main), *preload_modules(dp._rank_main), "pd_cluster.launch.worker",
                   *PRELOAD})
    done = subprocess.run([sys.executable, "-c", _SPY, *mods], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "", f"torch.cuda called while importing {mods}: {done.stdout}"


def sleep_long(seconds: float) -> None:
    """A rank's target that would outlive the test."""
    import time

    time.sleep(seconds)


@pytest.mark.slow
def test_stop_rank_processes_leaves_none_running():
    procs = [rank_process(sleep_long, (600,), f"sleeper-{i}") for i in range(2)]
    for p in procs:
        p.start()
    assert all(p.is_alive() for p in procs)
    assert sorted(rank_procs.stop_rank_processes(timeout=30)) == ["sleeper-0", "sleeper-1"]
    assert not any(p.is_alive() for p in procs) and all(p.exitcode == -9 for p in procs)
    assert rank_procs.stop_rank_processes() == []
