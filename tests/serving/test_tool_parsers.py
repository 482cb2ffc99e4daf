"""Tool calls: ``required`` and named functions forced through structured output on stories260K (the arguments
validate against the tool's schema), ``auto`` parsed from canned model outputs (hermes, llama3_json), and the
validation of ``tools`` / ``tool_choice`` / ``response_format`` naming the field."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pd_cluster.engine import LLM, SamplingParams
from pd_cluster.engine.errors import SamplingParamError
from pd_cluster.engine.sampling.structured import StructuredOutput, structured_output_from_request
from pd_cluster.serving.tools.parsers import TOOL_PARSERS, get_tool_parser
from pd_cluster.serving.tools.stream import ToolCallStream
from pd_cluster.serving.tools.spec import (FunctionTool, forced_tool_calls, parse_tool_choice, parse_tools,
                                              tool_choice_structured_output)

# String arguments are bounded (maxLength): stories260K would otherwise write a story inside the first string.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
BOOK = {"type": "function", "function": {
    "name": "book_table",
    "parameters": {"type": "object", "properties": {
        "guests": {"type": "integer", "minimum": 1, "maximum": 12},
        "names": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
        "outside": {"type": "boolean"}},
        "required": ["guests", "names", "outside"], "additionalProperties": False}}}
TOOLS = [WEATHER, BOOK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PROMPT = "Lily wanted to know if it would rain, so she"


@pytest.fixture(scope="module")
def llm():
    return LLM()


def _generate(llm, spec: StructuredOutput, n: int) -> list[str]:
    outs = llm.generate([PROMPT] * n, [SamplingParams(temperature=1.0, seed=s, max_tokens=200, structured_output=spec)
                                       for s in range(n)])
    assert all(o.outputs[0].finish_reason == "stop" for o in outs), [o.outputs[0].text for o in outs]
    return [o.outputs[0].text for o in outs]


def test_required_returns_calls_whose_arguments_validate(llm):
    """One call per output (``parallel_tool_calls=False``): with parallel calls allowed stories260K rarely stops
    appending calls to the array within max_tokens."""
    tools = parse_tools(TOOLS)
    choice = parse_tool_choice("required", tools)
    for text in _generate(llm, tool_choice_structured_output(tools, choice, parallel_tool_calls=False), 10):
        calls = forced_tool_calls(text, choice)
        assert len(calls) == 1
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
            assert call.to_openai()["type"] == "function" and call.to_openai()["id"].startswith("call_")


@pytest.mark.parametrize("name", ["get_weather", "book_table"])
def test_a_named_function_returns_its_call_with_valid_arguments(llm, name):
    tools = parse_tools(TOOLS)
    choice = parse_tool_choice({"type": "function", "function": {"name": name}}, tools)
    assert isinstance(choice, FunctionTool)
    for text in _generate(llm, tool_choice_structured_output(tools, choice), 8):
        [call] = forced_tool_calls(text, choice)
        assert call.name == name
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[name])


def test_parallel_required_calls_allow_several_calls_of_either_tool(llm):
    tools = parse_tools(TOOLS)
    spec = tool_choice_structured_output(tools, "required")
    assert "maxItems" not in spec.json_schema and spec.json_schema["minItems"] == 1
    out = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=0, max_tokens=120, structured_output=spec))
    text = out[0].outputs[0].text
    assert text.startswith('[{"name": "') and text.count('{"name": ') >= 2  # cut by max_tokens, still the shape


def test_auto_and_none_are_not_constrained():
    tools = parse_tools(TOOLS)
    assert parse_tool_choice(None, tools) == "auto" and parse_tool_choice(None, []) == "none"
    assert tool_choice_structured_output(tools, "auto") is None
    assert tool_choice_structured_output(tools, "none") is None


@pytest.mark.parametrize("tools, tool_choice, param", [
    ("get_weather", None, "tools"),
    ([{"type": "retrieval"}], None, "tools"),
    ([{"type": "function", "function": {"description": "no name"}}], None, "tools"),
    ([WEATHER, WEATHER], None, "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}], None, "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], None, "tools"),
    (TOOLS, "always", "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "missing"}}, "tool_choice"),
    ([], "required", "tool_choice"),
])
def test_bad_tools_and_tool_choice_name_the_field(tools, tool_choice, param):
    with pytest.raises(SamplingParamError) as e:
        parse_tool_choice(tool_choice, parse_tools(tools))
    assert e.value.param == param


# ---- auto: canned model outputs ----------------------------------------------------------------------------------
def test_hermes_parser():
    p = get_tool_parser("hermes")
    r = p.extract_tool_calls('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                             '"unit": "celsius"}}\n</tool_call>\n<tool_call>{"name": "book_table", "arguments": '
                             '{"guests": 2, "names": ["Ann"], "outside": true}}</tool_call>')
    assert r.tools_called and r.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in r.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("book_table", {"guests": 2, "names": ["Ann"], "outside": True})]
    assert r.tool_calls[0].id != r.tool_calls[1].id
    # cut at EOS before the closing tag; arguments given as JSON text
    r = p.extract_tool_calls('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}')
    assert r.tools_called and r.content is None and json.loads(r.tool_calls[0].arguments) == {"city": "Oslo"}
    for text in ["It is sunny in Paris.", "<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}'
                 "</tool_call>"]:
        r = p.extract_tool_calls(text)
        assert not r.tools_called and r.tool_calls == [] and r.content == text


def test_llama3_json_parser():
    p = get_tool_parser("llama3_json")
    r = p.extract_tool_calls('{"name": "get_weather", "parameters": {"city": "Rome", "unit": "fahrenheit"}}')
    assert r.tools_called and r.content is None
    assert (r.tool_calls[0].name, json.loads(r.tool_calls[0].arguments)) == (
        "get_weather", {"city": "Rome", "unit": "fahrenheit"})
    r = p.extract_tool_calls('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}')
    assert [(c.name, json.loads(c.arguments)) for c in r.tool_calls] == [("a", {}), ("b", {"x": 1})]
    for text in ["The weather is nice.", '{"city": "Rome"}', '{"name": "a", "parameters": {}} and more text',
                 '{"name": "a", "parameters": {']:
        r = p.extract_tool_calls(text)
        assert not r.tools_called and r.content == text


def test_parser_registry_uses_vllm_names():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json"}
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("mistral")


# ---- response_format and vLLM's guided_* fields --------------------------------------------------------------------
def test_structured_output_from_request():
    assert structured_output_from_request() is None
    assert structured_output_from_request(response_format={"type": "text"}) is None
    s = structured_output_from_request(response_format={"type": "json_object"})
    assert s.kind == "json_object" and s.param == "response_format"
    s = structured_output_from_request(response_format={"type": "json_schema", "json_schema": {
        "name": "w", "schema": SCHEMAS["get_weather"], "strict": True}})
    assert s.kind == "json_schema" and s.json_schema == SCHEMAS["get_weather"] and s.param == "response_format"
    assert structured_output_from_request(guided_json='{"type": "integer"}').param == "guided_json"
    assert structured_output_from_request(guided_choice=["a", "b"]).choice == ("a", "b")
    assert structured_output_from_request(guided_regex="[0-9]+").kind == "regex"
    assert structured_output_from_request(guided_grammar='root ::= "x"').kind == "grammar"


@pytest.mark.parametrize("kwargs, param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_json": {"type": "object"}, "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_regex": "a{2"}, "guided_regex"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"guided_json": {"type": "object"}, "guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
])
def test_bad_request_fields_name_the_field(kwargs, param):
    with pytest.raises(SamplingParamError) as e:
        structured_output_from_request(**kwargs)
    assert e.value.param == param


# ---- streaming -----------------------------------------------------------------------------------------------------
def _stream(stream: ToolCallStream, text: str, size: int) -> tuple[str | None, list[tuple[str, str]], list[dict]]:
    """Feed `text` in pieces of `size` characters; returns (content, [(name, arguments)], deltas) as a client
    that concatenates OpenAI's deltas sees them."""
    deltas = [d for i in range(0, len(text), size) for d in stream.feed(text[i:i + size])] + stream.finish()
    content = "".join(d["content"] for d in deltas if "content" in d) or None
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            if "id" in tc:
                assert tc["type"] == "function" and tc["index"] == len(calls) and tc["id"].startswith("call_")
                calls[tc["index"]] = [tc["function"]["name"], ""]
            calls[tc["index"]][1] += tc["function"]["arguments"]
    return content, [tuple(c) for c in calls.values()], deltas


