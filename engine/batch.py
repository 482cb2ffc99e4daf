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


def build_forward_batch(
    token_ids: list[np.ndarray],
    start_positions: list[int],
    block_tables: list[list[int]],
    logits_rows: list[np.ndarray],
    num_decodes: int,
    page_size: int,
    device: torch.device,
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

    Raises:
        ValueError: a block table does not cover its request's new tokens.
    """
    query_lens = np.fromiter((len(t) for t in token_ids), dtype=np.int64, count=len(token_ids))
    starts = np.asarray(start_positions, dtype=np.int64)
    qsl = np.zeros(len(token_ids) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=qsl[1:])
    total = int(qsl[-1])
    req_of_token = np.repeat(np.arange(len(token_ids)), query_lens)
    positions = starts[req_of_token] + (np.arange(total) - qsl[:-1][req_of_token])
    seq_lens = starts + query_lens

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

    def t(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)

    return ForwardBatch(
        input_ids=t(ids, torch.long),
        positions=t(positions, torch.long),
        slot_mapping=t(slots, torch.long),
        query_start_loc=t(qsl, torch.int32),
        seq_lens=t(seq_lens, torch.int32),
        block_tables=t(table, torch.int32),
        logits_indices=t(logits_idx.astype(np.int64), torch.long),
        num_decodes=num_decodes,
        query_lens_cpu=query_lens.tolist(),
        seq_lens_cpu=seq_lens.tolist(),
        query_start_loc_cpu=qsl.tolist(),
    )


@dataclass
class BatchInputs:
    """Host-side inputs of one forward pass; rank 0 sends them to every TP rank, each builds its `ForwardBatch`.

    token_ids: per request, int64 numpy ids of the tokens to run; start_positions: the position of each
    request's first such token; block_tables: page ids per request; logits_rows: per request, the rows
    (offsets into its tokens) whose logits are needed; the first ``num_decodes`` requests are decodes."""

    token_ids: list[np.ndarray]
    start_positions: list[int]
    block_tables: list[list[int]]
    logits_rows: list[np.ndarray]
    num_decodes: int
    page_size: int

    def build(self, device: torch.device) -> ForwardBatch:
        return build_forward_batch(self.token_ids, self.start_positions, self.block_tables, self.logits_rows,
                                   self.num_decodes, self.page_size, device)
