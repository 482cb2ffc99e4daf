"""Pass UCX settings through to the UCX library NIXL loads, and warn about the costly defaults.

UCX reads ``UCX_*`` environment variables when a context is created, so the
values must be in the environment before the first NIXL agent of the process
starts. `apply` exports the configured ones and returns what UCX will see.

The warning matters: with ``UCX_NET_DEVICES`` unset on a host with RDMA
NICs, UCX probes every device when the first endpoint is made, which other
systems saw cost 38 s on the first request (see ``docs/transfer.md``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from pd_cluster.transfer.config import TransferConfig

logger = logging.getLogger(__name__)

_SYS_IB = Path("/sys/class/infiniband")


def rdma_devices(sys_ib: Path = _SYS_IB) -> list[str]:
    """Names of the RDMA devices the kernel exposes (``mlx5_0``, ...); empty on hosts without any."""
    try:
        return sorted(p.name for p in sys_ib.iterdir())
    except OSError:
        return []


def apply(config: TransferConfig, environ: dict | None = None) -> dict[str, str | None]:
    """Export `config`'s UCX settings and return the effective ``UCX_TLS`` and ``UCX_NET_DEVICES``.

    A configured value overrides the environment's (logged when they differ);
    an unset one leaves the environment alone.

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
    if env.get("UCX_TLS") is not None and not env["UCX_TLS"].strip():
        raise ValueError("UCX_TLS is set but empty; unset it or name transports (e.g. rc,cuda_copy or shm,tcp)")
    effective = {"UCX_TLS": env.get("UCX_TLS"), "UCX_NET_DEVICES": env.get("UCX_NET_DEVICES")}
    devices = rdma_devices()
    if devices and not effective["UCX_NET_DEVICES"]:
        logger.warning("KV transfer: UCX_NET_DEVICES is unset but RDMA devices %s are present; UCX will probe "
                       "every device on the first connection (seen to cost ~38 s). Set --kv-transfer-ucx-net-devices "
                       "(e.g. %s:1) to the NIC(s) next to this worker's GPU.", devices, devices[0])
    logger.info("KV transfer: UCX_TLS=%s UCX_NET_DEVICES=%s", effective["UCX_TLS"] or "(UCX default)",
                effective["UCX_NET_DEVICES"] or "(UCX default)")
    return effective
