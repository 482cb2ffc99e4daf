"""Which running requests get draft tokens this step, and how many (the scheduler asks `Drafter.propose`).

A request is drafted only where verification reproduces non-speculative decoding's distribution exactly with
one target extend: its sampling does not depend on the tokens being verified. Requests with repetition,
frequency or presence penalties, logits processors, a structured-output grammar, a per-request seed (its
draws must stay those of the seed), or ``min_tokens`` not yet reached decode one token per step as without
speculation; their output is unchanged.
"""

from __future__ import annotations

from pd_cluster.engine.request import Request
from pd_cluster.engine.spec.config import SpeculativeConfig
from pd_cluster.engine.spec.ngram import NgramProposer


def can_draft(req: Request) -> bool:
    """Whether `req`'s next tokens may be drafted and verified (see the module docstring)."""
    p = req.params
    return (req.grammar is None and not p.has_penalties and not p.logits_processors and req.generator is None
            and req.num_output_tokens >= p.min_tokens and not req.num_inflight)


class Drafter:
    """Proposes a running request's draft tokens (NGRAM).

    Args:
        config: the speculative settings (enabled).
        context_length: the engine's longest sequence (drafts never run past it).
    """

    def __init__(self, config: SpeculativeConfig, context_length: int) -> None:
        self.k = config.num_draft_tokens
        self.context_length = context_length
        self.proposer = NgramProposer(config.speculative_ngram_min_match_window_size,
                                      config.speculative_ngram_max_match_window_size)

    def propose(self, req: Request, budget: int) -> list[int]:
        """Draft tokens for `req`'s next step (it is decoding: one known token without KV), at most `budget`.

        Never more than the request may still emit after the bonus token (``max_tokens``) or than the context
        holds; [] when the request is not eligible (`can_draft`) or no suffix recurs.
        """
        k = min(self.k, budget, req.remaining_output_tokens - 1, self.context_length - req.num_tokens)
        if k <= 0 or not can_draft(req):
            return []
        return self.proposer.propose(req.token_ids, k)
