"""Helpers for the pd-bench tests: run pd-bench in-process with command-line flags."""

from __future__ import annotations

from typing import Any

from bench.args import build_parser, to_config
from bench.cli import run_benchmark


def bench(url: str, *flags: str) -> dict[str, Any]:
    """Run pd-bench with ``flags`` against ``url`` (no progress bar); returns the result dict."""
    ns = build_parser().parse_args(["--base-url", url, "--disable-tqdm", *flags])
    return run_benchmark(to_config(ns))
