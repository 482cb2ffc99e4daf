"""Structured outputs, tool calls and ``n`` / ``best_of`` over HTTP on a real mixed worker (stories260K), with the
real `openai` client; ``auto`` tool parsing needs the worker's ``--tool-call-parser`` and
``--enable-auto-tool-choice`` (vLLM's flags)."""

from __future__ import annotations

import json
import threading
import time

import httpx

import jsonschema
import openai
import pytest
import uvicorn
from worker_kit import InProcessWorker

from pd_cluster.serving.mixed import build_mixed_app
from pd_cluster.serving.tools.chat import ToolSettings
from pd_cluster.serving.worker_app import WorkerConfig

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "mood": {"enum": ["happy", "sad"]},
    "pets": {"type": "array", "items": {"type": "object", "properties": {
        "kind": {"enum": ["dog", "cat", "bird"]}, "age": {"type": "integer", "minimum": 0, "maximum": 20}},
        "required": ["kind", "age"], "additionalProperties": False}, "maxItems": 3}},
    "required": ["name", "mood", "pets"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                     "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"],
    "additionalProperties": False}}}
MSG = [{"role": "user", "content": "Once upon a time"}]


class ToolWorker(InProcessWorker):
    """The in-process mixed worker, with tool settings."""

    def __init__(self, tools: ToolSettings, **kw) -> None:
        super().__init__(**kw)
        self.app = build_mixed_app(self.engine, WorkerConfig(engine=self.engine.config, tools=tools),
                                   {"url": "", "incarnation": "test"}, exit_on_fatal=False)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    access_log=False))
        self.thread = threading.Thread(target=self.server.run, daemon=True)


@pytest.fixture(scope="module")
def worker():
    w = ToolWorker(ToolSettings("hermes", True)).start()
    try:
        yield w
    finally:
        w.stop()


@pytest.fixture(scope="module")
def client(worker):
    return openai.OpenAI(base_url=worker.url + "/v1", api_key="x", max_retries=0, timeout=120)


def test_json_schema_and_choice(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "story", "schema": SCHEMA, "strict": True}}
    for seed in range(3):
        r = client.chat.completions.create(model=None, messages=MSG, response_format=fmt, temperature=1.0,
                                           seed=seed, max_tokens=120)
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    r = client.completions.create(model=None, prompt="The cat was", max_tokens=10,
                                  extra_body={"guided_choice": ["happy", "sad"]}, temperature=1.0, seed=1)
    assert r.choices[0].text in ("happy", "sad")


def test_required_and_named_tools(client):
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        r = client.chat.completions.create(model=None, messages=MSG, tools=[WEATHER, TIME], tool_choice=choice,
                                           parallel_tool_calls=False, max_tokens=80, temperature=1.0, seed=3)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        call = c.message.tool_calls[0]
        assert call.id.startswith("call_") and call.type == "function"
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        # streamed: the deltas add up to the same kind of call
        s = client.chat.completions.create(model=None, messages=MSG, tools=[WEATHER, TIME], tool_choice=choice,
                                           parallel_tool_calls=False, max_tokens=80, temperature=1.0, seed=3,
                                           stream=True)
        name, args, reasons = None, "", []
        for ch in s:
            d = ch.choices[0].delta
            reasons.append(ch.choices[0].finish_reason)
            for tc in d.tool_calls or []:
                name = tc.function.name or name
                args += tc.function.arguments or ""
        assert reasons[-1] == "tool_calls" and name == call.function.name
        assert json.loads(args) == json.loads(call.function.arguments)


def test_auto_parses_hermes_calls(client):
    # a regex forces a hermes block out of stories260K: the hermes parser turns it into a call
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}</tool_call>'
    regex = "Hi " + call.replace("{", "\\{").replace("}", "\\}")
    kw = dict(model=None, messages=MSG, tools=[WEATHER, TIME], max_tokens=200, extra_body={"guided_regex": regex})
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Hi"
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"})]
    content, calls, reasons, pieces = "", {}, [], 0
    for ch in client.chat.completions.create(stream=True, **kw):
        d = ch.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:  # the name first, then the arguments in pieces (as vLLM and OpenAI stream)
            slot = calls.setdefault(t.index, [t.function.name, ""])
            slot[1] += t.function.arguments or ""
            pieces += bool(t.function.arguments)
        reasons.append(ch.choices[0].finish_reason)
    assert content == "Hi" and [(n, json.loads(a)) for n, a in calls.values()] == [
        ("get_weather", {"city": "Paris", "unit": "c"})]
    assert pieces > 2 and reasons[-1] == "tool_calls"


