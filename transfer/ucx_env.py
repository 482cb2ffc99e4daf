"""Pass UCX settings through to the UCX library NIXL loads, and warn about the costly defaults.

UCX reads ``UCX_*`` environment variables when a context is created, so the
values must be in the environment before the first NIXL agent of the process
starts. `apply` exports the configured ones and returns what UCX will see.

`bind_to_host` keeps UCX's TCP listeners (one per network device, opened by
every agent) on the worker's own address: UCX's TCP transport listens on
each device named in ``UCX_NET_DEVICES`` (all of them when unset), so a
worker started with ``--host 127.0.0.1`` would otherwise accept KV transfer
connections on the machine's external interface.

The warning matters: with ``UCX_NET_DEVICES`` unset on a host with RDMA
NICs, UCX probes every device when the first endpoint is made, which other
systems saw cost 38 s on the first request (see ``docs/transfer.md``).

On a host without RDMA devices `apply` also leaves UCX's InfiniBand module
unloaded (``UCX_MODULES=^ib``, unless ``UCX_MODULES`` is set): it has nothing
to drive there, and the netlink library it loads (``libnl-route``, bundled in
NIXL's wheels 1.5.x) crashes in its unload hook, so every process that had
started an agent ended with SIGSEGV (exit code 139) after a clean shutdown.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from pathlib import Path

from pd_cluster.transfer.config import TransferConfig

logger = logging.getLogger(__name__)

_SYS_IB = Path("/sys/class/infiniband")
NO_RDMA_MODULES = "^ib"  # UCX_MODULES on hosts without RDMA devices: every module but InfiniBand's


def rdma_devices(sys_ib: Path = _SYS_IB) -> list[str]:
    """Names of the RDMA devices the kernel exposes (``mlx5_0``, ...); empty on hosts without any."""
    try:
        return sorted(p.name for p in sys_ib.iterdir())
    except OSError:
        return []


def apply(config: TransferConfig, environ: dict | None = None,
          sys_ib: Path | None = None) -> dict[str, str | None]:
    """Export `config`'s UCX settings and return the effective ``UCX_TLS`` and ``UCX_NET_DEVICES``.

    A configured value overrides the environment's (logged when they differ);
    an unset one leaves the environment alone. Without RDMA devices (under
    `sys_ib`, default ``/sys/class/infiniband``) ``UCX_MODULES=^ib`` is
    exported unless ``UCX_MODULES`` is set (module doc).

    Raises:
        ValueError: the environment holds an empty ``UCX_TLS`` (UCX then fails to start).
    """
    env = os.environ if environ is None else environ
    for key, value in (("UCX_TLS", config.ucx_tls), ("UCX_NET_DEVICES", config.ucx_net_devices)):
        if value is None:
            continue
        old = env.get(key)
        if old is not None and old != value:
            logger.info("KV transfer: %s=%s from the flags overrides %s=%s from the environment", key, value, key, old)
        env[key] = value
    devices = rdma_devices() if sys_ib is None else rdma_devices(sys_ib)
    if not devices and env.get("UCX_MODULES") is None:
        env["UCX_MODULES"] = NO_RDMA_MODULES  # module doc: nothing for the ib module to drive; its unload crashes
    if env.get("UCX_TLS") is not None and not env["UCX_TLS"].strip():
        raise ValueError("UCX_TLS is set but empty; unset it or name transports (e.g. rc,cuda_copy or shm,tcp)")
    effective = {"UCX_TLS": env.get("UCX_TLS"), "UCX_NET_DEVICES": env.get("UCX_NET_DEVICES")}
    if devices and not effective["UCX_NET_DEVICES"]:
        logger.warning("KV transfer: UCX_NET_DEVICES is unset but RDMA devices %s are present; UCX will probe "
                       "every device on the first connection (seen to cost ~38 s). Set --kv-transfer-ucx-net-devices "
                       "(e.g. %s:1) to the NIC(s) next to this worker's GPU.", devices, devices[0])
    logger.info("KV transfer: UCX_TLS=%s UCX_NET_DEVICES=%s", effective["UCX_TLS"] or "(UCX default)",
                effective["UCX_NET_DEVICES"] or "(UCX default)")
    return effective


WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


def _ips(host: str) -> set[str]:
    """The IP addresses `host` (a literal or a name) stands for; empty when it does not resolve."""
    host = host.strip("[]")
    try:
        return {str(ipaddress.ip_address(host))}
    except ValueError:
        pass
    try:
        return {str(ipaddress.ip_address(info[4][0].split("%")[0])) for info in socket.getaddrinfo(host, None)}
    except (OSError, ValueError):
        return set()


def interfaces_of(host: str) -> list[str]:
    """Names of the network interfaces holding an address of `host` (``["lo"]`` for ``127.0.0.1``)."""
    import psutil

    ips = _ips(host)
    loopback = any(ipaddress.ip_address(ip).is_loopback for ip in ips)  # 127.0.1.1 is on lo's 127.0.0.0/8
    out = []
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            address = a.address.split("%")[0]
            if address in ips or (loopback and ipaddress.ip_address(address).is_loopback):
                out.append(name)
                break
    return sorted(out)


def rdma_ports(sys_ib: Path = _SYS_IB) -> list[str]:
    """UCX names (``mlx5_0:1``) of every port of every RDMA device; empty on hosts without any."""
    out = []
    for dev in rdma_devices(sys_ib):
        try:
            out += [f"{dev}:{p.name}" for p in sorted((sys_ib / dev / "ports").iterdir())]
        except OSError:
            out.append(f"{dev}:1")
    return out


def bind_to_host(host: str, config: TransferConfig, environ: dict | None = None,
                 sys_ib: Path = _SYS_IB) -> str | None:
    """Restrict UCX's network devices to the interface of `host`, the worker's listening address.

    Exports ``UCX_NET_DEVICES=<interface>[,<RDMA ports>]`` (RDMA ports kept: they open no TCP listener)
    before any NIXL agent of the process starts, and returns it. Leaves everything alone, returning None,
    when the operator chose the devices (``--kv-transfer-ucx-net-devices`` or ``UCX_NET_DEVICES``) or
    `host` is a wildcard (``0.0.0.0``, ``::``: the operator asked for every interface); logs a warning when
    no interface holds `host`'s address.
    """
    env = os.environ if environ is None else environ
    if config.ucx_net_devices or env.get("UCX_NET_DEVICES"):
        logger.info("KV transfer: UCX_NET_DEVICES=%s chosen by the operator; UCX listens on those devices",
                    config.ucx_net_devices or env.get("UCX_NET_DEVICES"))
        return None
    if host in WILDCARD_HOSTS:
        logger.info("KV transfer: --host %s: UCX listens on every network interface", host or "(empty)")
        return None
    names = interfaces_of(host)
    if not names:
        logger.warning("KV transfer: no network interface holds %s; UCX listens on every interface (set "
                       "--kv-transfer-ucx-net-devices to restrict it)", host)
        return None
    ports = rdma_ports(sys_ib)
    value = ",".join(names + ports)
    env["UCX_NET_DEVICES"] = value
    if ports:
        logger.warning("KV transfer: UCX may use every RDMA port %s and probes each on the first connection (seen "
                       "to cost ~38 s); set --kv-transfer-ucx-net-devices to %s plus the NIC(s) next to this "
                       "worker's GPU", ports, ",".join(names))
    logger.info("KV transfer: UCX_NET_DEVICES=%s: the transfer listeners bind %s's interface only", value, host)
    return value
