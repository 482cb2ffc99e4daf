"""Admission control: may a waiting request start without starving the running ones?

SGLang's model (`PrefillAdder` and the new-token ratio): each running request
reserves room for its remaining prompt tokens plus ``new_token_ratio`` times its
remaining output tokens (clipped); a new request needs its remaining known
tokens plus its (clipped) output budget. The ratio starts at
``0.7 * schedule_conservativeness``, decays towards 14 % of that over 600 decode
steps while the pool holds, and jumps back up after a retraction. A ratio
that is too optimistic costs retractions; too pessimistic, idle pages.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pd_cluster.engine.request import Request

CLIP_MAX_NEW_TOKENS = 4096  # SGLang's SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
RETRACT_DECODE_STEPS = 20
# (request, tokens it still needs) -> pool tokens those take; a hybrid pool's windowed groups hold fewer
# (`GroupedPageManager.pool_tokens`). None: one token each.
Cost = Callable[[Request, float], float]


class AdmissionPolicy:
    """Keeps the new-token ratio and answers admission questions.

    Args:
        schedule_conservativeness: > 1 reserves more (fewer retractions), < 1 less.
    """

    def __init__(self, schedule_conservativeness: float) -> None:
        self.init_ratio = min(INIT_NEW_TOKEN_RATIO * schedule_conservativeness, 1.0)
        self.min_ratio = min(self.init_ratio * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        self.decay = (self.init_ratio - self.min_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = self.init_ratio

    def reserved_tokens(self, running: Iterable[Request], cost: Cost | None = None) -> float:
        """Tokens the running requests are still expected to need (through `cost`, when given: pool tokens)."""
        total = 0.0
        for r in running:
            remaining_known = r.num_tokens - r.num_computed_tokens
            tokens = remaining_known + min(r.remaining_output_tokens, CLIP_MAX_NEW_TOKENS) * self.new_token_ratio
            total += tokens if cost is None else cost(r, tokens)
        return total

    @staticmethod
    def tokens_needed(req: Request, cost: Cost | None = None) -> float:
        """Tokens a new request needs: what is known but not computed, plus its output budget (through `cost`,
        when given)."""
        tokens = req.num_tokens - req.num_computed_tokens + min(req.remaining_output_tokens, CLIP_MAX_NEW_TOKENS)
        return tokens if cost is None else cost(req, tokens)

    def on_decode_step(self) -> None:
        self.new_token_ratio = max(self.new_token_ratio - self.decay, self.min_ratio)

    def on_idle(self) -> None:
        self.new_token_ratio = self.init_ratio

    def on_retract(self, running: Iterable[Request]) -> None:
        """Raise the ratio to what the running requests actually used, plus a margin."""
        running = list(running)
        decoded = sum(r.num_output_tokens for r in running)
        budget = sum(min(r.max_tokens, CLIP_MAX_NEW_TOKENS) for r in running)
        if budget:
            estimate = (decoded + RETRACT_DECODE_STEPS * len(running)) / budget
            self.new_token_ratio = min(1.0, max(self.new_token_ratio, estimate))
        else:
            self.new_token_ratio = self.init_ratio
