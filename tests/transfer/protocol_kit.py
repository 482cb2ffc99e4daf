"""The shared set-up of the KV transfer protocol tests: two real NIXL agents (a prefill and a decode side) over
small pools in one process, and a clock the test moves."""

from __future__ import annotations

import time

import pytest
import torch
from prometheus_client import CollectorRegistry

from pd_cluster.engine.kv.pool import KVLayout, KVPool
from pd_cluster.transfer import protocol
from pd_cluster.transfer.agent import TransferAgent
from pd_cluster.transfer.config import TransferConfig
from pd_cluster.transfer.metrics import TransferMetrics
from pd_cluster.transfer.receiver import KVReceiver
from pd_cluster.transfer.sender import KVSender

T = 2.0
LAYOUT = KVLayout(5, 4, 8, 16, "fp8_e4m3", (0.5,) * 5, (0.25,) * 5)


class Clock:
    """Monotonic seconds that move only when a test sets `t`."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Side:
    """One worker's pool, NIXL agent and sender (prefill) or receiver (decode), with its own metrics."""

    def __init__(self, role: str, clock: Clock, cfg: TransferConfig) -> None:
        self.pool = KVPool(LAYOUT, 32, "cpu", torch.float32)
        self.registry = CollectorRegistry()
        self.agent = TransferAgent(self.pool, "model-x", role, cfg)
        m = TransferMetrics(self.registry)
        self.sender = KVSender(self.agent, m, clock) if role == "prefill" else None
        self.receiver = KVReceiver(self.agent, m, clock) if role != "prefill" else None

    def metric(self, name: str, labels: dict | None = None) -> float:
        return self.registry.get_sample_value(name, labels or {}) or 0.0


@pytest.fixture(scope="module")
def sides():
    """(clock, prefill side, decode side), connected both ways; a module's tests share them."""
    clock = Clock()
    cfg = TransferConfig(kv_transfer_timeout=T, heartbeat_interval=0.5)
    p, d = Side("prefill", clock, cfg), Side("decode", clock, cfg)
    p.agent.connect(d.agent.info)
    d.agent.connect(p.agent.info)
    yield clock, p, d
    p.agent.close()
    d.agent.close()


def drain(side: Side, n: int = 50, *others: Side):
    """Poll until something happens (bounded: `n` polls, 1 ms apart, so UCX's own threads get the CPU on a loaded
    host). Like workers' loops, the other sides progress too (a first message to a peer needs both sides'
    progress to set up the connection)."""
    for i in range(n):
        for other in others:
            other.agent.take()  # progress only; its messages stay for its own poll
        ev = side.receiver.poll() if side.receiver else side.sender.poll()
        if ev.completed or ev.failed or getattr(ev, "released", None):
            return ev
        if i < n - 1:
            time.sleep(0.001)
    return ev


def until_completed(p: Side, d: Side, n: int = 200, allow_failures: bool = False, timeout: float = 10.0):
    """Poll both sides until decode's receiver completes a transfer; returns that `RecvDone`, or None after `n`
    polls and `timeout` seconds of real time (a loaded host may take longer than `n` tight polls to move it)."""
    deadline = time.monotonic() + timeout
    i = 0
    while i < n or time.monotonic() < deadline:
        p.sender.poll()
        ev = d.receiver.poll()
        assert allow_failures or not ev.failed, ev.failed
        if ev.completed:
            return ev.completed[0]
        i += 1
        if i >= n:
            time.sleep(0.001)
    return None


def polls(n: int, timeout: float = 10.0):
    """Count the polls of a loop that waits for something to happen (``for _ in polls(100): ... break``): `n` tight
    ones, then more 1 ms apart until `timeout` seconds of real time have passed, since a loaded host may take
    longer than `n` tight polls to move a UCX message. Only for waits that end in a `break`: a loop that checks
    that nothing happens keeps its fixed ``range``."""
    deadline = time.monotonic() + timeout
    i = 0
    while i < n or time.monotonic() < deadline:
        yield i
        if i >= n - 1:
            time.sleep(0.001)
        i += 1


def push_msg(tid, index, start, n, total=0):
    """A `protocol.Push` of `n` pages of `LAYOUT`; the last one (`total` set) carries a first token."""
    return protocol.Push(tid, index, start, n, n * LAYOUT.page_nbytes, total, {"first_token_id": 7} if total else None)
