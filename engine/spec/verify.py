"""Verification of draft tokens from one target extend: greedy prefix match, or rejection sampling.

The target's logits at a request's last known token and at each of its K draft tokens (K + 1 rows) are
processed as non-speculative sampling processes one row (`Sampler`: logit bias, the structured-output grammar's
mask, temperature, top-k, top-p, min-p; the drafted requests have no other token-dependent processing,
`drafter.can_draft`). A grammar's mask at row j is the one after the drafts before it (`grammar_masks`). Then:

- greedy rows: draft j is accepted while it equals the target's argmax at row j; the first mismatch emits the
  target's argmax instead, and when all K are accepted row K's argmax is the bonus token. The tokens equal
  non-speculative greedy decoding's.
- sampled rows: speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via
  Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative
  Sampling"): draft x is accepted with probability min(1, p(x) / q(x)); on rejection a token is drawn from
  norm(max(0, p - q)). An n-gram draft is a point mass (q(x) = 1), so x is accepted with probability p(x) and
  the residual is p with x removed, renormalised. Each emitted token is then distributed as p exactly.

Draws come from the sampler's shared generator (`Sampler.generator`): uniforms for the acceptance tests,
exponential variates for the residual and bonus draws (argmax(p / E), the Gumbel-max trick's exponential form
that `Sampler` uses).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pd_cluster.engine.device_copy import to_device
from pd_cluster.engine.request import Request
from pd_cluster.engine.sampling.batch import SamplingBatch
from pd_cluster.engine.sampling.pending import Logprob
from pd_cluster.engine.sampling.sampler import Sampler


@dataclass
class Verified:
    """One request's verification.

    Attributes:
        token_ids: the emitted tokens, 1 to K + 1: the accepted drafts, then the correction or bonus token.
        logprobs: per emitted token, None or (its logprob, top-N) from the raw distribution (as `Sampler`).
        num_drafts: K, the draft tokens checked.
        error: why the request could not be verified (its rows hold no finite value), else None.
    """

    token_ids: list[int]
    logprobs: list[Logprob | None]
    num_drafts: int
    error: str | None = None

    @property
    def num_accepted(self) -> int:
        return len(self.token_ids) - 1 if self.error is None else 0


def accept_mask(uniforms: torch.Tensor, p_draft: torch.Tensor) -> torch.Tensor:
    """The acceptance test of a point-mass draft: accept with probability p(x) (q(x) = 1). [S] bool."""
    return uniforms < p_draft


@torch.inference_mode()
def verify_drafts(sampler: Sampler, logits: torch.Tensor, reqs: list[Request], drafts: list[list[int]]
                  ) -> list[Verified]:
    """Verify each request's drafts against the target's logits.

    Args:
        sampler: the engine's sampler (its shared generator draws).
        logits: [R, V] target logits, R = sum(len(d) + 1): for each request in order, the rows at its last known
            token and at each draft token.
        reqs: the drafted requests; drafts: each one's draft tokens (at least one).

    Returns:
        One `Verified` per request, in order.
    """
    dev = logits.device
    params = [r.params for r, d in zip(reqs, drafts) for _ in range(len(d) + 1)]
    n_rows = len(params)
    batch = SamplingBatch(params, [None] * n_rows, [[] for _ in range(n_rows)], [0] * n_rows,
                          [() for _ in range(n_rows)])
    x = Sampler._prepare(logits.float().clone(), batch)  # logit bias (no bans or penalties when drafted)
    grammar_masks(x, reqs, drafts)
    draft_col = [t for d in drafts for t in (*d, -1)]  # -1: the bonus row of each request
    d_t = to_device(draft_col, dev)
    chosen = x.argmax(dim=-1)  # greedy rows: the target's token
    bad = x.isnan().any(dim=-1) | (x == float("-inf")).all(dim=-1)
    accept = chosen == d_t
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        idx = to_device(sampled, dev)
        probs = Sampler._filtered_probs(x[idx], [params[i] for i in sampled])
        ds = d_t[idx]
        has_draft = ds >= 0
        p_draft = probs.gather(1, ds.clamp(min=0)[:, None])[:, 0]
        u = torch.rand(len(sampled), generator=sampler.generator, device=dev)
        accept[idx] = accept_mask(u, p_draft) & has_draft
        residual = probs.scatter(1, ds.clamp(min=0)[:, None], 0.0)
        residual = torch.where(has_draft[:, None], residual, probs)  # the bonus row draws from p itself
        q = torch.empty_like(residual).exponential_(generator=sampler.generator)
        chosen[idx] = (residual / q).argmax(dim=-1)
        bad[idx] |= probs.isnan().any(dim=-1)
    acc, out_tok, bad_h = accept.tolist(), chosen.tolist(), bad.tolist()
    results: list[Verified] = []
    emitted_rows: list[int] = []
    emitted_ids: list[int] = []
    row = 0
    for d in drafts:
        span = range(row, row + len(d) + 1)
        if any(bad_h[i] for i in span):
            results.append(Verified([], [], len(d),
                                    "the logits hold no finite value to sample from (NaN or every token banned)"))
        else:
            m = 0
            while m < len(d) and acc[row + m]:
                m += 1
            tokens = list(d[:m]) + [out_tok[row + m]]
            results.append(Verified(tokens, [None] * len(tokens), len(d)))
            emitted_rows += list(span[:m + 1])
            emitted_ids += tokens
        row += len(d) + 1
    _fill_logprobs(logits, params, results, drafts, emitted_rows, emitted_ids)
    return results


def grammar_masks(x: torch.Tensor, reqs: list[Request], drafts: list[list[int]]) -> None:
    """Mask, in place, each structured-output request's rows by its grammar as it would stand there: row j after
    the drafts 0..j-1 are accepted (xgrammar's matcher advanced over them, then rolled back).

    A draft the grammar refuses is masked out of its own row, so verification rejects it and picks the
    correction from the allowed tokens; the rows after it (never used) and those after a draft that completes
    the grammar (the request stops there) are left unmasked. The matcher is where it was on return: the emitted
    tokens advance it as without speculation (`LLMEngine._on_token`).

    Args:
        x: [R, V] float32 processed logits, the rows of `reqs` in order (len(d) + 1 each).
    """
    if not any(r.grammar is not None for r in reqs):
        return
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(x), x.shape[-1])
    rows: list[int] = []
    row = 0
    for req, d in zip(reqs, drafts):
        matcher = None if req.grammar is None else req.grammar.matcher
        advanced = 0
        for j in range(len(d) + 1 if matcher is not None else 0):
            if matcher.is_terminated():
                break
            matcher.fill_next_token_bitmask(bitmask, row + j)
            rows.append(row + j)
            if j == len(d) or not matcher.accept_token(int(d[j])):
                break
            advanced += 1
        if advanced:
            matcher.rollback(advanced)
        row += len(d) + 1
    xgr.apply_token_bitmask_inplace(x, bitmask.to(x.device), vocab_size=x.shape[-1], indices=rows)


def _fill_logprobs(logits: torch.Tensor, params, results: list[Verified], drafts: list[list[int]],
                   rows: list[int], ids: list[int]) -> None:
    """The raw-distribution logprobs of the emitted tokens of requests that asked for them."""
    want = [(r, t) for r, t in zip(rows, ids) if params[r].logprobs is not None]
    if not want:
        return
    sel = [r for r, _ in want]
    sel_params = [params[r] for r in sel]
    idx = to_device(sel, logits.device)
    lp = Sampler._logprobs(logits[idx], sel_params, to_device([t for _, t in want], logits.device),
                           [None] * len(sel))
    host = dict(zip(sel, lp.to_host(sel_params)))
    row = 0
    for res, d in zip(results, drafts):
        for j in range(len(res.token_ids)):
            res.logprobs[j] = host.get(row + j)
        row += len(d) + 1
