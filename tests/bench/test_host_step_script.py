"""`bench/scripts/host_step.py` builds, over 20 decode steps (pages gained every 16), the same batches through
the host-rebuilt tables and through the device block-table rows it times against each other."""

from __future__ import annotations

import torch

from pd_cluster.bench.scripts import host_step as hs
from pd_cluster.engine.batch import HostStaging


def test_both_paths_of_the_host_step_benchmark_build_the_same_batch():
    cpu = torch.device("cpu")
    old_reqs, new_reqs = hs.make_requests(4, 100), hs.make_requests(4, 100)
    staging = HostStaging(cpu)
    runner, table, rows_staging = hs.device_rows_runner(cpu)
    for _ in range(20):
        a = hs.rebuilt_step(old_reqs, cpu, staging)
        b = hs.device_rows_step(runner, table, new_reqs, rows_staging)
        for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "block_tables"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert int(b.seq_lens.max()) == 120 and b.block_tables.shape == (4, 8)
