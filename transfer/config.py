"""Configuration of the KV transfer agent, with its command-line flags.

All deadlines derive from one number, ``--kv-transfer-timeout`` (seconds,
default 30): see ``docs/transfer.md`` for the reasoning. In short, decode fails
a transfer when neither a push nor a heartbeat arrived for that long; the
sender stops posting after half of it without progress or heartbeat and
cancels any single push older than a quarter of it, so by the time decode
gives up a live sender has already stopped. Heartbeats come from a thread of
their own while the step loop is alive (it polled within
``--kv-transfer-step-timeout``), so a long chunk is not a silence.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pd_cluster.common.flags import Flag, add_flags, flag_values

BACKENDS = ("UCX",)


@dataclass(frozen=True)
class TransferConfig:
    """How one worker's transfer agent behaves.

    Attributes:
        kv_transfer_timeout: decode's deadline in seconds: a transfer fails when no
            push of it arrived for this long (counted from the page reservation,
            then from each push). Also bounds the sender (see the properties).
        heartbeat_interval: seconds between liveness probes (a tiny NIXL
            notification) to each peer with a transfer in progress; a dead peer
            is detected within about this long. The sender's heartbeats
            (`protocol.Alive`) go at most this far apart, and at most a quarter
            of `kv_transfer_timeout` (`heartbeat_period`).
        step_timeout: seconds one engine step may run while the sender's
            heartbeats keep its transfers alive: a step loop that has not
            polled for longer is taken as hung, its heartbeats stop, and decode's
            deadline ends its transfers. SGLang's ``--watchdog-timeout`` has the
            same default for one forward batch. On decode, also the longest a
            ticket waits for a live prefill worker to take it (`KVReceiver`).
        abort_quarantine: seconds decode keeps the pages of an aborted or timed-out
            transfer out of use when the sender neither confirms it stopped nor is
            known dead; None means `kv_transfer_timeout`.
        backend: the NIXL backend (``UCX``).
        ucx_tls: if set, exported as ``UCX_TLS`` before the agent starts (else the
            environment's value, else UCX's default, is used).
        ucx_net_devices: if set, exported as ``UCX_NET_DEVICES`` likewise.
        enable_progress_thread: run NIXL's UCX progress thread. Off by default: it
            spins, costing about half a CPU core per agent even when idle (measured
            here), and the step loop's `poll` already progresses the transfers.
            Turn it on for TCP-only transports across hosts, where the target's
            progress moves the data.
        num_threads: UCX backend worker threads (0: NIXL's default).
        metadata_timeout: seconds for one HTTP fetch of a peer's metadata.
        hugepages: back a host-memory pool with transparent huge pages before
            registering it (`pd_cluster.transfer.hugepages`); no effect on GPU pools.
    """

    kv_transfer_timeout: float = 30.0
    heartbeat_interval: float = 1.0
    step_timeout: float = 300.0
    abort_quarantine: float | None = None
    backend: str = "UCX"
    ucx_tls: str | None = None
    ucx_net_devices: str | None = None
    enable_progress_thread: bool = False
    num_threads: int = 0
    metadata_timeout: float = 5.0
    hugepages: bool = True

    def __post_init__(self) -> None:
        if self.kv_transfer_timeout <= 0:
            raise ValueError(f"kv_transfer_timeout must be > 0 seconds, got {self.kv_transfer_timeout}")
        if not 0 < self.heartbeat_interval <= self.kv_transfer_timeout:
            raise ValueError(f"heartbeat_interval must be in (0, kv_transfer_timeout], got {self.heartbeat_interval}")
        if not self.step_timeout > 0:
            raise ValueError(f"step_timeout must be > 0 seconds, got {self.step_timeout}")
        if self.abort_quarantine is not None and self.abort_quarantine < 0:
            raise ValueError(f"abort_quarantine must be >= 0, got {self.abort_quarantine}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        for name in ("ucx_tls", "ucx_net_devices"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                # An empty UCX_TLS makes UCX fail to start (NIXL_ERR_BACKEND); refuse it here, by name.
                raise ValueError(f"{name} must be unset or non-empty, got {value!r}")
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0, got {self.num_threads}")
        if self.metadata_timeout <= 0:
            raise ValueError(f"metadata_timeout must be > 0, got {self.metadata_timeout}")

    @property
    def push_timeout(self) -> float:
        """Seconds after which the sender cancels one posted push that has not completed."""
        return self.kv_transfer_timeout / 4

    @property
    def sender_idle_timeout(self) -> float:
        """Seconds without progress or heartbeat after which the sender stops a transfer and posts nothing more."""
        return self.kv_transfer_timeout / 2

    @property
    def heartbeat_period(self) -> float:
        """Seconds between the sender's heartbeats: `heartbeat_interval`, at most a quarter of the timeout."""
        return min(self.heartbeat_interval, self.kv_transfer_timeout / 4)

    @property
    def quarantine(self) -> float:
        """Seconds decode holds unconfirmed aborted pages (see `abort_quarantine`)."""
        return self.kv_transfer_timeout if self.abort_quarantine is None else self.abort_quarantine


TRANSFER_FLAGS: tuple[Flag, ...] = (
    Flag("--kv-transfer-timeout", "kv_transfer_timeout", float,
         "decode: seconds without a KV push or heartbeat from prefill before a transfer fails (504); "
         "default %(default)s"),
    Flag("--kv-transfer-heartbeat-interval", "heartbeat_interval", float,
         "seconds between liveness probes and heartbeats to peers with transfers in flight; default %(default)s"),
    Flag("--kv-transfer-step-timeout", "step_timeout", float,
         "prefill: seconds one engine step may compute while heartbeats keep its KV transfers alive; a step "
         "loop silent longer is taken as hung; default %(default)s"),
    Flag("--kv-transfer-abort-quarantine", "abort_quarantine", float,
         "seconds decode keeps unconfirmed aborted pages unused; default: --kv-transfer-timeout"),
    Flag("--kv-transfer-backend", "backend", str, "the NIXL backend", choices=BACKENDS),
    Flag("--kv-transfer-ucx-tls", "ucx_tls", str,
         "exported as UCX_TLS before NIXL starts (e.g. rc,cuda_copy,cuda_ipc on RDMA clusters)"),
    Flag("--kv-transfer-ucx-net-devices", "ucx_net_devices", str,
         "exported as UCX_NET_DEVICES (e.g. mlx5_0:1); set it on RDMA clusters"),
    Flag("--kv-transfer-progress-thread", "enable_progress_thread", None,
         "run NIXL's UCX progress thread (default off: it spins a CPU core; poll() progresses)",
         action=argparse.BooleanOptionalAction),
    Flag("--kv-transfer-num-threads", "num_threads", int, "UCX backend worker threads (0: NIXL's default)"),
    Flag("--kv-transfer-hugepages", "hugepages", None,
         "back a host-memory KV pool with transparent huge pages before registering it (default on)",
         action=argparse.BooleanOptionalAction),
)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add the transfer flags (``--kv-transfer-*``) to a worker's parser; defaults are `TransferConfig`'s."""
    add_flags(parser.add_argument_group("KV transfer (NIXL)"), TRANSFER_FLAGS, TransferConfig())


def from_cli_args(args: argparse.Namespace) -> TransferConfig:
    """Build a `TransferConfig` from the flags of `add_cli_args` (the heartbeat is capped by the timeout)."""
    values = flag_values(args, TRANSFER_FLAGS, skip_none=False)
    values["heartbeat_interval"] = min(values["heartbeat_interval"], values["kv_transfer_timeout"])
    return TransferConfig(**values)
