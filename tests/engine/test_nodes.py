"""An instance over several nodes (``--nnodes``, ``--node-rank``, ``--dist-init-addr``, SGLang's flags): bad settings
are refused at start-up naming the flag; a LeaderWorkerSet pod's environment gives the flags it lacks (a flag wins);
and the nodes' rendezvous at node 0's store, run here by threads of one process over a real TCP store on loopback:
a node that differs or never comes fails start-up on every node with the flag named, and rank 0's posts reach a
rank of another node in order."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time

import pytest

from pd_cluster.engine.args import config_from_kwargs
from pd_cluster.engine.config import DeviceConfig
from pd_cluster.engine.parallel.nodes import DEFAULT_DIST_INIT_PORT, check_node_gpus, lws_node_args, node_ranks
from pd_cluster.engine.parallel.rendezvous import (NodeJoinError, StoreInbox, StoreOutbox, host_instance,
                                                   join_instance)
from pd_cluster.launch import worker as launch_worker


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("kwargs, named", [
    ({"tp_size": 3, "nnodes": 2, "dist_init_addr": "10.0.0.1:20000"}, "--tp-size 3 is not divisible by --nnodes 2"),
    ({"tp_size": 4, "nnodes": 2, "node_rank": 2, "dist_init_addr": "a:1"}, "--node-rank 2 must be below --nnodes 2"),
    ({"tp_size": 2, "node_rank": 1}, "--node-rank 1 must be below --nnodes 1"),
    ({"tp_size": 2, "nnodes": 2}, "--nnodes 2 needs --dist-init-addr"),
    ({"tp_size": 2, "nnodes": 2, "dist_init_addr": "10.0.0.1"}, "--dist-init-addr '10.0.0.1' is not HOST:PORT"),
    ({"tp_size": 2, "nnodes": 0}, "--nnodes must be >= 1"),
    ({"tp_size": 2, "dp_size": 2, "enable_dp_attention": True, "nnodes": 2, "dist_init_addr": "a:1"},
     "--enable-dp-attention with --nnodes 2 is not built"),
    ({"tp_size": 2, "nnodes": 2, "dist_init_addr": "a:1", "dist_timeout": 0}, "--dist-timeout must be positive"),
])
def test_bad_node_settings_are_refused_naming_the_flag(kwargs, named):
    with pytest.raises(ValueError, match=named):
        config_from_kwargs(**kwargs)


def test_a_node_runs_its_share_of_the_ranks():
    p = config_from_kwargs(tp_size=16, nnodes=2, node_rank=1, dist_init_addr="[fd00::1]:20000").parallel
    assert (p.nnodes, p.node_rank, p.dist_init_addr) == (2, 1, "[fd00::1]:20000")
    assert list(node_ranks(16, 2, 1)) == list(range(8, 16)) and list(node_ranks(4, 1, 0)) == [0, 1, 2, 3]


def test_more_ranks_than_the_node_has_gpus_is_refused_naming_the_flags():
    """The check a GPU host runs before it spawns a rank (`engine.executor.tp.check_gpus`), here with the counts."""
    with pytest.raises(ValueError, match=r"--tp-size 16 needs 16 GPUs on this node but it has 8: span nodes with "
                                         r"--nnodes N --node-rank R --dist-init-addr HOST:PORT"):
        check_node_gpus(16, 1, 8)
    with pytest.raises(ValueError, match=r"--tp-size 16 over --nnodes 2 is 8 ranks a node, more than this node's 6 "
                                         r"GPUs: raise --nnodes"):
        check_node_gpus(16, 2, 8, first_gpu=2)
    check_node_gpus(16, 2, 8)
    check_node_gpus(8, 1, 8)


def test_an_engine_is_node_0_a_node_r_runs_only_its_ranks():
    from pd_cluster.engine.executor.tp import TPDriver

    with pytest.raises(ValueError, match=r"--node-rank 1: rank 0 runs on node 0; .* `pd-worker --node-rank 1`"):
        TPDriver(config_from_kwargs(tp_size=2, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:9"))


def test_lws_environment_gives_the_node_flags_an_explicit_flag_wins():
    env = {"LWS_LEADER_ADDRESS": "pd-decode-0.pd-decode.ns", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1"}
    assert lws_node_args(env, None, None, None) == (2, 1, f"pd-decode-0.pd-decode.ns:{DEFAULT_DIST_INIT_PORT}")
    assert lws_node_args(env, None, 0, "10.0.0.9:1234") == (2, 0, "10.0.0.9:1234")
    assert lws_node_args({}, None, None, None) == (None, None, None)  # not a LWS pod
    assert lws_node_args(dict(env, LWS_GROUP_SIZE="1"), None, None, None) == (None, None, None)  # a group of one
    with pytest.raises(ValueError, match="LWS_GROUP_SIZE"):
        lws_node_args(dict(env, LWS_GROUP_SIZE="two"), None, None, None)


def test_pd_worker_takes_the_lws_environment(monkeypatch):
    monkeypatch.setenv("LWS_LEADER_ADDRESS", "10.1.2.3")
    monkeypatch.setenv("LWS_GROUP_SIZE", "2")
    monkeypatch.setenv("LWS_WORKER_INDEX", "1")
    argv = ["--role", "decode", "--tp-size", "16"]
    p = launch_worker.worker_config_from_args(launch_worker.build_parser().parse_args(argv)).engine.parallel
    assert (p.nnodes, p.node_rank, p.dist_init_addr) == (2, 1, "10.1.2.3:20000")
    p = launch_worker.worker_config_from_args(launch_worker.build_parser().parse_args(
        argv + ["--node-rank", "0", "--dist-init-addr", "127.0.0.1:9"])).engine.parallel
    assert (p.nnodes, p.node_rank, p.dist_init_addr) == (2, 0, "127.0.0.1:9")


def _configs(port: int, timeout: int = 20, **node1):
    base = config_from_kwargs(role="decode", tp_size=2, nnodes=2, dist_init_addr=f"127.0.0.1:{port}",
                              dist_timeout=timeout, page_size=16)
    other = dict(dict(tp_size=2, nnodes=2, dist_init_addr=f"127.0.0.1:{port}", dist_timeout=timeout,
                      page_size=16, node_rank=1, cpu_threads=2), **node1)
    return base, config_from_kwargs(role="decode", **other)


def _run_node(config, out: dict) -> threading.Thread:
    def run():
        try:
            out["joined"] = join_instance(config)
        except NodeJoinError as e:
            out["error"] = str(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_nodes_meet_and_a_node_runs_rank_0s_configuration_on_its_own_devices():
    node0, node1 = _configs(_port())
    out: dict = {}
    t = _run_node(node1, out)
    store = host_instance(node0)
    t.join(20)
    _, config = out["joined"]
    assert config.device == DeviceConfig(cpu_threads=2) and config.parallel.node_rank == 1
    assert dataclasses.replace(config, device=node0.device, parallel=node0.parallel) == node0
    # rank 0's posts to rank 1 of node 1, through the store, in order
    inbox, outbox = StoreInbox(node1, 1), StoreOutbox(node0, 1)
    for i in range(3):
        outbox.send(("kv_transfer", "sender_announce", (f"t{i}",)))
    assert [inbox.recv()[2] for _ in range(3)] == [("t0",), ("t1",), ("t2",)]
    del store


@pytest.mark.parametrize("node1, named", [
    ({"nnodes": 4, "tp_size": 4}, "node 1 was started with --nnodes 4, node 0 with --nnodes 2"),
    ({"page_size": 32}, "node 1: --page-size: node 0 16, this node 32"),
    ({"kv_cache_dtype": "fp8_e4m3"}, "node 1: --kv-cache-dtype: node 0 'auto', this node 'fp8_e4m3'"),
])
def test_a_node_that_differs_fails_start_up_on_both_nodes_naming_the_flag(node1, named):
    node0, other = _configs(_port(), **node1)
    out: dict = {}
    t = _run_node(other, out)
    with pytest.raises(NodeJoinError, match=named):
        host_instance(node0)
    t.join(20)
    assert named in out["error"] and "node 0 refused this instance" in out["error"]


def test_node_0_fails_start_up_when_a_node_never_joins_naming_the_flags_and_address():
    port = _port()
    node0, _ = _configs(port, timeout=1)
    started = time.monotonic()
    with pytest.raises(NodeJoinError, match=rf"node\(s\) 1 of --nnodes 2 did not join at --dist-init-addr "
                                            rf"127.0.0.1:{port} within 1 s \(--dist-timeout\)"):
        host_instance(node0)
    assert time.monotonic() - started < 15  # its own second, and the wait for a refusal to be read


def test_a_node_without_node_0_fails_naming_the_address():
    port = _port()
    _, node1 = _configs(port, timeout=1)
    with pytest.raises(NodeJoinError, match=rf"node 1: node 0 did not answer at --dist-init-addr 127.0.0.1:{port}"):
        join_instance(node1)
