"""Structured output through the engine (CPU, the embedded pair), in both draft modes -- the default (drafts proposed
unmasked, the grammar masks only the target's verify positions, nothing read back inside the step) and
structured_draft_masks (the head masked too, K+1 reads per step, eager):

- greedy constrained decoding with speculation (K=1, 3) equals greedy constrained plain decoding token for token,
  overlap on and off, n=1 and n=2, over 20 schema x prompt cases plus choices and regexes; every output parses and
  validates; draft masks only raise acceptance;
- drafts that break the grammar are rejected without changing the output;
- sampled: with coupled verification (deterministic=True) a seed gives plain decoding's tokens; otherwise the
  output's distribution is plain decoding's (two-sample chi-square), also with every draft forced out of the grammar;
- a default-mode constrained step launches its target forward, then processes the previous step and builds its
  masks, then launches the finish; it reads nothing back inside either half and, with graph shapes forced on CPU
  (what CUDA does), takes a masked decode bucket -- the graph's path -- with the same tokens;
- n=2 samples each follow their own matcher; a terminated grammar stops the request; an uncompilable grammar is
  refused before anything is admitted."""

from __future__ import annotations

import json
import re
from collections import Counter

import jsonschema
import pytest
import torch

from m3eagle import LLM, SamplingParams
from m3eagle.engine.llm_engine import RequestError
from m3eagle.engine.model_runner import ModelRunner
from m3eagle.sampling.params import StructuredOutputsParams
from tests.helpers.engine_utils import assert_clean, chi2_sf

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


KW = dict(device="cpu", max_model_len=128, max_num_seqs=32)
# (K, overlap, structured_draft_masks) of the module's engines; K=0 has no drafts to mask.
KEYS = [(0, False, False), (0, True, False), (1, True, False), (3, False, False), (3, True, False),
        (1, True, True), (3, False, True), (3, True, True)]
SPEC = [key for key in KEYS if key[0]]
MODE_IDS = {False: "unmasked", True: "draft_masks"}


def _id(key) -> str:
    k, overlap, dm = key
    return f"K{k}-{'overlap' if overlap else 'sync'}-{MODE_IDS[dm]}"


@pytest.fixture(scope="module")
def llms(one_thread):
    made = {(k, ov, dm): LLM(num_draft_tokens=k, overlap=ov, structured_draft_masks=dm, **KW) for k, ov, dm in KEYS}
    yield made
    for llm in made.values():
        assert_clean(llm)


@pytest.fixture(scope="module")
def plain(llms):
    outs = _run(llms[(0, False, False)])
    _check_valid(outs, _so_cases())
    return [o.outputs[0].token_ids for o in outs]


def _acceptance(outs) -> tuple[int, int]:
    return sum(o.metrics.num_accepted for o in outs), sum(o.metrics.num_drafted for o in outs)


@pytest.mark.parametrize("key", [k for k in KEYS if k != (0, False, False)], ids=_id)
def test_greedy_constrained_speculative_equals_plain(llms, plain, key):
    llm = llms[key]
    outs = _run(llm)
    assert len(outs) == len(plain) >= 20
    assert [o.outputs[0].token_ids for o in outs] == plain
    _check_valid(outs, _so_cases())
    accepted, drafted = _acceptance(outs)
    if key[0]:  # unmasked drafts leave the grammar often, and the masked target still keeps some of them
        assert drafted and accepted > 0, (accepted, drafted)
    if key[2]:  # masked drafts: the head proposes in-grammar tokens, and the target keeps many of them
        assert accepted / drafted > 0.3, (accepted, drafted)


def test_draft_masks_only_raise_acceptance(llms, plain):
    """The head's masks change what is drafted, never what is emitted: both modes give plain decoding's output,
    and masked drafts are accepted more often (the embedded pair's head often leaves the grammar)."""
    rates = {}
    for dm in (False, True):
        outs = _run(llms[(3, False, dm)])
        assert [o.outputs[0].token_ids for o in outs] == plain
        accepted, drafted = _acceptance(outs)
        rates[dm] = accepted / drafted
    assert rates[True] > rates[False], rates


