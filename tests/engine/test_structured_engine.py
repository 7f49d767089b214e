"""Structured output through the engine (CPU, the embedded pair): greedy constrained decoding with speculation
(K=1, 3) equals greedy constrained plain decoding token for token, overlap on and off, over 20 schema x prompt
cases plus choices and regexes; every output parses and validates; drafts that break the grammar are rejected
without changing the output; n=2 samples each follow their own matcher; a terminated grammar stops the request;
an uncompilable grammar is refused before anything is admitted."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from m3eagle import LLM, SamplingParams
from m3eagle.engine.llm_engine import RequestError
from m3eagle.sampling.params import StructuredOutputsParams
from tests.helpers.engine_utils import assert_clean

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green", "blue"]}},
     "required": ["ok", "tag"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"point": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                         "y": {"type": "integer", "minimum": -9, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 3},
                                                "maxItems": 2}}, "required": ["items"], "additionalProperties": False},
]
PROMPTS = ["def parse(line):", "import os\n", "class Stack:", "x = [1, 2, 3]\n"]
CHOICES = ["yes", "no", "maybe not"]
REGEX = r"[0-9]{3}-[a-z]{2,5}"
MAX_TOKENS = 40


def _so_cases() -> list[tuple[str, StructuredOutputsParams]]:
    cases = [(p, StructuredOutputsParams(json=s)) for s in SCHEMAS for p in PROMPTS]  # 20
    cases += [(p, StructuredOutputsParams(choice=CHOICES)) for p in PROMPTS[:2]]
    cases += [(p, StructuredOutputsParams(regex=REGEX)) for p in PROMPTS[2:]]
    cases += [(PROMPTS[0], StructuredOutputsParams(json_object=True))]
    return cases


def _params(so: StructuredOutputsParams, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=so, **kw)


def _run(llm: LLM, cases=None, **kw) -> list:
    cases = cases or _so_cases()
    return llm.generate([p for p, _ in cases], [_params(so, **kw) for _, so in cases], use_tqdm=False)


def _check_valid(outs, cases) -> None:
    """Every output ends its grammar (finish "stop") and matches it: JSON parses and validates."""
    for o, (_, so) in zip(outs, cases):
        c = o.outputs[0]
        assert c.finish_reason == "stop", (so, c.text, c.finish_reason)
        if so.json is not None:
            jsonschema.validate(json.loads(c.text), so.json)
        elif so.json_object:
            assert isinstance(json.loads(c.text), dict)
        elif so.choice is not None:
            assert c.text in CHOICES
        else:
            assert re.fullmatch(REGEX, c.text), c.text


@pytest.fixture(scope="module")
def llms(one_thread):
    kw = dict(device="cpu", max_model_len=128, max_num_seqs=32)
    made = {(k, ov): LLM(num_draft_tokens=k, overlap=ov, **kw) for k, ov in ((0, False), (0, True), (1, True),
                                                                            (3, False), (3, True))}
    yield made
    for llm in made.values():
        assert_clean(llm)


@pytest.fixture(scope="module")
def plain(llms):
    outs = _run(llms[(0, False)])
    _check_valid(outs, _so_cases())
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("k, overlap", [(0, True), (1, True), (3, False), (3, True)])
def test_greedy_constrained_speculative_equals_plain(llms, plain, k, overlap):
    llm = llms[(k, overlap)]
    outs = _run(llm)
    assert len(outs) == len(plain) >= 20
    assert [o.outputs[0].token_ids for o in outs] == plain
    _check_valid(outs, _so_cases())
    if k:  # masked drafts: the head proposes in-grammar tokens, and the target keeps many of them
        drafted, accepted = sum(o.metrics.num_drafted for o in outs), sum(o.metrics.num_accepted for o in outs)
        assert drafted and accepted / drafted > 0.3, (accepted, drafted)


def test_drafts_outside_the_grammar_are_rejected_and_change_nothing(llms, plain, monkeypatch):
    """Every draft is forced to a letter that no digit-only grammar allows: the masked target rejects each one
    (nothing accepted), and the output is still plain decoding's."""
    llm = llms[(3, True)]
    letter = llm.get_tokenizer().encode("Z")[0]
    runner = llm.engine.runner

    def forced(logits, mask, st, pos, any_random, drafts, step):
        return drafts[:, step].fill_(letter), None

    monkeypatch.setattr(runner, "_draft_constrained", forced)
    cases = [(p, so) for p, so in _so_cases() if so.json == SCHEMAS[2]]  # arrays of integers
    cases += [(PROMPTS[0], StructuredOutputsParams(regex="[0-9]{6}"))]
    outs = _run(llm, cases)
    monkeypatch.undo()
    want = _run(llms[(0, False)], cases)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
    assert sum(o.metrics.num_drafted for o in outs) > 0 and sum(o.metrics.num_accepted for o in outs) == 0


