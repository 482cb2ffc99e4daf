"""Data-parallel attention: the MoE layers' group across the DP ranks of one engine instance.

SGLang's ``--enable-dp-attention`` (``--tp-size N --dp-size N``): each of the N
ranks runs attention for its own requests, on its own KV pool, with the
attention weights (and the dense layers, embeddings and LM head) whole; only
the MoE layers are shared. Their experts are split over the N ranks, by width
(tensor parallel) or whole (``--enable-expert-parallel``), and each MoE layer
of a step:

1. exchanges the ranks' token counts ``[T_0 .. T_{N-1}]`` (an all-gather of one int64 each);
2. **dispatch**: gathers every rank's hidden states, in rank order, ``[sum T, H]`` on every rank
   (an all-gather of uneven sizes, made as one ``all_to_all_single``);
3. computes this rank's partial output for all those tokens (its experts, or its slice of each, and its
   slice of the shared experts);
4. **combine**: sums the partial outputs and hands each rank its own ``T_r`` rows (a reduce-scatter of
   uneven sizes, again one ``all_to_all_single``: rank r receives every rank's rows of its tokens and
   adds them in rank order, so every rank sums in the same order).

This is the all-gather + reduce-scatter form of dispatch and combine (SGLang's
DP-attention MoE without DeepEP): every hidden state goes to every rank, which
under expert parallelism is ``N / min(N, ranks a token's experts lie on)``
times the bytes of a routed all-to-all, but needs no per-expert routing of the
tokens before the collective.

The ranks step in lockstep: every rank runs one forward per step, and a rank
with no work runs an idle pass (`DPMoEGroup.end_step`: each MoE layer with zero
tokens), so the collectives of every layer pair up. Collectives go over
``torch.distributed``: gloo on CPU, NCCL on GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pd_cluster.engine.parallel.group import TPGroup, init_tp_group


@dataclass
class DPMoEGroup(TPGroup):
    """The MoE layers' group under DP attention: `rank` of `size` DP ranks.

    `SparseMoE` calls `dispatch` then `combine` once per layer; `end_step` closes each step (an idle pass
    when this rank ran no forward).
    """

    gathers_tokens = True
    _counts: list[int] = field(default_factory=list)
    _calls: int = 0

    def dispatch(self, x: torch.Tensor) -> torch.Tensor:
        """Every DP rank's tokens, in rank order.

        Args:
            x: [T_r, H] this rank's hidden states (T_r may be 0).

        Returns:
            [sum T, H] in x's dtype on x's device; empty when no rank has a token (then `combine` is not called).
        """
        self._calls += 1
        n = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)
        counts = [torch.empty_like(n) for _ in range(self.size)]
        dist.all_gather(counts, n, group=self._tensor_group)
        self._counts = [int(c.item()) for c in counts]
        total = sum(self._counts)
        if total == 0:
            return x
        out = x.new_empty(total, x.shape[1])
        mine = x.shape[0]
        dist.all_to_all_single(out, x.repeat(self.size, 1), output_split_sizes=self._counts,
                               input_split_sizes=[mine] * self.size, group=self._tensor_group)
        return out

    def combine(self, partial: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the sum over the DP ranks of `partial`.

        Args:
            partial: [sum T, H] this rank's partial output for the tokens `dispatch` returned.

        Returns:
            [T_r, H]: rows of this rank's tokens, summed over the ranks in rank order.
        """
        mine = self._counts[self.rank]
        out = partial.new_empty(self.size * mine, partial.shape[1])
        dist.all_to_all_single(out, partial.contiguous(), output_split_sizes=[mine] * self.size,
                               input_split_sizes=self._counts, group=self._tensor_group)
        return out.view(self.size, mine, partial.shape[1]).sum(dim=0)

    def end_step(self, layers: list[torch.nn.Module], hidden_size: int, dtype: torch.dtype) -> bool:
        """Close one step: when this rank ran no forward, run every MoE layer (`layers`, the model's `SparseMoE`
        blocks in order) on zero tokens (the idle pass), so the other ranks' collectives find this rank's.
        Returns whether it ran the idle pass.

        Raises:
            RuntimeError: this rank ran a number of MoE layers that is not a whole number of forwards.
        """
        calls, self._calls = self._calls, 0
        if calls:
            if calls % len(layers):
                raise RuntimeError(f"DP rank {self.rank} ran {calls} MoE layers in one step, not a whole number of "
                                   f"forwards of {len(layers)}: the ranks' collectives no longer pair up")
            return False
        empty = torch.empty(0, hidden_size, dtype=dtype, device=self.device)
        for layer in layers:
            layer(empty)
        self._calls = 0
        return True


def init_dp_group(rank: int, size: int, master: tuple[str, int], device: torch.device) -> TPGroup:
    """Join the instance's DP ranks (every rank calls this with the same `master`; rank 0 listens there) and
    return this rank's attention group: one rank (the attention weights whole), whose ``moe`` is the
    `DPMoEGroup` of all of them.

    Raises:
        RuntimeError: the rendezvous failed or a rank did not arrive in time (`init_tp_group`).
    """
    moe = init_tp_group(rank, size, master, device, cls=DPMoEGroup)
    return TPGroup(0, 1, device, moe_group=moe)
