"""The one explicit per-step batch object passed to the model and the attention backend.

There is no global forward context (the weak spot nano-vllm's style notes
warn about): everything a step needs travels in `ForwardBatch`.

Requests are ordered decode first (one new token each), then prefill chunks
(one or more new tokens each), so a backend can treat ``[:num_decodes]`` as a
uniform decode batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class ForwardBatch:
    """Inputs of one forward pass over ``T`` tokens of ``B`` requests.

    Attributes:
        input_ids: [T] int64 token ids.
        positions: [T] int64 absolute positions.
        slot_mapping: [T] int64 KV slots (``page * page_size + offset``), -1 = padding.
        query_start_loc: [B + 1] int32 prefix sums of the new tokens per request.
        seq_lens: [B] int32 context length of each request after this step.
        block_tables: [B, max_pages] int32 page ids, padded with the null page 0.
        logits_indices: [L] int64 rows of the hidden states whose logits are needed.
        num_decodes: requests ``[:num_decodes]`` have exactly one new token.
        query_lens_cpu, seq_lens_cpu, query_start_loc_cpu: host copies (lists of
            int) for the torch backend and the scheduler.
        group_batches: with KV cache groups (`pd_cluster.engine.kv.groups`), the same batch for groups 1..G:
            each with its group's ``slot_mapping`` and ``block_tables`` (the fields above are group 0's); None
            with one group.
        rope_variant: [T] int64, 1 where the token's request rotates by longrope's long factors
            (`Request.rope_variant`); None when every token rotates by the short ones (or the model has no
            longrope).
        states: [B, floats] float32, the recurrent states of the step's requests (linear-attention layers),
            read by the model from the pool's state pages at the start of its forward pass and written back at
            its end (`pd_cluster.engine.kv.pool.KVPool.read_states`); None for a model without them.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    logits_indices: torch.Tensor
    num_decodes: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    query_start_loc_cpu: list[int]
    group_batches: "tuple[ForwardBatch, ...] | None" = None
    rope_variant: torch.Tensor | None = None
    states: torch.Tensor | None = None

    def for_group(self, group: int) -> "ForwardBatch":
        """This step as KV group `group`'s layers see it (its slot mapping and block tables)."""
        if not group or self.group_batches is None:
            return self
        return self.group_batches[group - 1]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_prefills(self) -> int:
        return self.num_reqs - self.num_decodes

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    @property
    def is_decode_only(self) -> bool:
        return self.num_decodes == self.num_reqs


