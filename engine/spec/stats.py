"""Counters of speculative decoding (vLLM's ``spec_decode_*`` metrics) and SGLang's ``accept len``."""

from __future__ import annotations

from pd_cluster.engine.spec.verify import Verified


class SpecDecodeStats:
    """Totals since start, plus the interval behind the ``accept len`` of the ``Decode batch.`` line.

    Args:
        num_draft_tokens: K (positions counted in `accepted_per_pos`).

    Attributes:
        num_drafts: verifications run (one per drafted request and step; vLLM's ``spec_decode_num_drafts``).
        num_draft_tokens: draft tokens checked (``spec_decode_num_draft_tokens``).
        num_accepted_tokens: draft tokens accepted (``spec_decode_num_accepted_tokens``; bonus tokens not counted).
        accepted_per_pos: [K] drafts accepted at each position 0..K-1
            (``spec_decode_num_accepted_tokens_per_pos{position}``).
    """

    def __init__(self, num_draft_tokens: int) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * num_draft_tokens
        self._interval_tokens = 0   # tokens emitted by decoding rows (plain decodes and verifies)
        self._interval_rows = 0     # decoding rows: each emits its accepted drafts plus one token

    def on_verified(self, v: Verified) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += v.num_drafts
        self.num_accepted_tokens += v.num_accepted
        for j in range(v.num_accepted):
            self.accepted_per_pos[j] += 1
        self._interval_tokens += v.num_accepted + 1
        self._interval_rows += 1

    def on_plain_decodes(self, num_rows: int) -> None:
        """Decoding rows that carried no draft this step (they emit one token each)."""
        self._interval_tokens += num_rows
        self._interval_rows += num_rows

    def take_accept_length(self) -> float:
        """Mean tokens emitted per decoding request and step since the last call (SGLang's ``accept len``)."""
        value = self._interval_tokens / self._interval_rows if self._interval_rows else 0.0
        self._interval_tokens = self._interval_rows = 0
        return value

    @property
    def mean_accept_length(self) -> float:
        """Mean tokens per verification since start: 1 + accepted drafts per draft."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
