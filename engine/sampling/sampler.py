"""Batched token sampling: logits processing, greedy, temperature, top-k, top-p, min-p, seeds, logprobs.

A step's logits go through, per row: the request's own logits processors,
``min_tokens`` bans, ``logit_bias`` and penalties (`penalties`); the structured-output
token bitmask of every constrained row, filled for the step and applied once
(`grammar.apply_grammar_bitmask`); then greedy rows
take the argmax, and sampled rows are divided by their temperature, filtered by
top-k, top-p and min-p in that order (transformers' warper order; top-p and
min-p act on the distribution renormalised within the top-k), and sampled.

No full sort of the vocabulary: top-k reads the k-th value with `torch.topk`;
top-p looks at the `torch.topk` candidates (the top-k, or 1,024 when top-k is
off) and widens them only while the candidates hold less than ``top_p`` of the
mass; min-p is a threshold on the top probability. Greedy takes one argmax.

Sampling draws one exponential variate per vocabulary entry and takes
``argmax(p / q)``, which samples from ``p`` exactly (the Gumbel-max trick in
exponential form, as vLLM's sampler does). Seeded requests draw ``q`` from their
own `torch.Generator`, always ``vocab_size`` float32 variates per token, so their
tokens do not depend on the batch and `Sampler.skip` can advance a generator
without logits.

Per-request fault isolation: a row whose processing or sampling fails (a
processor raises, the logits hold no finite value) gets an error in
`SamplerOutput.errors` and token -1; the other rows are sampled as usual.
"""

from __future__ import annotations

import inspect
import logging

import torch

from pd_cluster.engine.device_copy import to_device
from pd_cluster.engine.sampling.batch import SamplingBatch
from pd_cluster.engine.sampling.pending import Logprob, PendingSample, PromptLogprob, SamplerOutput, DeviceLogprobs
from pd_cluster.engine.sampling.grammar import apply_grammar_bitmask
from pd_cluster.engine.sampling.params import SamplingParams
from pd_cluster.engine.sampling.penalties import apply_bans, apply_logit_bias, apply_penalties

logger = logging.getLogger("engine.sampling")

TOP_P_CANDIDATES = 1024
"""Top-p without top-k first looks at this many candidates (doubled while they hold less than top_p)."""

