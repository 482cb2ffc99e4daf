"""Which prefill rank sends which KV heads to which decode rank, when the two workers' TP sizes differ.

Each TP rank of a worker holds its own pool: with ``mha`` pages, its share of the KV heads (rank ``r`` of ``tp``
holds heads ``[r * H / tp, (r + 1) * H / tp)`` of the model's ``H``; when ``tp > H`` each head is replicated on
``tp / H`` ranks, rank ``r`` holding head ``r * H // tp``); with ``mla`` pages, the whole latent (the same bytes on
every rank). A decode rank receives exactly its own heads:

- ``mha``: each of its heads from one prefill rank that holds it (of several holders, the one of index
  ``decode_rank % holders``, so replicas spread the load); consecutive heads from one prefill rank are one
  `HeadSlice`. P TP 2 -> D TP 1: decode rank 0 takes heads 0..H/2-1 from prefill rank 0 and the rest from
  prefill rank 1. P TP 1 -> D TP 2: prefill rank 0 sends each decode rank its half.
- ``mla``: the latent once, from prefill rank ``decode_rank % prefill_tp``; no prefill rank sends the same bytes
  to one decode rank twice, and a prefill rank no decode rank needs sends nothing.

A `Part` whose slices cover both ranks' pages entirely (same TP size: rank ``r`` to rank ``r``) moves whole pages,
the descriptors of `pd_cluster.transfer.descriptors`; otherwise each page is cut into one byte range per
(layer slot, K/V plane, head slice) on both sides (`slice_descs`): the page-major order
``[page, layer, kv, head, token, dim]`` keeps the tokens of one head and plane contiguous.

Idea: SGLang's ``test_disaggregation_different_tp`` setups and vLLM's NIXL connector with heterogeneous TP
(a decode rank reads its heads from the prefill ranks that hold them); written here for a push protocol.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class HeadSlice:
    """A run of KV heads moved as one: rank-local head `src_head..+num_heads` of the prefill pool's pages into
    rank-local `dst_head..+num_heads` of the decode pool's."""

    src_head: int
    dst_head: int
    num_heads: int


@dataclass(frozen=True)
class Part:
    """One (prefill rank, decode rank) pair of a transfer; `slices` empty: whole pages."""

    prefill_rank: int
    decode_rank: int
    slices: tuple[HeadSlice, ...] = ()

    @property
    def whole_pages(self) -> bool:
        return not self.slices


