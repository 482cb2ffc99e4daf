"""Decode graphs under tensor parallelism: every rank builds the same buckets and serves the same decode steps
from its runner, in lockstep, with exact greedy output.

Without a GPU the runners are the eager stand-in (`CudaGraphConfig.eager_stand_in`): nothing is captured, but
each rank pads every decode step into its static buffers and runs the bucket, so the bookkeeping is the one a
GPU replays. Two CPU ranks over gloo, the Triton backend in the interpreter.
"""

from __future__ import annotations

import pytest
from engine_reference import PROMPTS

from pd_cluster.engine import LLM, SamplingParams
from pd_cluster.engine.graph import CudaGraphConfig

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py: the fast tier starts none)

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS_3 = ["Once upon a time", *PROMPTS[:2]]


def _generate(**kwargs) -> list[list[int]]:
    llm = LLM(page_size=16, chunked_prefill_size=7, kv_cache_memory="4MiB", **kwargs)
    try:
        return [o.token_ids for o in llm.generate(PROMPTS_3, PARAMS)]
    finally:
        llm.engine.close()


@pytest.mark.timeout(600)
def test_tp2_decode_runs_through_every_ranks_runner_with_exact_greedy_output():
    want = _generate(attention_backend="torch")
    llm = LLM(tp_size=2, attention_backend="triton", page_size=16, chunked_prefill_size=7, kv_cache_memory="4MiB")
    try:
        driver = llm.engine.tp_driver
        assert driver.call("graph_replays", gather=True) == [0, 0]  # off CUDA the engine captured nothing
        buckets = driver.capture_decode_graphs(CudaGraphConfig(max_bs=4, max_context_len=256, eager_stand_in=True))
        assert buckets == [1, 2, 4]
        got = [o.token_ids for o in llm.generate(PROMPTS_3, PARAMS)]
        replays = driver.call("graph_replays", gather=True)
    finally:
        llm.engine.close()
    assert got == want
    assert replays[0] == replays[1] >= PARAMS.max_tokens - 2  # the decode-only steps, on both ranks alike
