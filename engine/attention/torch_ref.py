"""Reference paged attention in plain torch; runs on CPU and GPU.

Decode requests (one query each) are handled together: their pages are
gathered into a padded ``[B, H_kv, L, D]`` tensor and masked past each
request's length. To keep padding small, decodes are sorted by length and
split into a few groups, each padded only to its own longest request. A layer
with a window or chunk (`LayerAttention`) gathers only the pages its queries
can see.

Prefill chunks are handled one request at a time, in blocks of queries: each
block reads only the keys its queries can see (from the first visible position
of its first query to its last query), and a block holds at most
`PREFILL_SCORE_BUDGET` bytes of scores. So a chunk of ``c`` queries over a
context of ``n`` tokens never builds ``c x n`` scores; a windowed or chunked
layer's blocks read ``block + window`` keys, whatever the context. Both paths
read K and V back from the pool after storing them, so FP8 rounding is
identical for every path.

Per layer (`AttentionBackend.spec`): the scores are soft-capped first (Gemma 2:
``cap * tanh(s / cap)``), then masked (causal, window or chunk); the softmax is
in float32 and, with sinks (gpt-oss), its denominator also holds ``exp(sink)``
of the query's head, as transformers' eager attention computes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pd_cluster.engine.attention.base import AttentionBackend
from pd_cluster.engine.batch import ForwardBatch
from pd_cluster.engine.kv.pool import KVPool
from pd_cluster.engine.layer_attention import LayerAttention

MAX_DECODE_GROUPS = 4
MIN_GROUP_ROWS = 16
PREFILL_SCORE_BUDGET = 64 * 2**20  # bytes of one query block's scores (float32) in a prefill chunk
MIN_QUERY_BLOCK = 16


@dataclass
class _DecodeGroup:
    rows: torch.Tensor | None     # decode rows of this group (None: all rows, in order)
    block_tables: torch.Tensor    # [g, num_pages]
    seq_lens: torch.Tensor        # [g]
    num_pages: int                # pages of the group's longest request


def first_visible(spec: LayerAttention, positions: torch.Tensor) -> torch.Tensor:
    """`LayerAttention.first_visible` of each query position (any int tensor)."""
    if spec.kind == "sliding":
        return (positions - spec.window + 1).clamp(min=0)
    if spec.kind == "chunked":
        return positions - positions % spec.chunk_size
    return torch.zeros_like(positions)


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim in float32; with sinks [..., 1] broadcastable to scores' leading dims, each row's
    denominator also holds ``exp(sink)`` (transformers' gpt-oss: a sink column, softmax, the column dropped)."""
    scores = scores.float()
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    combined = torch.cat((scores, sinks.float().expand(*scores.shape[:-1], 1)), dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.softmax(combined, dim=-1)[..., :-1]


def softcap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    return scores if cap is None else torch.tanh(scores / cap) * cap


class TorchAttentionBackend(AttentionBackend):
    """The correctness reference for every other backend (see the base class contract)."""

    name = "torch"

    def prepare(self, batch: ForwardBatch, pool: KVPool) -> None:
        """Group the decode rows by length once per step; every layer reuses the groups (and the masks of each
        attention type, built on first use in the step)."""
        self._groups: list[_DecodeGroup] = []
        self._masks: dict[tuple[int, tuple[str, int]], tuple[torch.Tensor, torch.Tensor]] = {}
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
            self._groups.append(_DecodeGroup(rows, tables[:, :n_pages], seq.long(), n_pages))

    def _decode_view(self, gi: int, g: _DecodeGroup, spec: LayerAttention, ps: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(block tables [g, n] of the pages this layer type can see, invalid [g, 1, 1, n * ps])."""
        key = (gi, spec.mask_key)
        if key not in self._masks:
            seq = g.seq_lens
            dev = seq.device
            first = first_visible(spec, seq - 1)
            start = first // ps if spec.kind != "full" else torch.zeros_like(seq)
            n = int((-(-seq // ps) - start).max()) if spec.kind != "full" else g.num_pages
            cols = start[:, None] + torch.arange(n, device=dev)[None, :]
            tables = g.block_tables.gather(1, cols.clamp(max=g.num_pages - 1))
            pos = (cols[:, :, None] * ps + torch.arange(ps, device=dev)).reshape(len(seq), n * ps)
            invalid = (pos >= seq[:, None]) | (pos < first[:, None])
            self._masks[key] = (tables, invalid[:, None, None, :])
        return self._masks[key]

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                pool: KVPool, batch: ForwardBatch, sinks: torch.Tensor | None = None) -> torch.Tensor:
        pool.store_kv(layer, k, v, batch.slot_mapping)
        spec = self.spec(layer)
        sinks = sinks if spec.sinks else None
        out = torch.empty_like(q)
        nd = batch.num_decodes
        if nd:
            if getattr(self, "_prepared_for", None) is not batch:
                self.prepare(batch, pool)
            for gi, g in enumerate(self._groups):
                tables, invalid = self._decode_view(gi, g, spec, pool.page_size)
                qg = q[:nd] if g.rows is None else q[g.rows]
                o = self._decode(layer, qg, pool, tables, invalid, spec, sinks)
                if g.rows is None:
                    out[:nd] = o
                else:
                    out.index_copy_(0, g.rows, o)
        qsl = batch.query_start_loc_cpu
        for i in range(nd, batch.num_reqs):
            lo, hi = qsl[i], qsl[i + 1]
            self._prefill(layer, q[lo:hi], pool, batch, i, out[lo:hi], spec, sinks)
        return out.view(q.shape[0], -1)

    def _decode(self, layer: int, q: torch.Tensor, pool: KVPool, tables: torch.Tensor, invalid: torch.Tensor,
                spec: LayerAttention, sinks: torch.Tensor | None) -> torch.Tensor:
        b = q.shape[0]
        k, v = pool.gather(layer, tables)  # [b, Hkv, L, D]
        group = self.num_heads // self.num_kv_heads
        qg = q.view(b, self.num_kv_heads, group, self.head_dim).to(k.dtype)
        scores = softcap(torch.matmul(qg, k.transpose(-1, -2)) * self.scale, spec.logit_softcap)  # [b, Hkv, G, L]
        scores.masked_fill_(invalid, float("-inf"))
        s = None if sinks is None else sinks.view(1, self.num_kv_heads, group, 1)
        probs = softmax_with_sinks(scores, s).to(v.dtype)
        return torch.matmul(probs, v).reshape(b, self.num_heads, self.head_dim).to(q.dtype)

    def _prefill(self, layer: int, q: torch.Tensor, pool: KVPool, batch: ForwardBatch, i: int,
                 out: torch.Tensor, spec: LayerAttention, sinks: torch.Tensor | None) -> None:
        """One request's chunk, in query blocks that each read only the keys they can see (module docstring)."""
        seq_len = batch.seq_lens_cpu[i]
        q_len = q.shape[0]
        ps = pool.page_size
        first_q = seq_len - q_len
        lo_page = spec.first_visible(first_q) // ps
        num_pages = -(-seq_len // ps)
        k, v = pool.gather(layer, batch.block_tables[i: i + 1, lo_page:num_pages])
        base = lo_page * ps
        k, v = k[0, :, :seq_len - base], v[0, :, :seq_len - base]  # [Hkv, S', D], positions base..seq_len-1
        group = self.num_heads // self.num_kv_heads
        qh = q.view(q_len, self.num_kv_heads, group, self.head_dim).permute(1, 2, 0, 3).to(k.dtype)
        s = None if sinks is None else sinks.view(self.num_kv_heads, group, 1, 1)
        span = spec.max_visible or seq_len
        block = max(MIN_QUERY_BLOCK, PREFILL_SCORE_BUDGET // (4 * self.num_heads * (span + MIN_QUERY_BLOCK)))
        for r0 in range(0, q_len, block):
            r1 = min(r0 + block, q_len)
            q_pos = torch.arange(first_q + r0, first_q + r1, device=q.device)[:, None]
            key_lo = spec.first_visible(first_q + r0) - base
            key_hi = first_q + r1 - base
            k_pos = torch.arange(base + key_lo, base + key_hi, device=q.device)[None, :]
            scores = torch.matmul(qh[:, :, r0:r1], k[:, None, key_lo:key_hi].transpose(-1, -2)) * self.scale
            scores = softcap(scores, spec.logit_softcap)  # [Hkv, G, rows, keys]
            invalid = (k_pos > q_pos) | (k_pos < first_visible(spec, q_pos))
            scores.masked_fill_(invalid, float("-inf"))
            probs = softmax_with_sinks(scores, s).to(v.dtype)
            o = torch.matmul(probs, v[:, None, key_lo:key_hi])  # [Hkv, G, rows, D]
            out[r0:r1].copy_(o.permute(2, 0, 1, 3).reshape(r1 - r0, self.num_heads, self.head_dim))
