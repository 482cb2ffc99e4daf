"""Token strings in context and the bytes-per-token bound, on a byte-level BPE tokenizer (Llama 3 / Qwen style)
built here, and on the embedded SentencePiece one."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pd_cluster.engine.assets import DEFAULT_MODEL
from pd_cluster.serving.token_text import TokenTexts
from pd_cluster.serving.tokenization import max_bytes_per_token

CORPUS = ["Once upon a time, there was a little girl named Lily.", "Café crème ☃ and naïve résumé, déjà vu.",
          "The little dog ran to the park and saw a big red ball."] * 20
TEXTS = ["Once upon a time, there was a café.", "naïve ☃ snow, déjà vu", "  two  spaces\nand a line"]


def byte_level() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(scope="module", params=["byte-level-bpe", "sentencepiece"])
def tokenizer(request):
    return byte_level() if request.param == "byte-level-bpe" else AutoTokenizer.from_pretrained(DEFAULT_MODEL)


@pytest.mark.parametrize("text", TEXTS)
def test_token_strings_concatenate_to_the_text_and_bytes_to_its_utf8(tokenizer, text):
    context = tokenizer("Prompt:", add_special_tokens=False).input_ids
    ids = tokenizer(text, add_special_tokens=False).input_ids
    expected = tokenizer.decode(context + ids)[len(tokenizer.decode(context)):]
    texts = TokenTexts(tokenizer, context)
    out = [texts.add(t) for t in ids]
    assert "".join(o.text for o in out) == expected
    assert b"".join(o.raw for o in out) == expected.encode()
    for o in out:
        assert expected[o.offset:].startswith(o.text)


def test_candidate_does_not_move_the_state(tokenizer):
    ids = tokenizer("Once upon a time, there", add_special_tokens=False).input_ids
    texts = TokenTexts(tokenizer, ids[:3])
    first = texts.candidate(ids[3])
    assert texts.candidate(ids[3]) == first == texts.add(ids[3])


def test_bytes_per_token_bound_holds(tokenizer):
    n = max_bytes_per_token(tokenizer)
    assert n is not None
    for text in TEXTS + CORPUS[:3]:
        assert len(text.encode()) <= n * len(tokenizer(text, add_special_tokens=False).input_ids)


def test_normalizers_scale_or_disable_the_bound():
    tok = byte_level()
    plain = max_bytes_per_token(tok)
    tok.backend_tokenizer.normalizer = normalizers.NFKC()  # may shrink text: "ｆｕｌｌ" (12 bytes) -> "full" (4)
    assert max_bytes_per_token(tok) == 4 * plain
    tok.backend_tokenizer.normalizer = normalizers.Sequence([normalizers.Strip()])  # may delete text: no bound
    assert max_bytes_per_token(tok) is None
    tok.backend_tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                                             normalizers.Replace(" ", "▁")])  # Llama 2's: grows
    assert max_bytes_per_token(tok) == plain
