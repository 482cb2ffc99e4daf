"""A step's inputs as one flat int64 array, and how every rank turns it into its `ForwardBatch`.

Rank 0 packs (`pack_step`); under tensor parallelism it broadcasts the header,
then the payload, as two tensors (`pd_cluster.engine.executor.tp`), not a
pickled object (SGLang instead runs a scheduler on every rank and broadcasts
the incoming requests pickled, ``broadcast_pyobj``); every rank, rank 0
included, decodes the same arrays with `build_step` against its own
`DeviceBlockTable`, so a packing bug cannot hide on one side.

Layout (all int64)::

    header  [HEADER_LEN]: STEP_MAGIC, B, num_decodes, T, L, C, S, N, F, P, G, R
    payload: token ids [T] | start positions [B] | query lengths [B] | table rows [B] | logits rows [L]
             | rows to clear [C] | append rows [S] | append first columns [S] | append lengths [S]
             | appended page ids [N] | future token positions [F] | their rows of the previous tokens [F]
             | table rows of KV groups 1..G [G * B] | longrope factor sets [R * B]

B requests (decodes first), T tokens, L logits rows (indices into the T tokens),
the block-table edits of `pd_cluster.engine.block_tables.TableEdits`, and
(overlap scheduling, `pd_cluster.engine.overlap`) F input tokens still being
sampled by the previous step: their ids come from its P sampled ids on the
device (rank 0's, broadcast to the other ranks on the device group). With KV cache groups
(`pd_cluster.engine.kv.groups`) every request has one table row per group, all in the one device table: the
rows above are group 0's, and G more rows per request follow; the edits cover every group's rows. R is 1
when some request of the step rotates by longrope's long factors (`Request.rope_variant`): each request's set
follows (0 short, 1 long); with R 0 every token rotates by the short ones.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from pd_cluster.engine.batch import ForwardBatch, HostStaging, token_layout, upload
from pd_cluster.engine.block_tables import DeviceBlockTable, TableEdits

HEADER_LEN = 12
STEP_MAGIC = 0x53544550_0004  # "STEP", layout version 4
COMMAND_MAGIC = 0x434D4E44_0001  # "CMND": a pickled command follows (pd_cluster.engine.executor.tp)


@dataclass
class StepArrays:
    """A decoded step: views into the packed payload (int64 arrays).

    Attributes:
        input_ids: [T]; starts: [B] position of each request's first new token; query_lens: [B];
        rows: [B] block-table rows; logits: [L] token rows whose logits are needed; num_decodes: leading decodes;
        edits: the block-table edits; future_pos: [F] token positions whose id is the previous step's
        ``future_src`` [F] row of its sampled ids (of which there are ``num_prev``); group_rows: [G, B] table rows
        of KV groups 1..G (G is 0 with one group); rope_variants: [B] longrope factor set of each request, None
        when all are 0.
    """

    input_ids: np.ndarray
    starts: np.ndarray
    query_lens: np.ndarray
    rows: np.ndarray
    logits: np.ndarray
    num_decodes: int
    edits: TableEdits
    future_pos: np.ndarray
    future_src: np.ndarray
    num_prev: int
    group_rows: np.ndarray | None = None
    rope_variants: np.ndarray | None = None


def pack_step(input_ids: list[int], starts: list[int], query_lens: list[int], rows: list[int], logits: list[int],
              num_decodes: int, edits: TableEdits, future_pos: list[int] = (), future_src: list[int] = (),
              num_prev: int = 0, group_rows: list[list[int]] = (), rope_variants: list[int] = ()) -> np.ndarray:
    """The flat int64 array ``header + payload`` of one step (see the module docstring).

    Args:
        group_rows: per KV group after the first, the table row of each request (in `rows`' order).
        rope_variants: each request's longrope factor set; packed only when one of them is 1.
    """
    b, t, n_l = len(starts), len(input_ids), len(logits)
    c, s, n, f, g = edits.clear.size, edits.seg_rows.size, edits.ids.size, len(future_pos), len(group_rows)
    variants = [rope_variants] if any(rope_variants) else []
    out = np.empty(HEADER_LEN + t + 3 * b + n_l + c + 3 * s + n + 2 * f + (g + len(variants)) * b, dtype=np.int64)
    out[:HEADER_LEN] = (STEP_MAGIC, b, num_decodes, t, n_l, c, s, n, f, num_prev, g, len(variants))
    o = HEADER_LEN
    for part in (input_ids, starts, query_lens, rows, logits, edits.clear, edits.seg_rows, edits.seg_cols,
                 edits.seg_lens, edits.ids, future_pos, future_src, *group_rows, *variants):
        k = len(part)
        out[o:o + k] = part
        o += k
    return out


def payload_len(header: np.ndarray) -> int:
    """Payload elements announced by `header` ([HEADER_LEN] int64).

    Raises:
        ValueError: not a step header.
    """
    if int(header[0]) != STEP_MAGIC:
        raise ValueError(f"not a packed step header: {header.tolist()}")
    _, b, _, t, n_l, c, s, n, f, _, g, r = (int(x) for x in header)
    return t + 3 * b + n_l + c + 3 * s + n + 2 * f + (g + r) * b


def unpack_step(header: np.ndarray, payload: np.ndarray) -> StepArrays:
    """Views of `payload` as a `StepArrays` (no copies).

    Raises:
        ValueError: not a step header, or a payload of the wrong length.
    """
    size = payload_len(header)
    if payload.size != size:
        raise ValueError(f"packed step payload has {payload.size} elements, its header announces {size}")
    _, b, nd, t, n_l, c, s, n, f, n_prev, g, r = (int(x) for x in header)
    parts, o = [], 0
    for k in (t, b, b, b, n_l, c, s, s, s, n, f, f):
        parts.append(payload[o:o + k])
        o += k
    ids, starts, qlens, rows, logits, clear, seg_rows, seg_cols, seg_lens, pages, fpos, fsrc = parts
    group_rows = payload[o:o + g * b].reshape(g, b) if g else None
    variants = payload[o + g * b:o + (g + r) * b] if r else None
    return StepArrays(ids, starts, qlens, rows, logits, nd, TableEdits(clear, seg_rows, seg_cols, seg_lens, pages),
                      fpos, fsrc, n_prev, group_rows, variants)


def build_step(step: StepArrays, table: DeviceBlockTable, page_size: int, staging: HostStaging | None,
               state_pages: dict[int, int] | None = None) -> ForwardBatch:
    """Apply the step's block-table edits to `table` and assemble its `ForwardBatch` on the table's device.

    One upload carries the step's index arrays and the edits; the edits are then applied on the device and the
    step's ``block_tables`` [B, W] int32 is a device gather of its rows (W: the most pages any of them holds).
    Slots come from the host mirror.

    `state_pages` maps a state group (`pd_cluster.engine.kv.groups`: index among the groups) to the pages each of
    its rows holds, whatever the tokens; its slots are -1 (no token is stored there).

    Raises:
        ValueError: a row does not hold the pages its request's tokens need, or an out-of-order append.
    """
    state_pages = state_pages or {}
    all_rows = step.rows if step.group_rows is None else np.concatenate([step.rows, step.group_rows.reshape(-1)])
    flat_idx, values = table.apply_host(step.edits, all_rows)
    qlens = step.query_lens
    qsl, req_of_token, positions, seq_lens = token_layout(step.starts, qlens)
    need = -(-seq_lens // page_size)
    groups = [step.rows] + ([] if step.group_rows is None else list(step.group_rows))
    helds = [table.lengths[rows] for rows in groups]
    for g, held in enumerate(helds):
        short = np.nonzero(held < (state_pages[g] if g in state_pages else need))[0]
        if short.size:
            table.apply_device(*(torch.from_numpy(a).to(table.device) for a in (step.edits.clear, flat_idx, values)))
            i = int(short[0])  # the edits are applied on the device too, so that mirror and table stay equal
            raise ValueError(f"request {i}: block table of KV group {g} has {held[i]} pages, needs "
                             f"{state_pages.get(g, need[i])} for {seq_lens[i]} tokens")
    slot_list = [np.full(positions.shape, -1, dtype=np.int64) if g in state_pages else
                 table.host[rows[req_of_token], positions // page_size].astype(np.int64) * page_size
                 + positions % page_size for g, rows in enumerate(groups)]
    widths = [int(held.max(initial=1)) or 1 for held in helds]
    arrays = [(step.input_ids, torch.long), (positions, torch.long), (slot_list[0], torch.long), (qsl, torch.int32),
              (seq_lens, torch.int32), (step.logits, torch.long), (step.rows, torch.long),
              (step.edits.clear, torch.long), (flat_idx, torch.long), (values, torch.int32)]
    for rows, slots in zip(groups[1:], slot_list[1:]):
        arrays += [(rows, torch.long), (slots, torch.long)]
    if step.rope_variants is not None:
        arrays.append((step.rope_variants[req_of_token], torch.long))
    tensors = upload(arrays, table.device, staging)
    ids_t, pos_t, slots_t, qsl_t, seq_t, logits_t, rows_t, clear_t, idx_t, val_t = tensors[:10]
    table.apply_device(clear_t, idx_t, val_t)
    batch = ForwardBatch(
        input_ids=ids_t, positions=pos_t, slot_mapping=slots_t, query_start_loc=qsl_t, seq_lens=seq_t,
        block_tables=table.gather(rows_t, widths[0]), logits_indices=logits_t, num_decodes=step.num_decodes,
        query_lens_cpu=qlens.tolist(), seq_lens_cpu=seq_lens.tolist(), query_start_loc_cpu=qsl.tolist(),
        rope_variant=tensors[-1] if step.rope_variants is not None else None,
    )
    if len(groups) > 1:
        extra = tensors[10:]
        batch.group_batches = tuple(
            dataclasses.replace(batch, slot_mapping=extra[2 * i + 1], block_tables=table.gather(extra[2 * i], w))
            for i, w in enumerate(widths[1:]))
    return batch
