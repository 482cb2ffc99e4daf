"""STANDALONE drafts: a separate small draft model proposes each decoding request's next K tokens greedily.

SGLang's ``STANDALONE`` algorithm and vLLM's ``draft_model`` method (Leviathan et al. 2023; Chen et al. 2023):
a draft model with the target's vocabulary runs K times per step, once over the tokens it has not seen and
then once per draft token, batched over the drafted requests. The drafts are a point mass (argmax), so the
existing verification (`pd_cluster.engine.spec.verify`) is exact for greedy and sampled requests alike.

The draft model's KV lives in its own paged pool (`DraftModel`). Each request's draft sequence records the
tokens its pages hold; before drafting, the draft KV is rolled back to the longest prefix that the request's
tokens still agree with (rejected drafts are dropped there, and their pages go back to the draft pool), and the
tokens after it are computed in one extend. A request's first draft thus runs the draft model over its prompt
(in PD: on the decode worker, at the request's first decode step after the handover; the prefill worker sends
nothing for it). Its pages return to the draft pool when the request leaves the running set (`release`):
finished, aborted, failed, retracted or migrated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pd_cluster.engine.request import Request
from pd_cluster.engine.spec.draft_model import PagedDraftProposer


@dataclass
class _DraftSequence:
    """One request's state in the draft model: `tokens[i]`'s KV is at position i of the pages in `pages`."""

    pages: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    synced: int = 0  # tokens[:synced] are known to be the request's own


class StandaloneProposer(PagedDraftProposer):
    """Runs the draft model for a step's drafted requests and keeps their draft KV (`PagedDraftProposer`: the
    pool, `release`, `propose`; ``max_tokens_per_forward``: a long prompt is caught up in several passes)."""

    def _propose(self, work: list[tuple[Request, int]]) -> dict[str, list[int]]:
        rows: list[tuple[Request, _DraftSequence, int]] = []
        for req, k in work:
            seq = self.seqs.setdefault(req.request_id, _DraftSequence())
            self._roll_back(seq, req.token_ids)
            if self._hold(seq.pages, req.num_tokens + k - 1):
                rows.append((req, seq, k))
            else:
                self.num_pool_full += 1
        if not rows:
            return {}
        drafts = self._catch_up(rows)
        for j in range(1, max(k for _, _, k in rows)):
            live = [i for i, (_, _, k) in enumerate(rows) if k > j]
            step = []
            for i in live:
                seq = rows[i][1]
                seq.tokens.append(drafts[i][-1])
                step.append(([drafts[i][-1]], len(seq.tokens) - 1, seq.pages))
            for i, tok in zip(live, self.model.next_tokens(step, decode=True)):
                drafts[i].append(tok)
        return {req.request_id: d for (req, _, _), d in zip(rows, drafts)}

    def _roll_back(self, seq: _DraftSequence, token_ids: list[int]) -> None:
        """Keep the draft KV of the longest prefix the request's tokens agree with, leaving at least the last token
        to compute (its logits give the first draft); free the pages past it."""
        limit = min(len(seq.tokens), len(token_ids) - 1)
        m = min(seq.synced, limit)
        while m < limit and seq.tokens[m] == token_ids[m]:
            m += 1
        del seq.tokens[m:]
        seq.synced = m
        keep = -(-m // self.page_size)
        if len(seq.pages) > keep:
            self.model.allocator.free(seq.pages[keep:])
            del seq.pages[keep:]

    def _catch_up(self, rows: list[tuple[Request, _DraftSequence, int]]) -> list[list[int]]:
        """Compute each row's tokens the draft has not seen, in passes of at most `cap` tokens; each row's first
        draft token (the argmax after its last token)."""
        first: list[int] = [-1] * len(rows)
        pending = []
        for i, (req, seq, _) in enumerate(rows):
            new = req.token_ids[len(seq.tokens):]
            pending.append((i, len(seq.tokens), new))
            self.num_caught_up += len(new)
            seq.tokens.extend(new)
            seq.synced = len(seq.tokens)
        while pending:
            batch, final, rest, room = [], [], [], self.cap
            for i, start, toks in pending:
                take = toks[:room] if room > 0 else []
                if take:
                    batch.append((take, start, rows[i][1].pages))
                    final.append(i if len(take) == len(toks) else -1)
                    room -= len(take)
                if len(take) < len(toks):
                    rest.append((i, start + len(take), toks[len(take):]))
            for i, tok in zip(final, self.model.next_tokens(batch, decode=False)):
                if i >= 0:
                    first[i] = tok
            pending = rest
        return [[t] for t in first]
