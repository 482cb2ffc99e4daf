"""pd-serve's GPU placement on one host: each role on its own devices, blocks of --tp-size, shared devices split
the memory fraction. Planned without GPUs (the host's device count is a parameter); the env and argv a worker gets
are checked on a real `LocalCluster` object (not started)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pd_cluster.launch.cluster import ClusterSpec, LocalCluster
from pd_cluster.launch.placement import cuda_device_count, parse_gpu_list, plan_gpus

PD = [("prefill-0", "prefill"), ("prefill-1", "prefill"), ("decode-0", "decode"), ("decode-1", "decode")]


def test_gpu_lists_parse_and_refuse_nonsense():
    assert parse_gpu_list("0-3,6") == (0, 1, 2, 3, 6)
    assert parse_gpu_list("4") == (4,)
    for bad in ("a", "3-1", "0,0", "-1", "1-"):
        with pytest.raises(ValueError):
            parse_gpu_list(bad)


def test_roles_on_their_own_gpus_in_blocks_of_tp_size():
    p = plan_gpus(PD, tp_size=2, num_gpus=8, role_gpus={"prefill": (0, 1, 2, 3), "decode": (4, 5, 6, 7)},
                  mem_fraction_given=False)
    assert p.devices == {"prefill-0": (0, 1), "prefill-1": (2, 3), "decode-0": (4, 5), "decode-1": (6, 7)}
    assert p.mem_fraction == {}
    assert p.env("decode-1") == {"CUDA_VISIBLE_DEVICES": "6,7"} and p.argv("decode-1") == []


def test_default_takes_consecutive_blocks_prefill_first():
    p = plan_gpus(PD, tp_size=1, num_gpus=8, role_gpus={}, mem_fraction_given=False)
    assert [p.devices[n] for n, _ in PD] == [(0,), (1,), (2,), (3,)]


def test_one_gpu_shared_by_prefill_and_decode_splits_the_memory_fraction():
    pd = [("prefill-0", "prefill"), ("decode-0", "decode")]
    p = plan_gpus(pd, tp_size=1, num_gpus=1, role_gpus={}, mem_fraction_given=False)
    assert p.devices == {"prefill-0": (0,), "decode-0": (0,)}
    assert p.mem_fraction == {"prefill-0": 0.44, "decode-0": 0.44}
    assert p.argv("decode-0") == ["--mem-fraction-static", "0.440"]
    given = plan_gpus(pd, tp_size=1, num_gpus=1, role_gpus={}, mem_fraction_given=True)
    assert given.mem_fraction == {}


def test_impossible_lists_are_refused_and_no_gpu_means_no_placement():
    with pytest.raises(ValueError, match="this host has 4"):
        plan_gpus(PD, 1, 4, {"decode": (4, 5)}, False)
    with pytest.raises(ValueError, match="fewer than --tp-size"):
        plan_gpus(PD, 4, 8, {"prefill": (0, 1)}, False)
    with pytest.raises(ValueError, match="no CUDA device"):
        plan_gpus(PD, 1, 0, {"prefill": (0,)}, False)
    assert plan_gpus(PD, 1, 0, {}, False).devices == {}


def test_a_local_cluster_gives_each_worker_its_devices_and_fraction():
    spec = ClusterSpec(num_prefill=1, num_decode=1, role_gpus={"prefill": (0,), "decode": (0,)}, num_gpus=2,
                       echo=False)
    cluster = LocalCluster(spec)
    by_name = {p.name: p for p in cluster.procs}
    for name in ("prefill-0", "decode-0"):
        assert cluster.placement.env(name) == {"CUDA_VISIBLE_DEVICES": "0"}
        argv = by_name[name].argv
        assert argv[argv.index("--mem-fraction-static") + 1] == "0.440"


def test_the_device_count_asks_torch_only_on_a_host_with_a_gpu_device_node(monkeypatch, tmp_path):
    """Without a GPU device file pd-serve answers 0 before importing torch (seconds of start-up); with one, it
    asks torch."""
    class FakeTorch:
        class cuda:
            is_available = staticmethod(lambda: True)
            device_count = staticmethod(lambda: 3)

    monkeypatch.setitem(sys.modules, "torch", FakeTorch)
    node = tmp_path / "nvidiactl"
    assert cuda_device_count((str(node),)) == 0  # no such file: torch is not asked
    node.touch()
    assert cuda_device_count((str(node),)) == 3


@pytest.mark.slow
def test_pd_serve_refuses_gpu_lists_on_a_host_without_cuda():
    out = subprocess.run([sys.executable, "-m", "pd_cluster.launch.serve", "--prefill-gpus", "0-3"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "no CUDA device" in out.stderr.splitlines()[-1]
