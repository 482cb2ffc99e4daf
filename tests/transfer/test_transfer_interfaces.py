"""The single-pool classes and the TP proxies both implement the transfer protocols the workers are typed with."""

from __future__ import annotations

import inspect

import pytest

from pd_cluster.transfer.agent import TransferAgent
from pd_cluster.transfer.interfaces import Agent, Receiver, Sender
from pd_cluster.transfer.receiver import KVReceiver
from pd_cluster.transfer.sender import KVSender
from pd_cluster.transfer.tp import TPAgent, TPReceiver, TPSender


def _members(proto) -> list[str]:
    return sorted(n for n in vars(proto) if not n.startswith("_") and n not in ("__annotations__",)) + \
        sorted(getattr(proto, "__annotations__", {}))


@pytest.mark.parametrize("proto,cls", [(Sender, KVSender), (Sender, TPSender), (Receiver, KVReceiver),
                                       (Receiver, TPReceiver), (Agent, TransferAgent), (Agent, TPAgent)])
def test_class_has_every_member_with_the_protocols_parameters(proto, cls):
    for name in _members(proto):
        want = inspect.getattr_static(proto, name, None)
        if name in getattr(proto, "__annotations__", {}):  # a data attribute, set in __init__
            src = inspect.getsource(cls.__init__)
            assert f"self.{name} =" in src, f"{cls.__name__} does not set {name}"
            continue
        got = inspect.getattr_static(cls, name, None)
        assert got is not None, f"{cls.__name__} lacks {name}"
        if isinstance(want, property):
            assert isinstance(got, property), f"{cls.__name__}.{name} must be a property"
            continue
        wp = list(inspect.signature(want).parameters)
        gp = list(inspect.signature(got).parameters)
        assert gp == wp, f"{cls.__name__}.{name}{gp} != protocol {wp}"


def test_only_a_single_pool_agent_connects_off_the_engine_thread():
    from types import SimpleNamespace

    assert TransferAgent.connects_off_thread.fget(None) is True
    for size, off in ((1, True), (2, False)):  # one rank in-process (LocalDriver); TP ranks take collectives
        agent = SimpleNamespace(driver=SimpleNamespace(tp=SimpleNamespace(size=size)))
        assert TPAgent.connects_off_thread.fget(agent) is off