class Sampler:
    """Samples one token per row of logits.

    Args:
        device: where the logits live.
        seed: seed of the shared generator used by unseeded requests.
        vocab_size: the logits' width (the draws per sampled token; see `skip`).
    """

    def __init__(self, device: torch.device, seed: int = 0, vocab_size: int | None = None) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def new_request_generator(self, seed: int | None) -> torch.Generator | None:
        """A generator for a seeded request (None for unseeded ones)."""
        return None if seed is None else torch.Generator(device=self.device).manual_seed(seed)

    def skip(self, params: SamplingParams, generator: torch.Generator | None) -> None:
        """Advance `generator` exactly as sampling one token for a request with these params would.

        The decode worker calls this for the first token, which the prefill worker sampled from the same seed.
        Greedy requests draw nothing; sampled ones draw ``vocab_size`` float32 exponentials.
        """
        if generator is None or params.greedy:
            return
        if self.vocab_size is None:
            raise ValueError("Sampler.skip needs the vocabulary size (construct the Sampler with vocab_size)")
        torch.empty(self.vocab_size, dtype=torch.float32, device=self.device).exponential_(generator=generator)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample from logits [B, V] (float32 or lower), one row per entry of `batch`."""
        return self.launch(logits, batch).result()

    @torch.inference_mode()
    def launch(self, logits: torch.Tensor, batch: SamplingBatch) -> PendingSample:
        """Issue the sampling of logits [B, V] without waiting for the device (`PendingSample.result` waits).

        Everything that reads `logits` runs here, so the caller may overwrite them afterwards (a CUDA graph's
        static output). The chosen ids stay on the device too (`PendingSample.token_ids`, [B] int64, always
        valid vocabulary ids) for the next step's inputs under overlap scheduling.
        """
        n = len(batch)
        errors: list[str | None] = [None] * n
        x = self._run_processors(logits, batch, errors)
        try:
            x = self._prepare(x, batch)
        except Exception:  # noqa: BLE001 - isolate the failing row(s)
            logger.exception("sampling: batched logits processing failed; retrying row by row")
            x = self._prepare_row_by_row(x, batch, errors)
        if batch.grammars:
            self._apply_grammars(x, batch, errors)
        try:
            tokens, bad = self._pick(x, batch, errors)
        except _BeforeDraws:  # nothing drawn yet: every generator is where it was
            logger.exception("sampling: batched choice failed; retrying row by row")
            tokens, bad = self._pick_row_by_row(x, batch, errors)
        pending = PendingSample(tokens, bad, errors, batch.params)
        try:
            pending.logprobs = self._logprobs(logits, batch.params, tokens, errors)
        except Exception:  # noqa: BLE001
            logger.exception("sampling: batched logprobs failed; retrying row by row")
            pending.fallback_logprobs = self._logprobs_row_by_row(logits, batch.params, pending.host_tokens(),
                                                                  errors)
        pending.start_copy()
        return pending

    # ---- logits processing ---------------------------------------------------
    @staticmethod
    def _needs_processing(batch: SamplingBatch) -> bool:
        return any(b for b in batch.banned) or any(p.logit_bias or p.has_penalties for p in batch.params)

    def _run_processors(self, logits: torch.Tensor, batch: SamplingBatch, errors: list[str | None]) -> torch.Tensor:
        """float32 logits with each row's own processors applied; a row whose processor raises fails alone."""
        owned = (any(p.logits_processors for p in batch.params) or self._needs_processing(batch)
                 or bool(batch.grammars))
        x = logits.float()
        if owned and x.data_ptr() == logits.data_ptr():
            x = x.clone()
        for i, p in enumerate(batch.params):
            if not p.logits_processors:
                continue
            try:
                row = x[i]
                for fn in p.logits_processors:
                    args = (batch.output_ids(i), row)
                    if _arity(fn) == 3:
                        args = (batch.prompt_ids(i),) + args
                    row = fn(*args)
                    if not isinstance(row, torch.Tensor) or row.shape != x[i].shape:
                        raise TypeError(f"a logits processor returned {type(row).__name__}, not a [vocab] tensor")
                x[i] = row
            except Exception as e:  # noqa: BLE001
                errors[i] = f"logits processor failed: {type(e).__name__}: {e}"
                x[i] = 0.0
        return x

    @staticmethod
    def _prepare(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Bans, bias and penalties, in place on `x` [B, V] float32."""
        apply_bans(x, batch)
        apply_logit_bias(x, batch)
        apply_penalties(x, batch)
        return x

    def _prepare_row_by_row(self, x: torch.Tensor, batch: SamplingBatch, errors: list[str | None]) -> torch.Tensor:
        for i in range(len(batch)):
            if errors[i] is not None:
                continue
            row = x[i:i + 1].clone()
            try:
                x[i:i + 1] = self._prepare(row, batch.select([i]))
            except Exception as e:  # noqa: BLE001
                errors[i] = f"logits processing failed: {type(e).__name__}: {e}"
                x[i] = 0.0
        return x

    @staticmethod
    def _apply_grammars(x: torch.Tensor, batch: SamplingBatch, errors: list[str | None]) -> None:
        """The structured-output masks, in place on `x` [B, V]: batched, else row by row (a failing row fails)."""
        try:
            apply_grammar_bitmask(x, batch.grammars, errors)
            return
        except Exception:  # noqa: BLE001
            logger.exception("sampling: batched grammar bitmask failed; retrying row by row")
        for i, g in enumerate(batch.grammars):
            if g is None or errors[i] is not None:
                continue
            row_errors: list[str | None] = [None]
            try:
                apply_grammar_bitmask(x[i:i + 1], [g], row_errors)
            except Exception as e:  # noqa: BLE001
                row_errors[0] = f"structured output failed: {type(e).__name__}: {e}"
            errors[i] = row_errors[0]

    # ---- choosing tokens ------------------------------------------------------
    def _pick(self, x: torch.Tensor, batch: SamplingBatch, errors: list[str | None]
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy rows: argmax. Sampled rows: temperature, filters, one draw each.

        Returns:
            the chosen ids [B] int64 and the rows with nothing finite to sample from [B] bool, on the device.

        Raises:
            _BeforeDraws: something failed before any generator was used (the rows can be retried).
        """
        try:
            tokens = x.argmax(dim=-1)
            bad = x.isnan().any(dim=-1) | (x == float("-inf")).all(dim=-1)
            sampled = [i for i, p in enumerate(batch.params) if not p.greedy and errors[i] is None]
            if sampled:
                idx = to_device(sampled, x.device)
                probs = self._filtered_probs(x[idx], [batch.params[i] for i in sampled])
        except Exception as e:  # noqa: BLE001
            raise _BeforeDraws() from e
        if sampled:
            q = self._draws(probs, [batch.generators[i] for i in sampled], sampled, errors)
            tokens[idx] = (probs / q).argmax(dim=-1)
            bad[idx] |= probs.isnan().any(dim=-1)
        return tokens, bad

    def _pick_row_by_row(self, x: torch.Tensor, batch: SamplingBatch, errors: list[str | None]
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.zeros(len(batch), dtype=torch.long, device=x.device)
        bad = torch.zeros(len(batch), dtype=torch.bool, device=x.device)
        for i in range(len(batch)):
            if errors[i] is not None:
                continue
            row_errors: list[str | None] = [None]
            try:
                t, b = self._pick(x[i:i + 1], batch.select([i]), row_errors)
                tokens[i:i + 1], bad[i:i + 1] = t, b
            except _BeforeDraws as e:
                row_errors[0] = f"sampling failed: {type(e.__cause__).__name__}: {e.__cause__}"
            errors[i] = row_errors[0]
        return tokens, bad

    @staticmethod
    def _filtered_probs(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p; returns probabilities [S, V] float32."""
        dev = x.device
        x = x / to_device([p.temperature for p in params], dev, x.dtype)[:, None]
        if any(p.needs_topk_topp for p in params):
            x = top_k_top_p_min_p(x, to_device([p.top_k for p in params], dev),
                                  to_device([p.top_p for p in params], dev, x.dtype),
                                  to_device([p.min_p for p in params], dev, x.dtype),
                                  max_k=max((p.top_k for p in params if p.top_k < x.shape[-1]), default=0),
                                  any_top_p=any(p.top_p < 1.0 for p in params),
                                  any_min_p=any(p.min_p > 0.0 for p in params),
                                  top_p_in_top_k=all(0 < p.top_k <= TOP_P_CANDIDATES for p in params
                                                     if p.top_p < 1.0))
        return x.softmax(dim=-1)

    def _draws(self, probs: torch.Tensor, generators: list[torch.Generator | None], rows: list[int],
               errors: list[str | None]) -> torch.Tensor:
        """Exponential variates [S, V]: unseeded rows from the shared generator, seeded rows from their own."""
        q = torch.empty_like(probs)
        unseeded = [j for j, g in enumerate(generators) if g is None]
        if len(unseeded) == len(generators):
            return q.exponential_(generator=self.generator)
        if unseeded:
            fill = torch.empty(len(unseeded), probs.shape[-1], dtype=probs.dtype, device=probs.device)
            q[to_device(unseeded, probs.device)] = fill.exponential_(generator=self.generator)
        for j, g in enumerate(generators):
            if g is None:
                continue
            try:
                q[j].exponential_(generator=g)
            except Exception as e:  # noqa: BLE001
                errors[rows[j]] = f"sampling failed: {type(e).__name__}: {e}"
                q[j] = 1.0
        return q

    # ---- logprobs ---------------------------------------------------------------
    def _logprobs_row_by_row(self, logits: torch.Tensor, params: list[SamplingParams], tokens: list[int],
                             errors: list[str | None]) -> list[Logprob | None]:
        out: list[Logprob | None] = [None] * len(params)
        for i, p in enumerate(params):
            if p.logprobs is None or tokens[i] < 0:
                continue
            try:
                t = torch.tensor([tokens[i]], device=logits.device)
                lp = self._logprobs(logits[i:i + 1], [p], t, [None])
                out[i] = lp.to_host([p])[0] if lp is not None else None
            except Exception as e:  # noqa: BLE001
                errors[i] = f"logprobs failed: {type(e).__name__}: {e}"
                tokens[i] = -1
        return out

    @staticmethod
    def _logprobs(logits: torch.Tensor, params: list[SamplingParams], tokens: torch.Tensor,
                  errors: list[str | None]) -> DeviceLogprobs | None:
        """The logprobs of the rows that ask for them, on the device (read back by `PendingSample.result`)."""
        rows = [i for i, p in enumerate(params) if p.logprobs is not None and errors[i] is None]
        if not rows:
            return None
        dev = logits.device
        idx = to_device(rows, dev)
        logp = logits[idx].float().log_softmax(dim=-1)
        top_n = max(params[i].logprobs for i in rows)
        top_vals, top_ids = logp.topk(max(top_n, 1), dim=-1)  # at most 20: no full sort
        chosen = logp.gather(-1, tokens[idx][:, None])[:, 0]
        return DeviceLogprobs(rows, chosen, top_vals, top_ids)


class _BeforeDraws(Exception):
    """Choosing tokens failed before any generator was used."""


def top_k_top_p_min_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                      max_k: int, any_top_p: bool = True, any_min_p: bool = True,
                      top_p_in_top_k: bool = False) -> torch.Tensor:
    """Mask filtered tokens to -inf, without sorting the whole vocabulary.

    Args:
        x: [S, V] float32 logits (already divided by the temperature).
        top_k: [S] int; <= 0 or >= V is off. Tokens tied with the k-th value are kept (as transformers, vLLM).
        top_p: [S] float in (0, 1]; keeps the smallest set of most likely tokens, within the top-k, whose
            renormalised mass reaches top_p (Holtzman et al. 2019; transformers' TopPLogitsWarper rule).
        min_p: [S] float in [0, 1]; drops tokens whose probability is below min_p times the top one.
        max_k: the largest entry of `top_k` below V (a host value: no device sync); <= 0: no top-k.
        any_top_p, any_min_p: whether any row asks for top-p / min-p (host values).
        top_p_in_top_k: every top-p row also has a top-k of at most `TOP_P_CANDIDATES` (a host value): the
            top-p candidates then hold all the mass left, and no host check (a device sync) is needed.

    Returns:
        [S, V] float32: `x` with the filtered tokens at -inf. The most likely token always survives.
    """
    vocab = x.shape[-1]
    if 0 < max_k:
        k = torch.where((top_k > 0) & (top_k < vocab), top_k, 0)
        kmax = min(max_k, vocab)
        kth = x.topk(kmax, dim=-1).values.gather(1, (k.clamp(min=1) - 1)[:, None])
        x = x.masked_fill((k > 0)[:, None] & (x < kth), float("-inf"))
    if any_top_p:
        x = _top_p(x, top_p, covered=top_p_in_top_k and 0 < max_k)
    if any_min_p:
        probs = x.softmax(dim=-1)
        x = x.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), float("-inf"))
    return x


def _top_p(x: torch.Tensor, top_p: torch.Tensor, covered: bool = False) -> torch.Tensor:
    """The top-p cut, looking at `torch.topk` candidates widened only while they hold less than top_p.

    `covered`: the candidates hold every token left (a top-k of at most their number ran first; tokens tied
    with the k-th beyond them share the cut's value and are kept), so the widening check is skipped."""
    vocab = x.shape[-1]
    probs = x.softmax(dim=-1)
    width = min(TOP_P_CANDIDATES, vocab)
    while True:
        cand_probs, cand_ids = probs.topk(width, dim=-1)  # sorted, descending
        cum = cand_probs.cumsum(dim=-1)
        if covered or width == vocab or bool(((cum[:, -1] >= top_p) | (top_p >= 1.0)).all()):
            break
        width = min(2 * width, vocab)
    keep = (cum - cand_probs) < top_p[:, None]  # rank j is kept while the mass before it is below top_p
    last = keep.sum(dim=-1, keepdim=True) - 1
    cut = x.gather(1, cand_ids.gather(1, last))
    cut = cut.masked_fill(top_p[:, None] >= 1.0, float("-inf"))  # rows without top-p keep everything
    return x.masked_fill(x < cut, float("-inf"))


def _arity(fn) -> int:
    try:
        return len(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return 2


def prompt_logprobs(logits: torch.Tensor, next_ids: list[int], n: int) -> list[PromptLogprob]:
    """Logprobs of the actual next prompt tokens (raw distribution; top-N by `torch.topk`, no full sort).

    Args:
        logits: [L, V] logits at L consecutive prompt positions.
        next_ids: the L tokens that follow those positions.
        n: top-N to return per position (0..20).

    Returns:
        Per position ``(logprob of the next token, [(id, logprob)] top-N, rank)``: the rank of the next token
        in the distribution (1 = the likeliest; vLLM's ``Logprob.rank``: 1 + the tokens strictly likelier).
    """
    logp = logits.float().log_softmax(dim=-1)
    chosen_t = logp.gather(-1, torch.tensor(next_ids, device=logits.device)[:, None])
    ranks = ((logp > chosen_t).sum(dim=-1) + 1).tolist()
    chosen = chosen_t[:, 0].tolist()
    vals, ids = logp.topk(max(n, 1), dim=-1)
    vals, ids = vals.tolist(), ids.tolist()
    return [(chosen[i], list(zip(ids[i][:n], vals[i][:n])), int(ranks[i])) for i in range(len(next_ids))]
