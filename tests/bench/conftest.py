"""Fixtures for the pd-bench tests."""

from __future__ import annotations

import pytest

from pd_cluster.bench.fake_process import FakeServerProcess


@pytest.fixture
def fake_factory():
    """Starts fake OpenAI servers (separate processes); stops them when the test ends."""
    started: list[FakeServerProcess] = []

    def start(*args: str, realtime: bool = False) -> FakeServerProcess:
        f = FakeServerProcess(list(args), realtime=realtime).start()
        started.append(f)
        return f

    yield start
    for f in started:
        f.stop()
