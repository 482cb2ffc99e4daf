"""One instance over several nodes: SGLang's ``--nnodes``, ``--node-rank`` and ``--dist-init-addr``.

An instance of ``W`` ranks (``--tp-size``) on ``N`` nodes runs ``W / N`` ranks a node: node ``r`` holds the global
ranks ``r * W/N .. (r+1) * W/N - 1`` and places each on its local rank's device (``cuda:<local rank>``). Node 0 runs
rank 0 (the engine: scheduler, HTTP server, KV transfer driver); the other nodes run only their ranks, which join
the process group at ``--dist-init-addr`` (node 0's address) and obey rank 0's commands.

On Kubernetes a LeaderWorkerSet (LWS) gives every pod of a group ``LWS_LEADER_ADDRESS``, ``LWS_GROUP_SIZE`` and
``LWS_WORKER_INDEX``; a worker started without the node flags takes them from there (`lws_node_args`): the node
count, this pod's node rank, and the leader's address at `DEFAULT_DIST_INIT_PORT`. A flag given on the command line
wins over the environment, flag by flag.

`check_dp` refuses the DP attention settings that are not built, beside `check_nodes` (both run on the flags, before
any rank starts).

This module holds the pure checks; the rendezvous is `pd_cluster.engine.parallel.rendezvous`.
"""

from __future__ import annotations

from collections.abc import Mapping

from pd_cluster.common.net import DEFAULT_DIST_INIT_PORT  # noqa: F401 (the rendezvous port with LWS_LEADER_ADDRESS)
LWS_ENV = ("LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX")
LOCAL_JOIN_TIMEOUT_S = 120   # ranks spawned on this host must have started by then
NODES_JOIN_TIMEOUT_S = 600   # other nodes (pods that may still pull an image) must have joined by then


def parse_dist_init_addr(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for an IPv6 literal) as (host, port).

    Raises:
        ValueError: not HOST:PORT, naming ``--dist-init-addr``.
    """
    host, sep, port = str(text).rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--dist-init-addr {text!r} is not HOST:PORT (node 0's address and a free port, e.g. "
                         f"10.0.0.1:{DEFAULT_DIST_INIT_PORT})")
    return host, int(port)


def check_nodes(world_size: int, nnodes: int, node_rank: int, dist_init_addr: str | None,
                dp_attention: bool = False, context_parallel: int = 1) -> None:
    """Refuse node settings that cannot run (SGLang's flags and meaning).

    Args:
        world_size: the instance's ranks (``--tp-size`` times ``--prefill-context-parallel-size``).

    Raises:
        ValueError: naming the flag.
    """
    if nnodes < 1:
        raise ValueError(f"--nnodes must be >= 1, got {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank {node_rank} must be below --nnodes {nnodes} (nodes are numbered 0 .. "
                         f"{nnodes - 1})")
    if nnodes == 1:
        return
    if not dist_init_addr:
        raise ValueError(f"--nnodes {nnodes} needs --dist-init-addr HOST:PORT (node 0's address, the same on every "
                         f"node)")
    parse_dist_init_addr(dist_init_addr)
    if world_size % nnodes:
        raise ValueError(f"--tp-size {world_size} is not divisible by --nnodes {nnodes}: every node runs "
                         f"--tp-size / --nnodes ranks")
    if dp_attention:
        raise ValueError(f"--enable-dp-attention with --nnodes {nnodes} is not built (DP attention runs on one node)")
    if context_parallel > 1:
        raise ValueError(f"--prefill-context-parallel-size with --nnodes {nnodes} is not built")


def check_node_gpus(world_size: int, nnodes: int, gpus: int, first_gpu: int = 0) -> None:
    """Refuse more ranks on this node than its GPUs from `first_gpu` on (``--device cuda:N``).

    Raises:
        ValueError: naming ``--tp-size`` and ``--nnodes``.
    """
    per_node = world_size // nnodes
    have = gpus - first_gpu
    if per_node <= have:
        return
    if nnodes == 1:
        raise ValueError(f"--tp-size {world_size} needs {world_size} GPUs on this node but it has {have}"
                         f"{f' from cuda:{first_gpu} on' if first_gpu else ''}: span nodes with --nnodes N "
                         f"--node-rank R --dist-init-addr HOST:PORT, or lower --tp-size")
    raise ValueError(f"--tp-size {world_size} over --nnodes {nnodes} is {per_node} ranks a node, more than this "
                     f"node's {have} GPUs: raise --nnodes")


def node_ranks(world_size: int, nnodes: int, node_rank: int) -> range:
    """The global ranks node `node_rank` runs."""
    per_node = world_size // nnodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)


def lws_node_args(environ: Mapping[str, str], nnodes: int | None, node_rank: int | None,
                  dist_init_addr: str | None) -> tuple[int | None, int | None, str | None]:
    """The node flags, each taken from the LWS environment when it was not given (an explicit flag wins).

    Without ``LWS_GROUP_SIZE`` (not an LWS pod) or with a group of one pod, the flags are returned as given.

    Raises:
        ValueError: an LWS variable that is not a number, naming it.
    """
    if not all(environ.get(k) for k in LWS_ENV):
        return nnodes, node_rank, dist_init_addr
    try:
        size, index = int(environ["LWS_GROUP_SIZE"]), int(environ["LWS_WORKER_INDEX"])
    except ValueError as e:
        raise ValueError(f"LWS_GROUP_SIZE / LWS_WORKER_INDEX must be numbers: {e}") from e
    if size <= 1:
        return nnodes, node_rank, dist_init_addr
    leader = environ["LWS_LEADER_ADDRESS"]
    return (size if nnodes is None else nnodes, index if node_rank is None else node_rank,
            f"{leader}:{DEFAULT_DIST_INIT_PORT}" if dist_init_addr is None else dist_init_addr)


def check_dp(tp_size: int, dp_size: int, enable_dp_attention: bool) -> None:
    """Refuse the DP attention settings that are not built (SGLang's flags and meaning).

    Raises:
        ValueError: naming the flag.
    """
    if dp_size < 1:
        raise ValueError(f"--dp-size must be >= 1, got {dp_size}")
    if enable_dp_attention and dp_size == 1:
        raise ValueError("--enable-dp-attention needs --dp-size > 1 (the number of data-parallel attention ranks)")
    if dp_size > 1 and not enable_dp_attention:
        raise ValueError(f"--dp-size {dp_size} without --enable-dp-attention (data-parallel replicas of the whole "
                         "engine in one worker) is not built: start one worker per replica behind the router, or "
                         "add --enable-dp-attention")
    if tp_size % dp_size:
        raise ValueError(f"--dp-size {dp_size} must divide --tp-size {tp_size} (each DP rank's attention runs on "
                         f"--tp-size / --dp-size ranks)")
    if dp_size > 1 and tp_size != dp_size:
        raise ValueError(f"--tp-size {tp_size} with --dp-size {dp_size}: tensor-parallel attention inside a DP rank "
                         f"(--tp-size / --dp-size = {tp_size // dp_size}) is not built; use --tp-size {dp_size}")
