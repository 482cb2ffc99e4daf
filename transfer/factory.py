"""A worker's transfer objects: its agent and its sender (prefill) or receiver (decode)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from pd_cluster.transfer.config import TransferConfig
from pd_cluster.transfer.interfaces import Agent, Receiver, Sender


class LocalDriver:
    """`pd_cluster.engine.executor.tp.TPDriver`'s ``install`` / ``ext`` calls for a worker of one rank: run in this
    process, on its only `pd_cluster.transfer.tp_rank.RankTransfer` (nothing is posted: there is no other rank).

    Args:
        pool: the worker's `KVPool`.
    """

    def __init__(self, pool) -> None:
        self.tp = SimpleNamespace(rank=0, size=1)
        self._shard = SimpleNamespace(pool=pool)
        self.local = SimpleNamespace(extensions={})

    def call(self, kind: str, ext: str, *args: Any, gather: bool = False, rank0_kwargs: dict | None = None) -> Any:
        if kind == "install":
            from importlib import import_module

            factory, *rest = args
            module, attr = factory.split(":")
            self.local.extensions[ext] = getattr(import_module(module), attr)(self._shard, self.tp, *rest,
                                                                              **(rank0_kwargs or {}))
            return [None] if gather else None
        method, *rest = args
        result = getattr(self.local.extensions[ext], method)(*rest)
        return [result] if gather else result

    def post(self, ext: str, method: str, *args: Any) -> None:
        """Nothing to post: rank 0 (this process) ran the call itself."""


def make_worker_transfer(engine, role: str, config: TransferConfig, registry) -> tuple[Agent, Sender | Receiver]:
    """The transfer agent and the sender (``role="prefill"``) or receiver (``"decode"``) of a worker running `engine`.

    A `RankTransfer` on every rank (one: in this process, `LocalDriver`) and rank 0's proxies `TPAgent` /
    `TPSender` / `TPReceiver` (`pd_cluster.transfer.tp`), so a worker meets a peer of another TP size the same
    way whatever its own. Every rank's agent advertises the engine's speculative decoding at the handshake
    (`SpeculativeConfig.handshake`). Metrics go on `registry` (rank 0's agent). Every sender (each rank's) runs its
    heartbeat thread (`KVSender.heartbeat`). A context-parallel prefill worker (``--prefill-context-parallel-size``)
    pushes from rank 0 alone, as a worker of one rank: its pool holds every token's KV of the whole model
    (`pd_cluster.engine.parallel.context_parallel`).
    """
    from pd_cluster.transfer.tp import TPAgent, TPReceiver, TPSender, install

    one_rank = engine.tp_driver is None or engine.shard.cp is not None
    driver = LocalDriver(engine.pool) if one_rank else engine.tp_driver
    infos = install(driver, role, config, engine.loaded.identity, registry, engine.config.speculative.handshake())
    proxy = (TPSender(driver, tuple(i.agent_name for i in infos)) if role == "prefill" else TPReceiver(driver))
    return TPAgent(driver, infos), proxy
