"""NGRAM drafts (prompt lookup decoding): continue the latest earlier occurrence of the sequence's suffix.

The idea is Saxena's prompt lookup decoding (2023), as vLLM's ``ngram`` method and SGLang's ``NGRAM``
algorithm use it: for n from the longest match window down to the shortest, find the latest earlier position
where the last n tokens occurred in the prompt or the output so far, and propose the (up to) K tokens that
followed it. No model runs; a sequence without a match gets no draft and decodes one token as usual.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    """Proposes draft tokens from a request's own tokens.

    Args:
        min_n, max_n: the match windows tried, longest first (tokens).
        max_lookback: how many trailing tokens are searched (bounds the host work per step).
    """

    def __init__(self, min_n: int, max_n: int, max_lookback: int = 4096) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.max_lookback = max_lookback

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to `k` draft tokens following `token_ids` (prompt then output), or [] when no suffix recurs."""
        if k <= 0:
            return []
        total = len(token_ids)
        lo = max(total - self.max_lookback, 0)
        tokens = np.fromiter(token_ids[lo:], dtype=np.int64, count=total - lo)
        n_tok = tokens.size
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            # windows starting at 0 .. n_tok - n - 1: each has at least one token after it
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:n_tok - 1], n)
            hits = np.flatnonzero((windows == tokens[n_tok - n:]).all(axis=1))
            if hits.size:
                i = int(hits[-1])  # the latest occurrence
                return tokens[i + n:i + n + k].tolist()
        return []
