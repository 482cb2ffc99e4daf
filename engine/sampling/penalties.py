"""Batched logits processing before sampling: ``min_tokens`` bans, ``logit_bias`` and the three penalties.

Each function takes float32 logits [B, V] and updates them in place, one
vectorised operation per kind over the rows that ask for it (no loop over
tokens in Python). Semantics:

- ``presence_penalty`` / ``frequency_penalty``: OpenAI's definition over the
  *generated* tokens, ``logit[j] -= count[j] * frequency + (count[j] > 0) * presence``.
- ``repetition_penalty``: CTRL (Keskar et al. 2019) over prompt *and* generated
  tokens, as transformers' ``RepetitionPenaltyLogitsProcessor`` and vLLM: a seen
  token's logit is divided by the penalty when positive, multiplied when negative.
- ``logit_bias``: OpenAI's, added to the logits.

The order is vLLM's: bans and bias, then repetition, frequency and presence.
"""

from __future__ import annotations

import numpy as np
import torch

from pd_cluster.engine.device_copy import to_device
from pd_cluster.engine.sampling.batch import SamplingBatch


def apply_bans(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """Set the banned ids of each row (``batch.banned``; ids outside the vocabulary ignored) to -inf."""
    vocab = logits.shape[-1]
    rows: list[int] = []
    cols: list[int] = []
    for i, banned in enumerate(batch.banned):
        ids = [t for t in banned if t < vocab]
        rows.extend([i] * len(ids))
        cols.extend(ids)
    if rows:
        idx = _index(rows, cols, logits.device)
        logits.index_put_(idx, torch.full((), float("-inf"), dtype=logits.dtype, device=logits.device))


def apply_logit_bias(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """Add each row's ``logit_bias`` ({token id: bias}, ids checked against the vocabulary at admission).

    Raises:
        IndexError: a token id outside the vocabulary.
    """
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for i, p in enumerate(batch.params):
        if p.logit_bias:
            rows.extend([i] * len(p.logit_bias))
            cols.extend(p.logit_bias.keys())
            vals.extend(p.logit_bias.values())
    if rows:
        logits.index_put_(_index(rows, cols, logits.device),
                          to_device(vals, logits.device, logits.dtype), accumulate=True)


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """Repetition, then frequency and presence penalties, on the rows that set any of them."""
    rows = [i for i, p in enumerate(batch.params) if p.has_penalties]
    if not rows:
        return
    dev, vocab = logits.device, logits.shape[-1]
    params = [batch.params[i] for i in rows]
    sub = logits[rows]
    counts = _bincounts(_padded([batch.output_ids(i) for i in rows], vocab), vocab, dev)  # [R, V] float32
    generated = counts > 0
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = generated | (_bincounts(_padded([batch.prompt_ids(i) for i in rows], vocab), vocab, dev) > 0)
        penalty = to_device([p.repetition_penalty for p in params], dev, sub.dtype)[:, None]
        penalised = torch.where(sub < 0, sub * penalty, sub / penalty)
        sub = torch.where(seen, penalised, sub)
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        freq = to_device([p.frequency_penalty for p in params], dev, sub.dtype)[:, None]
        pres = to_device([p.presence_penalty for p in params], dev, sub.dtype)[:, None]
        sub = sub - counts * freq - generated.to(sub.dtype) * pres
    logits[rows] = sub


def _index(rows: list[int], cols: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    both = to_device([rows, cols], device, torch.int64)
    return both[0], both[1]


def _padded(seqs: list, pad: int) -> np.ndarray:
    """[R, max length] int64, padded with `pad` (one past the vocabulary)."""
    width = max((len(s) for s in seqs), default=0)
    out = np.full((len(seqs), max(width, 1)), pad, dtype=np.int64)
    for i, s in enumerate(seqs):
        if len(s):
            out[i, :len(s)] = s
    return out


def _bincounts(ids: np.ndarray, vocab: int, device: torch.device) -> torch.Tensor:
    """Per row, how often each token id occurs: [R, V] float32 (the pad id `vocab` is dropped)."""
    t = torch.from_numpy(ids).to(device)
    counts = torch.zeros(t.shape[0], vocab + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, t, torch.ones_like(t, dtype=torch.float32))
    return counts[:, :vocab]
