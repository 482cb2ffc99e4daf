"""``POST /v1/responses`` on a real mixed worker (stories260K, in this process) with the real `openai` client: the
greedy text is the chat answer's, streamed events come in OpenAI's order and put together give the final response,
function tools and ``text.format`` go through the chat path's structured outputs, and what is not honoured is
refused by name."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from responses_kit import SCHEMA, WEATHER
from worker_kit import running_worker



@pytest.fixture(scope="module")
def client():
    with running_worker() as w:
        yield openai.OpenAI(base_url=w.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def events(stream) -> tuple[list, object]:
    got = list(stream)
    assert [e.sequence_number for e in got] == list(range(len(got)))
    return got, got[-1].response


def test_text_equals_the_chat_answer_streamed_or_not(client):
    messages = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "Once upon a time"}]
    chat = client.chat.completions.create(model="stories260K", messages=messages, max_tokens=24, temperature=0)
    kwargs = dict(model="stories260K", instructions="You tell stories.", input="Once upon a time",
                  max_output_tokens=24, temperature=0)
    whole = client.responses.create(**kwargs)
    assert whole.output_text == chat.choices[0].message.content and whole.output_text
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (chat.usage.prompt_tokens, 24)
    got, final = events(client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in got]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert "".join(e.delta for e in got if e.type == "response.output_text.delta") == whole.output_text
    assert final.output_text == whole.output_text and final.status == "incomplete"
    # message items as input, a stop before max_output_tokens: completed
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Tom had a red ball."}]}]
    short = client.responses.create(model="stories260K", input=items, max_output_tokens=400, temperature=0)
    chat = client.chat.completions.create(model="stories260K", messages=[{"role": "user", "content":
                                          "Tom had a red ball."}], max_tokens=400, temperature=0)
    assert short.output_text == chat.choices[0].message.content
    assert short.status == ("completed" if chat.choices[0].finish_reason == "stop" else "incomplete")


def test_a_function_tool_streamed_and_not(client):
    kwargs = dict(model="stories260K", input="What is the weather?", tools=[WEATHER], max_output_tokens=300,
                  temperature=0, tool_choice="required", parallel_tool_calls=False)
    whole = client.responses.create(**kwargs)
    calls = [o for o in whole.output if o.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls) and whole.status == "completed"
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), WEATHER["parameters"])
        assert c.call_id.startswith("call_")
    got, final = events(client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in got]
    assert kinds[2] == "response.output_item.added" and got[2].item.type == "function_call"
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    done = [e for e in got if e.type == "response.function_call_arguments.done"]
    assert [(d.arguments) for d in done] == [c.arguments for c in calls]
    assert [(o.name, o.arguments) for o in final.output] == [(c.name, c.arguments) for c in calls]
    named = client.responses.create(**dict(kwargs, tool_choice={"type": "function", "name": "get_weather"}))
    (call,) = named.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


def test_text_format_json_schema(client):
    fmt = {"format": {"type": "json_schema", "name": "who", "schema": SCHEMA, "strict": True}}
    r = client.responses.create(model="stories260K", input="A girl named Lily", text=fmt, max_output_tokens=80,
                                temperature=0)
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text.format.type == "json_schema"
    chat = client.chat.completions.create(
        model="stories260K", messages=[{"role": "user", "content": "A girl named Lily"}], max_tokens=80,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "who", "schema": SCHEMA,
                                                                                "strict": True}})
    assert r.output_text == chat.choices[0].message.content


@pytest.mark.parametrize("extra, param", [({"store": True}, "store"), ({"previous_response_id": "resp_x"},
                                                                       "previous_response_id"),
                                          ({"reasoning": {"effort": "high"}}, "reasoning"),
                                          ({"max_output_tokens": 0}, "max_output_tokens")])
def test_what_is_not_honoured_is_a_400_naming_it(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="stories260K", input="Hi", **extra)
    assert e.value.body["param"] == param
