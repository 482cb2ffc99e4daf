"""The tensor-parallel group of one engine instance: N processes, one per GPU (or CPU slice).

Megatron-LM's scheme (Shoeybi et al. 2019): the q/k/v and gate/up projections
are split by output rows (each rank holds ``1/N`` of the heads and of the MLP
width), the o and down projections by input columns, and one all-reduce after
each of those sums the partial outputs. Rank 0 runs the scheduler; every step
it broadcasts a step as two int64 tensors (`TPGroup.broadcast_tensor`), or
another command as a pickled object (`TPGroup.broadcast_object`), and all
ranks execute it in lockstep.

Collectives: the model's all-reduces over NCCL on GPUs and gloo on CPUs;
commands (packed steps, pickled objects) and results always over a gloo group.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=120)  # every rank process must have started by then
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)   # a collective may wait for a large model to load


@dataclass
class TPGroup:
    """This process's place in the tensor-parallel group.

    Attributes:
        rank, size: the rank and the group size.
        device: this rank's device.
    """

    rank: int
    size: int
    device: torch.device
    _tensor_group: Any = None
    _object_group: Any = None
    moe_group: "TPGroup | None" = None  # DP attention: the MoE layers' group across the DP ranks

    gathers_tokens = False  # a MoE group that gathers every DP rank's tokens (`dp_attention.DPMoEGroup`)

    @property
    def moe(self) -> "TPGroup":
        """The group the MoE layers split their experts over: this one, or under DP attention the group of the
        DP ranks (`pd_cluster.engine.parallel.dp_attention`)."""
        return self.moe_group if self.moe_group is not None else self

    @property
    def is_driver(self) -> bool:
        """Rank 0 schedules, samples and serves; the others only compute."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place (the partial outputs of a row-parallel layer)."""
        if self.size > 1:
            dist.all_reduce(x, group=self._tensor_group)
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `x` (the same shape and dtype on each), in rank order, over the tensor group."""
        out = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(out, x.contiguous(), group=self._tensor_group)
        return out

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's `obj`, on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._object_group)
        return box[0]

    def broadcast_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's `t` (a CPU tensor; the others pass one of the same shape and dtype to receive into), in
        place, over the gloo object group: no pickling (a packed step, `pd_cluster.engine.packed_step`)."""
        dist.broadcast(t, src=0, group=self._object_group)
        return t

    def broadcast_device(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's `t` (on this rank's device; the others pass one of the same shape and dtype), in place,
        over the tensor group (NCCL on GPUs: queued on the stream, no host wait)."""
        if self.size > 1:
            dist.broadcast(t, src=0, group=self._tensor_group)
        return t

    def gather_objects(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj`, in rank order, on rank 0 (None elsewhere)."""
        out = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self._object_group)
        return out

    def all_min(self, value: int) -> int:
        """The smallest `value` over the ranks (e.g. the pool size every rank can hold)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._object_group)
        return int(t.item())

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def init_tp_group(rank: int, size: int, master: tuple[str, int] | None, device: torch.device, cls: type = TPGroup,
                  store: dist.Store | None = None) -> TPGroup:
    """Join the group (every rank calls this with the same `master` address; rank 0 listens there); `cls` is the
    group's class (`TPGroup` or a subclass). An instance over several nodes passes node 0's `store` instead
    (`pd_cluster.engine.parallel.rendezvous`: node 0's own, or a connection to it).

    Raises:
        RuntimeError: the rendezvous failed or a rank did not arrive within `RENDEZVOUS_TIMEOUT` (or the store's).
    """
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if store is None:
        store = dist.TCPStore(master[0], master[1], size, is_master=rank == 0, timeout=RENDEZVOUS_TIMEOUT,
                              wait_for_workers=True)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
    objects = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    logger.info("%s rank %d of %d ready (%s)", cls.__name__, rank, size, backend)
    return cls(rank, size, device, dist.group.WORLD, objects)


SINGLE = TPGroup(0, 1, torch.device("cpu"))
"""The group of an engine without tensor parallelism (no collective is ever called)."""
