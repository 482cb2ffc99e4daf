"""Synthetic prompts of exact token lengths, and Mooncake-style shared prefix blocks.

Prompts are built as token ids and decoded to text. The ids come from a "safe"
vocabulary: whole-word tokens (``▁word`` in SentencePiece vocabularies,
``Ġword`` in byte-level BPE) that re-encode to themselves in any order, so
``encode(decode(ids)) == ids``. Hence a prompt made of blocks has exactly
those blocks as its tokens, and two prompts that share a hash id share exactly
that block of tokens (Mooncake trace semantics: Qin et al., FAST'25).
"""

from __future__ import annotations

import re

import numpy as np

from pd_cluster.bench.tokenizer import Tokenizer

_WORD = re.compile(r"[\u2581\u0120][a-z]{2,}")
_MAX_CANDIDATES = 4096
_MIN_WORDS = 8


def safe_vocab(tok: Tokenizer) -> np.ndarray:
    """Sorted ids of whole-word tokens that round-trip through decode/encode in context.

    Raises ``ValueError`` when the vocabulary has fewer than 8 such tokens.
    """
    cands = sorted(i for s, i in tok.vocab().items() if _WORD.fullmatch(s))[:_MAX_CANDIDATES]
    anchor = next((c for c in cands if tok.encode(tok.decode([c, c, c])) == [c, c, c]), None)
    if anchor is None:
        raise ValueError(f"tokenizer {tok.name}: no whole-word tokens to synthesise prompts from")
    seqs = [[anchor, c, anchor, c] for c in cands]
    got = tok.encode_batch([tok.decode(s) for s in seqs])
    words = np.array([c for c, s, g in zip(cands, seqs, got) if s == g], dtype=np.int64)
    if len(words) < _MIN_WORDS:
        raise ValueError(f"tokenizer {tok.name}: only {len(words)} whole-word tokens round-trip")
    probe = np.random.default_rng(0).choice(words, size=512).tolist()
    if tok.encode(tok.decode(probe)) != probe:
        raise ValueError(f"tokenizer {tok.name}: synthesised text does not re-encode to its tokens")
    return words


class PromptSynth:
    """Random token sequences and per-hash-id prefix blocks, all seeded by ``seed``.

    ``block(key, n)`` is the first ``n`` tokens of the endless token stream of
    hash id ``key``; the stream is made of chunks of ``chunk`` tokens, each drawn
    from its own generator, so a shorter block is always a prefix of a longer one.
    """

    def __init__(self, tok: Tokenizer, seed: int, chunk: int = 512) -> None:
        self.tok = tok
        self.seed = seed
        self.chunk = chunk
        self.words = safe_vocab(tok)
        self._cache: dict[tuple[int, int], np.ndarray] = {}

    def random_ids(self, rng: np.random.Generator, n: int) -> list[int]:
        """``n`` random safe token ids, shape ``[n]``."""
        return self.words[rng.integers(0, len(self.words), size=n)].tolist()

    def _chunk(self, key: int, j: int) -> np.ndarray:
        hit = self._cache.get((key, j))
        if hit is None:
            rng = np.random.default_rng([self.seed, 0x5EED, key, j])
            hit = self.words[rng.integers(0, len(self.words), size=self.chunk)]
            if len(self._cache) < 200_000:
                self._cache[(key, j)] = hit
        return hit

    def block(self, key: int, n: int) -> list[int]:
        """The first ``n`` tokens of hash id ``key``'s stream (``key >= 0``)."""
        parts = [self._chunk(key, j) for j in range(-(-n // self.chunk))]
        return np.concatenate(parts)[:n].tolist() if parts else []

    def text(self, ids: list[int]) -> str:
        return self.tok.decode(ids)
