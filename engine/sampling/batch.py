"""`SamplingBatch`: what the sampler needs to know about each row of one step's logits."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, Sequence

import torch

from pd_cluster.engine.sampling.params import SamplingParams

if TYPE_CHECKING:
    from pd_cluster.engine.sampling.grammar import RequestGrammar


class SamplingRequest(Protocol):
    """The request attributes the sampler reads (`pd_cluster.engine.request.Request` has them)."""

    params: SamplingParams
    generator: torch.Generator | None
    token_ids: list[int]
    num_prompt_tokens: int
    eos_token_ids: tuple[int, ...]
    grammar: RequestGrammar | None


@dataclass
class SamplingBatch:
    """One step's sampling rows, in the order of the logits' rows.

    Attributes:
        params: per row, the request's sampling parameters.
        generators: per row, the request's own generator (seeded requests) or None.
        token_ids: per row, the request's prompt then generated tokens (not copied: read only).
        num_prompt_tokens: per row, how many of `token_ids` are the prompt.
        banned: per row, token ids that cannot be sampled this step (``min_tokens`` not reached yet).
        grammars: per row, the request's structured-output matcher or None (empty list: no row has one).
    """

    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    token_ids: list[Sequence[int]]
    num_prompt_tokens: list[int]
    banned: list[tuple[int, ...]]
    grammars: list[RequestGrammar | None] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.params)

    @classmethod
    def from_requests(cls, reqs: Sequence[SamplingRequest]) -> SamplingBatch:
        """The rows of `reqs`; EOS (unless ``ignore_eos``) and stop ids are banned below ``min_tokens``."""
        banned = []
        for r in reqs:
            p = r.params
            # tokens in flight (overlap scheduling) are output already: this row samples the one after them
            if len(r.token_ids) + getattr(r, "num_inflight", 0) - r.num_prompt_tokens < p.min_tokens:
                banned.append(tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(r.eos_token_ids)))
            else:
                banned.append(())
        grammars = [getattr(r, "grammar", None) for r in reqs]
        return cls([r.params for r in reqs], [r.generator for r in reqs], [r.token_ids for r in reqs],
                   [r.num_prompt_tokens for r in reqs], banned, grammars if any(grammars) else [])

    @classmethod
    def plain(cls, params: list[SamplingParams], generators: list[torch.Generator | None] | None = None
              ) -> SamplingBatch:
        """Rows without token history (empty prompts and outputs): for sampling only from logits."""
        n = len(params)
        return cls(list(params), list(generators) if generators is not None else [None] * n,
                   [[] for _ in range(n)], [0] * n, [() for _ in range(n)])

    def select(self, rows: Sequence[int]) -> SamplingBatch:
        """The sub-batch of `rows`, in that order."""
        return SamplingBatch([self.params[i] for i in rows], [self.generators[i] for i in rows],
                             [self.token_ids[i] for i in rows], [self.num_prompt_tokens[i] for i in rows],
                             [self.banned[i] for i in rows],
                             [self.grammars[i] for i in rows] if self.grammars else [])

    def prompt_ids(self, i: int) -> Sequence[int]:
        return self.token_ids[i][:self.num_prompt_tokens[i]]

    def output_ids(self, i: int) -> Sequence[int]:
        return self.token_ids[i][self.num_prompt_tokens[i]:]
