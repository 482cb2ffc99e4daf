"""The ranks of a tensor-parallel engine: processes 1..N-1, and rank 0's driver that commands them.

Rank 0 (the engine's own process) schedules; for each step it broadcasts a
command and every rank, rank 0 included, runs it on its own shard: the
collectives inside the model then line up.

Every command starts with an int64 header of `HEADER_LEN` elements over the
gloo group. A forward step is a packed step (`pd_cluster.engine.packed_step`):
the header says so and gives the sizes, the payload (token ids, positions,
logits rows, block-table rows and appends) follows as one int64 tensor; no
Python object is pickled. Any other command (capture, install, ext, ping,
stop) has a `COMMAND_MAGIC` header followed by a pickled ``(name, args,
gather)``, run as the method of the same name of `RankServer`. Commands carry
host data only, so each rank builds its tensors on its own device.

Besides the step loop's commands, rank 0 can post a call to the other ranks
from any thread (`TPDriver.post`): a pipe per rank, read by a thread of that
rank, which runs an installed extension's method declared safe from any thread
(the extension's ``SIDE_METHODS``). Nothing waits for it and nothing comes
back. It exists for what must reach the ranks while the step loop is busy, e.g.
a KV transfer ticket that arrives during a long prefill chunk and needs the
ranks' heartbeats to name it (`pd_cluster.transfer.tp.TPSender.announce`).

An instance over several nodes (``--nnodes``): rank 0's driver spawns only its own node's ranks; the other nodes'
processes run theirs (`pd_cluster.engine.executor.node`), which meet it at ``--dist-init-addr``
(`pd_cluster.engine.parallel.rendezvous`), serve the same command loop, and take rank 0's posts from the store.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import queue
import threading
from importlib import import_module
from typing import Any

import numpy as np
import torch

from pd_cluster.engine.config import EngineConfig
from pd_cluster.common.net import free_port
from pd_cluster.engine.parallel.group import TPGroup, init_tp_group
from pd_cluster.engine.parallel.nodes import check_node_gpus, node_ranks
from pd_cluster.engine.parallel.rendezvous import StoreInbox, StoreOutbox, client_store, host_instance
from pd_cluster.engine.executor.rank_procs import rank_process
from pd_cluster.engine.executor.shard import Shard, build_shard
from pd_cluster.engine.graph import CudaGraphConfig
from pd_cluster.engine.packed_step import COMMAND_MAGIC, HEADER_LEN, STEP_MAGIC, payload_len

logger = logging.getLogger(__name__)

_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")  # gloo's words for a dead rank



class RankServer:
    """The methods every rank runs on command. Rank 0's results are the ones used."""

    def __init__(self, shard: Shard, tp: TPGroup, device: torch.device) -> None:
        self.shard = shard
        self.tp = tp
        self.device = device
        self.extensions: dict[str, Any] = {}

    def run_step(self, header: np.ndarray, payload: np.ndarray, prev_tokens: torch.Tensor | None = None
                 ) -> torch.Tensor | None:
        """Run a packed step (the same decode on every rank); rank 0's logits, None elsewhere.

        A step with future tokens (overlap scheduling) first broadcasts rank 0's `prev_tokens` (the previous
        step's sampled ids, on its device) over the device group: NCCL on GPUs, ordered on each rank's stream
        after the sampling that wrote them, with no host wait."""
        if int(header[8]):
            if not self.tp.is_driver:
                prev_tokens = torch.empty(int(header[9]), dtype=torch.int64, device=self.device)
            self.tp.broadcast_device(prev_tokens)
        logits = self.shard.run_step(header, payload, prev_tokens)
        return logits if self.tp.is_driver else None

    def block_table_state(self) -> tuple[np.ndarray, np.ndarray, bool]:
        """This rank's device block table (as host int32 [rows, width]), its row lengths, and whether the host
        mirror equals it: every rank's must be identical (tests, diagnostics)."""
        table = self.shard.block_table
        dev = table.table.cpu().numpy()
        return dev, table.lengths.copy(), bool(np.array_equal(dev, table.host))

    def ping(self) -> int:
        return self.tp.rank

    def capture_decode_graphs(self, config: CudaGraphConfig) -> list[int]:
        """Capture this rank's decode graphs (the same buckets on every rank); the buckets, [] for none."""
        return self.shard.capture_decode_graphs(config)

    def graph_replays(self) -> int:
        """Decode steps this rank served from its graph runner."""
        return 0 if self.shard.graph_runner is None else self.shard.graph_runner.replays

    def install(self, name: str, factory: str, *args: Any, **local: Any) -> None:
        """Create ``factory(shard, tp, *args, **local)`` (``"module:callable"``) on this rank, e.g. a transfer
        agent; `local` are rank 0's own objects (`TPDriver.call`'s ``rank0_kwargs``)."""
        module, attr = factory.split(":")
        self.extensions[name] = getattr(import_module(module), attr)(self.shard, self.tp, *args, **local)

    def ext(self, name: str, method: str, *args: Any) -> Any:
        """Call a method of an installed extension."""
        return getattr(self.extensions[name], method)(*args)

    def side(self, name: str, method: str, *args: Any) -> Any:
        """Call, from the side-channel thread, an extension method listed in its class's ``SIDE_METHODS``.

        Raises:
            KeyError: no extension `name` is installed.
            ValueError: `method` is not declared safe from any thread.
        """
        ext = self.extensions[name]
        if method not in getattr(type(ext), "SIDE_METHODS", ()):
            raise ValueError(f"{type(ext).__name__}.{method} is not in SIDE_METHODS")
        return getattr(ext, method)(*args)


