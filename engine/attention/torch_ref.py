"""Reference paged attention in plain torch; runs on CPU and GPU.

Decode requests (one query each) are handled together: their pages are
gathered into a padded ``[B, H_kv, L, D]`` tensor and masked past each
request's length. To keep padding small, decodes are sorted by length and
split into a few groups, each padded only to its own longest request.
Prefill chunks are handled one request at a time with a causal mask offset by
the request's cached length. Both read K and V back from the pool after
storing them, so FP8 rounding is identical for every path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pd_cluster.engine.attention.base import AttentionBackend
from pd_cluster.engine.batch import ForwardBatch
from pd_cluster.engine.kv.pool import KVPool

MAX_DECODE_GROUPS = 4
MIN_GROUP_ROWS = 16


@dataclass
class _DecodeGroup:
    rows: torch.Tensor | None     # decode rows of this group (None: all rows, in order)
    block_tables: torch.Tensor    # [g, num_pages]
    invalid: torch.Tensor         # [g, 1, 1, num_pages * page_size] True past each row's length


class TorchAttentionBackend(AttentionBackend):
    """The correctness reference for every other backend (see the base class contract)."""

    name = "torch"

    def prepare(self, batch: ForwardBatch, pool: KVPool) -> None:
        """Group the decode rows by length once per step; every layer reuses the groups."""
        self._groups: list[_DecodeGroup] = []
        self._prepared_for = batch
        nd = batch.num_decodes
        if not nd:
            return
        ps = pool.page_size
        lens = np.asarray(batch.seq_lens_cpu[:nd])
        pages = -(-lens // ps)
        order = np.argsort(pages, kind="stable")
        n_groups = 1 if nd < 2 * MIN_GROUP_ROWS else min(MAX_DECODE_GROUPS, nd // MIN_GROUP_ROWS)
        dev = batch.seq_lens.device
        for chunk in np.array_split(order, n_groups):
            if chunk.size == 0:
                continue
            whole = n_groups == 1 and bool(np.all(chunk == np.arange(nd)))
            rows = None if whole else torch.from_numpy(chunk).to(dev)
            n_pages = int(pages[chunk].max())
            tables = batch.block_tables[:nd] if rows is None else batch.block_tables[rows]
            seq = batch.seq_lens[:nd] if rows is None else batch.seq_lens[rows]
            pos = torch.arange(n_pages * ps, device=dev)
            invalid = pos[None, :] >= seq[:, None]
            if self.sliding_window is not None:
                invalid |= pos[None, :] < (seq[:, None] - self.sliding_window)
            self._groups.append(_DecodeGroup(rows, tables[:, :n_pages], invalid[:, None, None, :]))

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                pool: KVPool, batch: ForwardBatch) -> torch.Tensor:
        pool.store_kv(layer, k, v, batch.slot_mapping)
        out = torch.empty_like(q)
        nd = batch.num_decodes
        if nd:
            if getattr(self, "_prepared_for", None) is not batch:
                self.prepare(batch, pool)
            for g in self._groups:
                self._decode(layer, q[:nd] if g.rows is None else q[g.rows], pool, g, out, nd)
        qsl = batch.query_start_loc_cpu
        for i in range(nd, batch.num_reqs):
            lo, hi = qsl[i], qsl[i + 1]
            self._prefill(layer, q[lo:hi], pool, batch, i, out[lo:hi])
        return out.view(q.shape[0], -1)

    def _decode(self, layer: int, q: torch.Tensor, pool: KVPool, g: _DecodeGroup, out: torch.Tensor,
                nd: int) -> None:
        b = q.shape[0]
        k, v = pool.gather(layer, g.block_tables)  # [b, Hkv, L, D]
        group = self.num_heads // self.num_kv_heads
        qg = q.view(b, self.num_kv_heads, group, self.head_dim).to(k.dtype)
        scores = torch.matmul(qg, k.transpose(-1, -2)) * self.scale  # [b, Hkv, G, L]
        scores.masked_fill_(g.invalid, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        o = torch.matmul(probs, v).reshape(b, self.num_heads, self.head_dim).to(out.dtype)
        if g.rows is None:
            out[:nd] = o
        else:
            out.index_copy_(0, g.rows, o)

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
