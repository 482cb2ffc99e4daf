"""Tool calls cut by ``max_tokens``: the non-streamed answer holds what the streamed one sends (the calls whose names
were complete, with the arguments generated so far), for ``required``, a named function and ``auto`` (hermes,
llama3_json); whole outputs are unchanged."""

from __future__ import annotations

import pytest

from pd_cluster.serving.tools.chat import ToolSettings, chat_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
BOOK = {"type": "function", "function": {"name": "book_table", "parameters": {
    "type": "object", "properties": {"guests": {"type": "integer"}}, "required": ["guests"]}}}
AUTO = {"hermes": ToolSettings("hermes", True), "llama3_json": ToolSettings("llama3_json", True)}


def streamed(tools, text: str, piece: int) -> tuple[str | None, list[tuple[str, str]]]:
    """What a client of the stream puts together: the content and each call's (name, arguments)."""
    stream = tools.stream()
    deltas = []
    for i in range(0, len(text), piece):
        deltas += stream.feed(text[i:i + piece])
    deltas += stream.finish()
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for p in d.get("tool_calls", ()):
            name, args = calls.get(p["index"], ("", ""))
            calls[p["index"]] = (name + (p["function"].get("name") or ""), args + (p["function"].get("arguments") or ""))
    return content or None, [calls[i] for i in sorted(calls)]


def whole(tools, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = tools.extract(text)
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


CASES = [
    ("required", ToolSettings(), '[{"name": "get_weather", "parameters": {"city": "Par'),
    ("required", ToolSettings(), '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "book_table", '
                                 '"parameters": {"gue'),
    ("required", ToolSettings(), '[{"name": "get_wea'),  # cut before any name: content, both ways
    ({"type": "function", "function": {"name": "get_weather"}}, ToolSettings(), '{"city": "Lyo'),
    ("auto", AUTO["hermes"], 'Let me look.<tool_call>{"name": "get_weather", "arguments": {"city": "Ro'),
    ("auto", AUTO["llama3_json"], '{"name": "book_table", "parameters": {"guests": 4'),
]


@pytest.mark.parametrize("choice, settings, text", CASES)
@pytest.mark.parametrize("piece", [1, 3, 7])
def test_a_cut_output_gives_the_same_calls_streamed_and_not(choice, settings, text, piece):
    tools = chat_tools([WEATHER, BOOK], choice, None, settings, None)
    assert whole(tools, text) == streamed(tools, text, piece)


def test_the_cut_calls_are_the_named_ones_with_their_arguments_so_far():
    tools = chat_tools([WEATHER, BOOK], "required", None, ToolSettings(), None)
    content, calls = whole(tools, CASES[1][2])
    assert content is None and [name for name, _ in calls] == ["get_weather", "book_table"]
    assert calls[0][1] == '{"city": "Paris"}' and calls[1][1].startswith('{"gue')


@pytest.mark.parametrize("choice, settings, text", [
    ("required", ToolSettings(), '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'),
    ("auto", AUTO["hermes"], 'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'),
    ("auto", AUTO["hermes"], "No tool needed here."),
])
def test_whole_outputs_are_unchanged(choice, settings, text):
    tools = chat_tools([WEATHER, BOOK], choice, None, settings, None)
    content, calls = whole(tools, text)
    assert (content, calls) == streamed(tools, text, 5) or (not calls and content == text)
