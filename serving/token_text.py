"""The exact text and bytes of each generated token, for logprobs.

Decoding one token alone loses what depends on its context: a SentencePiece
``▁there`` decodes to ``there`` alone but to `` there`` after other text, and a
byte-fallback piece (``<0xE2>``) is part of a character. `TokenTexts` decodes
each token in context with the incremental algorithm of the engine's
detokenizer (`engine/detokenizer.py`, vLLM's ``detokenize_incrementally``), so
the token strings concatenate to the generated text and ``text_offset`` indexes
it. A token that ends inside a UTF-8 sequence has the string ``""`` (the token
that completes the character carries it); its ``bytes`` are still its own raw
bytes, as OpenAI's ``bytes`` field is meant for. One exception, as in vLLM: when
a stop string ends the request, the last token's string holds text that the
response cuts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pd_cluster.engine.detokenizer import INITIAL_PREFIX_TOKENS, REPLACEMENT_CHAR

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass(frozen=True)
class TokenText:
    """One generated token: its string, the offset of that string in the text (characters), its raw bytes."""

    text: str
    offset: int
    raw: bytes


class TokenTexts:
    """Per-token strings of one request's output, in context.

    Args:
        tokenizer: the model's HF tokenizer.
        prompt_token_ids: the prompt (its last tokens are the context of the first output token).
        skip_special_tokens: as the request's text (a skipped special token has the string ``""``).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.ids: list[int] = list(prompt_token_ids[-INITIAL_PREFIX_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.length = 0  # characters of text so far
        self._byte_decoder = _byte_level_decoder(tokenizer)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def _delta(self, extra: list[int]) -> str | None:
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:] + extra)
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT_CHAR):
            return full[len(prefix):]
        return None

    def candidate(self, token_id: int) -> TokenText:
        """What `token_id` would add if it came next (for ``top_logprobs``); changes nothing."""
        delta = self._delta([token_id])
        return TokenText(delta or "", self.length, self.raw_bytes(token_id, delta))

    def add(self, token_id: int) -> TokenText:
        """Append a generated token; its string and where that string starts in the text."""
        delta = self._delta([token_id])
        self.ids.append(token_id)
        if delta is not None:
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        out = TokenText(delta or "", self.length, self.raw_bytes(token_id, delta))
        self.length += len(out.text)
        return out

    def raw_bytes(self, token_id: int, text: str | None) -> bytes:
        """The token's own bytes: a byte-fallback or byte-level piece's bytes, else its text in UTF-8."""
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            m = _BYTE_PIECE.fullmatch(piece)
            if m:
                return bytes([int(m.group(1), 16)])
            if self._byte_decoder is not None and all(c in self._byte_decoder for c in piece):
                return bytes(self._byte_decoder[c] for c in piece)
        return (text or "").encode("utf-8")


def _byte_level_decoder(tokenizer: Any) -> dict[str, int] | None:
    """GPT-2's byte-to-unicode table, inverted, when the tokenizer is byte-level BPE; else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None or "ByteLevel" not in type(decoder).__name__ and "ByteLevel" not in str(decoder):
        return None
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}
