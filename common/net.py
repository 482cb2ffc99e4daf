"""Picking TCP ports for servers started by this process (local clusters, TP rendezvous, tests)."""

from __future__ import annotations

import random
import socket

_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_LOWEST = 10000

DEFAULT_DIST_INIT_PORT = 20000
"""The multi-node rendezvous port taken with ``LWS_LEADER_ADDRESS`` (SGLang's LWS examples' port;
`pd_cluster.engine.parallel.nodes`). `free_port` never hands it out: a multi-node worker on this host may bind it
without a flag."""


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range ``(low, high)``, inclusive (Linux default 32768-60999)."""
    try:
        with open(_RANGE_FILE) as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1", attempts: int = 200) -> int:
    """A TCP port that is free on ``host`` now, for a server that another process binds later.

    The port is drawn at random below the kernel's ephemeral range. A port handed out by
    ``bind(0)`` is itself ephemeral, so between picking it and the server binding it, any
    socket bound to port 0 (UCX opens several TCP listeners per NIXL agent; every outgoing
    connection takes one too) may take it, and the server then fails with "address already in
    use". Ports below the range are never given out that way. Never `DEFAULT_DIST_INIT_PORT`. Falls back to
    ``bind(0)`` when no port in ``[10000, low)`` is free after ``attempts`` tries.
    """
    low, _ = ephemeral_range()
    if low - _LOWEST > attempts:
        for _ in range(attempts):
            port = random.randrange(_LOWEST, low)
            if port != DEFAULT_DIST_INIT_PORT and _bindable(host, port):
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def port_taken(host: str, port: int) -> str | None:
    """Why a server could not listen on ``host:port`` now (the `OSError`'s text, e.g. "Address already in use"),
    or None when it could.

    Binds as servers do (``SO_REUSEADDR``, so a port whose old connections linger in TIME_WAIT counts as free),
    and only binds: nothing is left listening.
    """
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return None
