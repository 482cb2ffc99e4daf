"""A request's prompt as *routing text*, and the chained hashes of its text blocks.

The router reads prompts as text (``cache_aware``'s approximate tree, SGLang's idea) and routes on the pages the
workers' prefix caches hold, which are named by hashes of token ids (``engine/kv/events.py``). The router does not
tokenize: the worker that tokenizes a prompt publishes, for text prefixes of it, the page hash of the pages those
prefixes determine (``serving/text_map.py``, ``GET /kv_text_map``), and the router looks a new prompt's text prefixes
up in what it learned (``router/text_map.py``). Both sides compute the text and the hashes here, from the request
body as the client sent it, so they agree by construction.

**Routing text.** A completion's prompt string as it is (several prompts joined by ``\\x00``, token ids as decimal
numbers joined by ``,``); a chat's messages as ``<role>content`` one after the other (text parts joined). Body
fields that change how the worker renders or tokenizes the text (`CHAT_CONTEXT`, `COMPLETION_CONTEXT`: tools, a
request's own chat template, ``add_special_tokens``...) go in front, as compact sorted JSON between ``\\x02`` and
``\\x03``, only when present; so two requests share a text prefix only where the workers see the same tokens.

**Block hashes.** The text is cut into blocks of `block_chars_for` the workers' page size characters (twice the
page size, between 32 and 128: a block stays under a page's worth of text, about 3-4 characters a token, and a
2,000-character prompt costs 16 hashes at the default 64-token page). Block ``k``'s hash names the whole text up to
the end of block ``k``: the CRC-32 (high 32 bits) and Adler-32 (low 32 bits) of the UTF-8 bytes (lone surrogates
passed through) of ``text[:block_chars * (k + 1)]``, both from zlib and computed incrementally. After the full
blocks comes the *end hash*: the same two checksums continued over the rest of the text and one ``0xFF`` byte (no
UTF-8 text holds it), which names the whole text as complete, so it never equals a prefix of a longer one. Texts
over `MAX_CHARS` are hashed only that far, with no end hash. A collision can only misroute.

Standard library only (``common`` is below every layer).
"""

from __future__ import annotations

import base64
import json
from array import array
from collections.abc import Sequence
from typing import Any
from zlib import adler32, crc32

MAX_CHARS = 1 << 18
"""Characters hashed at most (262,144)."""
END = b"\xff"

CHAT_CONTEXT = ("tools", "chat_template", "chat_template_kwargs", "documents", "add_special_tokens",
                "add_generation_prompt", "continue_final_message")
"""Chat body fields that change the tokens of the rendered prompt (beyond the messages)."""
COMPLETION_CONTEXT = ("add_special_tokens", "suffix")
"""Completion body fields that change the prompt's tokens (beyond the prompt)."""


def _context(data: dict[str, Any], keys: tuple[str, ...]) -> str:
    present = {k: data[k] for k in keys if data.get(k) is not None}
    if not present:
        return ""
    try:
        return "\x02" + json.dumps(present, sort_keys=True, separators=(",", ":"), default=str) + "\x03"
    except (TypeError, ValueError):
        return "\x02?\x03"


def content_text(content: Any) -> str:
    """A message's content as text: a string, or its text parts joined ("" for anything else)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content
                       if isinstance(p, dict) and isinstance(p.get("text", ""), str))
    return ""


def prompt_text(prompt: Any) -> str:
    """A completions ``prompt`` (text, texts, token ids, lists of ids) as text."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return "\x00".join(p for p in prompt if isinstance(p, str))
        if isinstance(first, int):
            return ",".join(str(t) for t in prompt)
        if isinstance(first, list):
            return "\x00".join(",".join(str(t) for t in p) for p in prompt if isinstance(p, list))
    return ""


def routing_text(data: dict[str, Any], chat: bool) -> str:
    """The routing text of a ``/v1/chat/completions`` (`chat`) or ``/v1/completions`` body (see the module
    docstring); malformed parts count as empty (the worker refuses them)."""
    if chat:
        messages = data.get("messages")
        if not isinstance(messages, list):
            return ""
        head = _context(data, CHAT_CONTEXT)
        return head + "".join(f"<{m.get('role', '')}>{content_text(m.get('content'))}"
                              for m in messages if isinstance(m, dict))
    return _context(data, COMPLETION_CONTEXT) + prompt_text(data.get("prompt"))