def rank_heads(num_heads: int, tp_size: int, rank: int) -> tuple[int, ...]:
    """The model's KV heads held by `rank` of `tp_size` (module doc), in pool order.

    Raises:
        ValueError: neither divides the other (no engine shards heads so).
    """
    if num_heads < 1 or tp_size < 1 or not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} of TP {tp_size} with {num_heads} KV heads")
    if tp_size <= num_heads:
        if num_heads % tp_size:
            raise ValueError(f"{num_heads} KV heads do not split over TP {tp_size}")
        per = num_heads // tp_size
        return tuple(range(rank * per, (rank + 1) * per))
    if tp_size % num_heads:
        raise ValueError(f"TP {tp_size} is not a multiple of {num_heads} KV heads (replication)")
    return (rank * num_heads // tp_size,)


def plan_parts(kv_format: str, num_heads: int, prefill_tp: int, decode_tp: int) -> tuple[Part, ...]:
    """Every part of one transfer, decode rank by decode rank (module doc).

    Args:
        kv_format: ``mha`` or ``mla``.
        num_heads: the model's KV heads (``mha``), ignored for ``mla``.

    Raises:
        ValueError: a TP size does not shard `num_heads` (`rank_heads`).
    """
    if kv_format == "mla":
        return tuple(Part(d % prefill_tp, d) for d in range(decode_tp))
    holders: dict[int, list[int]] = {}
    for p in range(prefill_tp):
        for h in rank_heads(num_heads, prefill_tp, p):
            holders.setdefault(h, []).append(p)
    parts: list[Part] = []
    for d in range(decode_tp):
        mine = rank_heads(num_heads, decode_tp, d)
        by_src: dict[int, list[HeadSlice]] = {}
        for j, h in enumerate(mine):
            src = holders[h][d % len(holders[h])]
            local = rank_heads(num_heads, prefill_tp, src).index(h)
            runs = by_src.setdefault(src, [])
            last = runs[-1] if runs else None
            if last and last.src_head + last.num_heads == local and last.dst_head + last.num_heads == j:
                runs[-1] = HeadSlice(last.src_head, last.dst_head, last.num_heads + 1)
            else:
                runs.append(HeadSlice(local, j, 1))
        for src, runs in sorted(by_src.items()):
            whole = (len(runs) == 1 and runs[0].src_head == 0 and runs[0].dst_head == 0
                     and runs[0].num_heads == len(mine) == len(rank_heads(num_heads, prefill_tp, src)))
            parts.append(Part(src, d, () if whole else tuple(runs)))
    return tuple(parts)


def describe(parts: tuple[Part, ...], kv_format: str, prefill_tp: int, decode_tp: int) -> str:
    """One line saying what the plan converts (logged at the handshake)."""
    if prefill_tp == decode_tp:
        return f"TP {prefill_tp} -> {decode_tp}: rank r to rank r, whole pages"
    what = []
    for part in parts:
        if part.whole_pages:
            what.append(f"decode rank {part.decode_rank} <- prefill rank {part.prefill_rank} "
                        f"({'the latent' if kv_format == 'mla' else 'all its heads'})")
        else:
            heads = ", ".join(f"heads {s.src_head}..{s.src_head + s.num_heads - 1} as "
                              f"{s.dst_head}..{s.dst_head + s.num_heads - 1}" for s in part.slices)
            what.append(f"decode rank {part.decode_rank} <- prefill rank {part.prefill_rank} ({heads})")
    kind = "latent replicated, sent once per decode rank" if kv_format == "mla" else "KV heads split/merged"
    return f"TP {prefill_tp} -> {decode_tp} ({kind}): " + "; ".join(what)


@dataclass(frozen=True)
class PageGeometry:
    """The byte geometry of one pool's page (`KVLayout`): ``[layer slots, planes, heads, tokens, dim]``."""

    page_nbytes: int
    page_layers: int
    num_planes: int
    num_heads: int
    head_nbytes: int  # one head's tokens of one plane: page_size * head_dim * element size

    @classmethod
    def of(cls, layout: dict) -> PageGeometry:
        """From `KVLayout.to_dict()` (an `AgentInfo.layout`)."""
        sizes = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8_e4m3": 1}
        planes = 1 if layout.get("kv_format", "mha") == "mla" else 2
        layers = int(layout.get("layers_per_page") or layout["num_layers"])
        head = int(layout["page_size"]) * int(layout["head_dim"]) * sizes[str(layout["kv_cache_dtype"])]
        return cls(int(layout["page_nbytes"]), layers, planes, int(layout["num_kv_heads"]), head)

    def slice_nbytes(self, slices: tuple[HeadSlice, ...]) -> int:
        """Bytes per page that `slices` move."""
        return self.page_layers * self.num_planes * sum(s.num_heads for s in slices) * self.head_nbytes


def slice_descs(base: int, geom: PageGeometry, pages: np.ndarray, slices: tuple[HeadSlice, ...], src: bool,
                device_id: int) -> np.ndarray:
    """NIXL descriptor rows of `slices` in each of `pages` of one pool, in the same order on both sides.

    Args:
        pages: [N] int64 page ids.
        src: True: the slices' `src_head` (this pool sends), False: their `dst_head`.

    Returns:
        [N * layer slots * planes * len(slices), 3] uint64 ``(address, nbytes, device_id)``.
    """
    heads = np.asarray([s.src_head if src else s.dst_head for s in slices], dtype=np.uint64)
    lengths = np.asarray([s.num_heads for s in slices], dtype=np.uint64) * np.uint64(geom.head_nbytes)
    planes = np.arange(geom.page_layers * geom.num_planes, dtype=np.uint64) * np.uint64(geom.num_heads)
    within = (planes[:, None] + heads[None, :]) * np.uint64(geom.head_nbytes)           # [LP, S]
    starts = np.uint64(base) + pages.astype(np.uint64) * np.uint64(geom.page_nbytes)     # [N]
    addr = starts[:, None, None] + within[None, :, :]
    out = np.empty((addr.size, 3), dtype=np.uint64)
    out[:, 0] = addr.reshape(-1)
    out[:, 1] = np.broadcast_to(lengths[None, None, :], addr.shape).reshape(-1)
    out[:, 2] = np.uint64(device_id)
    return out
