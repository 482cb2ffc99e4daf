"""The workers' text-to-page map (``engine/kv/text_map.py``): every entry a worker publishes for one prompt names the
pages that any other prompt sharing that text prefix really has (ShareGPT texts and conversations, real
tokenizers), and the log serves entries by sequence number."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from pd_cluster.common.routing_text import block_chars_for, block_hashes, routing_text, unpack_entries
from pd_cluster.engine.assets import DEFAULT_MODEL
from pd_cluster.engine.kv.text_map import (
    TextMapLog,
    chat_entries,
    completion_entries,
    page_chain,
    token_id_entries,
)

ROOT = Path(__file__).resolve().parents[2]
SHAREGPT = ROOT / "bench" / "data" / "sharegpt_50_with_responses.json"
LLAMA2 = next((d / "shared" / "tokenizers" / "llama2-32k" for d in (ROOT.parent, ROOT.parent.parent)
               if (d / "shared").is_dir()), ROOT.parent / "shared" / "tokenizers" / "llama2-32k")  # beside the checkout
PAGE = 16


@pytest.fixture(scope="module")
def rows():
    return json.loads(SHAREGPT.read_text())


def load(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def check(entries, other_body: dict, chat: bool, other_ids: list[int]) -> int:
    """Entries whose text hash is one of the other prompt's: each must name that prompt's own page. Returns how
    many were checked."""
    hashes = set(block_hashes(routing_text(other_body, chat), block_chars_for(PAGE)))
    chain = page_chain(other_ids, PAGE, (len(other_ids) - 1) // PAGE)
    checked = 0
    for text_hash, page, pages in entries:
        if text_hash in hashes:
            assert 0 < pages <= len(chain) and chain[pages - 1] == page
            checked += 1
    return checked


@pytest.mark.parametrize("path", [DEFAULT_MODEL, LLAMA2], ids=["stories260K", "llama2-32k"])
def test_completion_entries_name_the_pages_of_every_prompt_sharing_the_prefix(rows, path):
    if not Path(path).exists():
        pytest.skip(f"{path} is not here")
    tok, rng, checked = load(path), random.Random(0), 0
    for row in rows[:30]:
        a = row["prompt"][:2500]
        enc = tok(a, add_special_tokens=True, return_offsets_mapping=True)
        entries = completion_entries({"prompt": a}, a, enc.input_ids, enc.offset_mapping, PAGE)
        assert entries and entries[-1][2] == (len(enc.input_ids) - 1) // PAGE  # the end: the whole prompt
        for _ in range(3):  # the same text cut anywhere (mid-word too), then something else
            b = a[:rng.randrange(1, len(a))] + rows[rng.randrange(len(rows))]["prompt"][:300]
            checked += check(entries, {"prompt": b}, False, tok(b, add_special_tokens=True).input_ids)
        checked += check(entries, {"prompt": a}, False, enc.input_ids)  # the same prompt again
    assert checked > 100


def test_chat_entries_name_the_pages_of_the_next_turn_and_of_edited_chats(rows):
    tok, rng, checked = load(DEFAULT_MODEL), random.Random(1), 0

    def encode(messages):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text, tok(text, add_special_tokens=False, return_offsets_mapping=True)

    for row in rows[:30]:
        turns = [c["value"][:600] for c in row["conversations"]][:5]
        messages = [{"role": "user" if k % 2 == 0 else "assistant", "content": t} for k, t in enumerate(turns)]
        messages = messages[:len(messages) // 2 * 2 + 1] if len(messages) > 1 else messages
        text, enc = encode(messages)
        first = tok.apply_chat_template(messages[:1], tokenize=False) if len(messages) > 1 else None
        ids = [tok.bos_token_id] + enc.input_ids  # add_special_tokens: a BOS in front
        body = {"messages": messages, "add_special_tokens": True}
        entries = chat_entries(body, text, ids, enc.offset_mapping, 1, PAGE, first)
        assert entries
        nxt = messages + [{"role": "assistant", "content": "Sure."}, {"role": "user", "content": "And then?"}]
        last = messages[-1]["content"]
        edited = messages[:-1] + [{"role": "user", "content": last[:rng.randrange(1, len(last) + 1)] + " Why?"}]
        for other in (nxt, edited):
            _, e = encode(other)
            checked += check(entries, dict(body, messages=other), True, [tok.bos_token_id] + e.input_ids)
    assert checked > 30


def test_a_template_that_moves_the_system_prompt_gets_no_entries():
    tok = load(DEFAULT_MODEL)
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'user' %}{% if loop.last %}"
                         "{% for s in messages if s['role'] == 'system' %}{{ s['content'] }} {% endfor %}{% endif %}"
                         "{{ m['content'] }}\n{% elif m['role'] == 'assistant' %}{{ m['content'] }}\n{% endif %}"
                         "{% endfor %}")
    messages = [{"role": "system", "content": "You are a helpful storyteller who likes cats. " * 3},
                {"role": "user", "content": "Tell me about a dog who lived on a farm near the sea."}]
    text = tok.apply_chat_template(messages, tokenize=False)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    first = tok.apply_chat_template(messages[:1], tokenize=False)
    assert chat_entries({"messages": messages}, text, enc.input_ids, enc.offset_mapping, 0, PAGE, first) == []


def test_the_map_ends_at_a_message_with_tool_calls():
    tok = load(DEFAULT_MODEL)
    messages = [{"role": "user", "content": "Tell me about the weather in Paris and in Lyon today. " * 4},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function":
                                                                         {"name": "w", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "Sunny and warm everywhere today. " * 4}]
    text = tok.apply_chat_template(messages, tokenize=False)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    first = tok.apply_chat_template(messages[:1], tokenize=False)
    entries = chat_entries({"messages": messages}, text, enc.input_ids, enc.offset_mapping, 0, PAGE, first)
    head = set(block_hashes(routing_text({"messages": messages[:1]}, True), block_chars_for(PAGE)))
    assert entries and {e[0] for e in entries} <= head  # nothing past the first message, no end entry


def test_token_id_entries_are_exact():
    ids = list(range(1000, 1400))
    entries = token_id_entries({"prompt": ids}, ids, PAGE)
    other = ids[:250] + [7] * 60
    assert check(entries, {"prompt": other}, False, other) > 0
    assert entries[-1][2] == (len(ids) - 1) // PAGE


def test_the_log_serves_entries_after_since_once_each_and_bounded():
    log = TextMapLog(page_size=PAGE, max_entries=4)
    log.record([(1, 10, 1), (2, 20, 2)])
    log.record([(2, 20, 2), (3, 30, 3)])  # 2 is held already
    got = log.read(None)
    assert list(unpack_entries(got["entries"])) == [1, 10, 1, 2, 20, 2, 3, 30, 3] and got["seq"] == 3
    assert got["page_size"] == PAGE and got["block_chars"] == block_chars_for(PAGE) == 32 and not got["more"]
    assert list(unpack_entries(log.read(2)["entries"])) == [3, 30, 3]
    cut = log.read(0, limit=2)
    assert cut["more"] and cut["seq"] == 2
    log.record([(4, 40, 4), (5, 50, 5), (6, 60, 6)])  # past max_entries: 1 and 2 are dropped
    assert list(unpack_entries(log.read(0)["entries"]))[::3] == [3, 4, 5, 6]
    log.record([(1, 10, 1)])  # dropped, so published again
    assert list(unpack_entries(log.read(6)["entries"])) == [1, 10, 1]
    assert log.read(10 ** 6)["seq"] == log.seq  # another instance's number: from the oldest held
    with pytest.raises(ValueError):
        log.read(0, limit=0)
