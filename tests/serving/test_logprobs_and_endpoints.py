"""Logprobs carry exact token strings and bytes (issue 14 §4); /tokenize, /detokenize, /version, /v1/models,
``return_token_ids``; all through the real `openai` client against a real mixed worker."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from worker_kit import PROMPTS, running_worker  # noqa: E402


@pytest.fixture(scope="module")
def worker():
    with running_worker() as w:
        yield w


@pytest.fixture(scope="module")
def client(worker):
    return openai.OpenAI(base_url=worker.url + "/v1", api_key="none", max_retries=0, timeout=60)


def check_completion_logprobs(text: str, lp) -> None:
    assert "".join(lp.tokens) == text
    assert len(lp.text_offset) == len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs)
    for tok, off in zip(lp.tokens, lp.text_offset):
        assert text[off:].startswith(tok), (text, tok, off)
    for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[tok] == chosen  # greedy: the chosen token is the likeliest, under the same string
        assert all(v <= chosen + 1e-6 for v in top.values())


def test_completion_logprobs_concatenate_to_the_text(client):
    for prompt in PROMPTS:
        r = client.completions.create(model="stories260K", prompt=prompt, max_tokens=24, temperature=0, logprobs=3)
        choice = r.choices[0]
        assert choice.text and r.usage.completion_tokens == len(choice.logprobs.tokens)
        check_completion_logprobs(choice.text, choice.logprobs)
    # the case from the issue: leading spaces are part of the tokens
    r = client.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=6, temperature=0,
                                  logprobs=1)
    assert r.choices[0].text.startswith(", there was")
    assert r.choices[0].logprobs.tokens[:3] == [",", " there", " was"]
    assert r.choices[0].logprobs.text_offset[:3] == [0, 1, 7]


def test_streamed_completion_logprobs_match(client):
    for prompt in PROMPTS[:4]:
        ref = client.completions.create(model="stories260K", prompt=prompt, max_tokens=16, temperature=0, logprobs=2)
        tokens, offsets, text = [], [], ""
        for chunk in client.completions.create(model="stories260K", prompt=prompt, max_tokens=16, temperature=0,
                                               logprobs=2, stream=True):
            c = chunk.choices[0]
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                offsets += c.logprobs.text_offset
        assert text == ref.choices[0].text
        assert tokens == ref.choices[0].logprobs.tokens and offsets == ref.choices[0].logprobs.text_offset


def test_chat_logprobs_strings_and_bytes(client):
    for prompt in PROMPTS:
        r = client.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": prompt}],
                                           max_tokens=24, temperature=0, logprobs=True, top_logprobs=2)
        content = r.choices[0].message.content
        entries = r.choices[0].logprobs.content
        assert "".join(e.token for e in entries) == content
        assert b"".join(bytes(e.bytes) for e in entries) == content.encode()
        for e in entries:
            assert bytes(e.bytes).decode() == e.token
            assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob
        if " " in content:  # a word after the first carries its space, as in the text
            assert any(e.token.startswith(" ") and len(e.token) > 1 for e in entries)


def test_byte_fallback_tokens_have_their_own_bytes(worker):
    """A character spelled by byte-fallback pieces: the pieces carry its bytes, the last one its string."""
    from pd_cluster.serving.token_text import TokenTexts

    tok = worker.engine.tokenizer
    ids = tok("Once upon a time", add_special_tokens=True).input_ids
    snow = tok("\u2603", add_special_tokens=False).input_ids  # ☃, not in the 512-token vocabulary
    pieces = tok.convert_ids_to_tokens(snow)
    byte_ids = [t for t, p in zip(snow, pieces) if p.startswith("<0x")]
    assert len(byte_ids) == 3, pieces  # E2 98 83
    texts = TokenTexts(tok, ids)
    out = [texts.add(t) for t in byte_ids]
    assert [o.text for o in out] == ["", "", "\u2603"]
    assert b"".join(o.raw for o in out) == "\u2603".encode()
    assert [o.offset for o in out] == [0, 0, 0]


def test_return_token_ids(worker, client):
    prompt = PROMPTS[2]
    r = client.completions.create(model="stories260K", prompt=prompt, max_tokens=8, temperature=0,
                                  extra_body={"return_token_ids": True})
    expected_prompt = httpx.post(worker.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    choice = r.choices[0].model_dump()
    assert choice["prompt_token_ids"] == expected_prompt
    assert len(choice["token_ids"]) == r.usage.completion_tokens == 8
    detok = httpx.post(worker.url + "/detokenize", json={"tokens": expected_prompt + choice["token_ids"]}).json()
    assert detok["prompt"].endswith(r.choices[0].text)
    streamed, prompt_ids = [], None
    for chunk in client.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": prompt}],
                                                max_tokens=8, temperature=0, stream=True,
                                                extra_body={"return_token_ids": True}):
        d = chunk.model_dump()
        prompt_ids = prompt_ids or d.get("prompt_token_ids")
        streamed += d["choices"][0].get("token_ids") or []
    chat = httpx.post(worker.url + "/tokenize", json={"messages": [{"role": "user", "content": prompt}]}).json()
    assert prompt_ids == chat["tokens"] and len(streamed) == 8


def test_tokenize_detokenize_version_models(worker, client):
    with httpx.Client(base_url=worker.url, timeout=10) as c:
        t = c.post("/tokenize", json={"prompt": "Once upon a time", "return_token_strs": True}).json()
        assert t["tokens"][0] == worker.engine.tokenizer.bos_token_id and t["count"] == len(t["tokens"])
        assert t["max_model_len"] == worker.engine.context_length
        assert "".join(t["token_strs"][1:]).replace("\u2581", " ").strip() == "Once upon a time"
        plain = c.post("/tokenize", json={"prompt": "Once upon a time", "add_special_tokens": False}).json()
        assert plain["tokens"] == t["tokens"][1:] and plain["token_strs"] is None
        assert c.post("/detokenize", json={"tokens": plain["tokens"]}).json() == {"prompt": "Once upon a time"}
        info = c.get("/tokenizer_info").json()  # vLLM's shape, as lm-eval's remote tokenizer reads it
        tok = worker.engine.tokenizer
        assert (info["eos_token"], info["bos_token"]) == (tok.eos_token, tok.bos_token) == ("</s>", "<s>")
        assert info["tokenizer_class"] == type(tok).__name__ and info["chat_template"] == tok.chat_template
        assert "name_or_path" not in info and "vocab_file" not in info  # no local paths
        v = c.get("/version").json()
        assert isinstance(v["version"], str) and v["version"][0].isdigit()
    (card,) = client.models.list().data
    assert card.id == "stories260K" and card.model_dump()["max_model_len"] == worker.engine.context_length


# ---- the prompt's side: echo, max_tokens 0, prompt_logprobs, several prompts (lm-eval's loglikelihood) ---------
def test_echo_logprobs_of_several_prompts_equal_transformers(worker, client):
    from engine_reference import hf_prompt_logprobs

    prompts = PROMPTS[:4]
    ids = [httpx.post(worker.url + "/tokenize", json={"prompt": p}).json()["tokens"] for p in prompts]
    # lm-eval's local-completions loglikelihood request: token ids, max_tokens 1, logprobs 1, echo
    r = client.completions.create(model="stories260K", prompt=ids, max_tokens=1, logprobs=1, echo=True,
                                  temperature=0, seed=1234)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == sum(map(len, ids)) and r.usage.completion_tokens == 4
    for c, p, tok in zip(r.choices, prompts, ids):
        lp = c.logprobs
        assert len(lp.token_logprobs) == len(tok) + 1  # every prompt token, then the generated one
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        ref = hf_prompt_logprobs(tok)
        assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:len(tok)], ref)) < 1e-4
        for chosen, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
            assert len(top) == 1 and max(top.values()) >= chosen - 1e-6
        assert c.text.startswith(worker.engine.tokenizer.decode(tok, skip_special_tokens=True))
        assert "".join(lp.tokens) == c.text
    # max_tokens 0 with echo: the prompt alone, nothing generated
    z = client.completions.create(model="stories260K", prompt=prompts[1], max_tokens=0, echo=True, logprobs=0)
    assert z.choices[0].text == prompts[1] and z.usage.completion_tokens == 0
    assert z.choices[0].finish_reason == "length"
    assert z.choices[0].logprobs.token_logprobs[1:] == r.choices[1].logprobs.token_logprobs[1:len(ids[1])]
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="stories260K", prompt=prompts[1], max_tokens=0)


def test_prompt_logprobs_vllm_shape_and_n_per_prompt(worker, client):
    from engine_reference import hf_prompt_logprobs

    r = client.completions.create(model="stories260K", prompt=["Once upon a time", "Sam had a red ball."],
                                  max_tokens=4, n=2, temperature=1.0, seed=3, extra_body={"prompt_logprobs": 2})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]  # prompt i, choice j: index i * n + j
    lengths = [httpx.post(worker.url + "/tokenize", json={"prompt": p}).json()["count"]
               for p in ("Once upon a time", "Sam had a red ball.")]
    assert r.usage.prompt_tokens == sum(lengths)  # each prompt once, whatever n
    for c in r.choices:
        prompt = "Once upon a time" if c.index < 2 else "Sam had a red ball."
        ids = httpx.post(worker.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
        plp = c.model_dump()["prompt_logprobs"]
        assert plp[0] is None and len(plp) == len(ids)
        for tok, entry, ref in zip(ids[1:], plp[1:], hf_prompt_logprobs(ids)):
            assert abs(entry[str(tok)]["logprob"] - ref) < 1e-4
            ranks = sorted(v["rank"] for v in entry.values())
            assert ranks[:2] == [1, 2] or entry[str(tok)]["rank"] <= 2
    streamed = ["", ""]
    for chunk in client.completions.create(model="stories260K", prompt=["Once upon a time", "Sam had a red ball."],
                                           max_tokens=4, temperature=0, echo=True, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    plain = client.completions.create(model="stories260K", prompt=["Once upon a time", "Sam had a red ball."],
                                      max_tokens=4, temperature=0)
    assert streamed == ["Once upon a time" + plain.choices[0].text, "Sam had a red ball." + plain.choices[1].text]
