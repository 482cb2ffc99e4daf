"""Batched token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Sampling draws one exponential variate per vocabulary entry and takes
``argmax(p / q)``, which samples from ``p`` exactly (the Gumbel-max trick in
exponential form, as vLLM's sampler does). Seeded requests draw ``q`` from
their own `torch.Generator`, so their tokens do not depend on the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pd_cluster.engine.sampling.params import SamplingParams


@dataclass
class SamplerOutput:
    """Result of sampling one step.

    Attributes:
        token_ids: [B] int64 chosen tokens.
        logprobs: per row, None or (chosen token's logprob, [(token_id, logprob)] top-N),
            computed from the model's raw distribution (before temperature).
    """

    token_ids: list[int]
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


def _apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                             min_p: torch.Tensor) -> torch.Tensor:
    """Mask filtered tokens to -inf. logits [B, V] float32; top_k [B] int (<=0: off); top_p, min_p [B]."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)
    drop = ranks >= k[:, None]
    probs = sorted_logits.softmax(dim=-1)
    cum = probs.cumsum(dim=-1)
    drop |= (cum - probs) >= top_p[:, None]  # keep the smallest prefix whose mass reaches top_p
    drop |= probs < (min_p[:, None] * probs[:, :1])
    drop[:, 0] = False  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


class Sampler:
    """Samples one token per row of logits.

    Args:
        device: where the logits live.
        seed: seed of the shared generator used by unseeded requests.
    """

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def new_request_generator(self, seed: int | None) -> torch.Generator | None:
        """A generator for a seeded request (None for unseeded ones)."""
        return None if seed is None else torch.Generator(device=self.device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> SamplerOutput:
        """Sample from logits [B, V] (float32), one row per request."""
        greedy_ids = logits.argmax(dim=-1)
        if all(p.greedy for p in params):
            tokens = greedy_ids
        else:
            tokens = self._sample(logits, params, generators, greedy_ids)
        token_list = tokens.tolist()
        return SamplerOutput(token_list, self._logprobs(logits, params, token_list))

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None], greedy_ids: torch.Tensor) -> torch.Tensor:
        dev = logits.device
        temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=dev)
        scaled = logits / temps[:, None]
        if any(p.needs_topk_topp for p in params):
            scaled = _apply_top_k_top_p_min_p(
                scaled,
                torch.tensor([p.top_k for p in params], device=dev),
                torch.tensor([p.top_p for p in params], device=dev),
                torch.tensor([p.min_p for p in params], device=dev))
        probs = scaled.softmax(dim=-1)
        q = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, g in enumerate(generators):
            if g is not None:
                q[i].exponential_(generator=g)
        sampled = (probs / q).argmax(dim=-1)
        is_greedy = torch.tensor([p.greedy for p in params], device=dev)
        return torch.where(is_greedy, greedy_ids, sampled)

    @staticmethod
    def _logprobs(logits: torch.Tensor, params: list[SamplingParams],
                  tokens: list[int]) -> list[tuple[float, list[tuple[int, float]]] | None]:
        want = [p.logprobs for p in params]
        if all(n is None for n in want):
            return [None] * len(params)
        logp = logits.log_softmax(dim=-1)
        top_n = max(n for n in want if n is not None)
        top_vals, top_ids = logp.topk(max(top_n, 1), dim=-1)
        chosen = logp.gather(-1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0].tolist()
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
        out: list[tuple[float, list[tuple[int, float]]] | None] = []
        for i, n in enumerate(want):
            out.append(None if n is None else (chosen[i], list(zip(top_ids[i][:n], top_vals[i][:n]))))
        return out


def prompt_logprobs(logits: torch.Tensor, next_ids: list[int], n: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """Logprobs of the actual next prompt tokens.

    Args:
        logits: [L, V] logits at L consecutive prompt positions.
        next_ids: the L tokens that follow those positions.
        n: top-N to return per position.
    """
    logp = logits.float().log_softmax(dim=-1)
    chosen = logp.gather(-1, torch.tensor(next_ids, device=logits.device)[:, None])[:, 0].tolist()
    vals, ids = logp.topk(max(n, 1), dim=-1)
    vals, ids = vals.tolist(), ids.tolist()
    return [(chosen[i], list(zip(ids[i][:n], vals[i][:n]))) for i in range(len(next_ids))]
