"""Unit tests of the pure parts: descriptors, layout comparison, wire format, ticket, config, UCX variables."""

from __future__ import annotations

import argparse
import logging
import os

import numpy as np
import pytest
from agent_infos import info

from pd_cluster.transfer import protocol
from pd_cluster.transfer.config import TransferConfig, add_cli_args, from_cli_args
from pd_cluster.transfer.descriptors import page_runs, run_descs, validate_pages
from pd_cluster.transfer.errors import LayoutMismatchError
from pd_cluster.transfer.layout import AgentInfo, check_compatible, compare
from pd_cluster.transfer.ticket import KVTicket
from pd_cluster.transfer.ucx_env import apply as apply_ucx


# ---- descriptors --------------------------------------------------------------------------------------------
def test_runs_merge_pages_consecutive_on_both_sides():
    runs = page_runs([1, 2, 3, 7, 8, 9, 10, 4], [20, 21, 22, 23, 24, 30, 31, 2])
    assert runs.src_start.tolist() == [1, 7, 9, 4]
    assert runs.dst_start.tolist() == [20, 23, 30, 2]
    assert runs.length.tolist() == [3, 2, 2, 1]
    assert runs.num_pages == 8 and runs.num_runs == 4


def test_one_descriptor_for_a_fresh_request():
    runs = page_runs(range(5, 133), range(40, 168))
    assert runs.num_runs == 1 and runs.length.tolist() == [128]


def test_reversed_and_single_pages():
    assert page_runs([3, 2, 1], [1, 2, 3]).num_runs == 3
    assert page_runs([9], [4]).length.tolist() == [1]
    assert page_runs([], []).num_runs == 0


def test_run_descs_are_byte_ranges_of_whole_pages():
    runs = page_runs([1, 2, 3, 7], [10, 11, 12, 13])
    d = run_descs(0x10000, 5120, runs.src_start, runs.length, 0)
    assert d.dtype == np.uint64 and d.shape == (2, 3)
    assert d.tolist() == [[0x10000 + 5120, 3 * 5120, 0], [0x10000 + 7 * 5120, 5120, 0]]
    r = run_descs(1 << 40, 20480, runs.dst_start, runs.length, 3)
    assert r.tolist() == [[(1 << 40) + 10 * 20480, 3 * 20480, 3], [(1 << 40) + 13 * 20480, 20480, 3]]


def test_page_validation():
    validate_pages(np.array([1, 64]), 64, "decode")
    with pytest.raises(ValueError, match="decode page id 0 is outside 1..64"):
        validate_pages(np.array([0, 1]), 64, "decode")
    with pytest.raises(ValueError, match="prefill page id 65 is outside"):
        validate_pages(np.array([65]), 64, "prefill")
    with pytest.raises(ValueError, match="repeat"):
        validate_pages(np.array([3, 4, 3]), 64, "decode")
    with pytest.raises(ValueError, match="3 source pages but 2"):
        page_runs([1, 2, 3], [1, 2])


# ---- layout -------------------------------------------------------------------------------------------------
def test_identical_layouts_pass():
    check_compatible(info("prefill-h-1-tp0-aaa"), info())


@pytest.mark.parametrize("field, value, convertible", [
    ("page_size", 64, False), ("kv_cache_dtype", "bf16", False), ("head_dim", 16, False),
    ("num_layers", 6, False), ("model_identity", "x" * 64, False), ("tp_rank", 1, False),
])
def test_each_mismatch_is_named_with_both_values(field, value, convertible):
    local = info("prefill-h-1-tp0-aaa")
    remote = info(**{field: value})
    with pytest.raises(LayoutMismatchError) as err:
        check_compatible(local, remote)
    e = err.value
    assert e.fields[0] == field and e.mismatches[0].convertible is convertible
    local_value = local.model_identity if field == "model_identity" else local.layout[field]
    assert f"{field}: local={local_value!r} remote={value!r}" in str(e)
    assert "prefill-h-1-tp0-aaa" in str(e) and "decode-h-1-tp0-abc" in str(e)
    assert e.retriable is False and e.reason == "layout_mismatch"


def test_scales_mismatch_is_fatal():
    ms = compare(info("p-h-1-tp0-a"), info(k_scales=[0.5, 0.5, 0.5, 0.5, 0.75]))
    assert [(m.field, m.convertible) for m in ms] == [("k_scales", False)]


