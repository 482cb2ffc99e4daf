"""Ports for servers that another process binds later stay out of the kernel's ephemeral range."""

from __future__ import annotations

import socket

from pd_cluster.common.net import DEFAULT_DIST_INIT_PORT, ephemeral_range, free_port, port_taken


def test_free_ports_are_below_the_ephemeral_range_and_bindable():
    low, high = ephemeral_range()
    assert 1024 <= low <= high <= 65535
    ports = {free_port() for _ in range(50)}
    assert len(ports) > 40  # drawn at random
    for port in ports:
        assert 10000 <= port < low
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))


def test_a_port_taken_by_a_listener_is_skipped(monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", free_port()))
    taken.listen()
    free = free_port()
    draws = iter([taken.getsockname()[1], taken.getsockname()[1], free])
    monkeypatch.setattr("pd_cluster.common.net.random.randrange", lambda lo, hi: next(draws))
    try:
        assert free_port() == free
    finally:
        taken.close()


def test_the_multi_node_rendezvous_port_is_never_handed_out(monkeypatch):
    """A multi-node worker started with LWS's environment binds port 20000 without a flag: a server given that
    port by `free_port` (two test processes side by side, one starting a multi-node decode) would take it."""
    free = free_port()
    draws = iter([DEFAULT_DIST_INIT_PORT, free])
    monkeypatch.setattr("pd_cluster.common.net.random.randrange", lambda lo, hi: next(draws))
    assert free_port() == free


def test_port_taken_names_a_listener_and_not_a_closed_port():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        port = taken.getsockname()[1]
        assert "in use" in port_taken("127.0.0.1", port)
    assert port_taken("127.0.0.1", port) is None  # closed: free again, and the check left nothing listening
    assert port_taken("127.0.0.1", port) is None
