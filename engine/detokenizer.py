"""Incremental, UTF-8-safe detokenization with stop strings that are never emitted partially.

Each new token is decoded together with a few tokens before it (``prefix
offset``) and only the part beyond the previous decode is kept, so tokenizers
that strip a leading space or merge byte-fallback pieces give the same text as
decoding everything at once. A decode ending in U+FFFD (an incomplete UTF-8
sequence from byte-fallback tokens) is held back until the sequence completes.
This is the algorithm of vLLM's ``detokenize_incrementally`` and HF's
``TextStreamer``, written on top of ``tokenizer.decode``.

With a fast (Rust) tokenizer the same deltas come from ``tokenizers.decoders.DecodeStream`` (vLLM's
``FastIncrementalDetokenizer``), which keeps its decode state instead of decoding a window twice per token, where
it is exact: the tokenizer applies no ``clean_up_tokenization_spaces`` (DecodeStream does not), and the prompt
context decodes to whole characters (DecodeStream would emit a prompt's incomplete tail with the first token).
If DecodeStream refuses a token (it raises on a sequence it cannot continue), the request continues on the
window algorithm from where the stream stopped, so the text is the same either way
(``tests/engine/test_detokenizer.py`` compares both on real tokenizers, byte-fallback and unicode included).

Stop strings: the text is cut before the first stop string (or after it with
``include_stop_str_in_output``); while streaming, any tail that could still
grow into a stop string is held back.
"""

from __future__ import annotations

from typing import Any

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None

INITIAL_PREFIX_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a request's generated tokens into text, a delta at a time.

    Args:
        tokenizer: a HF tokenizer.
        prompt_token_ids: the prompt (its last tokens give the decoding context).
        stop: stop strings.
        include_stop_str_in_output: keep a matched stop string in the text.
        skip_special_tokens: drop special tokens from the text.
        min_tokens: stop strings are looked for only once more than this many tokens exist (as vLLM).
        decode_stream: use ``DecodeStream`` where it is exact (module docstring); False: always the window
            algorithm (the reference the tests compare with).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], stop: list[str] | None = None,
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True,
                 min_tokens: int = 0, decode_stream: bool = True) -> None:
        self.tokenizer = tokenizer
        context = list(prompt_token_ids[-INITIAL_PREFIX_TOKENS:])
        self.ids: list[int] = context
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.stop = stop or []
        self.include_stop = include_stop_str_in_output
        self.skip_special = skip_special_tokens
        self.text = ""
        self.sent = 0
        self.stop_matched: str | None = None
        self.min_tokens = min_tokens
        self.num_tokens = 0
        self._stream, self._backend = self._open_stream(context) if decode_stream else (None, None)

    def _open_stream(self, context: list[int]) -> tuple[Any, Any]:
        """A ``DecodeStream`` primed with the prompt context and the tokenizer's Rust backend, or (None, None)
        where it would not give the window algorithm's text."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if DecodeStream is None or backend is None or getattr(self.tokenizer, "clean_up_tokenization_spaces", True):
            return None, None
        if context and REPLACEMENT_CHAR in self._decode(context):
            return None, None
        try:
            return DecodeStream(ids=context, skip_special_tokens=self.skip_special), backend
        except TypeError:  # a DecodeStream that cannot be primed
            return None, None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add_tokens(self, new_token_ids: list[int]) -> str | None:
        """Append generated tokens; returns the stop string matched, if any (then the text is final)."""
        for tok in new_token_ids:
            if self.stop_matched is not None:
                break
            self.ids.append(tok)
            self.num_tokens += 1
            if self._stream is not None:
                try:
                    delta = self._stream.step(self._backend, tok)
                except Exception:  # noqa: BLE001 - tokenizers raises a plain Exception; the window takes over
                    self._stream = None
                else:
                    if delta:
                        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
                        self._append(delta)
                    continue
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.ids[self.prefix_offset:])
            if len(full) > len(prefix) and not full.endswith(REPLACEMENT_CHAR):
                delta = full[len(prefix):]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
                self._append(delta)
        return self.stop_matched

    def _append(self, delta: str) -> None:
        start = max(len(self.text) - max((len(s) for s in self.stop), default=0) + 1, 0)
        self.text += delta
        if not self.stop or self.num_tokens <= self.min_tokens:
            return
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = self.text.find(s, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is not None:
            idx, s = best
            self.text = self.text[: idx + len(s)] if self.include_stop else self.text[:idx]
            self.stop_matched = s

    def replay(self, token_ids: list[int]) -> str:
        """Take output tokens whose text was delivered already (a resumed request) and mark that text sent.

        The text marked sent is what streaming them one by one would have sent (`take_delta` with
        ``finished=False``, which holds back a tail that may begin a stop string); the held-back tail is
        sent later as usual. Returns the text marked sent.
        """
        if not token_ids:
            return ""
        self.add_tokens(token_ids)
        return self.take_delta(False)

    def add_all(self, token_ids: list[int]) -> None:
        """Decode a whole output at once (no stop strings): the same text as token-by-token, two decodes."""
        self._stream = None  # its state would lag behind the window's from here on
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        self.ids.extend(token_ids)
        full = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        if len(full) > len(prefix):
            self._append(full[len(prefix):])

    def flush_pending(self) -> None:
        """At the end, decode what is held back (an incomplete UTF-8 tail becomes U+FFFD)."""
        if self.stop_matched is None and self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.ids[self.prefix_offset:])
            self.read_offset = len(self.ids)
            if len(full) > len(prefix):
                self._append(full[len(prefix):])

    def take_delta(self, finished: bool) -> str:
        """Text not yet emitted, minus (unless finished) a tail that may begin a stop string."""
        limit = len(self.text)
        if not finished and self.stop and self.stop_matched is None:
            limit -= self._stop_prefix_len()
        if limit <= self.sent:
            return ""
        delta = self.text[self.sent:limit]
        self.sent = limit
        return delta

    def _stop_prefix_len(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best
