"""Acceptance on 1P1D (a prefill and a decode worker behind the router, real NIXL between OS processes), with the
real `openai` client: structured outputs, tool calls and ``n`` > 1. The first token of every request is sampled
by the prefill worker under the grammar's mask and replayed into the decode worker's matcher."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from cluster_util import running_cluster

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py: the fast tier starts none)

SCHEMA = {"type": "object", "properties": {
    "hero": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "mood": {"enum": ["happy", "sad", "brave"]}},
        "required": ["name", "mood"], "additionalProperties": False},
    "place": {"enum": ["park", "forest", "house"]},
    "things": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
    "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["hero", "place", "things", "days"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "story", "schema": SCHEMA, "strict": True}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"],
    "additionalProperties": False}}}
TOOLS = {"get_weather": WEATHER, "get_time": TIME}
MSG = [{"role": "user", "content": "Lily went to the park."}]
CHOICES = ["yes", "no", "maybe later"]


@pytest.fixture(scope="module")
def client():
    with running_cluster(1, 1, role_argv={"decode": ["--tool-call-parser", "hermes",
                                                     "--enable-auto-tool-choice"]}) as cluster:
        yield openai.OpenAI(base_url=cluster.router_url + "/v1", api_key="x", max_retries=0, timeout=120)


def _streamed_text(stream) -> tuple[str, str | None]:
    text, reason = "", None
    for ch in stream:
        if ch.choices:
            text += ch.choices[0].delta.content or ""
            reason = ch.choices[0].finish_reason or reason
    return text, reason


@pytest.mark.timeout(600)
def test_json_schema_20_seeded_samples(client):
    outs = []
    for seed in range(20):
        r = client.chat.completions.create(model="stories260K", messages=MSG, response_format=FORMAT,
                                           temperature=1.0, seed=seed, max_tokens=200)
        assert r.choices[0].finish_reason == "stop"
        value = json.loads(r.choices[0].message.content)
        jsonschema.validate(value, SCHEMA)
        outs.append(value)
    assert len({json.dumps(v) for v in outs}) > 1  # sampled, not one forced string
    for seed in range(3):  # streamed: the deltas add up to valid JSON, equal to the non-streamed seeded output
        text, reason = _streamed_text(client.chat.completions.create(
            model="stories260K", messages=MSG, response_format=FORMAT, temperature=1.0, seed=seed, max_tokens=200,
            stream=True))
        assert reason == "stop" and json.loads(text) == outs[seed]


@pytest.mark.timeout(600)
def test_guided_choice(client):
    for seed in range(6):
        r = client.completions.create(model="stories260K", prompt="Do you want to play?", max_tokens=24,
                                      temperature=1.0, seed=seed, extra_body={"guided_choice": CHOICES})
        assert r.choices[0].text in CHOICES and r.choices[0].finish_reason == "stop"
        s = client.completions.create(model="stories260K", prompt="Do you want to play?", max_tokens=24,
                                      temperature=1.0, seed=seed, extra_body={"guided_choice": CHOICES},
                                      stream=True)
        assert "".join(c.choices[0].text for c in s if c.choices) == r.choices[0].text
    text, _ = _streamed_text(client.chat.completions.create(
        model="stories260K", messages=MSG, max_tokens=24, extra_body={"guided_choice": CHOICES}, stream=True))
    assert text in CHOICES


def _check_call(call, name: str | None = None) -> dict:
    assert call.id.startswith("call_") and call.type == "function"
    assert name is None or call.function.name == name
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, TOOLS[call.function.name]["function"]["parameters"])
    return args


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_tool_calls(client, tool_choice):
    name = None if tool_choice == "required" else "get_weather"
    kw = dict(model="stories260K", messages=MSG, tools=[WEATHER, TIME], tool_choice=tool_choice,
              parallel_tool_calls=False, max_tokens=100, temperature=1.0)
    for seed in range(3):
        r = client.chat.completions.create(seed=seed, **kw)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None and len(c.message.tool_calls) == 1
        args = _check_call(c.message.tool_calls[0], name)
        calls: dict[int, dict] = {}
        reason = None
        for ch in client.chat.completions.create(seed=seed, stream=True, **kw):
            d = ch.choices[0].delta
            reason = ch.choices[0].finish_reason or reason
            assert not d.content
            for tc in d.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                slot["id"] = tc.id or slot["id"]
                slot["name"] = (tc.function.name if tc.function else None) or slot["name"]
                slot["arguments"] += (tc.function.arguments if tc.function else None) or ""
        assert reason == "tool_calls" and list(calls) == [0]
        assert calls[0]["id"].startswith("call_") and calls[0]["name"] == c.message.tool_calls[0].function.name
        assert json.loads(calls[0]["arguments"]) == args


@pytest.mark.timeout(600)
def test_auto_tool_choice_enabled_on_the_decode_worker(client):
    # stories260K writes no <tool_call> block: auto returns the text as content (hermes parser)
    r = client.chat.completions.create(model="stories260K", messages=MSG, tools=[WEATHER], max_tokens=12,
                                       temperature=0)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls


@pytest.mark.timeout(600)
def test_n3_seeded_distinct_and_reproducible(client):
    kw = dict(model="stories260K", prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=11, n=3)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    ta = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    tb = [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert len(set(ta)) == 3 and ta == tb
    assert a.usage.prompt_tokens == client.completions.create(**dict(kw, n=1)).usage.prompt_tokens
    streamed = ["", "", ""]
    for ch in client.completions.create(stream=True, **kw):
        for c in ch.choices:
            streamed[c.index] += c.text
    assert streamed == ta
    chat = client.chat.completions.create(model="stories260K", messages=MSG, n=3, seed=5, max_tokens=200,
                                          response_format=FORMAT)
    assert len({c.message.content for c in chat.choices}) == 3
    for c in chat.choices:
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