def _forced_out_of_grammar(monkeypatch, llm, letter: int) -> None:
    """Every draft becomes `letter` (greedy and sampled rows, either mode; a sampled row's q is one-hot on it, as
    a head sure of a token the grammar forbids would be)."""
    runner = llm.engine.runner
    vocab = llm.engine.target_cfg.vocab_size

    def greedy_ids(h_out, fused, out=None, scatter=None):
        ids = torch.full((h_out.shape[0],), letter, dtype=torch.int64)
        if out is not None:
            ids = out.copy_(ids)
        if scatter is not None:
            buf, rows, col = scatter
            buf[rows, col] = ids
        return ids

    def sampled(logits, st, pos, fused, drafts, step):
        q = torch.zeros(logits.shape[0], vocab)
        q[:, letter] = 1.0
        return drafts[:, step].fill_(letter), q

    def constrained(logits, mask, st, pos, any_random, drafts, step):
        q = torch.zeros(logits.shape[0], vocab)
        q[:, letter] = 1.0
        return drafts[:, step].fill_(letter), (q if any_random else None)

    monkeypatch.setattr(runner.draft, "greedy_ids", greedy_ids)
    monkeypatch.setattr(runner, "_draft_sample", sampled)
    monkeypatch.setattr(runner, "_draft_constrained", constrained)


@pytest.mark.parametrize("dm", [False, True], ids=MODE_IDS.get)
def test_drafts_outside_the_grammar_are_rejected_and_change_nothing(llms, plain, monkeypatch, dm):
    """Every draft is forced to a letter that no digit-only grammar allows: the masked target rejects each one
    (nothing accepted), and the output is still plain decoding's."""
    llm = llms[(3, True, dm)]
    _forced_out_of_grammar(monkeypatch, llm, llm.get_tokenizer().encode("Z")[0])
    cases = [(p, so) for p, so in _so_cases() if so.json == SCHEMAS[2]]  # arrays of integers
    cases += [(PROMPTS[0], StructuredOutputsParams(regex="[0-9]{6}"))]
    outs = _run(llm, cases)
    monkeypatch.undo()
    want = _run(llms[(0, False, False)], cases)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
    accepted, drafted = _acceptance(outs)
    assert drafted > 0 and accepted == 0


@pytest.mark.parametrize("dm", [False, True], ids=MODE_IDS.get)
def test_sampled_coupled_constrained_speculative_equals_plain(one_thread, dm):
    """deterministic=True couples verification to decoding without drafts (each emitted token is the target's
    own draw at its position): a constrained sampled request then gives plain decoding's tokens for its seed, in
    either draft mode -- masked target at every verify position, whatever the drafts."""
    cases = _so_cases()
    sps = [SamplingParams(temperature=0.9, seed=11 + i, max_tokens=MAX_TOKENS, structured_outputs=so)
           for i, (_, so) in enumerate(cases)]

    def run(**kw) -> list[list[int]]:
        llm = LLM(deterministic=True, **KW, **kw)
        outs = llm.generate([p for p, _ in cases], sps, use_tqdm=False)
        assert_clean(llm)
        return [o.outputs[0].token_ids for o in outs]

    want = run(num_draft_tokens=0)
    assert run(num_draft_tokens=3, overlap=True, structured_draft_masks=dm) == want


DIGITS = StructuredOutputsParams(regex="[0-9]{3}")
N_SAMPLED = 400


def _last_digits(llm: LLM, seed0: int) -> list[str]:
    """N_SAMPLED sampled 3-digit outputs (seeds seed0..): the last digit of each (emitted by a verify step when
    the engine drafts)."""
    sps = [SamplingParams(temperature=1.0, seed=seed0 + i, max_tokens=8, structured_outputs=DIGITS)
           for i in range(N_SAMPLED)]
    outs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(N_SAMPLED)], sps, use_tqdm=False)
    assert all(re.fullmatch("[0-9]{3}", o.outputs[0].text) for o in outs)
    return [o.outputs[0].text[-1] for o in outs]


@pytest.fixture(scope="module")
def plain_digits(one_thread):
    llm = LLM(num_draft_tokens=0, **{**KW, "max_num_seqs": 64})
    yield _last_digits(llm, 0)
    assert_clean(llm)


