"""Which running requests get draft tokens this step, and how many (the scheduler asks `Drafter.propose`).

A request is drafted only where verification reproduces non-speculative decoding's distribution exactly with
one target extend: its sampling does not depend on the tokens being verified. Requests with repetition,
frequency or presence penalties, logits processors, a per-request seed (its draws must stay those of the seed),
or ``min_tokens`` not yet reached decode one token per step as without speculation; their output is unchanged.
A structured-output request is drafted: its grammar masks each verified row (`verify.grammar_masks`).

The drafts come from the request's own tokens (NGRAM, `NgramProposer`), from a draft model (STANDALONE,
`StandaloneProposer`) or from the target's multi-token-prediction layer (NEXTN, `NextNProposer`): the scheduler calls `prepare` once per step with the decoding requests, then `propose`
per request it schedules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pd_cluster.engine.request import Request
from pd_cluster.engine.spec.config import SpeculativeConfig
from pd_cluster.engine.spec.ngram import NgramProposer

if TYPE_CHECKING:
    from pd_cluster.engine.config import EngineConfig
    from pd_cluster.engine.spec.nextn import NextNProposer
    from pd_cluster.engine.spec.standalone import StandaloneProposer


def never_drafted(req: Request) -> bool:
    """`req` is decoded without drafts for its whole life: penalties, logits processors or its own seed."""
    p = req.params
    return bool(p.has_penalties or p.logits_processors or req.generator is not None)


def can_draft(req: Request) -> bool:
    """Whether `req`'s next tokens may be drafted and verified (see the module docstring)."""
    return not never_drafted(req) and req.num_output_tokens >= req.params.min_tokens and not req.num_inflight


class Drafter:
    """Proposes a running request's draft tokens.

    Args:
        config: the speculative settings (enabled).
        context_length: the engine's longest sequence (drafts never run past it).
        model: STANDALONE's draft model proposer or NEXTN's MTP proposer; None: NGRAM.
    """

    def __init__(self, config: SpeculativeConfig, context_length: int,
                 model: "StandaloneProposer | NextNProposer | None" = None) -> None:
        self.k = config.num_draft_tokens
        self.context_length = context_length
        self.proposer = NgramProposer(config.speculative_ngram_min_match_window_size,
                                      config.speculative_ngram_max_match_window_size)
        self.model = model
        self._drafts: dict[str, list[int]] = {}

    def _k(self, req: Request, budget: int) -> int:
        """Never more than the request may still emit after the bonus token (``max_tokens``) or than the context
        holds; 0 when the request is not eligible (`can_draft`)."""
        k = min(self.k, budget, req.remaining_output_tokens - 1, self.context_length - req.num_tokens)
        return k if k > 0 and can_draft(req) else 0

    def prepare(self, decoding: list[Request]) -> None:
        """The step's decoding requests (one known token without KV each): STANDALONE runs the draft model for
        all of them at once here; NGRAM drafts lazily in `propose`."""
        self._drafts = {}
        if self.model is not None:
            work = [(r, k) for r in decoding if (k := self._k(r, self.k))]
            self._drafts = self.model.propose(work) if work else {}

    def propose(self, req: Request, budget: int) -> list[int]:
        """Draft tokens for `req`'s next step (it is decoding: one known token without KV), at most `budget`;
        [] when the request is not eligible or nothing is proposed (no suffix recurs, the draft pool is full)."""
        k = self._k(req, budget)
        if k <= 0:
            return []
        if self.model is not None:
            return self._drafts.get(req.request_id, [])[:k]
        return self.proposer.propose(req.token_ids, k)

    def release(self, request_id: str) -> None:
        """`request_id` left the running set (STANDALONE: its draft KV pages go back to the draft pool)."""
        if self.model is not None:
            self.model.release(request_id)

    def load(self) -> dict[str, int]:
        """The draft pool's numbers for ``/get_load`` (STANDALONE), else nothing."""
        if self.model is None:
            return {}
        alloc = self.model.model.allocator
        return {"draft_num_free_pages": alloc.num_free, "draft_num_total_pages": alloc.num_pages}


def captures_decode_graphs(config: "EngineConfig") -> bool:
    """Whether this engine's ranks may capture decode CUDA graphs: not with NEXTN on a decoding role (the target
    must write its hidden states every step; a replay would not), on any rank, so the ranks' steps stay alike."""
    spec = config.speculative
    return not (spec.speculative_algorithm == "NEXTN" and config.role != "prefill")


def build_drafter(config: "EngineConfig", context_length: int, vocab_size: int, tokenizer, device,
                  target_pages: int, max_running_requests: int, runner=None) -> Drafter | None:
    """The engine's drafter, or None without speculation or in the prefill role (the decode drafts; in PD
    the prefill worker computes the prompt's KV and first token as always). STANDALONE loads the draft model here;
    NEXTN the target checkpoint's MTP layer, and makes `runner` (the target's `ModelRunner`) keep and hand over
    the target's hidden states (no decode CUDA graphs: a replay would not write them; `captures_decode_graphs`).
    Under tensor parallelism both run whole on rank 0, beside the target's rank-0 shard: its final-norm output
    is the full hidden state (replicated on every rank after the last all-reduce), so the MTP layer needs
    nothing from the other ranks.

    Raises:
        ValueError: from `DraftModel` (another vocabulary, a pool over the memory available; NEXTN: a checkpoint
            without an MTP layer); each names the flag.
    """
    spec = config.speculative
    if not spec.enabled or config.role == "prefill":
        return None
    model = None
    if spec.speculative_algorithm == "STANDALONE":
        from pd_cluster.engine.spec.draft_model import DraftModel, plan_draft_pages
        from pd_cluster.engine.spec.standalone import StandaloneProposer

        page = config.cache.page_size
        pages = plan_draft_pages(target_pages, max_running_requests, spec.num_draft_tokens, page)
        draft = DraftModel(spec.speculative_draft_model_path, vocab_size, tokenizer, config.model.dtype, device,
                           config.device.attention_backend, pages, page, config.model.seed)
        model = StandaloneProposer(draft, config.scheduler.chunked_prefill_size)
    elif spec.speculative_algorithm == "NEXTN":
        model = _nextn(config, vocab_size, device, target_pages, max_running_requests, runner)
    return Drafter(spec, context_length, model)


def _nextn(config: "EngineConfig", vocab_size: int, device, target_pages: int, max_running_requests: int,
           runner) -> "NextNProposer":
    from pd_cluster.engine.spec.draft_model import DraftModel, plan_draft_pages
    from pd_cluster.engine.spec.nextn import NextNProposer

    if runner is None:
        raise ValueError("--speculative-algorithm NEXTN needs the target's model runner (its hidden states)")
    page, spec = config.cache.page_size, config.speculative
    pages = plan_draft_pages(target_pages, max_running_requests, spec.num_draft_tokens, page)
    mtp = DraftModel(config.model.path, vocab_size, None, config.model.dtype, device,
                     config.device.attention_backend, pages, page, config.model.seed, nextn=True)
    proposer = NextNProposer(mtp, config.scheduler.chunked_prefill_size, never_drafted)
    runner.shard.loaded.model.keep_hidden = True
    runner.shard.graph_runner = None
    runner.on_hidden = proposer.on_hidden
    return proposer
