"""Shared test set-up: GPU skipping, shared helpers on the path, and the rule that only `slow` tests start processes.

Test tiers: ``python -m pytest`` runs everything; ``python -m pytest -m "not slow"`` is the fast inner loop (under 4
minutes on a 2-core CPU with ``-n 2``). The modules whose checks are windows of wall-clock time are marked
``exclusive`` (`tests/support/exclusive.py`): CI's command (the README's) runs the rest split over two processes
(pytest-xdist, ``-n 2 --dist loadfile -m "not exclusive"``), then these alone (``-m exclusive``). A test that
starts a process (a worker, a router, a cluster, a tensor-parallel rank, a script, a ``pip``/``helm``/``git``
call) must be marked ``slow``, and so is one that runs over about 5 s: while a test that is not is set up, run or
torn down, `process_guard.ProcessGuard` makes every way of starting a process fail the test.

Clusters several slow modules only read from are shared: `tests/support/shared_clusters.py` (the fixture
``pd_1p1d``) starts one for the first test that asks and stops it after the last one.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))  # shared helpers (tests/support/)

from exclusive import EXCLUSIVE_MODULES  # noqa: E402
from process_guard import ProcessGuard, answer_processor_without_uname  # noqa: E402
from shared_clusters import SHARED, pd_1p1d  # noqa: E402, F401  (clusters shared by several modules)

answer_processor_without_uname()


ROOT = Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(config, items):
    _mark_exclusive(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not `in item.keywords`: that holds folder names too
            item.add_marker(skip)


def _mark_exclusive(items) -> None:
    """Mark the tests of `EXCLUSIVE_MODULES`. (A run split over processes uses ``--dist loadfile``: a module's tests
    run in one process, so its module fixtures start once. pytest-xdist's ``loadgroup`` names a test's group by
    rewriting its node id, which pytest 9.2's node ids no longer take: it split modules over both processes.)"""
    for item in items:
        if Path(item.path).resolve().relative_to(ROOT).as_posix() in EXCLUSIVE_MODULES:
            item.add_marker(pytest.mark.exclusive)


def _no_process_unless_slow(item):
    """Run one phase of `item` under a `ProcessGuard` unless it is marked slow; fail it on any attempt, even
    one the test caught."""
    guard = ProcessGuard(item.nodeid, enabled=item.get_closest_marker("slow") is None)
    with guard:
        result = yield
    if guard.attempts:
        pytest.fail("a test that is not marked slow started a process:\n  " + "\n  ".join(guard.attempts),
                    pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _no_process_unless_slow(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _no_process_unless_slow(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        return (yield from _no_process_unless_slow(item))
    finally:
        SHARED.release(item)  # a shared cluster stops after the last test that uses it


def pytest_collection_finish(session):
    SHARED.plan(session.items, in_order="PYTEST_XDIST_WORKER" not in os.environ)
