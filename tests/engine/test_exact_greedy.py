"""Acceptance: greedy output on the real stories260K equals transformers token for token.

The reference for a bf16 or FP8 pool is transformers with its cache rounded to
the same dtype (`RoundingCache`): exactly what such a pool stores.
"""

from __future__ import annotations

import pytest
from engine_reference import PROMPTS, hf_greedy, hf_model

from pd_cluster.engine import LLM, SamplingParams

GREEDY_64 = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)

# README of the embedded model: transformers' greedy output for "Once upon a time".
DOCUMENTED_IDS = [int(t) for t in (
    "432 383 286 261 376 298 315 421 395 317 426 338 401 396 267 337 410 408 419 292 411 322 265 282 295 433 426 385 "
    "328 432 358 394 261 370 432 352 266 268 388 426 338 391 266 267 337 335 312 432 398 312 286 267 414 270 333 415 "
    "426 13 438 310 439 419 357 336").split()]
DOCUMENTED_TEXT = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, she saw a "
    "big, red ball. She wanted to play with it, but it was too high.\nLily's mom said")


def test_documented_once_upon_a_time():
    llm = LLM()
    out = llm.generate("Once upon a time", SamplingParams(max_tokens=64, temperature=0.0))[0]
    assert out.token_ids == DOCUMENTED_IDS
    assert out.prompt + out.text == DOCUMENTED_TEXT
    _, tok = hf_model()
    assert tok.decode(tok("Once upon a time").input_ids + out.token_ids, skip_special_tokens=True) == DOCUMENTED_TEXT


def test_prompts_are_longer_than_the_chunk():
    _, tok = hf_model()
    assert len(PROMPTS) >= 8
    assert min(len(tok(p).input_ids) for p in PROMPTS) > 7


@pytest.mark.parametrize("kv", ["fp32", "bf16"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_batched_equals_transformers(kv, page_size):
    llm = LLM(kv_cache_dtype=kv, page_size=page_size)
    outs = llm.generate(PROMPTS, GREEDY_64)
    for prompt, out in zip(PROMPTS, outs):
        assert tuple(out.token_ids) == hf_greedy(prompt, 64, kv), prompt


@pytest.mark.parametrize("kv", ["fp32", "bf16"])
def test_one_at_a_time_equals_transformers(kv):
    llm = LLM(kv_cache_dtype=kv, page_size=16)
    for prompt in PROMPTS:
        out = llm.generate(prompt, GREEDY_64)[0]
        assert tuple(out.token_ids) == hf_greedy(prompt, 64, kv), prompt


@pytest.mark.parametrize("kv", ["fp32", "bf16"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_chunked_prefill_7_equals_transformers(kv, page_size):
    llm = LLM(kv_cache_dtype=kv, page_size=page_size, chunked_prefill_size=7)
    outs = llm.generate(PROMPTS, GREEDY_64)
    for prompt, out in zip(PROMPTS, outs):
        assert tuple(out.token_ids) == hf_greedy(prompt, 64, kv), prompt


def test_small_step_budget_mixes_decode_and_prefill_chunks():
    # A 9-token step budget forces decodes and prompt chunks of other requests into the same steps.
    llm = LLM(chunked_prefill_size=5, max_prefill_tokens=9, page_size=16)
    outs = llm.generate(PROMPTS, GREEDY_64)
    for prompt, out in zip(PROMPTS, outs):
        assert tuple(out.token_ids) == hf_greedy(prompt, 64, "fp32"), prompt


def test_fp8_pool_equals_transformers_with_fp8_cache():
    llm = LLM(kv_cache_dtype="fp8_e4m3", page_size=16, chunked_prefill_size=7)
    outs = llm.generate(PROMPTS, GREEDY_64)
    for prompt, out in zip(PROMPTS, outs):
        assert tuple(out.token_ids) == hf_greedy(prompt, 64, "fp8_e4m3"), prompt
