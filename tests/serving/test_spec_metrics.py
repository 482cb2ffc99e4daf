"""Speculative decoding's counters on a worker's registry (``serving/spec_metrics.py``) from a real engine with
NGRAM drafts: vLLM's ``spec_decode_*`` names, each ``vllm:`` twin equal to its ``pd:`` family and to the engine's
totals, the per-position acceptance labelled ``position``."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, generate_latest

from pd_cluster.bench import prom
from pd_cluster.engine.args import config_from_kwargs
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.engine.sampling.params import SamplingParams
from pd_cluster.serving.metrics import WorkerMetrics

PROMPT = "The cat sat on the mat. The cat sat on the mat. The cat sat on the"


def test_spec_decode_counters_equal_the_engine_totals():
    engine = LLMEngine(config_from_kwargs(speculative_algorithm="NGRAM", speculative_num_draft_tokens=3))
    reg = CollectorRegistry()
    metrics = WorkerMetrics(reg, "mixed")
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    deadline = time.monotonic() + 60
    while engine.has_work() and time.monotonic() < deadline:
        engine.step()
        metrics.on_step(engine)
    assert not engine.has_work()
    scrape = prom.parse(generate_latest(reg).decode())
    spec = engine.stats.spec
    assert spec.num_drafts > 0 and spec.num_accepted_tokens > 0
    want = {"num_drafts": spec.num_drafts, "num_draft_tokens": spec.num_draft_tokens,
            "num_accepted_tokens": spec.num_accepted_tokens}
    for name, total in want.items():
        for prefix in ("pd", "vllm"):
            assert prom.delta_sum({}, scrape, f"{prefix}:spec_decode_{name}_total") == total, (prefix, name)
    for prefix in ("pd", "vllm"):
        per_pos = prom.delta_by_label({}, scrape, f"{prefix}:spec_decode_num_accepted_tokens_per_pos_total",
                                      "position")
        assert per_pos == {str(i): float(n) for i, n in enumerate(spec.accepted_per_pos) if n}
