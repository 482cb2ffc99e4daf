"""Context-parallel prefill (vLLM's ``--prefill-context-parallel-size``): one prompt's chunk split over ranks.

Each of the N CP ranks is a process like a tensor-parallel rank (`pd_cluster.engine.executor.tp`): it holds
the whole model (no weight split) and a pool of the same page ids, receives every packed step from rank 0 and
runs it in lockstep. A prefill step of one request is cut into 2N pieces of near-equal length and rank r
computes pieces r and 2N-1-r (the zig-zag placement of Striped Attention, Brandon et al. 2023, and of Meta's
*Context Parallelism for Scalable Million-Token Inference*, Yang et al. 2024): a causal prefix grows along
the chunk, so the pair of an early and a late piece gives every rank the same attention work; linear layers
and MLPs divide by N exactly.

Attention over the other ranks' tokens: per layer, each rank all-gathers the chunk's K and V (pieces padded
to the longest rank's length) and writes the other ranks' tokens into its own pool, at the slots the step's
slot mapping gives; then it attends its own queries over the pool as a one-rank engine does (its two pieces
as two prefill rows of the same block table). Earlier chunks and decode tokens are therefore in every rank's
pool, decode steps run on every rank alike (rank 0's logits are used), and the KV is the same as at CP 1:
the cost is that every rank keeps the prompt's whole KV (the pool is not sharded by tokens).

Steps that are not one request's prefill of at least 2N tokens (decode, several requests, prompt logprobs)
run whole on every rank: correct, without the split.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from pd_cluster.engine.batch import ForwardBatch

FLAG = "--prefill-context-parallel-size"


def zigzag_pieces(n: int, size: int) -> list[tuple[int, int]]:
    """The 2 x `size` pieces of ``range(n)``, as [lo, hi) offsets, lengths differing by at most one."""
    bounds = np.linspace(0, n, 2 * size + 1).round().astype(int)
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(2 * size)]


def rank_pieces(n: int, size: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Rank `rank`'s two pieces of an `n`-token chunk: piece `rank` and piece ``2 * size - 1 - rank``
    (rank 0 holds the first and the last, so the chunk's last token, whose logits are sampled, is rank 0's)."""
    pieces = zigzag_pieces(n, size)
    return pieces[rank], pieces[2 * size - 1 - rank]


@dataclass
class _Split:
    """One step's split: every rank's chunk offsets ([n_r] int64 on the device) and the longest rank's count."""

    offsets: list[torch.Tensor]
    longest: int
    full_slots: torch.Tensor  # [T] the step's slot mapping (every rank's tokens)


class CPAttention:
    """The backend seen by the model during a split step: before attending, gather every rank's K and V of
    the chunk and store the other ranks' tokens in this rank's pool; then attend through `inner`.

    Args:
        inner: this rank's attention backend (any `AttentionBackend`).
        runner: this rank's `ContextParallel` (its group's ``all_gather``; it counts the gathers' seconds).
        split: the step's split.
    """

    def __init__(self, inner, runner: "ContextParallel", split: _Split) -> None:
        self.inner = inner
        self.runner = runner
        self.group = runner.group
        self.split = split

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def prepare(self, batch: ForwardBatch, pool) -> None:
        self.inner.prepare(batch, pool)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool, batch: ForwardBatch,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """`AttentionBackend.forward` of this rank's tokens (q, k, v: [t_r, heads, head_dim]) after the other
        ranks' K and V of the chunk are in the pool."""
        sp = self.split
        started = time.perf_counter()
        kv = torch.stack((k, v))  # [2, t_r, Hkv, D]
        padded = kv.new_zeros((2, sp.longest) + tuple(k.shape[1:]))
        padded[:, : k.shape[0]] = kv
        parts = self.group.all_gather(padded)
        for r, part in enumerate(parts):
            if r == self.group.rank:
                continue
            n = sp.offsets[r].numel()
            pool.store_kv(layer, part[0, :n], part[1, :n], sp.full_slots[sp.offsets[r]])
        self.runner.gather_seconds += time.perf_counter() - started
        return self.inner.forward(layer, q, k, v, pool, batch, sinks=sinks)


class ContextParallel:
    """This rank's context-parallel runner (rank `group.rank` of `group.size`).

    Args:
        group: the world group of the instance's ranks (`pd_cluster.engine.parallel.group.TPGroup`).
    """

    def __init__(self, group) -> None:
        self.group = group
        self.size = group.size
        self.rank = group.rank
        self.split_steps = 0  # prefill steps this rank ran split (tests, the benchmark)
        self.gather_seconds = 0.0  # wall time in the K/V all-gathers and their stores (waits for the slowest rank)

    def applies(self, batch: ForwardBatch) -> bool:
        """True for a step of one request's prefill of at least 2N tokens, with one KV group, whose logits
        rows (if any) are rank 0's tokens; every rank decides alike from the same broadcast step."""
        if self.size < 2 or batch.num_reqs != 1 or batch.num_decodes or batch.group_batches is not None:
            return False
        n = batch.query_lens_cpu[0]
        if n < 2 * self.size:
            return False
        (a0, a1), (b0, b1) = rank_pieces(n, self.size, 0)
        rows = batch.logits_indices.cpu().tolist() if batch.logits_indices.numel() else []
        return all(a0 <= i < a1 or b0 <= i < b1 for i in rows)

    def _local_batch(self, batch: ForwardBatch) -> tuple[ForwardBatch, _Split]:
        n = batch.query_lens_cpu[0]
        start = batch.seq_lens_cpu[0] - n
        dev = batch.input_ids.device
        offsets = []
        for r in range(self.size):
            (a0, a1), (b0, b1) = rank_pieces(n, self.size, r)
            offsets.append(torch.cat((torch.arange(a0, a1), torch.arange(b0, b1))).to(dev))
        (a0, a1), (b0, b1) = rank_pieces(n, self.size, self.rank)
        mine = offsets[self.rank]
        la, lb = a1 - a0, b1 - b0
        if self.rank == 0 and batch.logits_indices.numel():
            rows = batch.logits_indices.cpu().numpy()
            local_rows = np.where(rows < a1, rows - a0, la + rows - b0)
        else:
            local_rows = np.zeros(0, dtype=np.int64)
        row = batch.block_tables[:1]
        local = ForwardBatch(
            input_ids=batch.input_ids[mine], positions=batch.positions[mine], slot_mapping=batch.slot_mapping[mine],
            query_start_loc=torch.tensor([0, la, la + lb], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([start + a1, start + b1], dtype=torch.int32, device=dev),
            block_tables=torch.cat((row, row)), logits_indices=torch.from_numpy(local_rows).to(dev),
            num_decodes=0, query_lens_cpu=[la, lb], seq_lens_cpu=[start + a1, start + b1],
            query_start_loc_cpu=[0, la, la + lb],
            rope_variant=None if batch.rope_variant is None else batch.rope_variant[mine])
        split = _Split(offsets, max(o.numel() for o in offsets), batch.slot_mapping)
        return local, split

    def forward(self, model, batch: ForwardBatch, pool, backend) -> torch.Tensor:
        """Run `batch` (a step that `applies`) split over the ranks; the logits [L, vocab] of the step's
        logits rows on rank 0, [0, vocab] elsewhere."""
        local, split = self._local_batch(batch)
        self.split_steps += 1
        return model(local, pool, CPAttention(backend, self, split))

