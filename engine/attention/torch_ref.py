"""Reference paged attention in plain torch; runs on CPU and GPU.

Decode requests (one query each) are handled together: their pages are
gathered into a padded ``[B, H_kv, L, D]`` tensor and masked past each
request's length. Prefill chunks are handled one request at a time with a
causal mask offset by the request's cached length. Both read K and V back from
the pool after storing them, so FP8 rounding is identical for every path.
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend
from engine.batch import ForwardBatch
from engine.kv.pool import KVPool


class TorchAttentionBackend(AttentionBackend):
    """The correctness reference for every other backend (see the base class contract)."""

    name = "torch"

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                pool: KVPool, batch: ForwardBatch) -> torch.Tensor:
        pool.store_kv(layer, k, v, batch.slot_mapping)
        out = torch.empty_like(q)
        nd = batch.num_decodes
        if nd:
            self._decode(layer, q[:nd], pool, batch, out[:nd])
        qsl = batch.query_start_loc_cpu
        for i in range(nd, batch.num_reqs):
            lo, hi = qsl[i], qsl[i + 1]
            self._prefill(layer, q[lo:hi], pool, batch, i, out[lo:hi])
        return out.view(q.shape[0], -1)

    def _decode(self, layer: int, q: torch.Tensor, pool: KVPool, batch: ForwardBatch, out: torch.Tensor) -> None:
        nd = q.shape[0]
        seq_lens = batch.seq_lens[:nd]
        max_len = max(batch.seq_lens_cpu[:nd])
        num_pages = -(-max_len // pool.page_size)
        k, v = pool.gather(layer, batch.block_tables[:nd, :num_pages])  # [B, Hkv, L, D]
        group = self.num_heads // self.num_kv_heads
        qg = q.view(nd, self.num_kv_heads, group, self.head_dim).to(k.dtype)
        scores = torch.matmul(qg, k.transpose(-1, -2)) * self.scale  # [B, Hkv, G, L]
        pos = torch.arange(k.shape[2], device=q.device)
        invalid = pos[None, :] >= seq_lens[:, None]
        if self.sliding_window is not None:
            invalid |= pos[None, :] < (seq_lens[:, None] - self.sliding_window)
        scores.masked_fill_(invalid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        out.copy_(torch.matmul(probs, v).reshape(nd, self.num_heads, self.head_dim))

    def _prefill(self, layer: int, q: torch.Tensor, pool: KVPool, batch: ForwardBatch, i: int,
                 out: torch.Tensor) -> None:
        seq_len = batch.seq_lens_cpu[i]
        q_len = q.shape[0]
        num_pages = -(-seq_len // pool.page_size)
        k, v = pool.gather(layer, batch.block_tables[i : i + 1, :num_pages])
        k, v = k[0, :, :seq_len], v[0, :, :seq_len]  # [Hkv, S, D]
        group = self.num_heads // self.num_kv_heads
        qh = q.view(q_len, self.num_kv_heads, group, self.head_dim).permute(1, 2, 0, 3).to(k.dtype)
        scores = torch.matmul(qh, k[:, None].transpose(-1, -2)) * self.scale  # [Hkv, G, q_len, S]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        invalid = k_pos > q_pos
        if self.sliding_window is not None:
            invalid |= k_pos <= q_pos - self.sliding_window
        scores.masked_fill_(invalid, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        o = torch.matmul(probs, v[:, None])  # [Hkv, G, q_len, D]
        out.copy_(o.permute(2, 0, 1, 3).reshape(q_len, self.num_heads, self.head_dim))