def test_heads_differ_by_tp_is_convertible_but_same_tp_is_not():
    tp = compare(info("p-h-1-tp0-a"), info(num_kv_heads=2, tp_size=2))
    assert {m.field: m.convertible for m in tp} == {"num_kv_heads": True, "tp_size": True}
    same_tp = compare(info("p-h-1-tp0-a"), info(num_kv_heads=2))
    assert {m.field: m.convertible for m in same_tp} == {"num_kv_heads": False}


def test_agent_info_round_trip_and_validation():
    i = info()
    assert AgentInfo.from_dict(i.to_dict()) == i
    assert i.layout_hash == AgentInfo.from_dict(i.to_dict()).layout_hash and len(i.layout_hash) == 16
    bad = i.to_dict() | {"kv_nbytes": 123}
    with pytest.raises(ValueError, match="does not hold"):
        AgentInfo.from_dict(bad)
    with pytest.raises(ValueError, match="incarnation"):
        AgentInfo.from_dict(i.to_dict() | {"incarnation": "zzz"})
    with pytest.raises(ValueError, match="malformed"):
        AgentInfo.from_dict({"agent_name": "x"})


def test_layout_hash_equals_the_engine_layout_hash():
    from pd_cluster.engine.kv.pool import KVLayout

    lay = KVLayout(5, 4, 8, 16, "fp8_e4m3", (0.5,) * 5, (0.25,) * 5)
    i = AgentInfo("d-h-1-tp0-a", "a", "decode", "m", lay.to_dict(), 10, "DRAM", 0, 0, 11 * lay.page_nbytes, 0, 40, b"")
    assert i.layout_hash == lay.hash()


# ---- wire format --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("msg", [
    protocol.Push("r1@abc.1", 0, 0, 16, 81920),
    protocol.Push("r1@abc.1", 7, 112, 13, 66560, total=8, meta={"first_token_id": 42}),
    protocol.Stopped("r1@abc.1", "timeout", "push 3 did not complete", ack=True),
    protocol.Cancel("r1@abc.1", "aborted"),
    protocol.Ping(),
    protocol.Alive(("r1@abc.1", "r2@abc.2")),
    protocol.Alive(()),
])
def test_messages_round_trip(msg):
    raw = protocol.encode(msg)
    assert raw.startswith(b"pdkv1") and len(raw) < 200
    back = protocol.decode(raw)
    assert back == msg and getattr(back, "meta", None) == getattr(msg, "meta", None)


@pytest.mark.parametrize("raw", [b"hello", b"pdkv1{not json", b'pdkv1{"t":"push","x":"a"}', b'pdkv1{"t":"what"}',
                                 b'pdkv1{"t":"alive","x":"r1@abc.1"}', b'pdkv1{"t":"alive"}'])
def test_foreign_or_malformed_messages_are_refused(raw):
    with pytest.raises(ValueError):
        protocol.decode(raw)


# ---- ticket -------------------------------------------------------------------------------------------------
def test_ticket_round_trip_and_page_count():
    t = KVTicket("r@a.1", "r", "decode-x-a", "prefill-y-b", tuple(range(5, 10)), 70, 16)
    assert KVTicket.from_dict(t.to_dict()) == t
    with pytest.raises(ValueError, match="need 5"):
        KVTicket("r@a.1", "r", "d", "p", (1, 2), 70, 16)
    with pytest.raises(ValueError, match="malformed"):
        KVTicket.from_dict({"transfer_id": "x"})


# ---- config and UCX variables -------------------------------------------------------------------------------
def test_deadlines_derive_from_the_timeout():
    c = TransferConfig(kv_transfer_timeout=30.0)
    assert (c.push_timeout, c.sender_idle_timeout, c.quarantine) == (7.5, 15.0, 30.0)
    assert c.push_timeout + c.sender_idle_timeout < c.kv_transfer_timeout
    assert TransferConfig(abort_quarantine=2.0).quarantine == 2.0


@pytest.mark.parametrize("kw", [dict(kv_transfer_timeout=0), dict(heartbeat_interval=0), dict(ucx_tls=""),
                                dict(ucx_net_devices=" "), dict(backend="TCP"), dict(heartbeat_interval=100)])
