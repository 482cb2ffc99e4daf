"""pd-bench end to end: the command line, saved JSON, plots, compare, failures, limits."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from bench_testkit import bench

from pd_cluster.bench.arrival import rate_plan

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
FAST = ["--dataset-name", "random", "--random-input-len", "16", "--random-output-len", "5",
        "--no-server-metrics"]


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pd_cluster.bench.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def _png_is_a_real_plot(path: str) -> None:
    import matplotlib.image as mpimg

    assert os.path.getsize(path) > 10_000
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] > 300 and img.shape[1] > 600
    rgb = img[..., :3]
    not_white = np.mean(np.any(rgb < 0.9, axis=-1))
    assert 0.01 < not_white < 0.9  # axes, lines and text drawn, not a blank or solid image
    assert len(np.unique((rgb * 255).astype(np.uint8).reshape(-1, 3), axis=0)) > 20


def test_cli_saves_json_and_plots_and_compares(fake_factory, tmp_path):
    fake = fake_factory("--ttft-ms", "20", "--itl-ms", "2", "--num-tokens", "5", "--role", "decode",
                        "--transfer-ms", "5")
    runs = []
    for rate in ("50", "200"):
        name = f"run{rate}.json"
        p = _cli("--base-url", fake.url, *FAST[:-1], "--num-prompts", "60", "--request-rate", rate,
                 "--save-result", "--plot", "--result-dir", str(tmp_path), "--result-filename", name,
                 "--metadata", "note=test", "--disable-tqdm")
        assert p.returncode == 0, p.stderr
        assert "Serving Benchmark Result" in p.stdout and "Length scaling: input x1" in p.stdout
        assert "Transfer [decode] mean/p99 (ms):" in p.stdout and "Scheduler lag p99 (ms):" in p.stdout
        runs.append(tmp_path / name)
    data = json.loads(runs[0].read_text())
    assert set(data) >= {"config", "summary", "server_breakdown", "requests"}
    assert data["config"]["metadata"] == {"note": "test"}
    assert data["config"]["load"]["request_rate"] == 50.0
    assert len(data["requests"]) == 60 and data["summary"]["completed"] == 60
    r0 = data["requests"][0]
    assert r0["success"] and len(r0["itl_s"]) == 4 and r0["output_tokens"] == 5
    assert r0["output_tokens_from"] == "usage" and r0["request_id"].startswith("bench-")
    for suffix in ("_latency_cdf.png", "_timeline.png"):
        _png_is_a_real_plot(str(runs[0]).replace(".json", suffix))
    p = _cli("compare", str(runs[0]), str(runs[1]))
    assert p.returncode == 0, p.stderr
    row = next(line for line in p.stdout.splitlines() if line.startswith("Request throughput"))
    a, b, ratio = (float(x) for x in row.replace("*", "").split()[-3:])
    assert ratio == pytest.approx(b / a, rel=1e-2) and b > a


def test_chat_ttft_counts_from_the_first_content_not_the_first_byte(fake_factory):
    fake = fake_factory("--ttft-ms", "80", "--itl-ms", "2", "--num-tokens", "3", "--early-headers")
    s = bench(fake.url, *FAST, "--endpoint", "/v1/chat/completions", "--num-prompts", "10",
              "--request-rate", "50")["summary"]
    assert s["completed"] == 10
    assert 78 < s["median_ttft_ms"] < 90  # headers and the role chunk came at once; content at 80 ms


def test_failures_are_counted_by_reason(fake_factory):
    fake = fake_factory("--ttft-ms", "0", "--itl-ms", "0", "--num-tokens", "3", "--fail-every", "4",
                        "--fail-status", "503")
    res = bench(fake.url, *FAST, "--num-prompts", "40", "--request-rate", "200")
    s = res["summary"]
    assert s["completed"] == 30 and s["failed"] == 10
    assert s["failure_reasons"] == {"HTTP 503": 10}
    bad = [r for r in res["requests"] if not r["success"]]
    assert all("injected failure" in r["error"] and r["status"] == 503 for r in bad)


def test_a_server_dying_mid_stream_is_a_counted_failure(fake_factory):
    fake = fake_factory("--ttft-ms", "0", "--itl-ms", "20", "--num-tokens", "10", "--die-after", "5")
    s = bench(fake.url, *FAST, "--random-output-len", "10", "--num-prompts", "20", "--request-rate", "100",
              "--request-timeout", "10")["summary"]
    assert s["completed"] + s["failed"] == 20
    assert s["failure_reasons"].get("disconnected mid-stream", 0) >= 1
    assert s["failure_reasons"].get("connection error", 0) >= 1  # requests sent after the exit


def test_duration_caps_the_sends_and_concurrency_limits_in_flight(fake_factory):
    fake = fake_factory("--ttft-ms", "50", "--itl-ms", "1", "--num-tokens", "2")
    s = bench(fake.url, *FAST, "--num-prompts", "100", "--request-rate", "20", "--duration", "1")["summary"]
    due_in_first_second = sum(t <= 1.0 for t in rate_plan(100, 20.0, 1.0, seed=0).times)
    assert s["completed"] == due_in_first_second and s["not_sent"] == 100 - due_in_first_second
    s = bench(fake.url, *FAST, "--num-prompts", "12", "--max-concurrency", "3")["summary"]
    assert s["completed"] == 12 and s["peak_concurrency"] == 3
    assert s["client"]["concurrency_wait_mean_ms"] > 40  # 12 requests through 3 slots of ~52 ms


def test_pd_bench_does_not_import_torch():
    code = ("import sys; from pd_cluster.bench.cli import main; from pd_cluster.bench.tokenizer import load_tokenizer; "
            "from pd_cluster.engine.assets import DEFAULT_MODEL; load_tokenizer(DEFAULT_MODEL).encode('Once upon'); "
            "import pd_cluster.bench.plot, pd_cluster.bench.server_metrics, bench.fake_server; "
            "assert 'torch' not in sys.modules, 'torch imported'; print('ok')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr


def test_requests_beyond_the_context_are_flagged_and_empty_stats_are_not_zero(fake_factory, tmp_path, capsys):
    fake = fake_factory("--ttft-ms", "0", "--itl-ms", "0", "--fail-every", "1", "--context-length", "512")
    res = bench(fake.url, "--dataset-name", "random", "--random-input-len", "500", "--random-output-len", "20",
                "--num-prompts", "5", "--no-server-metrics", "--save-result", "--result-dir", str(tmp_path),
                "--result-filename", "r.json")
    notes = " ".join(res["config"]["resolved"]["notes"])
    assert "5 of 5 requests need more than the server's 512-token context" in notes
    s = res["summary"]
    assert s["completed"] == 0 and s["failure_reasons"] == {"HTTP 503": 5}
    assert np.isnan(s["mean_ttft_ms"]) and np.isnan(s["p99_itl_ms"])
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["summary"]["mean_ttft_ms"] is None
    out = capsys.readouterr().out
    assert "Mean TTFT (ms):                          n/a" in out
