"""Structured output over HTTP with the official openai client: response_format (json_schema, json_object,
text) on chat completions, vLLM's structured_outputs / guided_* extras on completions, every output valid and
equal to the offline engine's; a grammar that cannot be compiled (or two constraints at once) is a 400 naming
the field, and the server serves on."""

from __future__ import annotations

import json
import re

import jsonschema
import openai  # a test extra
import pytest

from m3eagle import LLM, SamplingParams
from m3eagle.entrypoints.server import OpenAIServer, ServerThread
from m3eagle.sampling.params import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Who are you?"}]


@pytest.fixture(scope="module")
def served(one_thread):
    llm = LLM(device="cpu", num_draft_tokens=3, max_model_len=256, max_num_seqs=16)
    ref = llm.generate("def f(x):", SamplingParams(temperature=0, max_tokens=40,
                                                   structured_outputs=StructuredOutputsParams(json=SCHEMA)),
                       use_tqdm=False)[0].outputs[0].text
    with ServerThread(OpenAIServer(llm, log_interval=0)) as st:
        yield openai.OpenAI(base_url=st.url + "/v1", api_key="none", max_retries=0, timeout=60), ref
    assert llm.engine.is_idle_and_clean()


def test_response_format_json_schema_on_chat(served):
    client, _ = served
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(model="m3eagle-default", messages=MESSAGES, temperature=0, max_tokens=40,
                                       response_format=fmt)
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    assert r.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model="m3eagle-default", messages=MESSAGES, temperature=0,
                                            max_tokens=40, response_format=fmt, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == r.choices[0].message.content


def test_response_format_json_object_and_text(served):
    client, _ = served
    r = client.chat.completions.create(model="m3eagle-default", messages=MESSAGES, temperature=0, max_tokens=40,
                                       response_format={"type": "json_object"}, n=2, seed=3)
    for c in r.choices:
        assert isinstance(json.loads(c.message.content), dict)
    plain = client.chat.completions.create(model="m3eagle-default", messages=MESSAGES, temperature=0, max_tokens=8,
                                           response_format={"type": "text"})
    free = client.chat.completions.create(model="m3eagle-default", messages=MESSAGES, temperature=0, max_tokens=8)
    assert plain.choices[0].message.content == free.choices[0].message.content


def test_vllm_extras_on_completions_equal_offline(served):
    client, ref = served
    for extra in ({"guided_json": SCHEMA}, {"structured_outputs": {"json": SCHEMA}},
                  {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}}):
        r = client.completions.create(model="m3eagle-default", prompt="def f(x):", temperature=0, max_tokens=40,
                                      extra_body=extra)
        assert r.choices[0].text == ref
    r = client.completions.create(model="m3eagle-default", prompt="x =", temperature=0, max_tokens=20,
                                  extra_body={"guided_choice": ["alpha", "beta"]})
    assert r.choices[0].text in ("alpha", "beta")
    r = client.completions.create(model="m3eagle-default", prompt="x =", temperature=0, max_tokens=20,
                                  extra_body={"guided_regex": "[0-9]{2}-[a-z]{2}"})
    assert re.fullmatch("[0-9]{2}-[a-z]{2}", r.choices[0].text)
    r = client.completions.create(model="m3eagle-default", prompt="x =", temperature=0, max_tokens=20,
                                  extra_body={"guided_grammar": 'root ::= "on" | "off"'})
    assert r.choices[0].text in ("on", "off")


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"guided_regex": "(ab"}, "guided_regex"),
    ({"guided_grammar": "root ::= missing_rule"}, "guided_grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"guided_json": SCHEMA, "guided_regex": "a+"}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
])
def test_bad_grammars_are_400_naming_the_field(served, extra, param):
    client, _ = served
    for call in (lambda: client.completions.create(model="m3eagle-default", prompt="x", max_tokens=4,
                                                   extra_body=extra),
                 lambda: client.chat.completions.create(model="m3eagle-default", messages=MESSAGES, max_tokens=4,
                                                        extra_body=extra)):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.body["param"] == param, e.value.body
    assert client.completions.create(model="m3eagle-default", prompt="x", max_tokens=2).choices[0].text is not None