def _serve_side(conn, server: RankServer) -> None:
    """A rank's side-channel thread: run each posted ``(name, method, args)`` until rank 0 closes the pipe."""
    while True:
        try:
            name, method, args = conn.recv()
        except (EOFError, OSError):
            return
        except Exception:  # noqa: BLE001 - a message that does not unpickle or unpack: skip it, keep serving
            logger.exception("tp rank %d: unreadable posted call", server.tp.rank)
            continue
        try:
            server.side(name, method, *args)
        except Exception:  # noqa: BLE001 - nobody waits for a posted call: log it and serve the next
            logger.exception("tp rank %d: posted %s.%s failed", server.tp.rank, name, method)


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Local rank r (the rank within its node) runs on ``cuda:r`` (offset by the configured index) on GPUs, on the
    CPU otherwise."""
    name = config.device.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        base = int(name.split(":")[1]) if ":" in name else 0
        return torch.device(f"cuda:{base + rank}")
    return torch.device("cpu")


def check_gpus(config: EngineConfig) -> None:
    """On GPUs, refuse more ranks a node than the node's GPUs (`pd_cluster.engine.parallel.nodes.check_node_gpus`)."""
    device = rank_device(config, 0)
    if device.type == "cuda":
        p = config.parallel
        check_node_gpus(p.world_size, p.nnodes, torch.cuda.device_count(), device.index or 0)


