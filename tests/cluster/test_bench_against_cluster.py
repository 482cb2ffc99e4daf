"""Acceptance (pd-bench #5): pd-bench runs against a real 1P1D cluster, scrapes the server-side breakdown,
and writes JSON and plots."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from PIL import Image

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py: the fast tier starts none)


@pytest.mark.timeout(900)
def test_pd_bench_breakdown_json_and_plots(tmp_path, pd_1p1d):
    cluster = pd_1p1d  # shared (tests/support/shared_clusters.py): pd-bench's breakdown is of before/after deltas
    cmd = [sys.executable, "-m", "pd_cluster.bench.cli", "--base-url", cluster.router_url, "--dataset-name", "random",
           "--random-input-len", "120", "--random-output-len", "24", "--num-prompts", "30",
           "--request-rate", "10", "--seed", "1", "--save-result", "--plot", "--result-dir", str(tmp_path),
           "--result-filename", "run.json", "--disable-tqdm"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "run.json").read_text())
    summary = result["summary"]
    assert summary["completed"] == 30 and summary["failed"] == 0
    assert summary["total_output_tokens"] > 0
    breakdown = result["server_breakdown"]
    phases = {(p["phase"], p["role"]): p for p in breakdown["phases"]}
    for key in [("queue", "prefill"), ("prefill", "prefill"), ("queue", "decode"), ("transfer", "decode"),
                ("decode", "decode")]:
        assert phases[key]["count"] == 30, key  # every request seen by the worker that ran that phase
    assert ("prefill", "decode") not in phases or phases[("prefill", "decode")]["count"] == 0
    assert phases[("decode", "decode")]["mean_ms"] > 0 and phases[("prefill", "prefill")]["mean_ms"] > 0
    kv = {k["role"]: k for k in breakdown["kv_transfer"]}
    assert kv["prefill"]["transfers"] == 30 and kv["prefill"]["bytes"] > 0 and not kv["prefill"]["failed"]
    assert max(breakdown["peak_token_usage"].values()) > 0
    assert "Server-side breakdown" in out.stdout
    pngs = sorted(tmp_path.glob("*.png"))
    assert len(pngs) >= 2
    for png in pngs:
        assert png.stat().st_size > 10_000
        with Image.open(png) as img:
            w, h = img.size
            assert w >= 400 and h >= 300
            colors = img.convert("RGB").getcolors(maxcolors=1_000_000)
            assert colors is not None and len(colors) > 20  # not a blank canvas
