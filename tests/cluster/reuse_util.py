"""Helpers for the prefix-cache tests through PD: offline reference conversations and exact expectations.

A conversation's turn k prompt is turn k-1's prompt, its answer and a new question. The reference is the
offline engine with the prefix cache off; from its token ids the tests derive exactly what each worker's
cache holds and so what each counter must show.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from cluster_util import metric_value

from pd_cluster.engine.llm import LLM
from pd_cluster.engine.sampling.params import SamplingParams

OPENING = "Once upon a time, there was a little girl named Lily. She liked to play in the park."
QUESTIONS = [" Then she saw a big dog.", " The dog wanted to play.", " Her mom called her home.",
             " At night she dreamed."]


@dataclass(frozen=True)
class Turn:
    """One turn of the reference: the prompt (text and ids) and the greedy answer (text and ids)."""

    prompt: str
    ids: tuple[int, ...]
    text: str
    out_ids: tuple[int, ...]


def conversation(opening: str, turns: int, max_tokens: int, **engine_kw) -> tuple[list[Turn], int]:
    """Offline greedy turns with the prefix cache off, and the KV page's bytes of that configuration.

    Args:
        engine_kw: engine flags as keywords (``page_size``, ``kv_cache_dtype``, ``chunked_prefill_size``).
    """
    llm = LLM(kv_cache_memory="64MiB", disable_radix_cache=True, **engine_kw)
    out, prompt = [], opening
    for k in range(turns):
        r = llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0))[0]
        ids = tuple(llm.engine.tokenize(prompt))
        if out:  # the premise: each prompt's tokens start with the previous prompt's
            assert ids[:len(out[-1].ids)] == out[-1].ids
        out.append(Turn(prompt, ids, r.outputs[0].text, tuple(r.outputs[0].token_ids)))
        prompt = prompt + r.outputs[0].text + QUESTIONS[k % len(QUESTIONS)]
    return out, llm.engine.layout.page_nbytes


def pages(num_tokens: int, page: int) -> int:
    return -(-num_tokens // page)


def decode_held(turns: list[Turn], k: int, page: int) -> int:
    """Pages of turn k's prompt that the decode worker's cache holds after turns 0..k-1 ran there.

    Each earlier request left its computed tokens' full pages: its prompt and its answer but the last
    token (sampled, never fed back). A prompt never matches its last token (the engine's cap).
    """
    ids, best = turns[k].ids, 0
    cap = (len(ids) - 1) // page
    for t in turns[:k]:
        seq = t.ids + t.out_ids[:-1]
        n = 0
        while n < min(len(seq) // page, cap) and seq[n * page:(n + 1) * page] == ids[n * page:(n + 1) * page]:
            n += 1
        best = max(best, n)
    return best


def prefill_held(turns: list[Turn], k: int, page: int, seen: list[int] | None = None) -> int:
    """Pages of turn k's prompt that the prefill worker's cache holds: the full pages of the earlier prompts it
    prefilled (`seen`: their indices; None: all), never the answers (decoded elsewhere)."""
    ids, best = turns[k].ids, 0
    cap = (len(ids) - 1) // page
    for t in (turns[j] for j in (range(k) if seen is None else seen)):
        n = 0
        while n < min(len(t.ids) // page, cap) and t.ids[n * page:(n + 1) * page] == ids[n * page:(n + 1) * page]:
            n += 1
        best = max(best, n)
    return best


COUNTERS = ("pd:kv_transfer_received_bytes_total", "pd:kv_transfer_saved_bytes_total",
            "pd:decode_local_prefill_requests_total", "pd:kv_transfer_bytes_total",
            "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
            # a decode worker counts its lookups under these names only (no vllm: twins: each prompt is looked up
            # once per cluster in vLLM's names, by the prefill)
            "pd:prefix_cache_queries_total", "pd:prefix_cache_hits_total", "pd:kv_transfer_window_skipped_bytes_total")


def counters(url: str) -> dict[str, float]:
    """The worker's counters of `COUNTERS` that it serves (absent ones are left out)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for name in COUNTERS:
        try:
            out[name] = metric_value(text, name)
        except KeyError:
            pass
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}
