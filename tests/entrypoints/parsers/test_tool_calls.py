"""The MiniMax-M3 tool-call parser (`]<]minimax[>[<tool_call>` / `<invoke name=...>` / a tag per parameter): table
tests on M3-shaped replies, each streamed split at every position (and a character at a time) equal to the whole
parse; arguments typed by the tool's JSON schema; markup never in content."""

from __future__ import annotations

import json

import pytest

from m3eagle.entrypoints.parsers import ParsedMessage, ToolCallParser, parse_output
from m3eagle.entrypoints.parsers.tool_calls import NS, convert_leaf
from tests.entrypoints.parsers._split import assert_every_split, streamed

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "limit": {"type": ["number", "null"]}, "tags": {"type": "array", "items": {"type": "string"}},
        "opts": {"type": "object", "properties": {"unit": {"type": "string"}, "n": {"type": "number"}}},
        "points": {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "integer"}}}},
        "zip": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}}}}},
]


def tag(name: str, body: str) -> str:
    return f"{NS}<{name}>{body}{NS}</{name}>"


def invoke(name: str, *params: str) -> str:
    return f'{NS}<invoke name="{name}">' + "".join(params) + f"{NS}</invoke>"


def block(*invokes: str) -> str:
    return f"{NS}<tool_call>\n" + "\n".join(invokes) + f"\n{NS}</tool_call>"


def call(i: int, name: str, args: dict) -> dict:
    return {"id": f"call_{i}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


WEATHER = invoke("get_weather", tag("city", "Paris"), tag("days", "3"))
CASES = [
    # (output, content, tool calls)
    (block(WEATHER), None, [call(0, "get_weather", {"city": "Paris", "days": 3})]),
    ("Let me check.\n" + block(WEATHER), "Let me check.", [call(0, "get_weather", {"city": "Paris", "days": 3})]),
    (block(WEATHER, invoke("search", tag("query", "a < b & \"c\"")), invoke("get_weather", tag("city", "Oslo"))), None,
     [call(0, "get_weather", {"city": "Paris", "days": 3}), call(1, "search", {"query": "a < b & \"c\""}),
      call(2, "get_weather", {"city": "Oslo"})]),
    (block(invoke("get_weather", tag("metric", "true"), tag("limit", "null"), tag("zip", "00123"),
                  tag("tags", tag("item", "a") + tag("item", "b")),
                  tag("opts", tag("unit", "C") + tag("n", "2.5")),
                  tag("points", tag("item", tag("x", "1")) + tag("item", tag("x", "2"))))), None,
     [call(0, "get_weather", {"metric": True, "limit": None, "zip": "00123", "tags": ["a", "b"],
                              "opts": {"unit": "C", "n": 2.5}, "points": [{"x": 1}, {"x": 2}]})]),
    (block(invoke("get_weather", tag("days", "three"), tag("city", "  spaced  "))), None,  # unparsable -> raw text
     [call(0, "get_weather", {"days": "three", "city": "  spaced  "})]),
    (block(invoke("unknown_tool", tag("n", "5"))), None, [call(0, "unknown_tool", {"n": "5"})]),  # no schema: str
    (block(invoke("search")), None, [call(0, "search", {})]),
    (block(invoke("search", tag("query", "x"), tag("query", "y"))), None, [call(0, "search", {"query": "x"})]),
    ("Before. " + block(WEATHER) + "\n\nAfter.", "Before.After.", [call(0, "get_weather", {"city": "Paris", "days": 3})]),
    (block(invoke("search", tag("query", "x")) + "stray text", invoke("search", tag("query", "y"))), None,
     [call(0, "search", {"query": "x"}), call(1, "search", {"query": "y"})]),  # noise between invokes dropped
    # an output cut inside a call: the call closes with what was read (finish_reason says it was cut)
    (f"{NS}<tool_call>\n{invoke('search', tag('query', 'x'))[:-len(NS + '</invoke>')]}{NS}<que", None,
     [call(0, "search", {"query": "x"})]),
    # cut inside a block before any call's name: the block's raw text comes back as content (as vLLM does)
    (f"Hi {NS}<tool_call>\n{NS}<invoke na", f"Hi{NS}<tool_call>\n{NS}<invoke na", []),
    (f"a partial {NS}<tool_ca", f"a partial {NS}<tool_ca", []),  # a marker that never completes is text
    ("no calls here, ] < [ minimax >", "no calls here, ] < [ minimax >", []),
]


@pytest.mark.parametrize("text,content,calls", CASES)
def test_tool_calls_table_every_split(text, content, calls):
    got = assert_every_split(text, TOOLS)
    assert (got.content, got.tool_calls) == (content, calls)
    if calls and content is not None and NS not in text[-20:]:
        assert NS not in content and "<invoke" not in content


def test_reasoning_then_calls_every_split():
    text = "<mm:think>\nThe user wants weather.\n</mm:think>\n\n" + block(WEATHER)
    got = assert_every_split(text, TOOLS, prompt="]~b]ai\n")
    assert got == ParsedMessage(None, "The user wants weather.", [call(0, "get_weather", {"city": "Paris", "days": 3})])
    got = assert_every_split(text[len("<mm:think>"):], TOOLS, prompt="]~b]ai\n<mm:think>")  # prefilled opener
    assert got.reasoning_content == "The user wants weather." and len(got.tool_calls) == 1
    # a call written inside the reasoning is reasoning
    inside = "<mm:think>" + block(WEATHER) + "</mm:think>done"
    assert streamed([inside], TOOLS) == ParsedMessage("done", block(WEATHER), [])


def test_tools_none_leaves_markup_as_content():
    """tool_choice "none" (no tools given to the parser): calls are not parsed."""
    text = "ok " + block(WEATHER)
    assert streamed([text], None) == ParsedMessage(text, None, [])


def test_stream_shape_header_then_fragments():
    p = ToolCallParser(TOOLS, lambda: "call_x")
    text = block(WEATHER)
    cut = text.index("Paris")
    first, second, end = p.feed(text[:cut]), p.feed(text[cut:]), p.finish()
    assert [(c.index, c.id, c.name, c.arguments) for c in first.tool_calls] == [(0, "call_x", "get_weather", "")]
    assert "".join(c.arguments for c in second.tool_calls) == '{"city": "Paris", "days": 3}'
    assert not first.content and not second.content and not end.tool_calls and p.num_calls == 1


@pytest.mark.parametrize("text,schema,value", [
    ("42", {"type": "integer"}, 42), ("-7", {"type": "number"}, -7), ("2.5", {"type": "number"}, 2.5),
    ("True", {"type": "boolean"}, True), ("null", {"type": ["string", "null"]}, None), ("x", {"type": "integer"}, "x"),
    ('{"a": 1}', {"type": "object"}, {"a": 1}), ("[1, 2]", {"type": "array"}, [1, 2]), ("", {"type": "object"}, {}),
    ("", {"type": "array"}, []), ("", {"type": "string"}, ""), ("5", {"enum": [1, 5]}, 5), ("5", None, "5"),
    ("inf", {"type": "number"}, "inf"), ("007", {"type": "string"}, "007"),
])
def test_leaf_conversion_by_schema(text, schema, value):
    assert convert_leaf(text, schema) == value and type(convert_leaf(text, schema)) is type(value)


def test_parse_output_offline_helper():
    m = parse_output("Sure. " + block(WEATHER), tools=TOOLS)
    assert m.content == "Sure." and json.loads(m.tool_calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 3}
    assert m.tool_calls[0]["id"].startswith("call_") and m.tool_calls[0]["type"] == "function"
