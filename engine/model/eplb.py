"""Expert-parallel load balancing (EPLB): redundant experts, expert load statistics from real routing, rebalancing.

DeepSeek's EPLB (github.com/deepseek-ai/EPLB; DeepSeek-V3 technical report, section 3.4 "redundant experts"), as
SGLang's ``--ep-num-redundant-experts`` / ``--enable-eplb`` / ``--eplb-rebalance-num-iterations`` and vLLM's
``--enable-eplb`` use it. Under expert parallelism over N ranks, a model of E routed experts holds
``P = E + R`` **physical** experts, ``P / N`` slots per rank: every **logical** expert has at least one replica
and R slots hold extra replicas of the busiest ones.

* **Routing** (`ExpertLocation.to_physical`): the router's choices are logical ids; the (token t, choice j)
  pair goes to replica ``(t + j) mod replicas(e)`` of expert e, so a hot expert's tokens spread over its
  replicas, and every rank of a TP group (same tokens) picks the same replica: no token is counted twice.
* **Statistics** (`ExpertLocation.record`): each MoE layer counts the (token, choice) pairs per logical expert,
  on the device, every forward (under DP attention each rank its own tokens; summed at a rebalance).
* **Rebalance** (`ExpertBalancer.rebalance`, every ``--eplb-rebalance-num-iterations`` steps when
  ``--enable-eplb``): from the window's counts, `place` gives each expert ``replicas`` by greedy division of
  its load (the busiest gets the next replica) and packs the replicas onto the ranks heaviest first, each to
  the least loaded rank with a free slot (DeepSeek's balanced packing); an expert that stays on a rank keeps its
  slot. `move_experts` then sends each moved expert's weights (every per-expert tensor: values, scales,
  biases) from a rank that holds it, point to point (``torch.distributed`` P2P: gloo on CPU, NCCL on GPU). It
  runs between two steps, at the same step on every rank, so no request is dropped or paused beyond that step.

Weights load as without EPLB (rank r's slots ``[0, E / N)`` hold experts ``[r E / N, (r + 1) E / N)``); the R / N
extra slots per rank start as replicas of the next rank's first experts, filled by the same point-to-point moves.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pd_cluster.engine.model.eplb_config import EPLBConfig

logger = logging.getLogger(__name__)


def initial_placement(num_experts: int, num_redundant: int, num_ranks: int) -> list[int]:
    """The physical-to-logical map at load: rank r's first ``E / N`` slots hold its contiguous experts (what the
    loader fills) and its ``R / N`` others replicas of the experts after them (the next rank's first ones).

    Returns:
        [P] logical expert id of each physical slot, rank-major.
    """
    own, extra = num_experts // num_ranks, num_redundant // num_ranks
    out: list[int] = []
    for r in range(num_ranks):
        out += [r * own + j for j in range(own)]
        out += [((r + 1) * own + j) % num_experts for j in range(extra)]
    return out


def replicate(load: list[float], num_redundant: int) -> list[int]:
    """Replicas per logical expert: one each, then each of the `num_redundant` extra to the expert with the most
    load per replica (the lowest id on a tie).

    Args:
        load: [E] tokens routed to each expert.
    """
    counts = [1] * len(load)
    for _ in range(num_redundant):
        e = max(range(len(load)), key=lambda i: (load[i] / counts[i], -i))
        counts[e] += 1
    return counts


def place(load: list[float], num_redundant: int, num_ranks: int, current: list[int] | None = None) -> list[int]:
    """A balanced physical-to-logical map for `load` (DeepSeek's EPLB: replicate, then balanced packing).

    Replicas (`replicate`) carry ``load / replicas`` each and go, heaviest first, to the rank with the least load
    so far among those with a free slot (the lowest rank on a tie); no rank holds two replicas of one expert
    while another rank could. Within a rank, an expert already in one of its slots (`current`) keeps it.

    Args:
        load: [E] tokens routed to each logical expert (the window since the last rebalance).
        num_redundant: R; ``E + R`` must be a multiple of `num_ranks`.
        current: [E + R] the map now (None: no slot kept).

    Returns:
        [E + R] logical id of each physical slot, rank-major (``P / N`` slots per rank).
    """
    num_experts = len(load)
    slots = (num_experts + num_redundant) // num_ranks
    counts = replicate(load, num_redundant)
    items = sorted(((load[e] / counts[e], e) for e in range(num_experts) for _ in range(counts[e])),
                   key=lambda it: (-it[0], it[1]))
    rank_load = [0.0] * num_ranks
    held: list[list[int]] = [[] for _ in range(num_ranks)]
    for w, e in items:
        free = [r for r in range(num_ranks) if len(held[r]) < slots]
        fresh = [r for r in free if e not in held[r]] or free
        r = min(fresh, key=lambda i: (rank_load[i], i))
        held[r].append(e)
        rank_load[r] += w
    out: list[int] = []
    for r in range(num_ranks):
        row: list[int | None] = [None] * slots
        want = list(held[r])
        if current is not None:
            for s in range(slots):
                e = current[r * slots + s]
                if e in want:
                    row[s] = e
                    want.remove(e)
        for s in range(slots):
            if row[s] is None:
                row[s] = want.pop(0)
        out += row  # type: ignore[arg-type]
    return out


class ExpertLocation(nn.Module):
    """One MoE layer's placement and load counts, as device buffers updated in place (captured CUDA graphs
    keep reading them).

    Buffers: ``physical_to_logical`` [P] int64; ``logical_to_physical`` [E, R + 1] int64 (-1 past an expert's
    replicas); ``replicas`` [E] int64; ``load`` [E] int64 (pairs routed since the last rebalance) and
    ``total_load`` [E] int64 (since start).
    """

    def __init__(self, placement: list[int], num_experts: int, num_redundant: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.register_buffer("physical_to_logical", torch.zeros(len(placement), dtype=torch.int64), persistent=False)
        self.register_buffer("logical_to_physical", torch.full((num_experts, num_redundant + 1), -1,
                                                               dtype=torch.int64), persistent=False)
        self.register_buffer("replicas", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("load", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("total_load", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self.update(placement)

    @property
    def placement(self) -> list[int]:
        return self.physical_to_logical.tolist()

    def update(self, placement: list[int]) -> None:
        """Install a new physical-to-logical map (in place)."""
        l2p = [[] for _ in range(self.num_experts)]
        for p, e in enumerate(placement):
            l2p[e].append(p)
        if any(not r for r in l2p):
            raise ValueError(f"a placement must hold every expert at least once, got {placement}")
        width = self.logical_to_physical.shape[1]
        table = torch.tensor([r + [-1] * (width - len(r)) for r in l2p], dtype=torch.int64)
        self.physical_to_logical.copy_(torch.tensor(placement, dtype=torch.int64))
        self.logical_to_physical.copy_(table)
        self.replicas.copy_(torch.tensor([len(r) for r in l2p], dtype=torch.int64))

    def record(self, ids: torch.Tensor) -> None:
        """Count the (token, choice) pairs of `ids` [T, k] int64 (logical) per expert."""
        flat = ids.reshape(-1)
        ones = torch.ones_like(flat)
        self.load.index_add_(0, flat, ones)
        self.total_load.index_add_(0, flat, ones)

    def to_physical(self, ids: torch.Tensor) -> torch.Tensor:
        """Logical choices [T, k] int64 -> physical slots [T, k]: replica ``(t + j) mod replicas`` of each."""
        t, k = ids.shape
        offset = torch.arange(t, device=ids.device).view(-1, 1) + torch.arange(k, device=ids.device).view(1, -1)
        return self.logical_to_physical[ids, offset % self.replicas[ids]]


def expand_slots(experts: nn.Module, extra: int) -> list[str]:
    """Give `experts` (`FusedExperts`, loaded) `extra` more slots: every parameter with one row per expert grows
    by `extra` rows (zeros until `move_experts` fills them). Returns those parameters' names, in order. A
    per-expert parameter has at least two dimensions (weights, scales, biases); a static input scale [1] is
    shared."""
    n = experts.num_local_experts
    names = [name for name, p in experts.named_parameters(recurse=False) if p.dim() >= 2 and p.shape[0] == n]
    for name in names:
        p = getattr(experts, name)
        grown = torch.cat([p.data, p.data.new_zeros((extra, *p.shape[1:]))])
        setattr(experts, name, nn.Parameter(grown, requires_grad=False))
    return names


@dataclass
class _MovePlan:
    """One rank's part of a move: slots to send to each rank, to receive from each rank, to copy within."""

    sends: dict[int, list[tuple[int, int]]]  # dest rank -> (my slot, its slot)
    recvs: dict[int, list[tuple[int, int]]]  # source rank -> (its slot, my slot)
    local: list[tuple[int, int]]             # (my slot, my slot)
    moved: int                               # slots the group fills (all ranks)


def _source(old: list[int | None], e: int) -> int:
    src = next((p for p, x in enumerate(old) if x == e), None)
    if src is None:
        raise ValueError(f"expert {e} is in no slot of the current placement {old}")
    return src


def plan_moves(old: list[int | None], new: list[int], size: int, me: int) -> _MovePlan:
    """Rank `me`'s share of going from `old` to `new` (`move_experts`): a slot whose expert changes copies it
    from a slot of its rank that holds it, else receives it from the lowest slot (rank) that does."""
    slots = len(new) // size
    plan = _MovePlan({}, {}, [], 0)
    for d in range(size):
        mine = old[d * slots:(d + 1) * slots]
        for s, e in enumerate(new[d * slots:(d + 1) * slots]):
            if mine[s] == e:
                continue
            plan.moved += 1
            if e in mine:
                if d == me:
                    plan.local.append((mine.index(e), s))
                continue
            sr, ss = divmod(_source(old, e), slots)
            if d == me:
                plan.recvs.setdefault(sr, []).append((ss, s))
            elif sr == me:
                plan.sends.setdefault(d, []).append((ss, s))
    return plan


def move_experts(experts: nn.Module, names: list[str], old: list[int | None], new: list[int], group: Any) -> int:
    """Make this rank's slots hold `new` (from `old`, `plan_moves`): every per-expert parameter of `experts`
    (`names`) is sent point to point as bytes, after every send buffer is taken, so a slot both sent and
    overwritten sends its old expert. Every rank calls this with the same maps. Returns the slots the group
    filled (all ranks).

    Raises:
        ValueError: an expert of `new` that no slot of `old` holds.
    """
    plan = plan_moves(old, new, group.size, group.rank)
    ops, landing = [], []
    with torch.no_grad():
        for tag, name in enumerate(names):
            data = getattr(experts, name).data
            for d, pairs in sorted(plan.sends.items()):
                rows = data[[a for a, _ in pairs]].contiguous()
                ops.append(dist.P2POp(dist.isend, rows.view(-1).view(torch.uint8), d, group._tensor_group, tag))
            for src, pairs in sorted(plan.recvs.items()):
                buf = data.new_empty((len(pairs), *data.shape[1:]))
                ops.append(dist.P2POp(dist.irecv, buf.view(-1).view(torch.uint8), src, group._tensor_group, tag))
                landing.append((data, [b for _, b in pairs], buf))
            if plan.local:
                landing.append((data, [b for _, b in plan.local], data[[a for a, _ in plan.local]].clone()))
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        for data, rows, buf in landing:
            data[rows] = buf
    return plan.moved


class ExpertBalancer:
    """The EPLB state of one rank: every expert-parallel MoE layer's `ExpertLocation`, the step count and the
    rebalances so far. `step_done` is called once per step on every rank of the EP group (the same steps)."""

    def __init__(self, layers: list[nn.Module], group: Any, config: EPLBConfig) -> None:
        self.layers, self.group, self.config = layers, group, config
        self.iterations = 0
        self.rebalances = 0
        self.experts_moved = 0  # slots filled by rebalances (all ranks), not counting the start-up fill

    def step_done(self) -> None:
        self.iterations += 1
        if self.config.enable and self.iterations % self.config.every == 0:
            self.rebalance()

    def reset_counts(self) -> None:
        """Forget the load counted so far (the warm-up passes of CUDA graph capture are not traffic)."""
        for layer in self.layers:
            layer.location.load.zero_()
            layer.location.total_load.zero_()

    def rebalance(self) -> int:
        """Place every layer's experts by the load recorded since the last rebalance and move their weights.
        A collective: every rank of the EP group calls it at the same step. Returns the slots filled."""
        moved = 0
        for layer in self.layers:
            loc = layer.location
            load = loc.load.clone()
            if self.group.gathers_tokens:  # DP attention: each rank counted its own tokens
                dist.all_reduce(load, group=self.group._tensor_group)
            else:  # TP: every rank saw the same tokens; rank 0's counts decide, so the ranks' plans pair up
                dist.broadcast(load, src=0, group=self.group._tensor_group)
            if not int(load.sum()):  # no traffic in the window: nothing to balance, nothing moves
                continue
            old = loc.placement
            new = place([float(x) for x in load.tolist()], self.config.num_redundant_experts, self.group.size, old)
            moved += move_experts(layer.experts, layer.expert_params, old, new, self.group)
            loc.update(new)
            loc.load.zero_()
        self.rebalances += 1
        self.experts_moved += moved
        logger.info("EPLB rebalance %d after %d steps: %d expert slots moved over %d layers", self.rebalances,
                    self.iterations, moved, len(self.layers))
        return moved

    def stats(self) -> dict:
        """The load counts since start and the placement of each layer, and the rebalances so far."""
        return {"enabled": True, "iterations": self.iterations, "rebalances": self.rebalances, "experts_moved": self.experts_moved,
                "num_redundant_experts": self.config.num_redundant_experts, "ep_size": self.group.size,
                "layers": [{"total_load": layer.location.total_load.tolist(),
                            "placement": layer.location.placement} for layer in self.layers]}


def _connect_peers(group: Any) -> None:
    """A byte to and from every other rank of the group: NCCL opens its point-to-point connections now, before
    the KV pool takes the free memory, not at the first rebalance."""
    ops = []
    for peer in range(group.size):
        if peer != group.rank:
            ops.append(dist.P2POp(dist.isend, torch.ones(1, dtype=torch.uint8, device=group.device), peer,
                                  group._tensor_group))
            ops.append(dist.P2POp(dist.irecv, torch.empty(1, dtype=torch.uint8, device=group.device), peer,
                                  group._tensor_group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()


def setup_eplb(model: nn.Module, group: Any, config: EPLBConfig) -> ExpertBalancer | None:
    """Give every expert-parallel MoE layer of the loaded `model` its redundant slots (filled from the other
    ranks) and an `ExpertLocation`; a collective over the EP `group`. None when EPLB is off.

    Raises:
        ValueError: EPLB without expert parallelism over more than one rank, or ``E + R`` not a multiple of the
            EP size (naming the flag).
    """
    if not config.active:
        return None
    from pd_cluster.engine.model.moe import SparseMoE

    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    if not layers or not all(m.experts.expert_parallel for m in layers):
        raise ValueError(f"{config.flags} need expert parallelism over several ranks (--enable-expert-parallel "
                         "with --tp-size > 1)")
    size, r = group.size, config.num_redundant_experts
    _connect_peers(group)
    for layer in layers:
        e = layer.cfg.num_experts
        if (e + r) % size:
            raise ValueError(f"--ep-num-redundant-experts {r}: the {e} experts and the redundant ones must be a "
                             f"multiple of the expert-parallel size {size}")
        experts = layer.experts
        own = experts.num_local_experts
        layer.expert_params = expand_slots(experts, r // size)
        experts.num_local_experts = own + r // size
        experts.first_expert = group.rank * experts.num_local_experts
        placement = initial_placement(e, r, size)
        loaded = [x if (p % experts.num_local_experts) < own else None for p, x in enumerate(placement)]
        move_experts(experts, layer.expert_params, loaded, placement, group)
        layer.location = ExpertLocation(placement, e, r).to(experts.w13_weight.device)
    logger.info("EPLB: %d redundant experts, %d physical experts per rank over %d ranks; %s", r,
                layers[0].experts.num_local_experts, size,
                f"rebalance every {config.every} steps" if config.enable else "no rebalance")
    return ExpertBalancer(layers, group, config)
