"""The fast tier starts no process: the guard of `tests/conftest.py` is on in every test not marked slow, and it
refuses every way Python starts one."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import subprocess

import pytest
from process_guard import ProcessGuard, ProcessInNotSlowTest


def _subprocess_run():
    subprocess.run(["true"], check=False)


def _asyncio_subprocess():
    async def start():
        await asyncio.create_subprocess_exec("true")
    asyncio.run(start())


def _multiprocessing_spawn():
    multiprocessing.get_context("spawn").Process(target=print).start()


def _multiprocessing_fork():
    multiprocessing.get_context("fork").Process(target=print).start()


STARTS = {
    "subprocess.run": _subprocess_run,
    "asyncio.create_subprocess_exec": _asyncio_subprocess,
    "multiprocessing spawn": _multiprocessing_spawn,
    "multiprocessing fork": _multiprocessing_fork,
    "os.fork": lambda: os.fork(),
    "os.system": lambda: os.system("true"),
    "os.posix_spawn": lambda: os.posix_spawn("/bin/true", ["true"], {}),
    "os.spawnv": lambda: os.spawnv(os.P_WAIT, "/bin/true", ["true"]),
}


@pytest.mark.parametrize("start", list(STARTS.values()), ids=list(STARTS))
def test_the_guard_refuses_every_way_to_start_a_process(start):
    with ProcessGuard("probe") as guard:
        with pytest.raises(ProcessInNotSlowTest, match="not marked slow"):
            start()
    assert len(guard.attempts) == 1 and "(in probe)" in guard.attempts[0], guard.attempts


def test_the_guard_is_on_in_a_test_that_is_not_slow(request):
    assert ProcessGuard.current is not None and ProcessGuard.current.where == request.node.nodeid
    assert subprocess.Popen._execute_child.__name__ == "guarded_execute_child"


@pytest.mark.slow
def test_a_slow_test_runs_without_the_guard():
    assert ProcessGuard.current is None
    assert subprocess.Popen._execute_child.__name__ == "_execute_child"


def test_no_two_test_modules_share_a_basename():
    """The test folders have no ``__init__.py``, so pytest imports each module by its basename: two files named
    alike (say ``tests/bench/test_x.py`` and ``tests/decode/test_x.py``) stop the whole run at collection with
    "import file mismatch"."""
    from collections import defaultdict
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1]
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in tests.rglob("*.py"):
        if path.name != "conftest.py" and "__pycache__" not in path.parts:
            by_name[path.name].append(str(path.relative_to(tests)))
    assert {n: p for n, p in by_name.items() if len(p) > 1} == {}


def test_a_shared_cluster_runs_from_its_first_user_to_its_last():
    """`shared_clusters.SharedClusters`: started once for every test that asks, stopped after the last one."""
    import contextlib
    from types import SimpleNamespace

    from shared_clusters import SharedClusters

    events = []

    @contextlib.contextmanager
    def start():
        events.append("start")
        yield "cluster"
        events.append("stop")

    items = [SimpleNamespace(nodeid=f"t{i}", fixturenames=names) for i, names in
             enumerate([(), ("pd_1p1d",), ("x",), ("pd_1p1d", "y"), ()])]
    shared = SharedClusters(["pd_1p1d"])
    shared.plan(items)
    for item in items:
        if "pd_1p1d" in item.fixturenames:
            assert shared.open("pd_1p1d", start) == "cluster"
        shared.release(item)
        assert events == ([] if item.nodeid == "t0" else ["start"] if item.nodeid in ("t1", "t2") else
                          ["start", "stop"]), item.nodeid
    shared.close("pd_1p1d")  # the session fixture's own teardown: nothing left to stop
    assert events == ["start", "stop"]

    # a pytest-xdist worker runs modules out of collection order: nothing stops before the session ends
    events.clear()
    shared.plan(items, in_order=False)
    for item in reversed(items):
        if "pd_1p1d" in item.fixturenames:
            assert shared.open("pd_1p1d", start) == "cluster"
        shared.release(item)
    assert events == ["start"]
    shared.close("pd_1p1d")
    assert events == ["start", "stop"]


def test_every_exclusive_module_exists_and_is_marked(request):
    from exclusive import EXCLUSIVE_MODULES
    root = request.config.rootpath
    missing = [m for m in EXCLUSIVE_MODULES if not (root / m).is_file()]
    assert not missing, f"tests/support/exclusive.py names modules that do not exist: {missing}"
    assert request.node.get_closest_marker("exclusive") is None  # this module is not one of them
