"""``GET /kv_events`` of a real worker (the embedded model, served on loopback): after a request, the pages its
prefix cache stored, by the same chained hashes the router computes from the same token ids; after other traffic
evicts them from a small pool, the same hashes removed; applied to the router's index, the prompt is held, then
not. The endpoint is worker-internal (the internal key)."""

from __future__ import annotations

import httpx
import pytest
from starlette.responses import JSONResponse
from worker_kit import running_worker

from pd_cluster.router.kv_index import KvIndex, PromptTokens, page_hashes
from pd_cluster.serving.worker_app import InternalAuth

PS = 4
PROMPT = "Once upon a time, there was a little girl named Lily. She liked to play."
OTHERS = ["The little dog ran to the park and saw a big red ball on the grass.",
          "Tom and Sue found a big box in the garden. Inside the box there was a toy.",
          "One sunny day, a small bird sat on a branch and sang a happy song.",
          "There was a boy named Ben who loved trucks and cars and trains.",
          "Sam had a red ball. He threw it up high and it went over the tree.",
          "The sun was hot, and the cat wanted to sleep in the shade of the house."]


def _complete(url: str, prompt: str) -> list[int]:
    """Prompt ids + generated ids of a greedy completion."""
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0,
                                                  "return_token_ids": True}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["prompt_token_ids"] + body["choices"][0]["token_ids"]


def _events(url: str, since: int | None) -> dict:
    r = httpx.get(url + "/kv_events", params={} if since is None else {"since": since}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def _stored(batch: dict) -> list[int]:
    return [h for e in batch["events"] if e["type"] == "BlockStored" for h in e["block_hashes"]]


def _removed(batch: dict) -> list[int]:
    return [h for e in batch["events"] if e["type"] == "BlockRemoved" for h in e["block_hashes"]]


@pytest.mark.timeout(300)
def test_kv_events_report_stored_then_evicted_pages_by_the_routers_hashes():
    with running_worker(page_size=PS, num_pages=24) as w:
        ids = _complete(w.url, PROMPT)
        want = page_hashes(ids, PS)  # the computed tokens' full pages (the last token has no KV yet)
        assert len(want) == (len(ids) - 1) // PS >= 5
        snap = _events(w.url, None)
        assert snap["snapshot"] and snap["page_size"] == PS and snap["events"][0]["type"] == "AllBlocksCleared"
        assert _stored(snap) == list(want)
        delta = _events(w.url, 0)
        assert not delta["snapshot"] and delta["seq"] == snap["seq"] == len(delta["events"])
        assert [e["seq"] for e in delta["events"]] == list(range(1, delta["seq"] + 1))
        assert _stored(delta) == list(want)  # stored chunk by chunk, in chain order
        first = delta["events"][0]
        assert first["parent_block_hash"] is None and first["block_size"] == PS
        assert first["token_ids"] == ids[:len(first["block_hashes"]) * PS]
        index, prompt = KvIndex(), PromptTokens(tuple(ids))
        index.apply(w.url, snap, 0.0)
        assert index.cached_pages(w.url, prompt) == (len(want), len(want))

        seq, removed = snap["seq"], []
        for other in OTHERS:  # a pool of 24 pages: other prompts evict the oldest pages, this prompt's
            _complete(w.url, other)
            batch = _events(w.url, seq)
            assert not batch["snapshot"] and batch["events"][0]["seq"] == seq + 1
            index.apply(w.url, batch, 0.0)
            seq, removed = batch["seq"], removed + _removed(batch)
            if set(want) <= set(removed):
                break
        assert set(want) <= set(removed)
        assert index.cached_pages(w.url, prompt) == (0, len(want))
        assert index.num_pages(w.url) == len(_stored(_events(w.url, None)))
        assert _events(w.url, seq)["events"] == []
        bad = httpx.get(w.url + "/kv_events", params={"since": "-1"}, timeout=10)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "since"


def test_the_router_tokenizes_as_the_worker_does():
    from pd_cluster.engine.assets import DEFAULT_MODEL
    from pd_cluster.router.tokenizer import RouterTokenizer

    tok = RouterTokenizer(DEFAULT_MODEL, max_chars=1 << 18)
    tok._load()  # what start_loading runs in its thread
    chat = [{"role": "system", "content": "You tell stories."},
            {"role": "user", "content": [{"type": "text", "text": "A dog "}, {"type": "text", "text": "and a cat."}]},
            {"role": "assistant", "content": "Once upon a time"}, {"role": "user", "content": "More!"}]
    cases = [({"prompt": PROMPT}, False), ({"prompt": PROMPT, "add_special_tokens": False}, False),
             ({"messages": chat}, True), ({"messages": chat, "add_generation_prompt": False}, True),
             ({"messages": chat, "add_special_tokens": True}, True)]
    with running_worker(page_size=PS) as w:
        for body, is_chat in cases:
            r = httpx.post(w.url + "/tokenize", json=body, timeout=10)
            assert r.status_code == 200, r.text
            ids = tok.chat_ids(body) if is_chat else tok.completion_ids(body)
            assert ids == r.json()["tokens"], body
    assert tok.chat_ids({"messages": chat, "tools": [{"type": "function"}]}) is None  # the tree routes these
    assert tok.completion_ids({"prompt": ["a", "b"]}) is None
    cut = RouterTokenizer(DEFAULT_MODEL, max_chars=400)
    cut._tokenizer, cut._backend, cut._added = tok._tokenizer, tok._backend, tok._added
    full = tok.completion_ids({"prompt": PROMPT * 20})
    short = cut.completion_ids({"prompt": PROMPT * 20})
    assert short == full[:len(short)] and 40 < len(short) < len(full)  # a cut prompt hashes a prefix


def test_kv_events_need_the_internal_key():
    auth = InternalAuth(lambda scope, receive, send: JSONResponse({})(scope, receive, send), key="k" * 32)
    assert auth.protects("/kv_events") and not auth.protects("/get_load")
