"""Node r > 0 of an instance that spans nodes (``--nnodes N --node-rank r``): its ranks, and the watch on them.

The node checks in with node 0 (`pd_cluster.engine.parallel.rendezvous.join_instance`), then starts its
``--tp-size / --nnodes`` ranks (global ranks ``r * W/N ..``, each on its local rank's device) with rank 0's
configuration. They join the process group and serve rank 0's commands exactly as the ranks rank 0 spawns on its
own node (`pd_cluster.engine.executor.tp._rank_main`). The node serves no API: rank 0 does (SGLang's nodes r > 0
neither). It ends when its ranks do: cleanly after rank 0's ``stop``, with an error naming ``--dist-init-addr``
when rank 0 goes away (the ranks' group breaks, or node 0's store stops answering).
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import threading

from pd_cluster.engine.config import EngineConfig
from pd_cluster.engine.executor.tp import _rank_main, check_gpus
from pd_cluster.engine.parallel.nodes import node_ranks
from pd_cluster.engine.parallel.rendezvous import PREFIX, client_store, join_instance

logger = logging.getLogger(__name__)

WATCH_PERIOD_S = 1.0          # how often the node checks its ranks and node 0's store
STORE_ANSWER_TIMEOUT_S = 10   # node 0's store silent this long: node 0 is gone (a host or network down)


class NodeRanks:
    """This node's rank processes.

    Args:
        config: this node's engine configuration (``node_rank`` > 0).

    Raises:
        NodeJoinError: the rendezvous failed (`join_instance`).
        ValueError: the node has fewer GPUs than its ranks (naming the flags).
    """

    def __init__(self, config: EngineConfig) -> None:
        _, self.config = join_instance(config)
        p = self.config.parallel
        check_gpus(self.config)
        self.ranks = node_ranks(p.world_size, p.nnodes, p.node_rank)
        self._watch = client_store(self.config, datetime.timedelta(seconds=STORE_ANSWER_TIMEOUT_S))
        ctx = mp.get_context("spawn")
        level = logging.getLogger().getEffectiveLevel()
        self.procs = [ctx.Process(target=_rank_main, args=(r, p.world_size, None, self.config, level, None),
                                  daemon=True, name=f"tp-rank-{r}") for r in self.ranks]
        for proc in self.procs:
            proc.start()
        logger.info("node %d of %d: ranks %d..%d started, rank 0 at %s", p.node_rank, p.nnodes, self.ranks.start,
                    self.ranks.stop - 1, p.dist_init_addr)

    @property
    def alive(self) -> bool:
        return all(proc.is_alive() for proc in self.procs)

    def wait(self, stop: threading.Event | None = None) -> str | None:
        """Block until the ranks end, node 0 stops answering or `stop` is set.

        Returns:
            None when every rank ended cleanly (rank 0 stopped the instance) or `stop` was set; else the error.
        """
        stop = stop or threading.Event()
        while not stop.wait(WATCH_PERIOD_S):
            ended = [proc for proc in self.procs if not proc.is_alive()]
            if ended and all(proc.exitcode == 0 for proc in ended) and len(ended) == len(self.procs):
                return None
            if any(proc.exitcode != 0 for proc in ended):
                codes = ", ".join(f"{proc.name} exit code {proc.exitcode}" for proc in ended)
                return self._gone(f"a rank of this node lost the group: {codes}")
            try:
                self._watch.check([PREFIX + "verdict"])
            except Exception as e:  # noqa: BLE001 - any store failure means node 0's process is gone
                return self._gone(f"its store stopped answering: {e}")
        return None

    def _gone(self, how: str) -> str:
        p = self.config.parallel
        return (f"node {p.node_rank}: rank 0 at --dist-init-addr {p.dist_init_addr} is gone or failed ({how}); this "
                f"node stops too")

    def stop(self, timeout: float = 10.0) -> None:
        """Kill this node's ranks (rank 0's instance cannot go on without them)."""
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(timeout)
