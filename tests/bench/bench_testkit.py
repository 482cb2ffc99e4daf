"""Helpers for the pd-bench tests: run pd-bench in-process with command-line flags."""

from __future__ import annotations

from typing import Any, Callable

import pytest

from pd_cluster.bench.args import build_parser, to_config
from pd_cluster.bench.cli import run_benchmark


def bench(url: str, *flags: str) -> dict[str, Any]:
    """Run pd-bench with ``flags`` against ``url`` (no progress bar); returns the result dict."""
    ns = build_parser().parse_args(["--base-url", url, "--disable-tqdm", *flags])
    return run_benchmark(to_config(ns))


def timer_stats(fake_url: str) -> dict[str, float]:
    """The fake server's ``/debug/timers``: how late its delays fired (ms)."""
    import httpx

    return httpx.get(fake_url + "/debug/timers", timeout=10).json()


def measure(run: Callable[[], dict[str, Any]], check: Callable[[dict[str, Any]], str | None],
            noise: Callable[[dict[str, Any]], list[str]], attempts: int = 3) -> dict[str, Any]:
    """Run a timing measurement until ``check`` passes, retrying only runs that were disturbed.

    A shared 2-core machine sometimes stalls a process for 100+ ms; a timing check then fails
    for reasons outside the code under test. ``noise(result)`` names what disturbed a run
    (pd-bench's own reliability warnings, the fake server's late timers). ``check`` returns
    None on success or the failure message. Two failed checks on undisturbed runs fail the test
    (one may be a stall the noise signals missed: a p99 a fraction of a millisecond over its
    bound on a machine loaded by other runs); when every attempt failed and at most one was
    undisturbed, the test is skipped with the measured noise, since the machine could not
    measure what it asserts.
    """
    notes = []
    undisturbed_failures = 0
    for i in range(attempts):
        res = run()
        failure = check(res)
        if failure is None:
            return res
        disturbed = noise(res)
        if not disturbed:
            undisturbed_failures += 1
            if undisturbed_failures == 2:
                pytest.fail(f"attempt {i + 1}, a second undisturbed run: {failure} (before: {' | '.join(notes)})")
        notes.append(f"attempt {i + 1}: {failure} [disturbed: {'; '.join(disturbed) or 'no signal'}]")
    pytest.skip("the machine was too noisy to measure this: " + " | ".join(notes))