def test_unmasked_drafts_give_the_same_output(llms, plain, monkeypatch):
    """The draft head's mask only raises acceptance: with it replaced by an all-allowed mask the output is the
    same (the target's K+1 masks decide), and fewer drafts are accepted."""
    from m3eagle.engine.structured_step import GrammarStep
    from m3eagle.sampling.structured import full_bitmask

    llm = llms[(3, False)]
    masked = _run(llm)
    monkeypatch.setattr(GrammarStep, "draft_mask", lambda self, depth, *a: full_bitmask(self.num_rows, self.vocab_size))
    outs = _run(llm)
    assert [o.outputs[0].token_ids for o in outs] == plain
    acc = [sum(o.metrics.num_accepted for o in x) for x in (masked, outs)]
    assert acc[1] < acc[0], acc


def test_sampled_n2_each_sample_has_its_own_matcher(llms):
    cases = [(p, StructuredOutputsParams(json=s)) for s in SCHEMAS[:3] for p in PROMPTS[:2]]
    for key in ((3, True), (0, False)):
        outs = llms[key].generate([p for p, _ in cases], [SamplingParams(temperature=1.0, seed=7 + i, n=2, max_tokens=64,
                                                          structured_outputs=so) for i, (_, so) in enumerate(cases)],
                                  use_tqdm=False)
        for o, (_, so) in zip(outs, cases):
            assert len(o.outputs) == 2
            for c in o.outputs:
                assert c.finish_reason in ("stop", "length")
                if c.finish_reason == "stop":
                    jsonschema.validate(json.loads(c.text), so.json)
        stopped = sum(c.finish_reason == "stop" for o in outs for c in o.outputs)
        assert stopped >= len(cases)  # most samples finish their (small) documents


def test_greedy_n2_samples_equal_n1(llms, plain):
    llm = llms[(3, True)]
    cases = _so_cases()[:4]
    outs = llm.generate([p for p, _ in cases], [_params(so, n=2) for _, so in cases], use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[t, t] for t in plain[:4]]


def test_terminated_grammar_stops_under_ignore_eos(llms):
    """With ignore_eos the EOS is no stop, but the grammar has ended: the request stops there ("stop")."""
    for key in ((0, False), (3, True)):
        o = llms[key].generate(PROMPTS[0], _params(StructuredOutputsParams(choice=CHOICES), ignore_eos=True),
                               use_tqdm=False)[0].outputs[0]
        assert o.finish_reason == "stop" and o.text in CHOICES and o.token_ids[-1] == 0


def test_uncompilable_grammar_is_refused_before_anything_runs(llms):
    llm = llms[(3, True)]
    good = _params(StructuredOutputsParams(regex="[a-z]+"))
    for so, field in ((StructuredOutputsParams(regex="(ab"), "regex"),
                      (StructuredOutputsParams(json={"type": "no-such-type"}), "json"),
                      (StructuredOutputsParams(grammar="root ::= missing"), "grammar")):
        with pytest.raises(RequestError, match=rf"structured_outputs\.{field} cannot be compiled"):
            llm.generate(PROMPTS[:2], [good, _params(so)], use_tqdm=False)
        assert llm.engine.is_idle_and_clean()


def test_constrained_request_joining_a_running_batch(llms, plain):
    """A constrained request arrives while unconstrained ones decode under overlap (steps in flight): the step in
    flight is processed first, both kinds share the following steps, and each output equals its own run alone
    (the unconstrained rows take all-allowed masks)."""
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for key in ((3, True), (0, True)):
        llm = llms[key]
        eng, tok = llm.engine, llm.get_tokenizer()
        alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], free, use_tqdm=False)]
        reqs = [eng.add_request(tok.encode(p), free) for p in PROMPTS[:2]]
        for _ in range(3):
            eng.step()
        assert eng._pending is not None or not key[1]  # a step is in flight when the constrained request joins
        p, so = _so_cases()[0]
        late = eng.add_request(tok.encode(p), _params(so))
        eng.run()
        assert [r.output_token_ids for r in reqs] == alone
        assert late.output_token_ids == plain[0]
        assert_clean(llm)
