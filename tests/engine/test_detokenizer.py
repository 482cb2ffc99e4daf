"""Incremental detokenization: equals a full decode, is UTF-8 safe, never emits part of a stop string."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from pd_cluster.engine.assets import DEFAULT_MODEL
from pd_cluster.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL)


TEXTS = [
    ", there was a little girl named Lily.\nShe said: \"Hi!\"  Two  spaces.",
    " café naïve — 日本語 🐶🎈 done",  # byte-fallback tokens for every non-ASCII character
    "\t tabs\tand\nnewlines \n",
]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_deltas_equal_full_decode(tok, text):
    prompt = tok("Once upon a time").input_ids
    out_ids = tok(text, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = []
    for t in out_ids:
        detok.add_tokens([t])
        d = detok.take_delta(False)
        assert "\ufffd" not in d  # an incomplete UTF-8 sequence is never emitted
        deltas.append(d)
    detok.flush_pending()
    deltas.append(detok.take_delta(True))
    full = tok.decode(prompt + out_ids, skip_special_tokens=True)
    assert "Once upon a time" + "".join(deltas) == full


def test_multibyte_character_is_held_until_complete(tok):
    ids = tok("🐶", add_special_tokens=False).input_ids
    byte_ids = [i for i in ids if 3 <= i <= 258]
    assert len(byte_ids) == 4  # four UTF-8 bytes as byte-fallback tokens
    detok = IncrementalDetokenizer(tok, tok("Hi").input_ids)
    emitted = []
    for t in ids:
        detok.add_tokens([t])
        emitted.append(detok.take_delta(False))
    assert tok.convert_ids_to_tokens(ids[:1]) == ["\u2581"]  # a leading space piece, then the 4 bytes
    assert emitted[0] == " " and emitted[1:4] == ["", "", ""] and emitted[4] == "🐶"


def test_stop_string_never_emitted_partially(tok):
    text = "the cat sat on the mat. The end of the story."  # the tokenizer prepends the space
    ids = tok(text, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tok, tok("Once").input_ids, stop=["The end"])
    sent = ""
    for t in ids:
        matched = detok.add_tokens([t])
        sent += detok.take_delta(matched is not None)
        assert "The e" not in sent and not sent.endswith(" The") and not sent.endswith("Th")
        if matched:
            break
    assert matched == "The end"
    assert sent == " the cat sat on the mat. "


def test_stop_string_spanning_tokens_with_include(tok):
    ids = tok(" a big red ball and more", add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tok, [1], stop=["red b"], include_stop_str_in_output=True)
    for t in ids:
        if detok.add_tokens([t]):
            break
    assert detok.take_delta(True) == " a big red b"


@pytest.mark.parametrize("text", TEXTS)
def test_whole_output_at_once_equals_streamed(tok, text):
    prompt = tok("Once upon a time").input_ids
    out_ids = tok(text, add_special_tokens=False).input_ids
    streamed = IncrementalDetokenizer(tok, prompt)
    for t in out_ids:
        streamed.add_tokens([t])
    streamed.flush_pending()
    once = IncrementalDetokenizer(tok, prompt)
    once.add_all(out_ids)
    assert once.take_delta(True) == streamed.take_delta(True)


def _deltas(tok, prompt, out, skip, decode_stream):
    d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip, decode_stream=decode_stream)
    used = d._stream is not None
    deltas = []
    for t in out:
        d.add_tokens([t])
        deltas.append(d.take_delta(False))
    d.flush_pending()
    deltas.append(d.take_delta(True))
    return deltas, used


def test_decode_stream_gives_the_window_algorithms_deltas_token_by_token(tok):
    """tokenizers.DecodeStream, where used, yields exactly the deltas of the window algorithm: on the embedded
    tokenizer (byte fallback for every non-ASCII character), for every split of real text into prompt and output,
    and for random token sequences (prompts ending mid-character fall back to the window algorithm)."""
    import random

    cases = []
    for text in ["Once upon a time" + TEXTS[0], "Lily said" + TEXTS[1], TEXTS[2] + TEXTS[1]]:
        ids = tok(text).input_ids
        cases += [(ids[:cut], ids[cut:]) for cut in range(1, len(ids))]
    rng = random.Random(0)
    specials = [tok.bos_token_id, tok.eos_token_id]
    for _ in range(200):
        prompt = [tok.bos_token_id] + [rng.randrange(3, tok.vocab_size) for _ in range(rng.randrange(0, 8))]
        cases.append((prompt, [rng.choice(specials) if rng.random() < 0.05 else rng.randrange(3, tok.vocab_size)
                               for _ in range(rng.randrange(1, 30))]))
    streamed = 0
    for prompt, out in cases:
        for skip in (True, False):
            reference, _ = _deltas(tok, prompt, out, skip, decode_stream=False)
            deltas, used = _deltas(tok, prompt, out, skip, decode_stream=True)
            assert deltas == reference, (prompt, out, skip)
            streamed += used
    assert streamed > len(cases)  # DecodeStream did the work in most cases (not a vacuous comparison)
