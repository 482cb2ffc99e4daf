"""Where the nodes of one instance meet: node 0's TCP store at ``--dist-init-addr`` (`torch.distributed.TCPStore`).

Before any rank joins the process group, node 0 (rank 0's process, `host_instance`) opens the store, publishes
its engine configuration and waits, for at most ``--dist-timeout`` seconds, for every other node to check in
(`join_instance`). It compares each node's configuration with its own and answers every node with one verdict:
``ok`` and rank 0's configuration (which the node's ranks then run, on the node's own devices), or the error that
fails start-up on every node alike, naming the flag that differs. A node whose rank 0 never answers fails with the
address it tried. The ranks then join the process group over the same store.

The store also carries rank 0's posts to the ranks of other nodes (`StoreOutbox` -> `StoreInbox`, one numbered
key per call): the side channel that local ranks get through a pipe (`pd_cluster.engine.executor.tp`).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import pickle
import time
from typing import Any

import torch.distributed as dist

from pd_cluster.engine.config import EngineConfig
from pd_cluster.engine.parallel.nodes import LOCAL_JOIN_TIMEOUT_S, NODES_JOIN_TIMEOUT_S, parse_dist_init_addr

logger = logging.getLogger(__name__)

PREFIX = "pd/instance/"
OK = "ok"
VERDICT_READ_S = 10.0  # how long node 0 waits, before it exits, for the nodes to read a refusal
_IGNORED = {"device", "parallel.node_rank"}  # each node's own: its devices and its place


class NodeJoinError(RuntimeError):
    """The nodes of an instance did not meet: one missing, unreachable or configured differently (the message names
    the flag and the address)."""


def join_timeout(config: EngineConfig) -> datetime.timedelta:
    """``--dist-timeout``, or its default: 120 s on one node, 600 s over several."""
    p = config.parallel
    default = NODES_JOIN_TIMEOUT_S if p.nnodes > 1 else LOCAL_JOIN_TIMEOUT_S
    return datetime.timedelta(seconds=p.dist_timeout or default)


def store_address(config: EngineConfig) -> tuple[str, int]:
    return parse_dist_init_addr(config.parallel.dist_init_addr)


def client_store(config: EngineConfig, timeout: datetime.timedelta | None = None) -> dist.TCPStore:
    """A connection to node 0's store.

    Raises:
        NodeJoinError: node 0's store could not be reached within the timeout (the address named).
    """
    host, port = store_address(config)
    timeout = timeout or join_timeout(config)
    try:
        return dist.TCPStore(host, port, None, False, timeout, wait_for_workers=False)
    except (RuntimeError, ValueError) as e:
        raise NodeJoinError(f"node {config.parallel.node_rank}: node 0 did not answer at --dist-init-addr "
                           f"{config.parallel.dist_init_addr} within {timeout.total_seconds():.0f} s "
                           f"(--dist-timeout): {e}") from e


def _flag_names() -> dict[str, str]:
    from pd_cluster.engine.args import ENGINE_FLAGS  # the flag table names the fields; imported late (it imports us)

    return {f.field: f.name for f in ENGINE_FLAGS} | {"role": "--role"}


def config_differences(mine: EngineConfig, theirs: EngineConfig) -> list[str]:
    """``--flag: node 0 X, this node Y`` for every engine field that differs, devices and node rank aside."""
    names = _flag_names()
    out = []
    for section in dataclasses.fields(mine):
        a, b = getattr(mine, section.name), getattr(theirs, section.name)
        pairs = ([(f"{section.name}.{f.name}", getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)]
                 if dataclasses.is_dataclass(a) else [(section.name, a, b)])
        for path, x, y in pairs:
            if path not in _IGNORED and section.name not in _IGNORED and x != y:
                out.append(f"{names.get(path, path)}: node 0 {x!r}, this node {y!r}")
    return out


def host_instance(config: EngineConfig) -> dist.TCPStore:
    """Node 0: open the store at ``--dist-init-addr``, wait for the other nodes and check them.

    Returns:
        The store (the process group of every rank is set up over it).

    Raises:
        NodeJoinError: a node did not join within ``--dist-timeout`` (naming the nodes, flags and address), or a
            node's configuration differs (naming the flag); every node gets the same message.
    """
    p = config.parallel
    timeout = join_timeout(config)
    host, port = store_address(config)
    try:
        store = dist.TCPStore(host, port, None, True, timeout, wait_for_workers=False)
    except RuntimeError as e:
        raise NodeJoinError(f"node 0 could not listen on --dist-init-addr {p.dist_init_addr}: {e}") from e
    store.set(PREFIX + "config", pickle.dumps(config))
    deadline = time.monotonic() + timeout.total_seconds()
    problems, missing = [], []
    for r in range(1, p.nnodes):
        key = f"{PREFIX}node/{r}"
        try:
            store.wait([key], datetime.timedelta(seconds=max(0.01, deadline - time.monotonic())))
        except (RuntimeError, dist.DistError):
            missing.append(r)
            continue
        theirs: EngineConfig = pickle.loads(store.get(key))
        if theirs.parallel.nnodes != p.nnodes:
            problems.append(f"node {r} was started with --nnodes {theirs.parallel.nnodes}, node 0 with --nnodes "
                            f"{p.nnodes}")
        else:
            problems += [f"node {r}: {d}" for d in config_differences(config, theirs)]
    if missing:
        problems.insert(0, f"node(s) {', '.join(map(str, missing))} of --nnodes {p.nnodes} did not join at "
                           f"--dist-init-addr {p.dist_init_addr} within {timeout.total_seconds():.0f} s "
                           f"(--dist-timeout): start them with the same flags and --node-rank 1 .. {p.nnodes - 1}")
    verdict = OK if not problems else "; ".join(problems)
    store.set(PREFIX + "verdict", verdict)
    if problems:  # the store dies with this process: let the nodes that joined read why first
        _wait_read(store, p.nnodes - 1 - len(missing), VERDICT_READ_S)
    if missing:
        raise NodeJoinError(verdict)
    if problems:
        raise NodeJoinError(f"the nodes of this instance disagree: {verdict}")
    logger.info("all %d nodes joined at %s", p.nnodes, p.dist_init_addr)
    return store


def _wait_read(store: dist.TCPStore, nodes: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while store.add(PREFIX + "read", 0) < nodes and time.monotonic() < deadline:
        time.sleep(0.05)


def join_instance(config: EngineConfig) -> tuple[dist.TCPStore, EngineConfig]:
    """Node r > 0: check in at node 0's store and wait for its verdict.

    Returns:
        The store and the configuration this node's ranks run: rank 0's, with this node's devices.

    Raises:
        NodeJoinError: node 0 unreachable or silent within ``--dist-timeout`` (the address named), its verdict (a
            configuration that differs, a node missing), or a node rank already taken.
    """
    p = config.parallel
    timeout = join_timeout(config)
    store = client_store(config, timeout)
    if store.add(f"{PREFIX}claim/{p.node_rank}", 1) > 1:
        raise NodeJoinError(f"--node-rank {p.node_rank} is taken: another node joined "
                         f"--dist-init-addr {p.dist_init_addr} with it")
    store.set(f"{PREFIX}node/{p.node_rank}", pickle.dumps(config))
    try:
        # node 0 answers after its own wait of --dist-timeout at most: give it that long and a margin
        store.wait([PREFIX + "verdict"], timeout + datetime.timedelta(seconds=30))
    except (RuntimeError, dist.DistError) as e:
        raise NodeJoinError(f"node {p.node_rank}: no answer from node 0 at --dist-init-addr {p.dist_init_addr}: "
                           f"{e}") from e
    try:
        verdict = store.get(PREFIX + "verdict").decode()
        rank0: EngineConfig = pickle.loads(store.get(PREFIX + "config"))
        store.add(PREFIX + "read", 1)
    except (RuntimeError, dist.DistError) as e:
        raise NodeJoinError(f"node {p.node_rank}: node 0 at --dist-init-addr {p.dist_init_addr} went away during "
                            f"start-up: {e}") from e
    if verdict != OK:
        raise NodeJoinError(f"node 0 refused this instance: {verdict}")
    if rank0.parallel.nnodes != p.nnodes:  # a node rank node 0 never waited for
        raise NodeJoinError(f"this node was started with --nnodes {p.nnodes}, node 0 with --nnodes "
                         f"{rank0.parallel.nnodes}")
    return store, dataclasses.replace(rank0, device=config.device,
                                      parallel=dataclasses.replace(rank0.parallel, node_rank=p.node_rank))


class StoreOutbox:
    """Rank 0's side channel to one rank of another node: each `send` is one numbered key of the store.

    Args:
        config: the instance's configuration (the store's address).
        rank: the global rank it writes to.
    """

    def __init__(self, config: EngineConfig, rank: int) -> None:
        self._store = client_store(config)
        self._key = f"{PREFIX}side/{rank}/"
        self._seq = 0

    def send(self, item: Any) -> None:
        self._store.set(self._key + str(self._seq), pickle.dumps(item))
        self._seq += 1

    def close(self) -> None:
        self._store = None


class StoreInbox:
    """A rank's end of `StoreOutbox`: `recv` waits for the next key; EOFError once the store is gone (rank 0
    exited)."""

    def __init__(self, config: EngineConfig, rank: int) -> None:
        self._store = client_store(config)
        self._key = f"{PREFIX}side/{rank}/"
        self._seq = 0

    def recv(self) -> Any:
        key = self._key + str(self._seq)
        while True:
            try:
                self._store.wait([key], datetime.timedelta(seconds=60))
                data = self._store.get(key)
                break
            except dist.DistStoreError as e:
                if "timeout" in str(e).lower():
                    continue
                raise EOFError(str(e)) from e
            except RuntimeError as e:  # connection reset: rank 0 and its store are gone
                raise EOFError(str(e)) from e
        self._store.delete_key(key)
        self._seq += 1
        return pickle.loads(data)