CANNED = {
    "hermes": ['Let me check the weather.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
               '"unit": "celsius"}}\n</tool_call>\n<tool_call>{"name": "book_table", "arguments": {"guests": 2, '
               '"names": ["Ann"], "outside": true}}</tool_call>',
               '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}',
               "No tools needed: it is < 20 degrees and sunny <tool_ in Paris.",
               "<tool_call>{broken}</tool_call>"],
    "llama3_json": ['{"name": "get_weather", "parameters": {"city": "Rome", "unit": "fahrenheit"}}',
                    '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}',
                    "Sure, {\"name\": \"a\"} is not a call here.", "<|python",
                    '<|python_tag|> {"parameters": {"x": [1, {"y": "}"}]}, "name": "late"}',
                    '<|python_tag|>print("{\\"name\\": 1}")', '\n  {"name": "q", "parameters": "{\\"a\\": 1}"}',
                    '{"name": "a", "parameters": {"s": "x;y"}} ; {"name": "b", "arguments": {}}', '{"nom": 1}'],
}


@pytest.mark.parametrize("parser", sorted(CANNED))
@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_streamed_auto_tool_calls_add_up_to_the_non_streamed_result(parser, size):
    p = get_tool_parser(parser)
    for text in CANNED[parser]:
        full = p.extract_tool_calls(text)
        stream = ToolCallStream("auto", get_tool_parser(parser))
        content, calls, deltas = _stream(stream, text, size)
        # the streamed arguments are the model's JSON text (its whitespace), the same value
        assert _parsed(calls) == _parsed([(c.name, c.arguments) for c in full.tool_calls]), text
        assert content == full.content, text
        assert stream.tools_called == full.tools_called
        # the arguments arrive in pieces (those written before the name, or quoted, are sent whole)
        if size == 1 and full.tools_called and '"parameters": "' not in text and '"late"' not in text:
            pieces = [tc for d in deltas for tc in d.get("tool_calls", []) if "id" not in tc]
            assert len(pieces) > 2 * len(calls), text


