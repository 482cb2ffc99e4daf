"""The bad-input table: malformed or unsupported requests and the OpenAI 4xx each must get, naming the field.

Served by a real mixed worker (`tests/serving/test_bad_input.py`) and through a real router and P/D cluster
(`tests/cluster/test_errors_through_router.py`, `tests/cluster/test_bad_input_under_load.py`).
"""

from __future__ import annotations

import dataclasses

import httpx

from pd_cluster.engine.sampling.params import SamplingParams

C, CHAT = "/v1/completions", "/v1/chat/completions"
OK = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
MSG = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
_PARAMS = {f.name for f in dataclasses.fields(SamplingParams)}


def raw(text: str) -> bytes:
    return text.encode()


def with_(base: dict, **kw) -> dict:
    return dict(base, **kw)


# (id, path, body (dict = JSON, bytes = raw), status, param, code)
CASES = [
    # issue 12 finding 8: lone surrogates and deep nesting were HTTP 500
    ("surrogate-prompt", C, raw('{"prompt": "a\\ud800b", "max_tokens": 2}'), 400, "prompt", "invalid_unicode"),
    ("surrogate-chat", CHAT, raw('{"messages": [{"role": "user", "content": "\\udfff"}]}'), 400,
     "messages[0].content", "invalid_unicode"),
    ("surrogate-stop", C, raw('{"prompt": "a", "stop": ["\\ud83d"]}'), 400, "stop[0]", "invalid_unicode"),
    ("nested-100000", C, raw("[" * 100_000 + "]" * 100_000), 400, None, "invalid_json"),
    ("nested-object-100000", C, raw('{"a":' * 100_000 + "1" + "}" * 100_000), 400, None, "invalid_json"),
    ("nested-field-40", C, raw('{"prompt": "a", "metadata": ' + "[" * 40 + "]" * 40 + "}"), 400, "metadata",
     "invalid_json"),
    # NaN / Infinity / overflow
    ("nan", C, raw('{"prompt": "a", "temperature": NaN}'), 400, None, "invalid_json"),
    ("infinity", C, raw('{"prompt": "a", "top_p": Infinity}'), 400, None, "invalid_json"),
    ("-infinity", C, raw('{"prompt": "a", "temperature": -Infinity}'), 400, None, "invalid_json"),
    ("float-overflow", C, raw('{"prompt": "a", "temperature": 1e400}'), 400, None, "invalid_json"),
    ("huge-int", C, raw('{"prompt": "a", "max_tokens": ' + "9" * 5000 + "}"), 400, None, "invalid_json"),
    # not JSON, not an object, not UTF-8
    ("not-json", C, raw("prompt=hello"), 400, None, "invalid_json"),
    ("json-list", C, raw("[1, 2]"), 400, None, "invalid_json"),
    ("empty-body", C, b"", 400, None, "invalid_json"),
    ("latin-1", C, b'{"prompt": "caf\xe9"}', 400, None, "invalid_json"),
    # wrong types (strict: no coercion from strings)
    ("max_tokens-str", C, with_(OK, max_tokens="5"), 400, "max_tokens", "invalid_value"),
    ("temperature-str", C, with_(OK, temperature="hot"), 400, "temperature", "invalid_value"),
    ("temperature-bool", C, with_(OK, temperature=True), 400, "temperature", "invalid_value"),
    ("prompt-int", C, with_(OK, prompt=5), 400, "prompt", "invalid_value"),
    ("prompt-dict", C, with_(OK, prompt={"a": 1}), 400, "prompt", "invalid_value"),
    ("prompt-mixed-list", C, with_(OK, prompt=[1, "a"]), 400, "prompt[0]", "invalid_value"),
    ("messages-str", CHAT, with_(MSG, messages="hi"), 400, "messages", "invalid_value"),
    ("role-unknown", CHAT, with_(MSG, messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role",
     "invalid_value"),
    ("stream-str", C, with_(OK, stream="yes"), 400, "stream", "invalid_value"),
    ("stop-int", C, with_(OK, stop=7), 400, "stop", "invalid_value"),
    ("logprobs-bool", C, with_(OK, logprobs=True), 400, "logprobs", "invalid_value"),
    ("seed-float", C, with_(OK, seed=1.5), 400, "seed", "invalid_value"),
    ("stream_options-unknown", C, with_(OK, stream_options={"foo": 1}), 400, "stream_options.foo",
     "unknown_parameter"),
    # missing and empty
    ("missing-prompt", C, {"max_tokens": 2}, 400, "prompt", "missing_required_parameter"),
    ("missing-messages", CHAT, {"max_tokens": 2}, 400, "messages", "missing_required_parameter"),
    ("empty-prompt", C, with_(OK, prompt=""), 400, "prompt", "invalid_value"),
    ("empty-prompt-list", C, with_(OK, prompt=[]), 400, "prompt", "invalid_request"),
    ("empty-messages", CHAT, with_(MSG, messages=[]), 400, "messages", "invalid_value"),
    # ranges
    ("temperature-negative", C, with_(OK, temperature=-1), 400, "temperature", "invalid_value"),
    ("top_p-zero", C, with_(OK, top_p=0), 400, "top_p", "invalid_value"),
    ("max_tokens-zero", C, with_(OK, max_tokens=0), 400, "max_tokens", "invalid_value"),
    ("min_tokens-over-max", C, with_(OK, min_tokens=8), 400, "min_tokens", "invalid_value"),
    ("top_logprobs-25", CHAT, with_(MSG, logprobs=True, top_logprobs=25), 400, "top_logprobs", "invalid_value"),
    ("top_logprobs-without-logprobs", CHAT, with_(MSG, top_logprobs=2), 400, "top_logprobs", "invalid_request"),
    ("logprobs-25", C, with_(OK, logprobs=25), 400, "logprobs", "invalid_value"),
    ("stop-100", C, with_(OK, stop=[f"s{i}" for i in range(100)]), 400, "stop", "invalid_value"),
    ("token-out-of-vocab", C, with_(OK, prompt=[1, 99999]), 400, "prompt", "invalid_request"),
    # lengths: the prompt is blamed when it alone does not fit, else the output budget
    ("prompt-too-long-ids", C, with_(OK, prompt=[400] * 600), 400, "prompt", "context_length_exceeded"),
    ("prompt-too-long-text", C, with_(OK, prompt="Once upon a time " * 400), 400, "prompt",
     "context_length_exceeded"),
    ("chat-too-long", CHAT, with_(MSG, messages=[{"role": "user", "content": "hello " * 2000}]), 400, "messages",
     "context_length_exceeded"),
    ("max_tokens-too-large", C, with_(OK, max_tokens=100_000), 400, "max_tokens", "context_length_exceeded"),
    ("max_completion_tokens-too-large", CHAT, with_(MSG, max_tokens=None, max_completion_tokens=100_000), 400,
     "max_completion_tokens", "context_length_exceeded"),
    # honoured fields with bad values, and fields that would change the output and are not implemented
    ("n-too-large", C, with_(OK, n=129), 400, "n", "invalid_value"),
    ("best_of-below-n", C, with_(OK, n=2, best_of=1), 400, "best_of", "invalid_value"),
    ("echo-on-chat", CHAT, with_(MSG, echo=True), 400, "echo", "unsupported_parameter"),
    ("suffix", C, with_(OK, suffix="The end."), 400, "suffix", "unsupported_parameter"),
    ("response_format-yaml", CHAT, with_(MSG, response_format={"type": "yaml"}), 400, "response_format",
     "invalid_value"),
    ("tools-auto-not-enabled", CHAT, with_(MSG, tools=[{"type": "function", "function": {"name": "f"}}]), 400,
     "tool_choice", "unsupported_parameter"),
    ("tools-on-completions", C, with_(OK, tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools",
     "unsupported_parameter"),
    ("guided_choice-empty", C, with_(OK, guided_choice=[]), 400, "guided_choice", "invalid_value"),
    ("prompt_logprobs-25", C, with_(OK, prompt_logprobs=25), 400, "prompt_logprobs", "invalid_value"),
    ("empty-prompt-in-list", C, with_(OK, prompt=["a", ""]), 400, "prompt[1]", "invalid_value"),
    ("too-many-sequences", C, with_(OK, prompt=["a"] * 9, n=128), 400, "prompt", "invalid_value"),
    ("one-prompt-of-a-list-too-long", C, with_(OK, prompt=[[400] * 3, [400] * 600]), 400, "prompt[1]",
     "context_length_exceeded"),
    ("image-part", CHAT, with_(MSG, messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400,
     "messages[0].content[0]", "unsupported_parameter"),
    ("unknown-field", C, with_(OK, temprature=0.5), 400, "temprature", "unknown_parameter"),
    # other statuses
    ("wrong-model", C, with_(OK, model="gpt-4"), 404, "model", "model_not_found"),
    ("too-large-body", C, raw('{"prompt": "' + "a" * (33 * 1024 * 1024) + '"}'), 413, None, "request_too_large"),
    ("tokenize-neither", "/tokenize", {"model": None}, 400, "prompt", "invalid_value"),
    ("detokenize-bad-id", "/detokenize", {"tokens": [1, 10_000]}, 400, "tokens[1]", "invalid_value"),
    ("detokenize-negative", "/detokenize", {"tokens": [-1]}, 400, "tokens[0]", "invalid_value"),
    # resume_token_ids (a migrated stream's output so far): only streamed, and it must leave something to generate
    ("resume-not-streamed", C, with_(OK, resume_token_ids=[5]), 400, "resume_token_ids", "unsupported_parameter"),
    ("resume-n-2-one-list", C, with_(OK, stream=True, n=2, resume_token_ids=[5]), 400, "resume_token_ids",
     "invalid_value"),
    ("resume-past-max_tokens", C, with_(OK, stream=True, resume_token_ids=[5] * 200_000), 400, "resume_token_ids",
     "invalid_value"),
    ("resume-str", C, with_(OK, stream=True, resume_token_ids=["5"]), 400, "resume_token_ids[0]", "invalid_value"),
]

# Penalties and logit bias: passed through once SamplingParams has the field, refused by name until then.
for name, value in (("presence_penalty", 0.5), ("frequency_penalty", 0.5), ("repetition_penalty", 1.2),
                    ("logit_bias", {"5": 10})):
    if name not in _PARAMS:
        CASES.append((f"{name}-unsupported", C, with_(OK, **{name: value}), 400, name, "unsupported_parameter"))
CASES.append(("presence_penalty-range", C, with_(OK, presence_penalty=3), 400, "presence_penalty", "invalid_value"))
CASES.append(("logit_bias-key", C, with_(OK, logit_bias={"x": 1}), 400, "logit_bias", "invalid_value"))


def send(client: httpx.Client, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return client.post(path, content=body, headers={"Content-Type": "application/json"})
    return client.post(path, json=body)


def assert_openai_error(r: httpx.Response, status: int, param: str | None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error"), err
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err