def chat_segments(data: dict[str, Any]) -> list[tuple[int, int, str]]:
    """Where each message sits in a chat's routing text: ``(marker start, content start, content)`` per message,
    in order (the marker is ``<role>``)."""
    pos = len(_context(data, CHAT_CONTEXT))
    out = []
    for m in data.get("messages") or ():
        if not isinstance(m, dict):
            continue
        marker = f"<{m.get('role', '')}>"
        content = content_text(m.get("content"))
        out.append((pos, pos + len(marker), content))
        pos += len(marker) + len(content)
    return out


def holds_whole_message(message: dict[str, Any]) -> bool:
    """Whether a chat message's routing text (``<role>content``) is all the template renders of it: False for a
    message carrying tool calls, which the routing text leaves out."""
    return not message.get("tool_calls")


def completion_offset(data: dict[str, Any]) -> int:
    """Where a completion's prompt starts in its routing text (after the context, if any)."""
    return len(_context(data, COMPLETION_CONTEXT))


def block_chars_for(page_size: int) -> int:
    """The text-to-page maps' block, in characters, for workers of `page_size` tokens a page."""
    return max(32, min(128, 2 * page_size))


def full_blocks(text: str, block_chars: int) -> int:
    """How many full blocks of `text` are hashed (the text up to `MAX_CHARS`)."""
    return min(len(text), MAX_CHARS // block_chars * block_chars) // block_chars


def block_hashes(text: str, block_chars: int, max_blocks: int | None = None) -> list[int]:
    """The hashes of `text`'s full blocks, then its end hash (see the module docstring); unsigned 64-bit ints.
    `max_blocks`: blocks hashed at most (default: `MAX_CHARS` worth)."""
    out: list[int] = []
    append = out.append
    c, a = 0, 1
    limit = block_chars * (MAX_CHARS // block_chars if max_blocks is None else max_blocks)
    full = min(len(text), limit) // block_chars * block_chars
    data = text.encode("utf-8", "surrogatepass")
    if len(data) == len(text):  # ASCII: byte blocks are character blocks, slice the bytes without copies
        view = memoryview(data)
        for s in range(0, full, block_chars):
            b = view[s:s + block_chars]
            c, a = crc32(b, c), adler32(b, a)
            append(c << 32 | a)
        if len(text) <= limit:
            b = view[full:].tobytes() + END
            append(crc32(b, c) << 32 | adler32(b, a))
        return out
    for s in range(0, full, block_chars):
        b = text[s:s + block_chars].encode("utf-8", "surrogatepass")
        c, a = crc32(b, c), adler32(b, a)
        append(c << 32 | a)
    if len(text) <= limit:
        b = text[full:].encode("utf-8", "surrogatepass") + END
        append(crc32(b, c) << 32 | adler32(b, a))
    return out


# ---- packed 64-bit integers (the map's entries; KV events' hashes when asked for) -----------------------------
def pack_u64(values: Sequence[int]) -> str:
    """Unsigned 64-bit integers as base64 of their little-endian bytes (a JSON string a reader decodes in C,
    where a JSON list of 20-digit numbers costs a conversion per number)."""
    flat = array("Q", values)
    if _BIG_ENDIAN:  # pragma: no cover
        flat.byteswap()
    return base64.b64encode(flat.tobytes()).decode("ascii")


def unpack_u64(text: str, group: int = 1) -> array:
    """`pack_u64`'s integers as an ``array('Q')``.

    Raises:
        ValueError: not base64 of a whole number of `group`-integer groups.
    """
    raw = base64.b64decode(text, validate=True)
    if len(raw) % (8 * group):
        raise ValueError(f"not base64 of whole groups of {group} 64-bit integers")
    flat = array("Q")
    flat.frombytes(raw)
    if _BIG_ENDIAN:  # pragma: no cover
        flat.byteswap()
    return flat


def pack_entries(entries: Sequence[tuple[int, int, int]]) -> str:
    """The map's ``(text hash, page hash, pages)`` entries, flattened, as `pack_u64`."""
    return pack_u64([v for entry in entries for v in entry])


def unpack_entries(text: str) -> array:
    """The flat ``array('Q')`` of `pack_entries`' triples.

    Raises:
        ValueError: not base64 of whole triples.
    """
    return unpack_u64(text, 3)


_BIG_ENDIAN = array("H", [1]).tobytes() == b"\x00\x01"
