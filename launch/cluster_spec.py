"""What a local cluster starts (`ClusterSpec`), and what each child is given from it: its port, its auth flags and
the environment that carries the cluster's keys (keys never appear in a command line).

Used by the process launcher (`launch.cluster.LocalCluster`), the Ray one (`launch.ray_cluster`) and `pd-serve`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pd_cluster.launch.restarts import RestartBackoff

API_KEY_ENV = "PD_ROUTER_API_KEY"  # as pd_cluster.router.args reads them: keys never appear in a command line
ADMIN_API_KEY_ENV = "PD_ROUTER_ADMIN_API_KEY"
INTERNAL_API_KEY_ENV = "PD_INTERNAL_API_KEY"  # the cluster's internal key, read by pd-worker and pd-router


@dataclass
class ClusterSpec:
    """What to start.

    Attributes:
        num_prefill, num_decode: PD workers (ignored when `colocated`).
        colocated: start `num_workers` mixed workers instead.
        engine_argv: engine/transfer flags passed to every worker.
        role_argv: extra flags for the workers of one role (``{"prefill": [...]}``), after `engine_argv`.
        router_argv: extra router flags. The router gets no tokenizer: ``cache_aware`` routes on the workers' KV
            events through their text-to-page maps (``docs/router.md``); a ``--tokenizer-path`` here makes it
            tokenize prompts itself.
        api_key, admin_api_key: the router's keys (given to it through its environment); the launcher
            uses the admin key to register restarted workers.
        internal_api_key: the cluster's shared internal key, given to the router and every worker through
            their environment (`internal_key_env`); pd-serve generates one per cluster.
        restart: when to restart a process that exited (`tend`).
        kv_store_size: the memory of the KV store the cluster starts when the workers use a Mooncake store and
            name no master (`pd_cluster.launch.kv_store`).
        shutdown_grace_period_secs: how long `LocalCluster.stop` lets the router drain before it stops the
            workers (the router's ``--shutdown-grace-period-secs``; `router_grace_period` reads it from
            `router_argv`).
        role_ports: each role's worker ports, in order (``--prefill-ports`` ...); a role not named gets free
            ports below the kernel's ephemeral range (`common.net.free_port`).
        role_gpus, num_gpus, tp_size, mem_fraction_given: GPU placement (`pd_cluster.launch.placement`):
            each role's devices (``--prefill-gpus`` ...), the host's device count (0: none, no placement),
            each worker's TP size, and whether ``--mem-fraction-static`` was given.
        fork_workers: fork the workers from a zygote that imported their code once (`pd_cluster.launch.zygote`;
            the default) instead of starting a new interpreter for each (`docs/perf/worker-start.md`); the router
            and the KV store always start anew.
    """

    num_prefill: int = 1
    num_decode: int = 1
    colocated: bool = False
    num_workers: int = 0
    host: str = "127.0.0.1"
    router_port: int = 8000
    engine_argv: list[str] = field(default_factory=list)
    role_argv: dict[str, list[str]] = field(default_factory=dict)
    router_argv: list[str] = field(default_factory=list)
    log_level: str = "info"
    echo: bool = True
    api_key: str | None = None
    admin_api_key: str | None = None
    internal_api_key: str | None = field(default=None, repr=False)
    restart: RestartBackoff = field(default_factory=RestartBackoff)
    role_ports: dict[str, tuple[int, ...]] = field(default_factory=dict)
    role_gpus: dict[str, tuple[int, ...]] = field(default_factory=dict)
    num_gpus: int = 0
    tp_size: int = 1
    role_tp: dict[str, int] = field(default_factory=dict)  # a role's own --tp-size (pd-serve --prefill-arg=...)
    mem_fraction_given: bool = False
    shutdown_grace_period_secs: float = 180.0
    kv_store_size: str = "1GiB"
    fork_workers: bool = True


def worker_ports(workers: list[tuple[str, str]], role_ports: dict[str, tuple[int, ...]],
                 router_port: int) -> list[int | None]:
    """Each worker's port from `role_ports` (the role's list, in order; None: pick a free one).

    Raises:
        ValueError: a role's list does not have one port per worker of that role, a port is out of range, or a
            port is given twice or is the router's.
    """
    counts = {role: sum(1 for _, r in workers if r == role) for role in role_ports}
    for role, ports in role_ports.items():
        if len(ports) != counts[role]:
            raise ValueError(f"--{role}-ports: {len(ports)} port(s) for {counts[role]} {role} worker(s)")
        for port in ports:
            if not 0 < port < 65536:
                raise ValueError(f"--{role}-ports: {port} is not a TCP port")
    given = [p for ports in role_ports.values() for p in ports]
    if len(set(given)) != len(given) or router_port in given:
        raise ValueError("worker ports must differ from each other and from the router's --port")
    taken = {role: list(ports) for role, ports in role_ports.items()}
    return [taken[role].pop(0) if role in taken else None for _, role in workers]


def worker_auth_argv(spec: ClusterSpec) -> list[str]:
    """``["--internal-api-key-protects-v1"]`` when the router has an API key and the cluster an internal key: then
    a worker's ``/v1/*`` (and ``/tokenize``, ``/detokenize``) answer only the router (which sends the internal key)
    and clients holding that key, so the router's key cannot be bypassed by posting to a worker's port."""
    return ["--internal-api-key-protects-v1"] if spec.api_key and spec.internal_api_key else []


def internal_key_env(spec: ClusterSpec) -> dict[str, str]:
    """The environment that gives a child the cluster's internal key (never its command line)."""
    return {INTERNAL_API_KEY_ENV: spec.internal_api_key} if spec.internal_api_key else {}