def test_config_refuses_bad_values(kw):
    with pytest.raises(ValueError):
        TransferConfig(**kw)


def test_cli_flags():
    p = argparse.ArgumentParser()
    add_cli_args(p)
    c = from_cli_args(p.parse_args(["--kv-transfer-timeout", "12", "--kv-transfer-ucx-tls", "rc,cuda_copy",
                                    "--kv-transfer-ucx-net-devices", "mlx5_0:1", "--kv-transfer-progress-thread"]))
    assert (c.kv_transfer_timeout, c.ucx_tls, c.ucx_net_devices, c.enable_progress_thread) == \
        (12.0, "rc,cuda_copy", "mlx5_0:1", True)
    assert from_cli_args(p.parse_args([])) == TransferConfig()


def test_ucx_settings_pass_through(caplog, tmp_path):
    env = {"UCX_TLS": "tcp"}
    with caplog.at_level(logging.INFO, logger="pd_cluster.transfer.ucx_env"):
        eff = apply_ucx(TransferConfig(ucx_tls="shm,tcp", ucx_net_devices="lo"), env, sys_ib=tmp_path)
    assert env == {"UCX_TLS": "shm,tcp", "UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib"}
    assert eff == {"UCX_TLS": "shm,tcp", "UCX_NET_DEVICES": "lo"}
    assert "overrides UCX_TLS=tcp" in caplog.text
    env = {"UCX_NET_DEVICES": "mlx5_1:1"}
    assert apply_ucx(TransferConfig(), env) == {"UCX_TLS": None, "UCX_NET_DEVICES": "mlx5_1:1"}
    with pytest.raises(ValueError, match="empty"):
        apply_ucx(TransferConfig(), {"UCX_TLS": ""})


def test_ib_module_left_unloaded_only_without_rdma_devices(tmp_path):
    """Without RDMA devices UCX's ib module is not loaded (its netlink library crashes the process at exit);
    with them, or with UCX_MODULES set by the operator, the environment is left as it is."""
    env: dict = {}
    apply_ucx(TransferConfig(), env, sys_ib=tmp_path / "missing")
    assert env["UCX_MODULES"] == "^ib"
    env = {"UCX_MODULES": "all"}
    apply_ucx(TransferConfig(), env, sys_ib=tmp_path / "missing")
    assert env["UCX_MODULES"] == "all"
    (tmp_path / "mlx5_0" / "ports" / "1").mkdir(parents=True)
    env = {}
    apply_ucx(TransferConfig(), env, sys_ib=tmp_path)
    assert "UCX_MODULES" not in env


def test_warns_when_rdma_devices_present_and_net_devices_unset(monkeypatch, caplog):
    import pd_cluster.transfer.ucx_env as u

    monkeypatch.setattr(u, "rdma_devices", lambda: ["mlx5_0", "mlx5_1"])
    with caplog.at_level(logging.WARNING, logger="pd_cluster.transfer.ucx_env"):
        apply_ucx(TransferConfig(), {})
    assert "UCX_NET_DEVICES is unset" in caplog.text and "mlx5_0:1" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pd_cluster.transfer.ucx_env"):
        apply_ucx(TransferConfig(ucx_net_devices="mlx5_0:1"), {})
    assert "unset" not in caplog.text


def test_rdma_devices_reads_sysfs(tmp_path):
    from pd_cluster.transfer.ucx_env import rdma_devices

    assert rdma_devices(tmp_path / "missing") == []
    (tmp_path / "mlx5_1").mkdir()
    (tmp_path / "mlx5_0").mkdir()
    assert rdma_devices(tmp_path) == ["mlx5_0", "mlx5_1"]


# ---- huge pages ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_hugepages_keep_the_data_and_report_what_moved():
    import torch

    from pd_cluster.transfer.hugepages import HUGE, advise

    gen = torch.Generator().manual_seed(5)
    t = torch.randint(0, 256, (8 * HUGE,), dtype=torch.uint8, generator=gen)
    copy = t.clone()
    addr = t.data_ptr()
    moved = advise(t)
    assert t.data_ptr() == addr and torch.equal(t, copy)  # same addresses, same bytes
    assert 0 <= moved <= t.numel()
    try:
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        mode = "[never]"
    if "[never]" not in mode:
        assert moved >= 6 * HUGE  # the 2 MiB-aligned interior went to huge pages
    assert advise(torch.zeros(100, dtype=torch.uint8)) == 0  # smaller than one huge page: nothing to do


