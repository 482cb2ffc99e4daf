"""Data-parallel attention: the MoE layers' group across the DP ranks of one engine instance.

SGLang's ``--enable-dp-attention`` (``--tp-size N --dp-size N``): each of the N
ranks runs attention for its own requests, on its own KV pool, with the
attention weights (and the dense layers, embeddings and LM head) whole; only
the MoE layers are shared. Their experts are split over the N ranks, and each
MoE layer of a step runs one of two exchanges.

**Experts split by width (tensor parallel, the default): all-gather + reduce-scatter.**

1. exchange the ranks' token counts ``[T_0 .. T_{N-1}]`` (an all-gather of one int64 each);
2. **dispatch**: every rank's hidden states, in rank order, ``[sum T, H]`` on every rank (an all-gather of
   uneven sizes, made as one ``all_to_all_single``);
3. this rank's partial output for all those tokens (its slice of every expert and of the shared experts);
4. **combine**: each rank receives every rank's partial rows of its own tokens and adds them in rank order
   (a reduce-scatter of uneven sizes, one ``all_to_all_single``).

**Whole experts (``--enable-expert-parallel``): routed all-to-all.** Each rank routes its own tokens, then
(`DPMoEGroup.dispatch_routed`) sends each token once to every rank holding one of its chosen experts, with
its expert ids and weights (an all-to-all of the counts, then of the hidden states and of the choices); each
rank runs its experts on what it received (the other ranks' choices are -1 there) and sends each row back
(`combine_routed`), where a token's parts are added in rank order. The shared experts are whole on every
rank and run on the rank's own tokens, with no exchange. A token crosses to at most ``min(N, k)`` ranks,
against N for the all-gather (SGLang's DeepEP normal mode, without its kernels).

The ranks step in lockstep: every rank runs one forward per step, and a rank
with no work runs an idle pass (`DPMoEGroup.end_step`: each MoE layer with zero
tokens), so the collectives of every layer pair up. Collectives go over
``torch.distributed``: gloo on CPU, NCCL on GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pd_cluster.engine.parallel.group import TPGroup, init_tp_group


@dataclass
class DPMoEGroup(TPGroup):
    """The MoE layers' group under DP attention: `rank` of `size` DP ranks.

    `SparseMoE` calls `dispatch` then `combine` (or `dispatch_routed` then `combine_routed`) once per layer; `end_step` closes each step (an idle pass
    when this rank ran no forward).
    """

    gathers_tokens = True
    _counts: list[int] = field(default_factory=list)
    _calls: int = 0
    _send: list[int] = field(default_factory=list)  # routed dispatch: tokens sent to / received from each rank
    _recv: list[int] = field(default_factory=list)
    _token: torch.Tensor | None = None  # routed dispatch: which of this rank's tokens each sent row is
    eplb: Any = None  # this rank's `ExpertBalancer` (`pd_cluster.engine.model.eplb`): told of every lockstep step

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

    def dispatch_routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts_per_rank: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert parallelism: send each token, once, to every rank that holds one of its experts (rank d holds
        experts ``[d E_r, (d + 1) E_r)``), with its choices.

        Args:
            x: [T_r, H] this rank's hidden states; weights: [T_r, k] (float32 or x's dtype); ids: [T_r, k] int64
                global expert ids.
            experts_per_rank: E_r.

        Returns:
            (received [R, H] in x's dtype, their weights [R, k] in weights' dtype, their ids [R, k] int64): the
            tokens other ranks (and this one) sent here, in source rank order.
        """
        self._calls += 1
        owner = ids // experts_per_rank
        ranks = torch.arange(self.size, device=x.device).view(-1, 1, 1)
        dest, token = (owner.unsqueeze(0) == ranks).any(dim=-1).nonzero(as_tuple=True)  # by dest, then token
        send = torch.bincount(dest, minlength=self.size)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self._tensor_group)
        self._send, self._recv, self._token = send.tolist(), recv.tolist(), token
        k = ids.shape[1]
        meta = torch.cat([ids[token].to(torch.float32), weights[token].to(torch.float32)], dim=1)  # ids < 2^24
        received = x.new_empty(sum(self._recv), x.shape[1])
        r_meta = meta.new_empty(received.shape[0], 2 * k)
        dist.all_to_all_single(received, x[token], self._recv, self._send, group=self._tensor_group)
        dist.all_to_all_single(r_meta, meta, self._recv, self._send, group=self._tensor_group)
        return received, r_meta[:, k:].to(weights.dtype), r_meta[:, :k].long()

    def combine_routed(self, partial: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Send each received token's partial output back to its rank and add up each token's parts.

        Args:
            partial: [R, H] this rank's experts' weighted sum for the tokens `dispatch_routed` returned.
            num_tokens: T_r, this rank's tokens.

        Returns:
            [T_r, H] in partial's dtype: each token's sum over the ranks of its experts, in rank order.
        """
        back = partial.new_empty(sum(self._send), partial.shape[1])
        dist.all_to_all_single(back, partial.contiguous(), self._send, self._recv, group=self._tensor_group)
        return partial.new_zeros(num_tokens, partial.shape[1]).index_add_(0, self._token, back)

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
            idled = False
        else:
            empty = torch.empty(0, hidden_size, dtype=dtype, device=self.device)
            for layer in layers:
                layer(empty)
            self._calls = 0
            idled = True
        if self.eplb is not None:  # every rank closes the same steps: a rebalance pairs up
            self.eplb.step_done()
        return idled


def init_dp_group(rank: int, size: int, master: tuple[str, int], device: torch.device) -> TPGroup:
    """Join the instance's DP ranks (every rank calls this with the same `master`; rank 0 listens there) and
    return this rank's attention group: one rank (the attention weights whole), whose ``moe`` is the
    `DPMoEGroup` of all of them.

    Raises:
        RuntimeError: the rendezvous failed or a rank did not arrive in time (`init_tp_group`).
    """
    moe = init_tp_group(rank, size, master, device, cls=DPMoEGroup)
    return TPGroup(0, 1, device, moe_group=moe)