@pytest.mark.parametrize("forced", [False, True], ids=["head-drafts", "out-of-grammar-drafts"])
def test_sampled_constrained_speculative_follows_the_masked_target(plain_digits, monkeypatch, forced):
    """Unmasked drafts (the default), sampled with temperature 1: the distribution of the output's last digit
    equals plain constrained decoding's (two-sample chi-square over 400 seeds each; other seeds than plain's).
    Forced drafts outside the grammar with q one-hot on them are all rejected, and the residual max(0, p - q) is
    then the masked target itself."""
    llm = LLM(num_draft_tokens=3, overlap=True, **{**KW, "max_num_seqs": 64})
    if forced:
        _forced_out_of_grammar(monkeypatch, llm, llm.get_tokenizer().encode("Z")[0])
    got = _last_digits(llm, 10**6)
    a, b = Counter(plain_digits), Counter(got)
    cats = sorted(set(a) | set(b))
    big = [c for c in cats if a[c] + b[c] >= 10]  # the rare digits pooled into one category
    pairs = [(a[c], b[c]) for c in big] + [(sum(a[c] for c in cats if c not in big),
                                            sum(b[c] for c in cats if c not in big))]
    pairs = [(x, y) for x, y in pairs if x + y]
    chi2 = sum((x - y) ** 2 / (x + y) for x, y in pairs)  # equal sample sizes
    assert len(pairs) >= 4 and chi2_sf(chi2, len(pairs) - 1) > 1e-3, (chi2, pairs)
    monkeypatch.undo()
    assert_clean(llm)


@pytest.mark.parametrize("dm", [False, True], ids=MODE_IDS.get)
def test_sampled_n2_each_sample_has_its_own_matcher(llms, dm):
    cases = [(p, StructuredOutputsParams(json=s)) for s in SCHEMAS[:3] for p in PROMPTS[:2]]
    for key in ((3, True, dm), (0, False, False)):
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


@pytest.mark.parametrize("key", [(3, False, False), (3, True, False), (3, False, True), (3, True, True)], ids=_id)
def test_greedy_n2_samples_equal_n1(llms, plain, key):
    llm = llms[key]
    cases = _so_cases()[:4]
    outs = llm.generate([p for p, _ in cases], [_params(so, n=2) for _, so in cases], use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[t, t] for t in plain[:4]]


def test_terminated_grammar_stops_under_ignore_eos(llms):
    """With ignore_eos the EOS is no stop, but the grammar has ended: the request stops there ("stop")."""
    for key in ((0, False, False), (3, True, False), (3, True, True)):
        o = llms[key].generate(PROMPTS[0], _params(StructuredOutputsParams(choice=CHOICES), ignore_eos=True),
                               use_tqdm=False)[0].outputs[0]
        assert o.finish_reason == "stop" and o.text in CHOICES and o.token_ids[-1] == 0


def test_uncompilable_grammar_is_refused_before_anything_runs(llms):
    llm = llms[(3, True, False)]
    good = _params(StructuredOutputsParams(regex="[a-z]+"))
    for so, field in ((StructuredOutputsParams(regex="(ab"), "regex"),
                      (StructuredOutputsParams(json={"type": "no-such-type"}), "json"),
                      (StructuredOutputsParams(grammar="root ::= missing"), "grammar")):
        with pytest.raises(RequestError, match=rf"structured_outputs\.{field} cannot be compiled"):
            llm.generate(PROMPTS[:2], [good, _params(so)], use_tqdm=False)
        assert llm.engine.is_idle_and_clean()


@pytest.mark.parametrize("key", [(3, True, False), (3, True, True), (0, True, False)], ids=_id)
def test_constrained_request_joining_a_running_batch(llms, plain, key):
    """A constrained request arrives while unconstrained ones decode under overlap (steps in flight): the step in
    flight is processed first, both kinds share the following steps, and each output equals its own run alone
    (the unconstrained rows take all-allowed masks)."""
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = llms[key]
    eng, tok = llm.engine, llm.get_tokenizer()
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], free, use_tqdm=False)]
    reqs = [eng.add_request(tok.encode(p), free) for p in PROMPTS[:2]]
    for _ in range(3):
        eng.step()
    assert eng._pending is not None  # a step is in flight when the constrained request joins
    p, so = _so_cases()[0]
    late = eng.add_request(tok.encode(p), _params(so))
    eng.run()
    assert [r.output_token_ids for r in reqs] == alone
    assert late.output_token_ids == plain[0]
    assert_clean(llm)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_masks_are_built_while_the_target_forward_runs(llms, plain, monkeypatch, overlap):
    """A default-mode constrained step launches in two halves: its target forward (f), then -- under overlap --
    the previous step's outputs are processed (p) and the masks built from them, then the finish (F): the
    steady state runs f p F, the host's mask work beside the device's forward. Without overlap each step is
    processed after its finish (f F p). Same tokens either way."""
    llm = llms[(3, overlap, False)]
    eng = llm.engine
    events = []
    forward, finish, process = eng.graphs.forward, eng.graphs.finish, eng._process_iteration
    monkeypatch.setattr(eng.graphs, "forward", lambda *a: (events.append("f"), forward(*a))[1])
    monkeypatch.setattr(eng.graphs, "finish", lambda *a: (events.append("F"), finish(*a))[1])
    monkeypatch.setattr(eng, "_process_iteration", lambda *a: (events.append("p"), process(*a))[1])
    outs = _run(llm)
    monkeypatch.undo()
    assert [o.outputs[0].token_ids for o in outs] == plain
    order = "".join(events)
    steps = order.count("f")
    assert steps >= 10 and order.count("F") == steps
    if overlap:
        assert order.count("fpF") >= steps - 2, order
    else:
        assert order.count("fFp") == steps, order


