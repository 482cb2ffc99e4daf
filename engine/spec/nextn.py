"""NEXTN drafts: DeepSeek-V3's multi-token-prediction layer proposes each decoding request's next K tokens.

SGLang's ``NEXTN`` algorithm (vLLM's ``deepseek_mtp``; DeepSeek-V3 technical report sec. 2.2): the MTP layer
(`pd_cluster.engine.model.nextn`) at position t reads the target's hidden state h_t and token t + 1 and predicts
token t + 2; chained K times (each step's final-norm output as the next h, each step's token as the next input)
it drafts K tokens greedily. The drafts are a point mass, so verification (`pd_cluster.engine.spec.verify`) is
exact for greedy and sampled requests alike.

The target keeps every forward's final-norm output (`CausalLM.keep_hidden`); after each forward the engine hands
each item's rows to `on_hidden`, which keeps them per request as pending hidden states. The MTP layer's KV
lives in its own paged one-layer latent pool (`DraftModel` with ``nextn``): entry t holds the pass over
(h_t, token t + 1). Before drafting, the entries for every t whose h_t and token t + 1 are both known (the
prompt after its prefill, the accepted tokens after a verify) are computed in one extend; the chain's entries
past them are speculative and are overwritten next step (their pages past what the request needs go back to
the pool: rejected drafts are rolled back). A request's pages return to the pool when it leaves the running set.

A request's MTP sequence starts at the first position whose hidden state this engine computed (`_MTPSequence.base`):
0 after a full local prefill; past a prefix-cache hit, or on a PD decode worker (its prompt was prefilled
elsewhere), at the first token computed here. Its MTP attention then sees only the entries from there on,
stored from page position 0 (RoPE is relative, so the scores are those of the true positions over that
window). Drafts only ever change how many tokens a step accepts, never which tokens are emitted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from pd_cluster.engine.request import Request
from pd_cluster.engine.spec.draft_model import DraftModel, PagedDraftProposer


@dataclass
class _MTPSequence:
    """One request's MTP state: entries for positions [base, base + computed) are in `pages` from slot 0;
    `pending` [P, hidden] holds the target's h for positions [base + computed, base + computed + P)."""

    base: int
    pages: list[int] = field(default_factory=list)
    computed: int = 0
    pending: torch.Tensor | None = None

    @property
    def next_position(self) -> int:
        return self.base + self.computed


class NextNProposer(PagedDraftProposer):
    """Runs the MTP layer for a step's drafted requests and keeps their MTP KV and pending hidden states
    (`PagedDraftProposer`: the pool, `release`, `propose`)."""

    def __init__(self, model: DraftModel, max_tokens_per_forward: int,
                 never_drafted: Callable[[Request], bool] = lambda req: False) -> None:
        super().__init__(model, max_tokens_per_forward)
        self.never_drafted = never_drafted  # `drafter.never_drafted`: requests whose hidden states are not kept
        self.seqs: dict[str, _MTPSequence] = {}
        self.num_no_hidden = 0  # drafts skipped because the target's hidden states were not all known here

    def on_hidden(self, items, hidden: torch.Tensor) -> None:
        """After a target forward: keep each item's rows of `hidden` [T, hidden_size] (in the step's token order:
        each item's ``num_new_tokens`` rows for positions from its ``start``) as its request's pending h; none for
        a request that is never drafted (`never_drafted`)."""
        row = 0
        for it in items:
            n = it.num_new_tokens
            rid, start = it.req.request_id, it.start
            if self.never_drafted(it.req):  # keeps no hidden state it would never use
                row += n
                continue
            seq = self.seqs.get(rid)
            if seq is None:
                seq = self.seqs[rid] = _MTPSequence(base=start)
            h = hidden[row:row + n]
            row += n
            nxt = seq.next_position
            if start < nxt:  # rows whose MTP entries exist already
                h, start = h[nxt - start:], nxt
            if not len(h):
                continue
            have = 0 if seq.pending is None else len(seq.pending)
            if start > nxt + have:  # a gap: positions computed elsewhere; drop what cannot be used
                continue
            kept = seq.pending[:start - nxt] if have else h[:0]
            seq.pending = torch.cat([kept, h.detach().clone()])

    def _propose(self, work: list[tuple[Request, int]]) -> dict[str, list[int]]:
        rows: list[tuple[Request, _MTPSequence, int, int]] = []  # (req, seq, k, entries to compute)
        for req, k in work:
            seq = self.seqs.get(req.request_id)
            if seq is None:
                self.num_no_hidden += 1
                continue
            count = req.num_tokens - 1 - seq.next_position  # t in [next, num_tokens - 2]
            have = 0 if seq.pending is None else len(seq.pending)
            if count < 1 or have < count:
                self.num_no_hidden += 1
                continue
            last_local = req.num_tokens - 2 + k - 1 - seq.base  # the chain's last entry, local slot
            if not self._hold(seq.pages, last_local + 1):
                self.num_pool_full += 1
                continue
            rows.append((req, seq, k, count))
        if not rows:
            return {}
        drafts, h = self._catch_up(rows)
        for j in range(1, max(k for _, _, k, _ in rows)):
            live = [i for i, (_, _, k, _) in enumerate(rows) if k > j]
            step = [([drafts[i][-1]], rows[i][0].num_tokens - 2 + j - rows[i][1].base, rows[i][1].pages)
                    for i in live]
            toks, h_live = self.model.mtp_step(step, True, h[live])
            h = h.clone()
            h[live] = h_live
            for i, tok in zip(live, toks):
                drafts[i].append(tok)
        return {req.request_id: d for (req, _, _, _), d in zip(rows, drafts)}

    def _catch_up(self, rows) -> tuple[list[list[int]], torch.Tensor]:
        """Compute each row's entries for its known tokens, in passes of at most `cap` tokens; each row's first
        draft token and its MTP output h at the last entry [len(rows), hidden_size]."""
        first: list[int] = [-1] * len(rows)
        last_h: list[torch.Tensor | None] = [None] * len(rows)
        pending = []
        for i, (req, seq, _, count) in enumerate(rows):
            t0 = seq.next_position
            pending.append((i, t0 - seq.base, req.token_ids[t0 + 1:t0 + 1 + count], seq.pending[:count]))
            self.num_caught_up += count
            seq.computed += count
            seq.pending = seq.pending[count:count]  # anything past is a rejected draft's: recomputed next step
        while pending:
            batch, hs, final, rest, room = [], [], [], [], self.cap
            for i, slot, toks, h in pending:
                take = min(len(toks), room) if room > 0 else 0
                if take:
                    batch.append((toks[:take], slot, rows[i][1].pages))
                    hs.append(h[:take])
                    final.append(i if take == len(toks) else -1)
                    room -= take
                if take < len(toks):
                    rest.append((i, slot + take, toks[take:], h[take:]))
            toks_out, h_out = self.model.mtp_step(batch, False, torch.cat(hs))
            for j, (i, tok) in enumerate(zip(final, toks_out)):
                if i >= 0:
                    first[i], last_h[i] = tok, h_out[j]
            pending = rest
        return [[t] for t in first], torch.stack(last_h)
