"""Tool calls and reasoning over HTTP with the official openai client, against the embedded model served in-process
with a MiniMax-M3-format chat template (tests/entrypoints/fixtures). What the model "writes" is scripted
(tests/helpers/scripted.py), split so that markers fall across chunks:

- tools are rendered by the template, earlier calls and tool results too; replies come back as tool_calls
  (finish_reason "tool_calls"), reasoning_content and content, and the streamed deltas add up to the
  non-streamed message; markup never reaches content;
- tool_choice none (rendered, not parsed), auto, required and named (their grammar attached; a scripted reply is
  checked after the fact, never a 400);
- bad tools / tool_choice / history get a 400 naming the field;
- one real (unscripted) request with tools through the engine;
- LLM.chat(tools=...) renders them offline.
"""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from m3eagle import LLM, SamplingParams
from m3eagle.engine.llm_engine import RequestError
from m3eagle.entrypoints.chat import ChatTemplate
from m3eagle.entrypoints.parsers import parse_output
from m3eagle.entrypoints.parsers.tool_calls import NS
from m3eagle.entrypoints.server import OpenAIServer, ServerThread
from tests.entrypoints.test_server import http
from tests.helpers.scripted import chunked, scripted

TEMPLATE = (Path(__file__).parent / "fixtures" / "minimax_m3_tools.jinja").read_text()
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}}}}},
         {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
             "query": {"type": "string"}}}}}]
MSGS = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
CALL = (f"{NS}<tool_call>\n{NS}<invoke name=\"get_weather\">{NS}<city>Paris{NS}</city>{NS}<days>3{NS}</days>"
        f"{NS}</invoke>\n{NS}</tool_call>")
REPLY = "<mm:think>\nThe user wants the weather.\n</mm:think>\n\nLet me look.\n" + CALL


@pytest.fixture(scope="module")
def st(one_thread):
    llm = LLM(device="cpu", max_num_seqs=8, max_model_len=512)
    server = OpenAIServer(llm, log_interval=0, chat_template=TEMPLATE)
    with ServerThread(server) as s:
        yield s


def client(st: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=st.url + "/v1", api_key="none", max_retries=0, timeout=60)


def assemble(chunks) -> dict[int, dict]:
    """Streamed chunks -> per choice: content, reasoning, tool calls (name, arguments, id) and finish_reason."""
    out: dict[int, dict] = {}
    for ch in chunks:
        for c in ch.choices:
            o = out.setdefault(c.index, {"content": "", "reasoning": "", "calls": {}, "finish": None})
            d = c.delta
            o["content"] += d.content or ""
            o["reasoning"] += (d.model_extra or {}).get("reasoning_content") or ""
            for t in d.tool_calls or []:
                e = o["calls"].setdefault(t.index, {"id": None, "name": None, "arguments": ""})
                if t.id:
                    assert e["id"] is None, "a call's id and name come once"
                    e.update(id=t.id, name=t.function.name)
                e["arguments"] += t.function.arguments or ""
            o["finish"] = c.finish_reason or o["finish"]
            assert NS not in (d.content or "") and "<invoke" not in (d.content or "")
    return out


def test_tool_call_and_reasoning_whole_and_streamed(st):
    c = client(st)
    with scripted(st.server, chunked(REPLY, 5), chunked(REPLY, 3)) as s:
        r = c.chat.completions.create(model="m3eagle-default", messages=MSGS, tools=TOOLS, max_tokens=64)
        chunks = list(c.chat.completions.create(model="m3eagle-default", messages=MSGS, tools=TOOLS, max_tokens=64,
                                                stream=True, n=2))
    assert "<tools>" in s.prompts[0] and '"name": "get_weather"' in s.prompts[0] and s.prompts[0] == s.prompts[1]
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.content == "Let me look."
    assert m.model_extra["reasoning_content"] == "The user wants the weather."
    assert len(m.tool_calls) == 1 and m.tool_calls[0].type == "function" and m.tool_calls[0].id.startswith("call_")
    assert m.tool_calls[0].function.name == "get_weather"
    assert json.loads(m.tool_calls[0].function.arguments) == {"city": "Paris", "days": 3}
    got = assemble(chunks)
    assert sorted(got) == [0, 1]
    for o in got.values():  # each of the n=2 choices streamed the same message
        assert (o["content"], o["reasoning"], o["finish"]) == ("Let me look.", "The user wants the weather.", "tool_calls")
        assert [(e["name"], e["arguments"]) for e in o["calls"].values()] == [
            ("get_weather", m.tool_calls[0].function.arguments)]


