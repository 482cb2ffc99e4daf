"""Routing text and its block hashes: the definition the router and the workers share (``common/routing_text.py``)."""

from __future__ import annotations

import zlib

import pytest

from pd_cluster.common.routing_text import (
    block_chars_for,
    block_hashes,
    chat_segments,
    pack_entries,
    pack_u64,
    routing_text,
    unpack_entries,
    unpack_u64,
)


BLOCK_CHARS = 64


def reference(text: str, block: int = BLOCK_CHARS) -> list[int]:
    """The module docstring's definition, computed from scratch for every prefix."""
    out = []
    full = len(text) // block * block
    for end in range(block, full + 1, block):
        b = text[:end].encode("utf-8", "surrogatepass")
        out.append(zlib.crc32(b) << 32 | zlib.adler32(b))
    b = text.encode("utf-8", "surrogatepass") + b"\xff"
    out.append(zlib.crc32(b) << 32 | zlib.adler32(b))
    return out


@pytest.mark.parametrize("text", ["", "a", "x" * 64, "Once upon a time " * 20,
                                  "héllo wörld — ünïcödé " * 9, "emoji 😀 " * 30, "lone \ud800 surrogate " * 7])
def test_block_hashes_follow_the_definition(text):
    assert block_hashes(text, BLOCK_CHARS) == reference(text)
    assert block_hashes(text, 32) == reference(text, 32)


def test_a_block_hash_names_the_whole_prefix_and_the_end_hash_the_whole_text():
    a = "The same opening paragraph. " * 5 + "Then one ending."
    b = "The same opening paragraph. " * 5 + "Then another, longer ending."
    ha, hb = block_hashes(a, BLOCK_CHARS), block_hashes(b, BLOCK_CHARS)
    shared = len(a[:len(b)]) // BLOCK_CHARS  # full blocks inside the common prefix
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y) // BLOCK_CHARS
    assert ha[:common] == hb[:common] and ha[common] != hb[common] and shared >= common
    # a text that is exactly whole blocks: its end hash is not the hash of the same text as a prefix
    whole = "y" * (2 * BLOCK_CHARS)
    assert block_hashes(whole, BLOCK_CHARS)[1] == block_hashes(whole + "more", BLOCK_CHARS)[1] \
        != block_hashes(whole, BLOCK_CHARS)[2]
    assert len(block_hashes("z" * 10 * BLOCK_CHARS, BLOCK_CHARS, max_blocks=4)) == 4  # cut: no end hash
    # the maps' block follows the page size: under a page of text, 32 to 128 characters
    assert [block_chars_for(p) for p in (1, 16, 32, 64, 256)] == [32, 32, 64, 128, 128]


def test_routing_text_puts_what_changes_the_tokens_in_front():
    chat = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "!"}]}]}
    assert routing_text(chat, chat=True) == "<system>Be brief.<user>Hi !"
    with_tools = dict(chat, tools=[{"type": "function", "function": {"name": "f"}}])
    text = routing_text(with_tools, chat=True)
    assert text.startswith("\x02") and text.endswith("<system>Be brief.<user>Hi !")
    assert routing_text({"prompt": "abc"}, chat=False) == "abc"
    assert routing_text({"prompt": "abc", "add_special_tokens": False}, chat=False) != "abc"
    assert routing_text({"prompt": [1, 22, 333]}, chat=False) == "1,22,333"
    # where each message sits: the marker, then the content
    segments = chat_segments(with_tools)
    for marker, start, content in segments:
        assert text[start:start + len(content)] == content and text[marker] == "<"


def test_packed_integers_round_trip():
    values = [0, 1, 2 ** 63, 2 ** 64 - 1, 12345678901234567890]
    assert list(unpack_u64(pack_u64(values))) == values
    entries = [(1, 2, 3), (2 ** 64 - 1, 7, 9)]
    assert list(unpack_entries(pack_entries(entries))) == [1, 2, 3, 2 ** 64 - 1, 7, 9]
    with pytest.raises(ValueError):
        unpack_entries(pack_u64([1, 2]))  # not whole triples
    with pytest.raises(ValueError):
        unpack_u64("not base64!")
