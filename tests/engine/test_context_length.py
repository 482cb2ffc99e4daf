"""Acceptance: --context-length never sizes the pool; oversize requests fail with the numbers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pd_cluster.engine import LLM, SamplingParams
from pd_cluster.engine.errors import ContextLengthExceeded, PoolCapacityExceeded

_PROBE = r"""
import json, os, sys, psutil
from pd_cluster.engine.args import config_from_kwargs
from pd_cluster.engine.llm_engine import LLMEngine
before = psutil.Process().memory_info().rss
engine = LLMEngine(config_from_kwargs(context_length=int(sys.argv[1]), kv_cache_memory="64MiB"))
after = psutil.Process().memory_info().rss
print(json.dumps({"pages": engine.pool.num_pages, "tokens": engine.pool.max_total_num_tokens,
                  "rss": after, "rss_delta": after - before, "ctx": engine.context_length}))
"""


def _start(context_length: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, str(context_length)], capture_output=True, text=True,
                         timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_context_length_does_not_size_the_pool():
    small, huge = _start(4096), _start(10_000_000)
    assert (small["ctx"], huge["ctx"]) == (4096, 10_000_000)
    assert small["pages"] == huge["pages"] > 0
    assert small["tokens"] == huge["tokens"]
    # The 64 MiB pool is zero-filled, so it is really resident; start-up memory agrees within 5 %.
    assert small["rss_delta"] > 64 * 2**20
    assert abs(small["rss"] - huge["rss"]) <= 0.05 * small["rss"]


def test_request_larger_than_the_pool_fails_clearly():
    llm = LLM(context_length=10_000_000, page_size=16, num_pages=8)  # 128 tokens of KV
    with pytest.raises(PoolCapacityExceeded) as err:
        llm.generate(list(range(3, 103)), SamplingParams(max_tokens=50))
    msg = str(err.value)
    assert "150 tokens" in msg and "100 prompt" in msg and "128 tokens" in msg and "8 pages of 16" in msg
    assert not llm.engine.requests and llm.engine.num_free_pages() == 8
    ok = llm.generate(list(range(3, 53)), SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))[0]
    assert len(ok.token_ids) == 50  # 100 tokens fit


def test_context_length_exceeded_message():
    llm = LLM(context_length=64)
    with pytest.raises(ContextLengthExceeded) as err:
        llm.generate(list(range(3, 53)), SamplingParams(max_tokens=20))
    assert "maximum context length is 64 tokens" in str(err.value)
    assert "70 tokens (50 in the prompt, 20 in the completion)" in str(err.value)