def token_layout(starts: np.ndarray, query_lens: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Where a step's tokens sit, vectorised.

    Args:
        starts: [B] int64, the position of each request's first new token; query_lens: [B] int64, its new tokens.

    Returns:
        query start offsets [B + 1], the request of each token [T], each token's position [T], and each
        request's context length after the step [B] (all int64).
    """
    qsl = np.zeros(query_lens.size + 1, dtype=np.int64)
    np.cumsum(query_lens, out=qsl[1:])
    req_of_token = np.repeat(np.arange(query_lens.size), query_lens)
    positions = starts[req_of_token] + (np.arange(int(qsl[-1])) - qsl[:-1][req_of_token])
    return qsl, req_of_token, positions, starts + query_lens


def upload(arrays: list[tuple[np.ndarray, torch.dtype]], device: torch.device, staging: "HostStaging | None"
           ) -> list[torch.Tensor]:
    """The (numpy array, torch dtype) pairs as device tensors: through `staging` (two copies, pinned on CUDA),
    or one plain copy each when it is None."""
    if staging is not None:
        return staging.upload(arrays)
    return [torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dt) for a, dt in arrays]


def build_forward_batch(
    token_ids: list[np.ndarray],
    start_positions: list[int],
    block_tables: list[list[int]],
    logits_rows: list[np.ndarray],
    num_decodes: int,
    page_size: int,
    device: torch.device,
    staging: "HostStaging | None" = None,
) -> ForwardBatch:
    """Assemble a `ForwardBatch` with vectorised position and slot arithmetic.

    Args:
        token_ids: per request, the new tokens (int64 arrays), decodes first.
        start_positions: per request, the position of its first new token
            (its number of computed tokens).
        block_tables: per request, its page ids (covering all new tokens).
        logits_rows: per request, offsets within its new tokens whose logits are
            needed (usually just the last one, or none for a mid-prompt chunk).
        num_decodes: how many leading requests are decodes.
        page_size: tokens per page.
        device: where the tensors go.
        staging: persistent host buffers to upload through (two copies instead of seven;
            pinned and asynchronous on CUDA); None copies each array on its own.

    Raises:
        ValueError: a block table does not cover its request's new tokens.
    """
    query_lens = np.fromiter((len(t) for t in token_ids), dtype=np.int64, count=len(token_ids))
    qsl, req_of_token, positions, seq_lens = token_layout(np.asarray(start_positions, dtype=np.int64), query_lens)

    max_pages = max((len(bt) for bt in block_tables), default=1) or 1
    table = np.zeros((len(block_tables), max_pages), dtype=np.int64)
    for i, bt in enumerate(block_tables):
        need = -(-int(seq_lens[i]) // page_size)
        if len(bt) < need:
            raise ValueError(f"request {i}: block table has {len(bt)} pages, needs {need} for {seq_lens[i]} tokens")
        table[i, : len(bt)] = bt
    slots = table[req_of_token, positions // page_size] * page_size + positions % page_size

    logits_idx = np.concatenate([qsl[i] + rows for i, rows in enumerate(logits_rows)]) if logits_rows else \
        np.zeros(0, dtype=np.int64)
    ids = np.concatenate(token_ids) if token_ids else np.zeros(0, dtype=np.int64)

    arrays = [(ids, torch.long), (positions, torch.long), (slots, torch.long), (qsl, torch.int32),
              (seq_lens, torch.int32), (table, torch.int32), (logits_idx.astype(np.int64), torch.long)]
    input_ids, positions_t, slots_t, qsl_t, seq_lens_t, table_t, logits_t = upload(arrays, device, staging)
    return ForwardBatch(
        input_ids=input_ids,
        positions=positions_t,
        slot_mapping=slots_t,
        query_start_loc=qsl_t,
        seq_lens=seq_lens_t,
        block_tables=table_t,
        logits_indices=logits_t,
        num_decodes=num_decodes,
        query_lens_cpu=query_lens.tolist(),
        seq_lens_cpu=seq_lens.tolist(),
        query_start_loc_cpu=qsl.tolist(),
    )


class HostStaging:
    """Persistent host buffers through which a step's index arrays reach the device.

    A step's index arrays (those of a `ForwardBatch`; in the engine also its block-table rows and edits,
    `pd_cluster.engine.packed_step.build_step`) are packed into one int64 and one int32
    host buffer, which are copied with one copy each into fresh device tensors;
    the batch's tensors are views of those. On CUDA the host buffers are pinned
    and the copies ``non_blocking``, so the host goes on building while the copy
    runs (pageable memory makes every copy synchronous). A buffer is refilled
    only after the previous step's copy out of it has completed (a CUDA event;
    in practice done: that copy was queued before the previous step's kernels,
    and with overlap scheduling the step before those has completed). Buffers grow to
    the largest step seen and are never shrunk.

    Each array starts at a multiple of `ALIGN` elements (128 bytes or more) into
    its allocation, whatever the step's sizes: Triton specialises on 16-byte
    pointer alignment, and a step-dependent alignment would compile new kernel
    variants while serving.

    Args:
        device: where the batches go.
    """

    ALIGN = 32  # elements: 128 bytes of int32, 256 of int64

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self._host: dict[torch.dtype, torch.Tensor] = {}
        self._copied: torch.cuda.Event | None = None
        self.uploads = 0

    def _buffer(self, dtype: torch.dtype, n: int) -> torch.Tensor:
        buf = self._host.get(dtype)
        if buf is None or buf.numel() < n:
            size = max(n, 2 * (0 if buf is None else buf.numel()), 4096)
            buf = torch.empty(size, dtype=dtype, pin_memory=self.pinned)
            self._host[dtype] = buf
        return buf

    def upload(self, arrays: list[tuple[np.ndarray, torch.dtype]]) -> list[torch.Tensor]:
        """Device tensors of `arrays` ((numpy array, torch dtype int64 or int32) pairs), in order and shape.

        Raises:
            ValueError: a dtype other than int64 or int32.
        """
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has read the host buffers
        out: list[torch.Tensor | None] = [None] * len(arrays)
        for dtype in (torch.int64, torch.int32):
            idx = [i for i, (_, dt) in enumerate(arrays) if dt == dtype]
            if not idx:
                continue
            offsets, total = [], 0
            for i in idx:
                offsets.append(total)
                total += -(-arrays[i][0].size // self.ALIGN) * self.ALIGN
            host = self._buffer(dtype, total)
            flat = host.numpy()
            for i, off in zip(idx, offsets):
                a = arrays[i][0]
                flat[off:off + a.size] = a.reshape(-1)
            if self.device.type == "cpu":
                dev = host[:total].clone()  # never alias the buffer the next step refills
            else:
                dev = host[:total].to(self.device, non_blocking=self.pinned)
            for i, off in zip(idx, offsets):
                a = arrays[i][0]
                out[i] = dev[off:off + a.size].view(a.shape)
        if any(t is None for t in out):
            raise ValueError(f"HostStaging uploads int64 and int32 arrays, got {[dt for _, dt in arrays]}")
        if self.pinned:
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(self.device))
        self.uploads += 1
        return out  # type: ignore[return-value]
