"""`bench/scripts/soak.py` end to end, short: a real local 2P2D `pd-serve`, one SIGKILL of a random worker.

Half a minute of soak after 5 s of capacity measurement, the kill 8 s in (the script then waits for every
worker, the restarted one included, to be idle before it reports).

pd-serve restarts the killed worker, the client sees no failure (streams migrate, requests retry), and every
worker's free pages return to its total; the report names every number `docs/perf/resilience.md` shows.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_soak_half_a_minute_with_one_kill(tmp_path):
    out = tmp_path / "soak.json"
    png = tmp_path / "rss.png"
    run = subprocess.run([sys.executable, "-m", "pd_cluster.bench.scripts.soak", "--duration", "30",
                          "--fault-interval", "30", "--first-fault-at", "8", "--faults", "kill",
                          "--capacity-secs", "5", "--rss-every", "2", "--json", str(out), "--plot", str(png)],
                         capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["capacity_req_s"] > 0 and report["requests"] > 10
    assert [f["kind"] for f in report["faults"]] == ["kill"]
    killed = report["faults"][0]["worker"]
    assert report["restarts"][killed] == 1, report["restarts"]
    assert sum(report["restarts"].values()) == 1
    assert report["failures"] == [], report["failures"]
    assert report["completed"] == report["requests"]
    assert report["leaked_pages"] == {name: 0 for name in report["restarts"]}, report["leaked_pages"]
    assert {row["process"].split(":")[0] for row in report["rss"]} >= {"pd-serve", "router", killed}
    assert png.stat().st_size > 10_000
    assert "leaked pages" in run.stdout and "| process:pid |" in run.stdout
