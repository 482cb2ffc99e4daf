"""The openai SDK's ``responses.create`` against ``pd-serve`` 1P1D (the router in front, a prefill and a decode
worker, real NIXL between OS processes): plain, streamed, with a function tool and with ``text.format``; the
greedy text equals ``/v1/chat/completions``' for the same messages, and what is not honoured is a 400 naming it."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from responses_kit import SCHEMA, WEATHER
from cluster_util import running_pd_serve

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py: the fast tier starts none)



@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with running_pd_serve(tmp_path_factory.mktemp("pd") / "manifest.json") as (url, _):
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.timeout(400)
def test_responses_through_the_router_in_pd(client):
    messages = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "Lily had a cat."}]
    chat = client.chat.completions.create(model="stories260K", messages=messages, max_tokens=30, temperature=0)
    kwargs = dict(model="stories260K", instructions="You tell stories.", input="Lily had a cat.",
                  max_output_tokens=30, temperature=0)
    plain = client.responses.create(**kwargs)
    assert plain.output_text == chat.choices[0].message.content and plain.output_text
    streamed = list(client.responses.create(**kwargs, stream=True))
    assert streamed[0].type == "response.created" and streamed[-1].type in ("response.completed",
                                                                             "response.incomplete")
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == plain.output_text
    assert streamed[-1].response.output_text == plain.output_text

    tool = dict(model="stories260K", input="What is the weather?", tools=[WEATHER], tool_choice="required",
                parallel_tool_calls=False, max_output_tokens=300, temperature=0)
    called = client.responses.create(**tool)
    (call,) = called.output
    assert call.type == "function_call" and call.name == "get_weather" and called.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    events = list(client.responses.create(**tool, stream=True))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == call.arguments and events[-1].response.output[0].arguments == call.arguments

    fmt = {"format": {"type": "json_schema", "name": "who", "schema": SCHEMA, "strict": True}}
    shaped = client.responses.create(model="stories260K", input="A boy named Tom", text=fmt, max_output_tokens=80,
                                     temperature=0)
    jsonschema.validate(json.loads(shaped.output_text), SCHEMA)

    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="stories260K", input="Hi", store=True)
    assert e.value.body["param"] == "store"