def test_tool_choice_variants(st):
    c = client(st)
    plain = ["It is sunny."]
    kw = dict(model="m3eagle-default", messages=MSGS, tools=TOOLS, max_tokens=64)
    with scripted(st.server, chunked(CALL, 4), chunked(CALL, 4), plain, chunked(CALL, 7), plain) as s:
        none = c.chat.completions.create(**kw, tool_choice="none")
        auto = c.chat.completions.create(**kw, tool_choice="auto")
        required_unmet = c.chat.completions.create(**kw, tool_choice="required")
        named = c.chat.completions.create(**kw, tool_choice={"type": "function", "function": {"name": "get_weather"}})
        named_unmet = c.chat.completions.create(**kw, tool_choice={"type": "function", "function": {"name": "search"}})
    assert all("<tools>" in p for p in s.prompts)  # "none" still renders the tools (vLLM's default)
    assert none.choices[0].message.content == CALL and not none.choices[0].message.tool_calls
    assert none.choices[0].finish_reason == "stop"
    assert auto.choices[0].message.tool_calls[0].function.name == "get_weather"
    # required / named carry their grammar; a scripted reply bypasses it, so the check after the fact logs the
    # miss and the reply comes back as written, never a 400
    assert [p.structured_outputs is not None and p.structured_outputs.kind == "grammar" for p in s.params] == [
        False, False, True, True, True]
    assert required_unmet.choices[0].message.content == "It is sunny." and required_unmet.choices[0].finish_reason == "stop"
    assert named.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert named_unmet.choices[0].message.content == "It is sunny."


def test_history_with_calls_and_results_is_rendered(st):
    msgs = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 3})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24C"}]
    with scripted(st.server, ["Sunny, 24C."]) as s:
        r = client(st).chat.completions.create(model="m3eagle-default", messages=msgs, tools=TOOLS, max_tokens=16)
    assert r.choices[0].message.content == "Sunny, 24C." and r.choices[0].finish_reason == "stop"
    assert f'{NS}<invoke name="get_weather">{NS}<city>Paris{NS}</city>{NS}<days>3{NS}</days>' in s.prompts[0]
    assert "]~b]tool\n<response>sunny, 24C</response>" in s.prompts[0]


def test_thinking_prefilled_by_the_template(st):
    with scripted(st.server, chunked("I plan.</mm:think>\nAnswer.", 2)) as s:
        r = client(st).chat.completions.create(model="m3eagle-default", messages=MSGS, max_tokens=16,
                                               extra_body={"chat_template_kwargs": {"thinking_mode": "enabled"}})
    assert s.prompts[0].endswith("<mm:think>")
    assert (r.choices[0].message.content, r.choices[0].message.model_extra["reasoning_content"]) == ("Answer.", "I plan.")


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": "get_weather"}, "tools"),
    ({"tools": []}, "tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools[2].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "messages": MSGS + [{"role": "assistant", "content": None, "tool_calls": [{"type": "function",
      "function": {"name": "search", "arguments": "{not json"}}]}]}, "messages[1].tool_calls[0].function.arguments"),
])
def test_bad_tools_are_400_naming_the_field(st, body, param):
    code, err = http(st, "POST", "/v1/chat/completions", {"messages": MSGS, "max_tokens": 4, **body})
    assert code == 400 and err["error"]["param"] == param, err


def test_real_engine_request_with_tools(st):
    """Unscripted: the embedded model answers a tools request through the engine; whatever it writes, the reply
    is well-formed and markup-free."""
    r = client(st).chat.completions.create(model="m3eagle-default", messages=MSGS, tools=TOOLS, max_tokens=8,
                                           temperature=0)
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length") and NS not in (c.message.content or "")
    assert r.usage.completion_tokens >= 1


def test_llm_chat_renders_tools_offline():
    llm = LLM(device="cpu", max_model_len=512)
    llm._chat_template = ChatTemplate(TEMPLATE)
    out = llm.chat(MSGS, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False, tools=TOOLS)[0]
    assert "<tools>" in out.prompt and '"name": "search"' in out.prompt
    assert parse_output(CALL, TOOLS, out.prompt).tool_calls[0]["function"]["name"] == "get_weather"
    with pytest.raises(RequestError, match=r"tools\[0\]\.function\.name"):
        llm.chat(MSGS, use_tqdm=False, tools=[{"type": "function", "function": {}}])
