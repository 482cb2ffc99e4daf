"""The router's tokenizer pool, prompt cache and reuse of a conversation's earlier turns give exactly the token
ids, page hashes and ``cache_aware`` decisions of tokenizing every prompt whole with transformers (what the
router did before, and what the workers do: ``tests/serving/test_kv_events_http.py`` compares with a real
worker's ``/tokenize``)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from pd_cluster.engine.assets import DEFAULT_MODEL
from pd_cluster.router.config import CacheAwareConfig, KvRoutingConfig
from pd_cluster.router.kv_index import KvIndex, PromptTokens, page_hashes
from pd_cluster.router.policies import CacheAware, RouteRequest
from pd_cluster.router.tokenizer import CUT_MARGIN, RouterTokenizer

SHAREGPT = Path(__file__).resolve().parents[2] / "bench" / "data" / "sharegpt_50_with_responses.json"
PAGE = 16
MAX_CHARS = 6000


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEFAULT_MODEL)


def reference_ids(tok, body: dict, chat: bool) -> list[int]:
    """Each prompt tokenized whole, as the router did before its pool and caches."""
    if not chat:
        text, special = body["prompt"], body.get("add_special_tokens", True)
        ids = tok(text[:MAX_CHARS], add_special_tokens=special).input_ids
        return ids[:-CUT_MARGIN] if len(text) > MAX_CHARS else ids
    text = tok.apply_chat_template(body["messages"], tokenize=False,
                                   add_generation_prompt=body.get("add_generation_prompt", True))
    ids = tok(text[:MAX_CHARS], add_special_tokens=False).input_ids
    ids = ids[:-CUT_MARGIN] if len(text) > MAX_CHARS else ids
    return [tok.bos_token_id] + ids if body.get("add_special_tokens", False) else ids


def workload() -> list[tuple[dict, bool]]:
    """ShareGPT conversations turn by turn (each turn resends the whole chat, as clients do), interleaved with
    completions: first prompts, repeats of them, and prompts long enough to be cut."""
    rows = json.loads(SHAREGPT.read_text())[:24]
    out: list[tuple[dict, bool]] = []
    chats = []
    for row in rows:
        turns = [c["value"][:900] for c in row["conversations"]] + ["Tell me more.", "Thanks, and a summary?",
                                                                   "Shorter.", "One line."]
        chats.append(turns)
    for step in range(0, 6, 2):  # three user turns per conversation, conversations interleaved
        for i, turns in enumerate(chats):
            messages = [{"role": "user" if k % 2 == 0 else "assistant", "content": turns[k]}
                        for k in range(step + 1)]
            out.append(({"messages": messages, "add_special_tokens": i % 3 == 0}, True))
            prompt = rows[i]["prompt"]
            out.append(({"prompt": prompt[: 300 + 40 * i]}, False))
            if i % 4 == 0:
                out.append(({"prompt": prompt * 3, "add_special_tokens": False}, False))  # past MAX_CHARS: cut
    return out


@pytest.fixture(scope="module")
def tokenized():
    """The workload through the router's tokenizer: 2 threads, requests sent 8 at a time (so batches form)."""
    tok = RouterTokenizer(DEFAULT_MODEL, max_chars=MAX_CHARS, threads=2, cache_tokens=1 << 20)
    tok._load_and_start()
    work = workload()

    async def run() -> list[PromptTokens | None]:
        out = []
        for start in range(0, len(work), 8):
            out += await asyncio.gather(*(tok.prompt(body, chat, (PAGE,)) for body, chat in work[start:start + 8]))
        return out

    prompts = asyncio.run(run())
    tok.close()
    return tok, work, prompts


def test_ids_and_page_hashes_equal_whole_prompt_tokenization(reference, tokenized):
    tok, work, prompts = tokenized
    for (body, chat), prompt in zip(work, prompts):
        want = reference_ids(reference, body, chat)
        assert prompt is not None and list(prompt.token_ids) == want, body
        assert prompt.hashes(PAGE) == page_hashes(want, PAGE)
    # the paths under test were taken: repeats answered from the cache, later turns reusing earlier ones
    assert tok.cache.hits > 0 and tok.reused >= 24


def test_cache_aware_decisions_are_unchanged(reference, tokenized):
    """Two ``cache_aware`` policies on two workers' KV state, one fed the reference ids, one the router's:
    the same worker every time."""
    _, work, prompts = tokenized

    @dataclass
    class Candidate:
        url: str
        load: object = None
        inflight: int = 0
        sent_since_report: int = 0

    def policy() -> tuple[CacheAware, KvIndex]:
        index = KvIndex()
        for url in ("http://a:1", "http://b:1"):
            index.apply(url, {"instance_id": "i", "seq": 0, "snapshot": True, "page_size": PAGE, "events": []}, 0.0)
        return CacheAware(CacheAwareConfig(), lambda: 0.0, index, KvRoutingConfig()), index

    seq = {"http://a:1": 0, "http://b:1": 0}
    (old, old_index), (new, new_index) = policy(), policy()
    candidates = [Candidate("http://a:1"), Candidate("http://b:1")]
    choices = []
    for (body, chat), prompt in zip(work, prompts):
        ref = PromptTokens(tuple(reference_ids(reference, body, chat)))
        a = old.select(candidates, RouteRequest("", 1, ref)).url
        b = new.select(candidates, RouteRequest("", 1, prompt)).url
        assert a == b, body
        choices.append(a)
        seq[a] += 1  # the chosen worker caches the prompt's pages
        for index, p in ((old_index, ref), (new_index, prompt)):
            index.apply(a, {"instance_id": "i", "seq": seq[a], "snapshot": False, "page_size": PAGE, "events": [
                {"type": "BlockStored", "seq": seq[a], "block_hashes": list(p.hashes(PAGE))}]}, 0.0)
    assert len(set(choices)) == 2 and old.by_events == new.by_events == len(work)
    assert old.hits == new.hits > 0
