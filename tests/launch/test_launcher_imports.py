"""The processes that only launch, route or plan (``pd-serve``, ``pd-router``, ``pd-planner``) do not import torch or
transformers: on a 2-core machine a cold ``pd-serve`` spends its first seconds spawning its router and workers, and
an import of torch there (about 1.4 s of CPU) delays every one of them (``pd-serve``'s import took 1.6 s with it and
0.24 s without, 2026-12-07)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "nixl")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_launcher_router_and_planner_import_no_torch():
    code = ("import json, sys; import pd_cluster.launch.serve, pd_cluster.router.main, pd_cluster.planner.main; "
            f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
