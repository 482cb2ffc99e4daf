"""Clusters shared by several test modules: one start for all of them.

Starting a 1P1D cluster costs ~13 s of CPU (three processes that each import torch, load a model or a tokenizer
and create a NIXL agent). Tests that only read from a cluster share one instead of starting their own:

    def test_something(pd_1p1d):                    # a test
        httpx.post(pd_1p1d.router_url + "/v1/completions", json=...)

    @pytest.fixture(scope="module")                 # or a module's own fixture name, kept for its tests
    def cluster(pd_1p1d):
        return pd_1p1d

`pd_1p1d` is `cluster_util.running_cluster(1, 1)`: the embedded model, `cluster_util.FAST_ENGINE`, the router's
default flags. The fixture is session-scoped, but the cluster runs only from the first test that asks for it to
the last one (`SharedClusters.plan` finds it at collection), so its idle processes do not slow the tests after it.
In a run split over processes (pytest-xdist) each process that runs a user starts its own and keeps it, idle, to
the end of its session: a worker runs modules in the order they are sent, not in collection order.

The contract of a test that takes a shared cluster:
- it only reads: requests, ``/metrics``, ``/get_load``, the router's endpoints. A test that kills, freezes or
  restarts a process, registers workers, or needs other flags starts its own cluster (`running_cluster`);
- it leaves the cluster idle: every request ended, every page free (`cluster_util.wait_all_free`);
- counters on ``/metrics`` are cumulative over every test that used the cluster: compare values read before and
  after, never an absolute count; the prefix caches hold earlier tests' prompts.

To share another configuration, add a fixture built like `pd_1p1d` (a name in `SHARED_FIXTURES`, `SHARED.open`
and `SHARED.close`) and import it in `tests/conftest.py`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from cluster_util import running_cluster


class SharedClusters:
    """The shared clusters that are running, and after which test each one stops."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)
        self._open: dict[str, contextlib.ExitStack] = {}
        self._values: dict[str, Any] = {}
        self._last_user: dict[str, str] = {}  # fixture name -> node id of the last test that uses it

    def plan(self, items: Sequence[pytest.Item], in_order: bool = True) -> None:
        """Note, for each shared fixture, the last of `items` (the tests about to run, in order) that uses it.
        With `in_order` False (a pytest-xdist worker: it runs the modules it is sent, in the order they come) no
        test is known to be the last, and each cluster runs until the session ends: stopped after a test that came
        last only in collection order, it would be gone for a module that runs later (the session fixture's value
        is kept)."""
        self._last_user = {}
        if not in_order:
            return
        for item in items:
            for name in self.names:
                if name in getattr(item, "fixturenames", ()):
                    self._last_user[name] = item.nodeid

    def open(self, name: str, start: Callable[[], contextlib.AbstractContextManager]) -> Any:
        """Enter `start()` (a context manager that yields a ready cluster) unless `name` is running; its value."""
        if name not in self._open:
            stack = contextlib.ExitStack()
            self._values[name] = stack.enter_context(start())
            self._open[name] = stack
        return self._values[name]

    def close(self, name: str) -> None:
        """Stop `name` if it is running (its context manager's exit: every process stopped)."""
        stack = self._open.pop(name, None)
        self._values.pop(name, None)
        if stack is not None:
            stack.close()

    def release(self, item: pytest.Item) -> None:
        """After `item`'s teardown: stop each shared cluster whose last user it was."""
        for name, nodeid in list(self._last_user.items()):
            if nodeid == item.nodeid:
                self.close(name)


SHARED_FIXTURES = ("pd_1p1d",)
SHARED = SharedClusters(SHARED_FIXTURES)


@pytest.fixture(scope="session")
def pd_1p1d():
    """The default 1P1D `LocalCluster` (router + 1 prefill + 1 decode worker), ready; shared, read only (see the
    module docstring)."""
    yield SHARED.open("pd_1p1d", lambda: running_cluster(1, 1))
    SHARED.close("pd_1p1d")
