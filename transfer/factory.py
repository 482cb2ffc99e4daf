"""A worker's transfer objects: its agent and its sender (prefill) or receiver (decode)."""

from __future__ import annotations

from pd_cluster.transfer.agent import TransferAgent
from pd_cluster.transfer.config import TransferConfig
from pd_cluster.transfer.interfaces import Agent, Receiver, Sender
from pd_cluster.transfer.metrics import TransferMetrics
from pd_cluster.transfer.receiver import KVReceiver
from pd_cluster.transfer.sender import KVSender


def make_worker_transfer(engine, role: str, config: TransferConfig, registry) -> tuple[Agent, Sender | Receiver]:
    """The transfer agent and the sender (``role="prefill"``) or receiver (``"decode"``) of a worker running `engine`.

    Without TP: a `TransferAgent` with a `KVSender` / `KVReceiver`. With TP: a `RankTransfer` on every rank and
    rank 0's proxies `TPAgent` / `TPSender` / `TPReceiver` (`pd_cluster.transfer.tp`). Metrics go on
    `registry` (rank 0's agent). Every sender (each rank's) runs its heartbeat thread (`KVSender.heartbeat`).
    """
    if engine.tp_driver is None:
        agent = TransferAgent(engine.pool, engine.loaded.identity, role, config)
        metrics = TransferMetrics(registry)
        if role != "prefill":
            return agent, KVReceiver(agent, metrics)
        sender = KVSender(agent, metrics)
        sender.start_heartbeat()
        return agent, sender
    from pd_cluster.transfer.tp import TPAgent, TPReceiver, TPSender, install

    infos = install(engine.tp_driver, role, config, engine.loaded.identity, registry)
    proxy = TPSender(engine.tp_driver) if role == "prefill" else TPReceiver(engine.tp_driver)
    return TPAgent(engine.tp_driver, infos), proxy
