"""From page ids to NIXL descriptors, vectorised in numpy.

The engine's pool is page-major (``kv[page, layer, k/v, head, token, dim]``):
one page holds every layer's K and V of `page_size` tokens in `page_nbytes`
contiguous bytes, so the byte range of page ``p`` is
``base + p * page_nbytes`` for ``page_nbytes`` bytes, all layers at once.
A run of pages that is consecutive on both sides is one descriptor. Fresh
requests get runs of consecutive pages from the allocator, so a request's KV
is usually one or a few descriptors, whatever its length (vLLM RFC #50913
measured tens of thousands of ~8 KB descriptors for a 5k-token pull with a
layer-major layout).

A descriptor array is ``[N, 3]`` uint64 rows ``(address, length, device_id)``,
the form `nixl_agent.get_xfer_descs` takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PageRuns:
    """Runs of pages consecutive on both sides.

    Attributes:
        src_start, dst_start: [N] int64 first page id of each run.
        length: [N] int64 pages per run.
    """

    src_start: np.ndarray
    dst_start: np.ndarray
    length: np.ndarray

    @property
    def num_runs(self) -> int:
        return int(self.length.shape[0])

    @property
    def num_pages(self) -> int:
        return int(self.length.sum())


def validate_pages(pages: np.ndarray, num_pages: int, side: str) -> None:
    """Check page ids are real pages of a pool (1..num_pages) and not repeated.

    Raises:
        ValueError: naming `side`, the offending id and the pool size.
    """
    if pages.size == 0:
        return
    lo, hi = int(pages.min()), int(pages.max())
    if lo < 1 or hi > num_pages:
        bad = lo if lo < 1 else hi
        raise ValueError(f"{side} page id {bad} is outside 1..{num_pages} (0 is the null page)")
    if not (np.diff(pages) > 0).all() and (np.diff(np.sort(pages)) == 0).any():  # sorted: a cheap pass
        raise ValueError(f"{side} page ids repeat: {pages.tolist()[:16]}")


def page_runs(src_pages, dst_pages) -> PageRuns:
    """Merge pages into runs that are consecutive in both `src_pages` and `dst_pages`.

    Args:
        src_pages, dst_pages: equal-length sequences of int page ids (pairwise: page
            ``src_pages[i]`` goes to ``dst_pages[i]``).

    Raises:
        ValueError: the lengths differ.
    """
    src = np.asarray(src_pages, dtype=np.int64).reshape(-1)
    dst = np.asarray(dst_pages, dtype=np.int64).reshape(-1)
    if src.shape != dst.shape:
        raise ValueError(f"{src.size} source pages but {dst.size} destination pages")
    if src.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return PageRuns(empty, empty, empty)
    cont = (np.diff(src) == 1) & (np.diff(dst) == 1)
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    length = np.diff(np.append(starts, src.size))
    return PageRuns(src[starts], dst[starts], length)


def run_descs(base: int, page_nbytes: int, starts: np.ndarray, length: np.ndarray, device_id: int) -> np.ndarray:
    """Descriptor rows for runs of pages of one pool.

    Args:
        base: address of page 0 (the pool tensor's data pointer).
        page_nbytes: bytes per page (its stride).
        starts, length: [N] int64 first page and page count of each run.
        device_id: GPU index (0 for host memory).

    Returns:
        [N, 3] uint64 ``(address, nbytes, device_id)``.
    """
    out = np.empty((starts.shape[0], 3), dtype=np.uint64)
    out[:, 0] = np.uint64(base) + starts.astype(np.uint64) * np.uint64(page_nbytes)
    out[:, 1] = length.astype(np.uint64) * np.uint64(page_nbytes)
    out[:, 2] = np.uint64(device_id)
    return out
