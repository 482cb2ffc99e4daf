"""Block tables that live on the device, one persistent row per running request, appended to step by step.

The idea is vLLM V1's (its `BlockTable` in the `InputBatch` keeps a persistent
row per request and writes only new blocks) and SGLang's (`req_to_token_pool`,
a device table indexed by a request's slot); the code here is this project's.

Two halves:

- `BlockTableRows` (rank 0 only, host): which row each running request owns
  and how many of its pages the rows already hold. Each step it returns the
  step's row indices and the *edits*: rows to clear (a new owner, or a page
  list that changed other than by appending) and ``(row, first column, ids)``
  appends. Rows are handed back with `release` when a request leaves the
  running set (the scheduler's ``on_leave`` hook, wired by the engine).
- `DeviceBlockTable` (every rank, in its `Shard`): the int32 table on the
  device and its host mirror, edited identically on every rank from the same
  packed step (`pd_cluster.engine.packed_step`). The mirror gives the slot
  mapping on the host without reading the device back.

Memory is never sized by the context length: the table starts at
`INITIAL_ROWS` x `INITIAL_WIDTH` and doubles in either dimension only when a
step's edits reach past it (rows: the number of requests running at once;
width: the longest page list seen). It is never shrunk.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import torch

INITIAL_ROWS = 16
INITIAL_WIDTH = 16  # pages


@dataclass
class TableEdits:
    """One step's changes to the block table, as host int64 arrays.

    Attributes:
        clear: [C] rows to zero (and whose known length drops to 0) before the appends.
        seg_rows, seg_cols, seg_lens: [S] each; append ``seg_lens[s]`` page ids to row ``seg_rows[s]`` starting
            at column ``seg_cols[s]`` (which must equal that row's current length).
        ids: [sum(seg_lens)] the appended page ids, segment after segment.
    """

    clear: np.ndarray
    seg_rows: np.ndarray
    seg_cols: np.ndarray
    seg_lens: np.ndarray
    ids: np.ndarray


@dataclass
class _RowState:
    row: int
    table: list[int]   # the request's page list object the row was written from (identity is the cheap check)
    known: int         # pages of it the row holds
    last: int          # table[known - 1] when written (-1 when known == 0)


class BlockTableRows:
    """Rank 0's bookkeeping of the rows of the device block table (host only; no tensors).

    A request gets the lowest free row the first time it is in a step. Each later step
    appends only the pages its list gained. A list that changed other than by appending
    (another list object, fewer pages, or a different page at the last known column)
    has its row rewritten: cleared, then written from column 0.
    """

    def __init__(self) -> None:
        self._rows: dict[str, _RowState] = {}
        self._free: list[int] = []   # a heap of released rows, lowest first
        self._next = 0               # rows ever used; rows >= this are fresh
        self.rewrites = 0            # rows rewritten because a page list changed other than by appending

    @property
    def num_used(self) -> int:
        """Rows owned by requests now."""
        return len(self._rows)

    @property
    def num_allocated(self) -> int:
        """Rows ever handed out (the table's row count must cover them)."""
        return self._next

    def owner_rows(self) -> dict[str, int]:
        """Request id -> row, for tests and diagnostics."""
        return {rid: st.row for rid, st in self._rows.items()}

    def release(self, request_id: str) -> None:
        """The request left the running set (finished, aborted, retracted, handed off); its row is free.
        Unknown ids are ignored (a request that never ran)."""
        st = self._rows.pop(request_id, None)
        if st is not None:
            heapq.heappush(self._free, st.row)

    def _take_row(self) -> int:
        if self._free:
            return heapq.heappop(self._free)
        self._next += 1
        return self._next - 1

    def step(self, request_ids: list[str], tables: list[list[int]]) -> tuple[list[int], TableEdits]:
        """Rows of the step's requests (in order) and the edits that bring those rows up to date.

        Args:
            request_ids: the step's requests; tables: each one's page list (``Request.block_table``).
        """
        rows: list[int] = []
        clear: list[int] = []
        seg_rows: list[int] = []
        seg_cols: list[int] = []
        seg_lens: list[int] = []
        ids: list[int] = []
        for rid, bt in zip(request_ids, tables):
            st = self._rows.get(rid)
            n = len(bt)
            if st is None:
                st = self._rows[rid] = _RowState(self._take_row(), bt, 0, -1)
                clear.append(st.row)
                col = 0
            # The page manager only appends to a request's list or replaces the list (retraction, a prefix-cache
            # match at readmission); an edit inside the same list object would not be seen here.
            elif st.table is not bt or n < st.known or (st.known and bt[st.known - 1] != st.last):
                self.rewrites += 1
                clear.append(st.row)
                col = 0
            else:
                col = st.known
            if n > col:
                seg_rows.append(st.row)
                seg_cols.append(col)
                seg_lens.append(n - col)
                ids.extend(bt[col:])
            st.table, st.known, st.last = bt, n, (bt[-1] if n else -1)
            rows.append(st.row)
        edits = TableEdits(np.asarray(clear, dtype=np.int64), np.asarray(seg_rows, dtype=np.int64),
                           np.asarray(seg_cols, dtype=np.int64), np.asarray(seg_lens, dtype=np.int64),
                           np.asarray(ids, dtype=np.int64))
        return rows, edits


class DeviceBlockTable:
    """One rank's persistent block table: ``table`` [rows, width] int32 on `device` (page ids, 0 = the null
    page) with a host mirror ``host`` [rows, width] int32 and ``lengths`` [rows] int64 (pages each row holds).

    Args:
        device: where the table lives.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.host = np.zeros((INITIAL_ROWS, INITIAL_WIDTH), dtype=np.int32)
        self.lengths = np.zeros(INITIAL_ROWS, dtype=np.int64)
        self.table = torch.zeros(INITIAL_ROWS, INITIAL_WIDTH, dtype=torch.int32, device=self.device)
        self.grows = 0

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, width) of the device table now (both grow on demand)."""
        return tuple(self.table.shape)  # type: ignore[return-value]

    def _ensure(self, rows: int, width: int) -> None:
        """Grow (doubling) so that the table holds `rows` rows of `width` pages; contents are kept."""
        r0, w0 = self.host.shape
        if rows <= r0 and width <= w0:
            return
        r1, w1 = r0, w0
        while r1 < rows:
            r1 *= 2
        while w1 < width:
            w1 *= 2
        host = np.zeros((r1, w1), dtype=np.int32)
        host[:r0, :w0] = self.host
        table = torch.zeros(r1, w1, dtype=torch.int32, device=self.device)
        table[:r0, :w0].copy_(self.table)
        lengths = np.zeros(r1, dtype=np.int64)
        lengths[:r0] = self.lengths
        self.host, self.table, self.lengths = host, table, lengths
        self.grows += 1

    def apply_host(self, edits: TableEdits, step_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Apply `edits` to the host mirror (growing the table first if needed); returns the flat indices
        ([N] int64, into ``table.view(-1)``) and values ([N] int32) to write on the device with `apply_device`.

        Raises:
            ValueError: an append that does not start at its row's current length (a packing or bookkeeping
                bug: every rank would otherwise drift apart silently).
        """
        need_rows = 1 + max(int(step_rows.max(initial=-1)), int(edits.clear.max(initial=-1)),
                            int(edits.seg_rows.max(initial=-1)))
        ends = edits.seg_cols + edits.seg_lens
        self._ensure(need_rows, int(ends.max(initial=0)))
        held = self.lengths[edits.seg_rows]  # checked before anything changes: mirror and device stay equal
        held[np.isin(edits.seg_rows, edits.clear)] = 0
        if not np.array_equal(held, edits.seg_cols):
            raise ValueError(f"block-table append out of order: rows {edits.seg_rows.tolist()} hold "
                             f"{held.tolist()} pages, appends start at {edits.seg_cols.tolist()}")
        if edits.clear.size:
            self.host[edits.clear] = 0
            self.lengths[edits.clear] = 0
        if not edits.seg_rows.size:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)
        # column of every appended id: its segment's first column plus its offset within the segment
        starts = np.zeros(edits.seg_lens.size, dtype=np.int64)
        np.cumsum(edits.seg_lens[:-1], out=starts[1:])
        seg_of = np.repeat(np.arange(edits.seg_lens.size), edits.seg_lens)
        cols = edits.seg_cols[seg_of] + (np.arange(edits.ids.size) - starts[seg_of])
        rows = edits.seg_rows[seg_of]
        values = edits.ids.astype(np.int32)
        self.host[rows, cols] = values
        self.lengths[edits.seg_rows] = ends
        return rows * self.host.shape[1] + cols, values

    def apply_device(self, clear: torch.Tensor, flat_idx: torch.Tensor, values: torch.Tensor) -> None:
        """The device half of `apply_host`: zero rows `clear` ([C] int64), then write `values` ([N] int32) at
        `flat_idx` ([N] int64). All on the device, in stream order; nothing is read back."""
        if clear.numel():
            self.table.index_fill_(0, clear, 0)
        if flat_idx.numel():
            self.table.view(-1).index_copy_(0, flat_idx, values)

    def gather(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """The step's block tables: rows `rows` ([B] int64, device) of the first `width` columns, [B, width]
        int32, contiguous (a device gather, no host data)."""
        return self.table[:, :width].index_select(0, rows)