def _rank_main(rank: int, size: int, master: tuple[str, int] | None, config: EngineConfig, log_level: int,
               side=None) -> None:
    """One rank's process: join the group (at `master`, or over several nodes at ``--dist-init-addr``), build its
    shard, obey rank 0's commands until ``stop``. A rank of another node than rank 0's reads rank 0's posts from
    the store (`StoreInbox`) and dies with its node's process."""
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s tp{rank} %(name)s: %(message)s")
    p = config.parallel
    if p.node_rank > 0:
        _die_with_parent()
    device = rank_device(config, rank - node_ranks(size, p.nnodes, p.node_rank).start)
    if device.type == "cpu":
        torch.set_num_threads(config.device.cpu_threads)
    tp = init_tp_group(rank, size, master, device, store=client_store(config) if master is None else None)
    server = RankServer(build_shard(config, device, tp), tp, device)
    if side is None and p.node_rank > 0:
        side = StoreInbox(config, rank)
    if side is not None:
        threading.Thread(target=_serve_side, args=(side, server), daemon=True, name=f"tp{rank}-side").start()
    try:
        _serve_commands(rank, tp, server)
    except RuntimeError as e:  # gloo: "Connection closed by peer" when rank 0 (or another rank) died
        if not any(s in str(e) for s in _PEER_GONE):
            raise
        logger.critical("tp rank %d: lost the tensor-parallel group, rank 0 is gone or failed: %s", rank, e)
        logging.shutdown()
        os._exit(3)  # no teardown: threads may still wait on the group or the store
    tp.destroy()


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent (the node's process) dies, so no rank outlives its node."""
    import ctypes
    import signal
    import sys

    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


def _serve_commands(rank: int, tp: TPGroup, server: RankServer) -> None:
    while True:
        header = tp.broadcast_tensor(torch.empty(HEADER_LEN, dtype=torch.int64)).numpy()
        if int(header[0]) == STEP_MAGIC:
            payload = tp.broadcast_tensor(torch.empty(payload_len(header), dtype=torch.int64)).numpy()
            try:
                server.run_step(header, payload)
            except Exception:  # noqa: BLE001 - rank 0 fails the same step on the same arrays
                logger.exception("tp rank %d: step failed", rank)
            continue
        if int(header[0]) != COMMAND_MAGIC:
            raise RuntimeError(f"tp rank {rank}: unknown command header {header.tolist()}")
        name, args, gather = tp.broadcast_object()
        if name == "stop":
            break
        try:
            result: Any = getattr(server, name)(*args)
        except Exception as e:  # noqa: BLE001 - reported to rank 0 when it gathers
            logger.exception("tp rank %d: %s failed", rank, name)
            result = e
        if gather:
            tp.gather_objects(result)


class TPDriver:
    """Rank 0's handle on the group: start the other ranks, command them, stop them.

    Args:
        config: the engine configuration (``parallel.world_size`` ranks; over ``nnodes`` nodes, this node's
            share spawned here and the rest met at ``dist_init_addr``).

    Raises:
        ValueError: ``node_rank`` > 0 (rank 0 lives on node 0), or more ranks than this node's GPUs.
        NodeJoinError: the other nodes did not join, or differ (`pd_cluster.engine.parallel.rendezvous`).
    """

    def __init__(self, config: EngineConfig) -> None:
        size, nnodes = config.parallel.world_size, config.parallel.nnodes
        if config.parallel.node_rank > 0:
            raise ValueError(f"--node-rank {config.parallel.node_rank}: rank 0 runs on node 0; a node r > 0 runs only "
                             f"its ranks, started by `pd-worker --node-rank {config.parallel.node_rank}` (any role)")
        check_gpus(config)
        local = node_ranks(size, nnodes, 0)
        store = host_instance(config) if nnodes > 1 else None  # waits for the other nodes, or raises
        master = None if store is not None else ("127.0.0.1", free_port())
        level = logging.getLogger().getEffectiveLevel()
        pipes = [mp.Pipe(duplex=False) for _ in local[1:]]  # (reader, writer): the side channel
        self.procs = [rank_process(_rank_main, (r, size, master, config, level, pipes[r - 1][0]), f"tp-rank-{r}")
                      for r in local[1:]]
        for p in self.procs:
            p.start()
        for reader, _ in pipes:
            reader.close()  # the rank holds its own copy
        # ranks of the other nodes: rank 0's posts go through node 0's store (`rendezvous.StoreOutbox`)
        self._side = [writer for _, writer in pipes] + [StoreOutbox(config, r) for r in range(local.stop, size)]
        self._posts = [queue.SimpleQueue() for _ in self._side]  # `post` -> rank r's writer thread
        self._posters = [threading.Thread(target=self._forward_posts, args=(r,), daemon=True, name=f"tp-post-{r}")
                         for r in range(1, size)]
        for t in self._posters:
            t.start()
        self.device = rank_device(config, 0)
        self._parallel = config.parallel
        self.tp = init_tp_group(0, size, master, self.device, store=store)
        self.local: RankServer | None = None

    def attach(self, server: RankServer) -> None:
        self.local = server

    def call(self, name: str, *args: Any, gather: bool = False, rank0_kwargs: dict[str, Any] | None = None) -> Any:
        """Run ``RankServer.<name>(*args)`` on every rank; rank 0's result, or every rank's with `gather`.

        `rank0_kwargs` go to rank 0's call only: objects that stay in this process and are not sent (e.g. the
        worker's metrics registry).

        Raises:
            Exception: with `gather`, the first rank's exception, as raised there.
            RuntimeError: a rank process is gone (on another node: the group broke).
        """
        with self._group_failures():
            return self._call(name, args, gather, rank0_kwargs)

    def _call(self, name: str, args: tuple, gather: bool, rank0_kwargs: dict[str, Any] | None) -> Any:
        self._check_alive()
        self._send_command(name, args, gather)
        local = rank0_kwargs or {}
        if not gather:
            return getattr(self.local, name)(*args, **local)
        try:
            result: Any = getattr(self.local, name)(*args, **local)
        except Exception as e:  # noqa: BLE001 - the other ranks still take part in the gather
            result = e
        results = self.tp.gather_objects(result)
        errors = [r for r in results if isinstance(r, Exception)]
        if errors:
            raise errors[0]  # the rank's own exception (e.g. a layout mismatch), so callers can tell them apart
        return results

    def post(self, name: str, method: str, *args: Any) -> None:
        """Run extension `name`'s `method` (listed in its ``SIDE_METHODS``) with `args` on ranks 1..N-1, off their
        step loops, without waiting (rank 0's part is the caller's to run). Safe from any thread and never
        blocks: a thread of rank 0 per rank writes that rank's pipe, so a stalled rank delays only its own
        calls. Posted calls run in order on each rank, but in no order with the step loop's commands. A rank
        that is gone is skipped (the step loop's next command reports it). Keep `args` small: a transfer id,
        not a block table."""
        for q in self._posts:
            q.put((name, method, args))

    def _forward_posts(self, rank: int) -> None:
        conn, posts = self._side[rank - 1], self._posts[rank - 1]
        while (item := posts.get()) is not None:
            try:
                conn.send(item)
            except (OSError, ValueError, RuntimeError) as e:  # BrokenPipeError: the rank is gone (a store: node 0's)
                logger.debug("tp rank %d: posted %s.%s not delivered: %s", rank, item[0], item[1], e)

    def _check_alive(self) -> None:
        dead = [p.name for p in self.procs if not p.is_alive()]
        if dead:
            raise RuntimeError(f"tensor-parallel ranks exited: {dead}")

    def _send_command(self, name: str, args: tuple, gather: bool) -> None:
        header = np.zeros(HEADER_LEN, dtype=np.int64)
        header[0] = COMMAND_MAGIC
        self.tp.broadcast_tensor(torch.from_numpy(header))
        self.tp.broadcast_object((name, args, gather))

    def run_step(self, step: np.ndarray, prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Run a packed step ([HEADER_LEN + payload] int64, `pd_cluster.engine.packed_step`) on every rank: the
        header, then the payload, as two tensor broadcasts; rank 0 then decodes the very arrays it sent, as the
        other ranks do. Returns rank 0's logits.

        Raises:
            RuntimeError: a rank process is gone.
        """
        self._check_alive()
        header, payload = torch.from_numpy(step[:HEADER_LEN]), torch.from_numpy(step[HEADER_LEN:])
        with self._group_failures():
            self.tp.broadcast_tensor(header)
            self.tp.broadcast_tensor(payload)
            return self.local.run_step(header.numpy(), payload.numpy(), prev_tokens)

    @contextlib.contextmanager
    def _group_failures(self):
        """A collective that fails because a peer's connection closed: say which ranks may be gone."""
        try:
            yield
        except RuntimeError as e:
            if not any(s in str(e) for s in _PEER_GONE):
                raise
            p = self._parallel
            where = (f"a rank on this node or on node(s) 1..{p.nnodes - 1} (--nnodes {p.nnodes}, --dist-init-addr "
                     f"{p.dist_init_addr})" if p.nnodes > 1 else "a rank process")
            raise RuntimeError(f"the tensor-parallel group broke: {where} is gone ({e})") from e

    def capture_decode_graphs(self, config: CudaGraphConfig) -> list[int]:
        """Every rank captures decode graphs for the same buckets, in lockstep (the all-reduces inside the
        captured steps must pair up across ranks); a decode step then replays on every rank, since each
        rank decides `CudaGraphRunner.can_run` from the same broadcast batch.

        Returns:
            the buckets ([] when graphs do not apply: no CUDA, ``--disable-cuda-graph``).

        Raises:
            RuntimeError: the ranks disagree on the buckets.
        """
        per_rank = self.call("capture_decode_graphs", config, gather=True)
        if any(b != per_rank[0] for b in per_rank):
            raise RuntimeError(f"tensor-parallel ranks captured different CUDA-graph buckets: {per_rank}")
        return per_rank[0]

    def shutdown(self, timeout: float = 10.0, graceful: bool = True) -> None:
        """Stop the ranks: a ``stop`` command, or (``graceful=False``, e.g. after a failed start) SIGKILL."""
        if not graceful:
            for p in self.procs:
                p.kill()
        elif any(p.is_alive() for p in self.procs):
            try:
                self._send_command("stop", (), False)
            except Exception as e:  # noqa: BLE001 - the ranks may be gone already
                logger.warning("could not tell the tensor-parallel ranks to stop: %s", e)
        for q in self._posts:
            q.put(None)
        for p in self.procs:
            p.join(timeout)
            if p.is_alive():
                p.kill()
                p.join(timeout)
        for t, conn in zip(self._posters, self._side):
            t.join(timeout)  # its rank is gone: a write blocked on it has failed
            if not t.is_alive():
                conn.close()
        self.tp.destroy()