def test_ucx_protocol_tables_are_parsed():
    from pd_cluster.transfer.ucx_log import put_protocols

    text = """[1.1] [vm:1:0]   +--------+-------------+-------------+
[1.1] [vm:1:0]   | init self cfg#0                              |
[1.1] [vm:1:0]   | remote memory write by ucp_put* from host memory to host |
[1.1] [vm:1:0]   +--------+-------------+-------------+
[1.1] [vm:1:0]   | Range  | Description |   Config    |
[1.1] [vm:1:0]   +--------+-------------+-------------+
[1.1] [vm:1:0]   | 0..inf | zero-copy   | cma/memory  |
[1.1] [vm:1:0]   +--------+-------------+-------------+
[1.2] [vm:1:0]   | init intra-node cfg#1                           |
[1.2] [vm:1:0]   | active message by ucp_am_send* from host memory |
[1.2] [vm:1:0]   +------------+--------------------+---------------+
[1.2] [vm:1:0]   |   Range    |    Description     |    Config     |
[1.2] [vm:1:0]   |          0 | short              | tcp/lo        |
[1.3] [vm:1:0]   +--------+-------------+-------------+
[1.3] [vm:1:0]   | init intra-node cfg#1                                    |
[1.3] [vm:1:0]   | remote memory write by ucp_put* from host memory to host |
[1.3] [vm:1:0]   +--------+-------------+-------------+
[1.3] [vm:1:0]   | Range  | Description |   Config    |
[1.3] [vm:1:0]   +--------+-------------+-------------+
[1.3] [vm:1:0]   | 0..inf | zero-copy   | cma/memory  |
"""
    assert put_protocols(text) == ["0..inf bytes: zero-copy over cma/memory (init intra-node cfg#1)"]


def test_kv_format_mismatch_is_fatal_and_an_unnamed_format_is_mha():
    assert compare(info("p-h-1-tp0-a"), info(kv_format="mha")) == []  # an older peer names no format
    ms = compare(info("p-h-1-tp0-a"), info(kv_format="mla"))
    assert [(m.field, m.convertible) for m in ms] == [("kv_format", False)]
    with pytest.raises(LayoutMismatchError, match="kv_format: local='mha' remote='mla'"):
        check_compatible(info("p-h-1-tp0-a"), info(kv_format="mla"))


# ---- heartbeat thread -----------------------------------------------------------------------------------------
def test_heartbeat_thread_beats_survives_a_failing_round_and_stops():
    import threading

    from pd_cluster.transfer.heartbeat import HeartbeatThread

    rounds, closed, seen = [], threading.Event(), threading.Event()

    def beat():
        rounds.append(threading.get_ident())
        if len(rounds) == 2:
            raise RuntimeError("one bad round")  # logged; the next round still comes
        if len(rounds) >= 4:
            seen.set()

    hb = HeartbeatThread(beat, 0.005, closed.is_set)
    hb.start()
    assert seen.wait(10) and hb.running
    assert threading.get_ident() not in rounds  # never on the caller's (the step loop's) thread
    closed.set()  # the agent closed: the thread ends by itself
    hb._thread.join(10)
    assert not hb.running
    n = len(rounds)
    hb.stop()
    assert len(rounds) == n


@pytest.mark.slow
def test_a_process_that_started_an_agent_exits_cleanly(tmp_path):
    """A process that started a NIXL agent (UCX backend) and returns exits 0, not with SIGSEGV from a library's
    unload hook (139 before UCX's ib module was left unloaded on hosts without RDMA devices)."""
    import subprocess
    import sys

    script = ("from pd_cluster.transfer.config import TransferConfig\n"
              "from pd_cluster.transfer.ucx_env import apply\n"
              "apply(TransferConfig())\n"
              "from nixl._api import nixl_agent, nixl_agent_config\n"
              "agent = nixl_agent('exit-check', nixl_agent_config(backends=['UCX']))\n"
              "print('agent', agent.get_agent_metadata() is not None)\n")
    env = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert "agent True" in out.stdout, out.stderr[-2000:]
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
