"""Speculative decoding's counters, vLLM's ``spec_decode_*`` names (exported under ``vllm:`` too,
`pd_cluster.serving.metrics.VLLM_NAMES`), read from `pd_cluster.engine.spec.stats.SpecDecodeStats`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from pd_cluster.serving.counter_totals import CounterTotals

SPEC_VLLM_NAMES = {f"pd:spec_decode_{n}": (f"vllm:spec_decode_{n}",)
                   for n in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")}


class SpecDecodeMetrics:
    """The counters on the worker's own registry; `on_step` brings them up to the engine's totals."""

    def __init__(self, own: CollectorRegistry) -> None:
        c = lambda name, doc, labels=(): Counter(f"pd:spec_decode_{name}", doc, labels, registry=own)  # noqa: E731
        self.num_drafts = c("num_drafts", "Speculative verifications: one per drafted request and step.")
        self.num_draft_tokens = c("num_draft_tokens", "Draft tokens verified.")
        self.num_accepted_tokens = c("num_accepted_tokens", "Draft tokens accepted (bonus tokens not counted).")
        self.per_pos = c("num_accepted_tokens_per_pos", "Draft tokens accepted at each draft position (0-based).",
                         ("position",))
        self._inc = CounterTotals().add

    def on_step(self, engine) -> None:
        spec = getattr(engine.stats, "spec", None)
        if spec is None:
            return
        self._inc(self.num_drafts, "drafts", spec.num_drafts)
        self._inc(self.num_draft_tokens, "draft_tokens", spec.num_draft_tokens)
        self._inc(self.num_accepted_tokens, "accepted", spec.num_accepted_tokens)
        for pos, total in enumerate(spec.accepted_per_pos):
            self._inc(self.per_pos.labels(position=str(pos)), f"pos{pos}", total)