def test_auto_refused_without_flag_and_none_is_plain():
    w = ToolWorker(ToolSettings()).start()
    try:
        c = openai.OpenAI(base_url=w.url + "/v1", api_key="x", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=None, messages=MSG, tools=[WEATHER], max_tokens=4)
        assert e.value.body["param"] == "tool_choice"
        r = c.chat.completions.create(model=None, messages=MSG, tools=[WEATHER], tool_choice="none", max_tokens=4)
        assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    finally:
        w.stop()


def test_n_and_best_of(client):
    kw = dict(model=None, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=7)
    a = client.completions.create(n=3, **kw)
    b = client.completions.create(n=3, **kw)
    texts = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(a.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert len(set(texts)) == 3 and texts == [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    one = client.completions.create(n=1, **kw)
    assert one.usage.prompt_tokens == a.usage.prompt_tokens
    assert a.usage.completion_tokens == sum(
        len(client.completions.create(**dict(kw, seed=7 + i), extra_body={"return_token_ids": True})
            .choices[0].token_ids) for i in range(3))
    chunks = list(client.completions.create(n=3, stream=True, **kw))
    streamed = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
                for i in range(3)}
    assert [streamed[i] for i in range(3)] == texts
    best = client.completions.create(n=2, best_of=4, logprobs=0, **kw)
    assert [c.index for c in best.choices] == [0, 1]
    cum = [sum(c.logprobs.token_logprobs) for c in best.choices]
    assert cum[0] >= cum[1]
    assert best.usage.completion_tokens >= sum(len(c.logprobs.tokens) for c in best.choices)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(n=2, best_of=4, stream=True, **kw)
    assert e.value.body["param"] == "best_of"
    chat = client.chat.completions.create(model=None, messages=MSG, n=2, max_tokens=8, seed=1,
                                          response_format={"type": "json_object"})
    assert [c.index for c in chat.choices] == [0, 1]


def test_tool_flags_reach_the_workers():
    from pd_cluster.launch import serve, worker
    from pd_cluster.serving.tools.chat import tool_argv

    argv = ["--tool-call-parser", "llama3_json", "--enable-auto-tool-choice"]
    assert tool_argv(serve.build_parser().parse_args(argv)) == argv
    config = worker.worker_config_from_args(worker.build_parser().parse_args(["--role", "decode", *argv]))
    assert config.tools == ToolSettings("llama3_json", True)
    with pytest.raises(ValueError, match="requires --tool-call-parser"):
        ToolSettings(None, True)


def test_a_client_leaving_an_n3_stream_aborts_every_choice(worker):
    body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "n": 3, "seed": 1, "stream": True}
    with httpx.Client(base_url=worker.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            seen = set()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    seen.add(json.loads(line[6:])["choices"][0]["index"])
                if len(seen) == 3:
                    break
            assert worker.engine.load()["num_running_reqs"] == 3
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        load = worker.engine.load()
        if load["num_running_reqs"] == 0 and load["num_free_pages"] == load["num_total_pages"]:
            break
        time.sleep(0.05)
    assert load["num_running_reqs"] == 0 and load["num_free_pages"] == load["num_total_pages"]


def test_pydantic_tool_with_nested_models(client):
    """`openai.pydantic_function_tool` of a model with nested models: its ``parameters`` hold ``$defs`` and
    ``$ref``s (and one recursive model), honoured under ``required`` (several tools in one schema) and a named
    choice, and parsed back by the SDK."""
    from pydantic import BaseModel, Field

    class Address(BaseModel):
        city: str = Field(max_length=10)
        zip: int = Field(ge=0, le=99999)

    class Person(BaseModel):
        name: str = Field(max_length=10)
        home: Address
        friends: list[Address] = Field(max_length=2)

    class Tree(BaseModel):
        value: int = Field(ge=0, le=9)
        children: list["Tree"] = Field(max_length=1)

    tools = [openai.pydantic_function_tool(Person), openai.pydantic_function_tool(Tree)]
    assert "$defs" in tools[0]["function"]["parameters"] and "$defs" in tools[1]["function"]["parameters"]
    models = {"Person": Person, "Tree": Tree}
    for choice in ("required", {"type": "function", "function": {"name": "Person"}}):
        for seed in range(2):
            r = client.chat.completions.parse(model=None, messages=MSG, tools=tools, tool_choice=choice,
                                              parallel_tool_calls=False, max_tokens=200, temperature=1.0,
                                              seed=seed)
            c = r.choices[0]
            assert c.finish_reason == "tool_calls", c
            (call,) = c.message.tool_calls
            parsed = call.function.parsed_arguments
            assert isinstance(parsed, models[call.function.name])
            assert parsed == models[call.function.name].model_validate_json(call.function.arguments)
