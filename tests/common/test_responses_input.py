"""A Responses API body as the chat body it means, and every field that is not honoured refused by name
(``common/responses_input.py``)."""

from __future__ import annotations

import pytest

from pd_cluster.common.responses_input import Refused, to_chat

TOOL = {"type": "function", "name": "get_weather", "description": "the weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}, "strict": True}


def test_text_input_and_instructions():
    chat = to_chat({"model": "m", "instructions": "Be brief.", "input": "Hi", "max_output_tokens": 9,
                    "temperature": 0, "top_p": 0.5, "stream": True, "metadata": {"k": "v"}, "store": False,
                    "seed": 3})
    assert chat == {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                    "model": "m", "temperature": 0, "top_p": 0.5, "stream": True, "seed": 3,
                    "max_completion_tokens": 9}


def test_items_tools_and_format():
    body = {"input": [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                                         {"type": "input_text", "text": "Paris?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Lyon"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]}],
        "tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": False,
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": True}}}
    chat = to_chat(body)
    m = chat["messages"]
    assert m[0] == {"role": "developer", "content": "Use tools."}
    assert m[1] == {"role": "user", "content": "Weather in Paris?"}
    assert m[2]["role"] == "assistant" and [c["id"] for c in m[2]["tool_calls"]] == ["call_1", "call_2"]
    assert m[3] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    assert m[4] == {"role": "assistant", "content": "Sunny."}
    assert chat["tools"] == [{"type": "function", "function": {k: TOOL[k] for k in
                                                                 ("name", "description", "parameters", "strict")}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "w", "schema": {"type": "object"}, "strict": True}}
    assert chat["parallel_tool_calls"] is False
    assert "response_format" not in to_chat({"input": "x", "text": {"format": {"type": "text"}}})


@pytest.mark.parametrize("extra, param", [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"max_tool_calls": 1}, "max_tool_calls"),
    ({"truncation": "auto"}, "truncation"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": 3}, "input"),
    ({"input": None}, "input"),
])
def test_what_is_not_honoured_is_refused_by_name(extra, param):
    with pytest.raises(Refused) as e:
        to_chat({"input": "Hi", **extra})
    assert e.value.param == param


def test_no_op_values_are_accepted():
    to_chat({"input": "Hi", "store": False, "background": False, "include": [], "top_logprobs": 0,
             "truncation": "disabled", "service_tier": "auto", "user": "u", "safety_identifier": "s",
             "prompt_cache_key": "k", "previous_response_id": None, "reasoning": None})
