"""pd-serve's per-role engine flags (``--prefill-arg`` / ``--decode-arg``): each role's workers get their own flags
after the shared ones (so they win), each role's GPUs come in blocks of its own --tp-size, and a flag that has no
meaning for a role, that pd-serve sets itself or that must agree on both roles is refused naming it."""

from __future__ import annotations

import pytest

from pd_cluster.launch.cluster import ClusterSpec, LocalCluster
from pd_cluster.launch.placement import plan_gpus
from pd_cluster.launch.role_args import role_argv_of, role_tp_sizes
from pd_cluster.launch.serve import main

PD = [("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-1", "decode")]


def test_per_role_flags_override_the_shared_ones_for_that_role_only():
    role_argv = role_argv_of({"prefill": ["--tp-size=2"], "decode": ["--tp-size=1", "--kv-transfer-timeout 5"]}, False)
    assert role_argv == {"prefill": ["--tp-size=2"], "decode": ["--tp-size=1", "--kv-transfer-timeout", "5"]}
    assert role_tp_sizes(role_argv, 4) == {"prefill": 2, "decode": 1, "mixed": 4}
    assert role_tp_sizes(role_argv_of({"decode": ["--tp-size=2"]}, False), None)["prefill"] == 1
    spec = ClusterSpec(engine_argv=["--tp-size", "4"], role_argv=role_argv, router_port=1)
    argv = {p.role: p.argv for p in LocalCluster(spec).procs}
    for role, tp in (("prefill", "2"), ("decode", "1")):  # argparse keeps the last: the role's own
        last = max(i for i, a in enumerate(argv[role]) if a.startswith("--tp-size"))
        assert argv[role][last].split("=")[1] == tp and argv[role].index("--tp-size") < last


@pytest.mark.parametrize("role, flag, words", [
    ("prefill", "--max-local-prefill-length=64", ["--max-local-prefill-length", "no meaning for a prefill worker"]),
    ("decode", "--page-size=32", ["--page-size", "must be the same on the prefill and decode workers"]),
    ("decode", "--kv-cache-dtype=fp8_e4m3", ["--kv-cache-dtype", "give it to pd-serve itself"]),
    ("prefill", "--model=/x", ["--model", "must be the same"]),
    ("prefill", "--port=30001", ["--port", "pd-serve sets"]),
    ("decode", "--prefill-policy=cache_aware", ["--prefill-policy", "not a worker flag"]),
    ("decode", "--tp-size=two", ["--tp-size", "invalid int value"]),
    ("decode", "--nnodes=2", ["--nnodes", "pd-worker on each node"]),
    ("prefill", "--dist-init-addr=10.0.0.1:20000", ["--dist-init-addr", "every worker on this host"]),
])
def test_a_flag_without_meaning_for_the_role_is_refused_naming_it(role, flag, words):
    with pytest.raises(ValueError) as err:
        role_argv_of({role: [flag]}, False)
    assert f"--{role}-arg" in str(err.value) and all(w in str(err.value) for w in words), str(err.value)


def test_per_role_flags_are_refused_with_colocated_workers():
    with pytest.raises(ValueError, match="--decode-arg has no meaning with --colocated"):
        role_argv_of({"decode": ["--tp-size=2"]}, True)


def test_pd_serve_exits_at_start_up_naming_the_refused_flag(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--prefill-arg=--page-size=32"])
    assert done.value.code == 2 and "--prefill-arg=--page-size" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--nnodes", "2"], ["--node-rank", "1"], ["--dist-init-addr", "10.0.0.1:20000"]])
def test_pd_serve_refuses_the_flags_of_an_instance_over_several_nodes(argv, capsys):
    with pytest.raises(SystemExit) as done:
        main(argv)
    err = capsys.readouterr().err
    assert done.value.code == 2 and f"pd-serve {argv[0]}" in err and "LeaderWorkerSet" in err, err


def test_each_role_takes_gpus_in_blocks_of_its_own_tp_size():
    p = plan_gpus(PD, tp_size={"prefill": 2, "decode": 1}, num_gpus=8,
                  role_gpus={"prefill": (0, 1), "decode": (4, 5)}, mem_fraction_given=False)
    assert p.devices == {"prefill-0": (0, 1), "decode-0": (4,), "decode-1": (5,)}
    shared = plan_gpus(PD, tp_size={"prefill": 4, "decode": 2}, num_gpus=8, role_gpus={}, mem_fraction_given=False)
    assert shared.devices == {"prefill-0": (0, 1, 2, 3), "decode-0": (4, 5), "decode-1": (6, 7)}
    with pytest.raises(ValueError, match="--prefill-gpus has 2 GPUs, fewer than --tp-size 4 of the prefill workers"):
        plan_gpus(PD, tp_size={"prefill": 4, "decode": 1}, num_gpus=8, role_gpus={"prefill": (0, 1)},
                  mem_fraction_given=False)