# ---- the graph path: no read inside the step ---------------------------------------------------------------

_READS = ("tolist", "item", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__")


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_constrained_steps_read_nothing_back_and_take_masked_graph_buckets(one_thread, plain, monkeypatch,
                                                                         sampled):
    """graph_shapes=True and prefill_graphs=True force on CPU what CUDA does: every steady constrained step is padded
    to a decode bucket under the masked mode (the key of the graph CUDA would replay: the masks a static input,
    uploaded into the same buffer each step) and gives the unpadded engine's tokens; a prompt step with a
    constrained sampling row runs eagerly. No device value is read back (and no tensor is made from host data)
    inside either half of a step (`ModelRunner.forward` / `finish`: a read there would be a host sync on CUDA,
    and impossible inside a graph), in any step."""
    llm = LLM(num_draft_tokens=3, overlap=True, graph_shapes=True, prefill_graphs=True, **KW)
    eng = llm.engine
    assert eng.graphs.masked_modes
    cases = _so_cases()
    sps = ([SamplingParams(temperature=0.8, seed=5 + i, max_tokens=MAX_TOKENS, structured_outputs=so)
            for i, (_, so) in enumerate(cases)] if sampled else [_params(so) for _, so in cases])
    want = plain
    if sampled:
        ref = LLM(num_draft_tokens=3, overlap=True, **KW)
        want = [o.outputs[0].token_ids for o in ref.generate([p for p, _ in cases], sps, use_tqdm=False)]
        assert_clean(ref)
    seen, mask_ptrs = [], set()
    build, forward, finish = eng.graphs.build, ModelRunner.forward, ModelRunner.finish

    def spy_build(batch, bucket, masked=False):
        inp = build(batch, bucket, masked)
        seen.append((bucket, inp.mode))
        if inp.masked:
            mask_ptrs.add(inp.verify_mask.data_ptr())
        return inp

    def refuse(name):
        def read(self, *a, **kw):
            raise AssertionError(f"Tensor.{name}() inside ModelRunner.execute: a device read in the step")
        return read

    def guarded(half):
        def run(self, inp, *args):
            assert inp.grammar is None  # no host half rides in a default-mode step
            with pytest.MonkeyPatch.context() as m:
                for name in _READS:
                    m.setattr(torch.Tensor, name, refuse(name))
                for name in ("tensor", "as_tensor"):  # a tensor from host data: a pageable copy on CUDA
                    m.setattr(torch, name, refuse(name))
                return half(self, inp, *args)
        return run

    monkeypatch.setattr(eng.graphs, "build", spy_build)
    monkeypatch.setattr(ModelRunner, "forward", guarded(forward))  # execute() is forward + finish
    monkeypatch.setattr(ModelRunner, "finish", guarded(finish))
    outs = llm.generate([p for p, _ in cases], sps, use_tqdm=False)
    monkeypatch.undo()
    assert [o.outputs[0].token_ids for o in outs] == want
    masked_decode = [(b, m) for b, m in seen if isinstance(b, int) and m[3]]
    assert len(masked_decode) >= 10 and all(m[0] == sampled for _, m in masked_decode)
    assert any(b is None and m[3] for b, m in seen)  # the prompt step: eager
    assert mask_ptrs == {eng.buffers.masks.dev.data_ptr()}  # one static buffer, every step
    assert_clean(llm)