def test_llama3_json_sends_each_name_before_the_output_ends():
    """The first call's name and the start of its arguments go out while the model is still writing the second
    call; output cut after a name (max_tokens) keeps that call with the arguments sent so far, as vLLM streams it,
    where the complete text (not valid JSON) is content."""
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "book_table", "param'
    stream = ToolCallStream("auto", get_tool_parser("llama3_json"))
    early = [d for i in range(0, len(text), 4) for d in stream.feed(text[i:i + 4])]
    names = [tc["function"]["name"] for d in early for tc in d["tool_calls"] if "id" in tc]
    assert names == ["get_weather", "book_table"] and stream.tools_called
    assert "".join(tc["function"]["arguments"] for d in early for tc in d["tool_calls"]
                   if tc["index"] == 0) == '{"city": "Rome"}'
    assert stream.finish() == []
    cut = '{"name": "a", "parameters": {"k": [1, 2'
    content, calls, _ = _stream(ToolCallStream("auto", get_tool_parser("llama3_json")), cut, 3)
    assert content is None and calls == [("a", '{"k": [1, 2')]
    assert not get_tool_parser("llama3_json").extract_tool_calls(cut).tools_called


def _parsed(calls: list[tuple[str, str]]) -> list[tuple[str, object]]:
    return [(name, json.loads(args)) for name, args in calls]


def test_streamed_named_and_required_calls(llm):
    tools = parse_tools(TOOLS)
    named = parse_tool_choice({"type": "function", "function": {"name": "get_weather"}}, tools)
    out = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=4, max_tokens=200,
                                                structured_output=tool_choice_structured_output(tools, named)))
    text = out[0].outputs[0].text
    content, calls, deltas = _stream(ToolCallStream(named), text, 2)
    assert content is None and calls == [("get_weather", text)] and len(deltas) > 3  # arguments stream
    jsonschema.validate(json.loads(calls[0][1]), SCHEMAS["get_weather"])
    spec = tool_choice_structured_output(tools, "required", parallel_tool_calls=False)
    text = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=4, max_tokens=200,
                                                 structured_output=spec))[0].outputs[0].text
    content, calls, deltas = _stream(ToolCallStream("required"), text, 5)
    assert content is None
    assert _parsed(calls) == _parsed([(c.name, c.arguments) for c in forced_tool_calls(text, "required")])
    assert sum(1 for d in deltas for tc in d["tool_calls"] if "id" not in tc) > 2  # the arguments stream
    _, cut, _ = _stream(ToolCallStream("required"), text[:text.index('"name"') + 3], 5)  # cut before a name
    assert cut == []
    assert ToolCallStream("none").feed("plain") == [{"content": "plain"}]
