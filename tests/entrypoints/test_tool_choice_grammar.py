"""tool_choice `required` and a named function, enforced by a grammar (entrypoints/parsers/tool_grammar.py):

- the grammar compiles with xgrammar against the embedded model's tokenizer, for named and required, several
  schemas and every reasoning position;
- hand-written MiniMax-M3 replies it accepts parse (entrypoints/parsers) into calls of the right function with
  typed arguments; replies it must refuse are refused (another function, missing markup, text after the block,
  a missing required parameter, a mistyped value, markers inside a string);
- end to end with the official openai client: the embedded model, never trained on tools, answers a named
  tool_choice with a call of that function (finish_reason tool_calls), equal to the non-speculative engine's
  output under the same grammar; a second structured output in the same request is a 400 naming it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import openai
import pytest
import xgrammar as xgr

from m3eagle import LLM, SamplingParams
from m3eagle.entrypoints.chat import ChatTemplate
from m3eagle.entrypoints.parsers import parse_output
from m3eagle.entrypoints.parsers.reasoning import prompt_position
from m3eagle.entrypoints.parsers.tool_calls import NS
from m3eagle.entrypoints.parsers.tool_grammar import tool_call_ebnf
from m3eagle.entrypoints.server import OpenAIServer, ServerThread
from m3eagle.entrypoints.tools import ToolChoice, tool_call_grammar
from m3eagle.loader.assets import default_model_paths
from m3eagle.loader.tokenizer import load_tokenizer
from m3eagle.sampling.params import StructuredOutputsParams
from m3eagle.sampling.structured import GrammarCompiler

TEMPLATE = (Path(__file__).parent / "fixtures" / "minimax_m3_tools.jinja").read_text()
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"type": "string", "enum": ["c", "f"]},
    "tags": {"type": "array", "items": {"type": "string"}},
    "loc": {"type": "object", "properties": {"lat": {"type": "number"}, "ok": {"type": "boolean"}},
            "required": ["lat"]}}, "required": ["city"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
    "query": {"type": "string"}, "limit": {"type": ["integer", "null"]}}}}}
PING = {"type": "function", "function": {"name": "ping"}}  # no parameters
TOOLS = [WEATHER, SEARCH, PING]
REASONING = [None, "inside", "before", "after"]
PROMPTS = {None: None, "inside": "]~b]ai\n<mm:think>", "before": "]~b]ai\n", "after": "]~b]ai\n</mm:think>"}


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(load_tokenizer(default_model_paths()[0]).tok, 8192, [0])


def accepts(compiler: GrammarCompiler, ebnf: str, text: str) -> bool:
    m = xgr.GrammarMatcher(compiler.compile(StructuredOutputsParams(grammar=ebnf)))
    return m.accept_string(text) and m.is_completed()


def P(tag: str) -> str:
    return NS + tag


def block(*invokes: str) -> str:
    return P("<tool_call>") + "\n" + "\n".join(invokes) + "\n" + P("</tool_call>")


def invoke(name: str, **params: str) -> str:
    return P(f'<invoke name="{name}">') + "".join(P(f"<{k}>") + v + P(f"</{k}>") for k, v in params.items()) + \
        P("</invoke>")


W1 = invoke("get_weather", city="Pa]ris <b>1</b>", days="-3", unit="f", tags=P("<item>a") + P("</item>") + "\n" +
            P("<item>b c") + P("</item>"), loc="\n" + P("<lat>1.5e3") + P("</lat>") + P("<ok>true") + P("</ok>"))
W2 = invoke("get_weather", city="")
S1 = invoke("search", query="m3 <mm:think", limit="null")
ARGS = {W1: ("get_weather", {"city": "Pa]ris <b>1</b>", "days": -3, "unit": "f", "tags": ["a", "b c"],
                             "loc": {"lat": 1500.0, "ok": True}}),
        W2: ("get_weather", {"city": ""}), S1: ("search", {"query": "m3 <mm:think", "limit": None}),
        invoke("ping"): ("ping", {})}


@pytest.mark.parametrize("reasoning", REASONING)
def test_grammar_compiles_for_named_and_required(compiler, reasoning):
    for name in (None, "get_weather", "search", "ping"):
        compiler.compile(StructuredOutputsParams(grammar=tool_call_ebnf(TOOLS, name, reasoning)))
    odd = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a/b": {"type": "string"}, "q\"uote": {"type": "string", "enum": ["x\"y", "é", 3, None, True, 1.5]},
        "deep": {"type": "object", "properties": {"d": {"type": "object", "properties": {"e": {"type": "array", "items": {
            "type": "object", "properties": {"f": {"type": "object", "properties": {"g": {"type": "integer"}}}}}}}}}},
        "any": {}, "one": {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "free": {"type": "object"}}}}}]
    compiler.compile(StructuredOutputsParams(grammar=tool_call_ebnf(odd, "f", reasoning)))


@pytest.mark.parametrize("reasoning", REASONING)
def test_accepted_replies_parse_to_the_right_calls(compiler, reasoning):
    lead = {None: "", "after": "\n", "inside": "I should call ]<]minimax[>[ get_weather. </mm:thin\n</mm:think>\n",
            "before": "<mm:think>Call it.</mm:think>\n"}[reasoning]
    required = tool_call_ebnf(TOOLS, None, reasoning)
    for calls in ([W1], [W2, S1], [invoke("ping"), W1, invoke("ping")]):
        reply = lead + block(*calls)
        assert accepts(compiler, required, reply), reply
        got = parse_output(reply, TOOLS, PROMPTS[reasoning], reasoning=reasoning is not None).tool_calls
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == [ARGS[c] for c in calls]
    named = tool_call_ebnf(TOOLS, "search", reasoning)
    assert accepts(compiler, named, lead + block(S1))
    if reasoning == "before":  # thinking is optional before the block, and a lone closer is allowed
        assert accepts(compiler, named, block(S1)) and accepts(compiler, named, "</mm:think>" + block(S1))


@pytest.mark.parametrize("reply", [
    block(W2),  # another function than the named one
    block(S1, S1),  # a named choice is one call
    "",  # nothing
    S1,  # an invoke without its block
    block(S1).replace(NS + "</tool_call>", ""),  # the block not closed
    block(S1) + "\nDone.",  # text after the block
    "Sure. " + block(S1),  # content before it
    block(invoke("search", query="a" + NS + "b")),  # the marker inside a string value
    block(invoke("search", limit="ten")),  # a mistyped value
    block(invoke("search", limit="3", query="x")),  # out of declared order
    block(invoke("search", extra="x")),  # an undeclared parameter
    block(invoke("search", query="x", limit="3", query_="y")),
    block(P('<invoke name="nope">') + P("</invoke>")),  # an unknown function
])
def test_refused_replies(compiler, reply):
    assert not accepts(compiler, tool_call_ebnf(TOOLS, "search", None), reply)


def test_refused_by_schema_and_reasoning(compiler):
    required = tool_call_ebnf(TOOLS, None, None)
    assert not accepts(compiler, required, block(invoke("get_weather", days="3")))  # city is required
    assert not accepts(compiler, required, block(invoke("get_weather", city="x", unit="kelvin")))
    assert not accepts(compiler, required, block(invoke("ping", x="1")))
    assert not accepts(compiler, required, "<mm:think>x</mm:think>" + block(W2))  # no reasoning parser
    inside = tool_call_ebnf(TOOLS, None, "inside")
    assert not accepts(compiler, inside, block(W2))  # the prefilled reasoning must close first
    assert not accepts(compiler, inside, "a</mm:think>b</mm:think>" + block(W2))
    # Skipping the thinking, a `<mm:think>` in a value would be read as reasoning: the grammar keeps it out
    before = tool_call_ebnf(TOOLS, None, "before")
    assert not accepts(compiler, before, block(invoke("search", query="a<mm:think>b")))
    nested = block(invoke("get_weather", city="x", tags=P("<item>a</item>b") + P("</item>")))
    assert not accepts(compiler, required, nested)  # the tree parser would close the item early


def test_free_text_excludes_exactly_the_markers(compiler):
    """A string value is any text without the namespace marker: random strings built from marker pieces."""
    ebnf = tool_call_ebnf([SEARCH], "search", None)
    rng = random.Random(0)
    pieces = ["]", "<", "[", ">", "m", "x", " ", "]<]", "minimax", "[>", "]<]minimax[>", NS]
    for _ in range(150):
        s = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))
        assert accepts(compiler, ebnf, block(invoke("search", query=s))) == (NS not in s), s


def test_tool_call_grammar_modes():
    assert tool_call_grammar(ToolChoice("auto"), TOOLS) is None and tool_call_grammar(ToolChoice("none"), TOOLS) is None
    assert "search" not in tool_call_grammar(ToolChoice("named", "get_weather"), TOOLS)
    assert "search" in tool_call_grammar(ToolChoice("required"), TOOLS, "before")


# ---- end to end ---------------------------------------------------------------------------------------

E2E_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}, "days": {"type": "integer"}},
    "required": ["unit"]}}}, SEARCH]
MSGS = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def served(one_thread):
    llm = LLM(device="cpu", num_draft_tokens=3, max_num_seqs=4, max_model_len=512)
    with ServerThread(OpenAIServer(llm, log_interval=0, chat_template=TEMPLATE)) as st:
        yield openai.OpenAI(base_url=st.url + "/v1", api_key="none", max_retries=0, timeout=60)
    assert llm.engine.is_idle_and_clean()


def test_named_choice_makes_the_model_call_it_spec_equals_plain(served):
    r = served.chat.completions.create(model="m3eagle-default", messages=MSGS, tools=E2E_TOOLS, temperature=0,
                                       max_tokens=256, tool_choice={"type": "function",
                                                                    "function": {"name": "get_weather"}})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and [t.function.name for t in c.message.tool_calls] == ["get_weather"]
    args = json.loads(c.message.tool_calls[0].function.arguments)
    assert args["unit"] in ("celsius", "fahrenheit") and set(args) <= {"unit", "days"}
    # the same prompt and grammar without speculation: token for token the same reply
    prompt = ChatTemplate(TEMPLATE).render(MSGS, True, False, E2E_TOOLS)
    grammar = tool_call_grammar(ToolChoice("named", "get_weather"), E2E_TOOLS, prompt_position(prompt))
    plain = LLM(device="cpu", num_draft_tokens=0, max_num_seqs=1, max_model_len=512)
    out = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=256, structured_outputs=StructuredOutputsParams(
        grammar=grammar)), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and r.usage.completion_tokens == len(out.token_ids)
    assert parse_output(out.text, E2E_TOOLS, prompt).tool_calls[0]["function"]["arguments"] == \
        c.message.tool_calls[0].function.arguments
    stream = served.chat.completions.create(model="m3eagle-default", messages=MSGS, tools=E2E_TOOLS, temperature=0,
                                            max_tokens=256, tool_choice="required", stream=True)
    names = [t.function.name for ch in stream for t in (ch.choices[0].delta.tool_calls or []) if t.function.name]
    assert names and set(names) <= {"get_weather", "search"}


def test_tool_choice_grammar_and_another_structured_output_is_a_400(served):
    with pytest.raises(openai.BadRequestError) as e:
        served.chat.completions.create(model="m3eagle-default", messages=MSGS, tools=E2E_TOOLS, tool_choice="required",
                                       max_tokens=8, response_format={"type": "json_object"})
    assert e.value.body["param"] == "response_format" and "tool_choice" in e.value.body["message"]
    r = served.chat.completions.create(model="m3eagle-default", messages=MSGS, tools=E2E_TOOLS, tool_choice="auto",
                                       max_tokens=8, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason in ("stop", "length")
