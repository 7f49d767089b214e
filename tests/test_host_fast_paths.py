"""The host step's fast paths equal the plain ones they sit beside.

- `LLMEngine._extend` (a step's tokens appended in one go when `_may_stop` says nothing can end the output
  inside them) against `_append`'s per-token checks: random multi-token steps with stop ids, EOS, stop
  strings, min_tokens, max_tokens, max_model_len and logprobs, on both detokenizers;
- end to end with speculation (the embedded model's trained head, so verify steps accept several tokens):
  stops placed inside multi-token steps, the per-token path forced against the default, same outputs and
  the same streaming deltas;
- `SlotParams`: the staged per-row sampling values equal the params' own, when requests come, go, share
  slots over time and carry another mode.
"""

from __future__ import annotations

import random
import warnings
from types import SimpleNamespace

import pytest
import torch
from engine_utils import assert_clean
from test_default_model import TARGET

from m3eagle import LLM, SamplingParams
from m3eagle.engine.request import Logprob

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def default_llms():
    """Two engines on the embedded model (tokenizer, trained head, K=3): the default one and one whose
    `_may_stop` always says yes, so every step takes `_append`'s per-token path."""
    fast = LLM(device="cpu", num_draft_tokens=3, max_model_len=256)
    plain = LLM(device="cpu", num_draft_tokens=3, max_model_len=256)
    plain.engine._may_stop = lambda req, tokens: True
    return fast, plain


def _state(req) -> tuple:
    lps = [sorted((t, v.logprob, v.rank) for t, v in d.items()) for d in req.logprobs]
    return (list(req.output_token_ids), req.finish_reason, req.stop_reason, req.text, lps,
            req.detok.pending if req.detok is not None else None, req.num_computed)


PARAMS = [
    dict(max_tokens=9, ignore_eos=True),
    dict(max_tokens=40, stop_token_ids=[7, 11], ignore_eos=True),
    dict(max_tokens=40, stop_token_ids=[7], min_tokens=5, ignore_eos=True),
    dict(max_tokens=40),  # EOS (id 0) stops
    dict(max_tokens=40, min_tokens=4),
    dict(max_tokens=40, stop=["ST"], ignore_eos=True),
    dict(max_tokens=40, stop=["ST", "T"], include_stop_str_in_output=True, min_tokens=3, ignore_eos=True),
    dict(max_tokens=40, logprobs=2, stop_token_ids=[7], ignore_eos=True),
    dict(max_tokens=500, ignore_eos=True),  # max_model_len ends it
]


@pytest.mark.parametrize("stream_text", [True, False])
def test_extend_equals_append_on_random_multi_token_steps(default_llms, stream_text):
    """Random steps of 1..4 tokens drawn from stop ids, EOS, stop-string characters and others; the default
    dispatch (`_extend` where `_may_stop` is False) and the per-token path leave identical requests and
    identical deltas after every step. Both paths are taken."""
    fast, plain = (llm.engine for llm in default_llms)
    tok = fast.tokenizer
    s_id, t_id = tok.encode("S")[0], tok.encode("T")[0]
    pool = [0, 7, 11, s_id, t_id, 40, 41, 42, 43, 44, 45]
    rng = random.Random(5)
    calls = {"extend": 0, "append": 0}
    extend, append = fast._extend, fast._append

    def count(name, f):
        def wrapped(*a):
            calls[name] += 1
            return f(*a)
        return wrapped

    fast._extend, fast._append = count("extend", extend), count("append", append)
    try:
        for _ in range(12):
            for p in PARAMS:
                prompt = [rng.randrange(3, 200) for _ in range(rng.choice([5, 200]))]
                reqs = [eng.add_request(list(prompt), SamplingParams(temperature=0, **p), stream_text=stream_text)
                        for eng in (fast, plain)]
                for eng in (fast, plain):
                    eng._admit()
                while not reqs[0].finished:
                    n = rng.randint(1, 4)
                    toks = [rng.choice(pool) for _ in range(n)]
                    lps = ([{t: Logprob(-0.5 * j, 1, None), 99: Logprob(-9.0, 2, None)} for j, t in enumerate(toks)]
                           if p.get("logprobs") is not None else None)
                    row = SimpleNamespace(samples=True, num_drafts=n - 1, num_tokens=n)
                    for eng, req in zip((fast, plain), reqs):
                        eng._process_row(req, row, list(toks), lps)
                    assert _state(reqs[0]) == _state(reqs[1])
                    d_fast, d_plain = fast._collect(), plain._collect()
                    assert [(d.token_ids, d.text, d.finish_reason, d.num_output_tokens) for d in d_fast] == \
                        [(d.token_ids, d.text, d.finish_reason, d.num_output_tokens) for d in d_plain]
                assert reqs[1].finished
    finally:
        fast._extend, fast._append = extend, append
    assert calls["extend"] > 50 and calls["append"] > 50, calls
    assert fast.counters.accepted_per_pos == plain.counters.accepted_per_pos


def test_extend_is_transactional(default_llms):
    """A detokenizer fault inside `_extend` leaves the request exactly as it was (and fails it, not the
    engine), like `_append`."""
    eng = default_llms[0].engine
    req = eng.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    eng._admit()
    row = SimpleNamespace(samples=True, num_drafts=2, num_tokens=3)
    eng._process_row(req, row, [40, 41, 42], None)
    before, det = _state(req), req.detok

    class Faulty:
        """The request's detokenizer, whose fork fails half-way through a step's tokens."""

        stop = ()

        def __init__(self, inner):
            self.inner = inner

        def fork(self):
            return Faulty(self.inner.fork())

        def extend(self, token_ids):
            self.inner.add(token_ids[0])
            raise RuntimeError("tokenizer fault")

    req.detok = Faulty(det)
    with pytest.raises(RuntimeError):
        eng._extend(req, [43, 44, 45], None)
    assert req.detok.inner is det
    req.detok = det
    assert _state(req) == before
    eng.abort(req.request_id)
    eng._collect()


def _chunks(llm: LLM, prompts: list[list[int]], sp: SamplingParams) -> list[list[list[int]]]:
    """Each request's tokens as its steps delivered them (one delta per step)."""
    eng = llm.engine
    reqs = [eng.add_request(list(p), sp) for p in prompts]
    chunks: dict[str, list[list[int]]] = {r.request_id: [] for r in reqs}
    while eng.has_work():
        for d in eng.step():
            if d.token_ids:
                chunks[d.request_id].append(d.token_ids)
    return [chunks[r.request_id] for r in reqs]


def _run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[list, list]:
    eng = llm.engine
    reqs = [eng.add_request(list(p), sp) for p, sp in zip(prompts, params)]
    deltas = []
    while eng.has_work():
        deltas += [(d.request_id, d.token_ids, d.text, d.finish_reason, d.num_output_tokens,
                    None if d.logprobs is None else [sorted(x) for x in d.logprobs]) for d in eng.step()]
    outs = [(r.output_token_ids, r.finish_reason, r.stop_reason, r.text, r.num_accepted, r.accepted_per_position)
            for r in reqs]
    return outs, [d[1:] for d in deltas]


def test_stops_inside_verify_steps_equal_the_per_token_path(default_llms):
    """Speculation with the trained head: steps deliver several tokens. A stop id, a stop string, max_tokens
    and min_tokens placed inside such a step give the same outputs, finish reasons, text, logprobs,
    acceptance and streamed deltas with the fast path as with the per-token path."""
    from m3eagle.training.evaluate import stdlib_code_prompts
    from m3eagle.training.tokenizer import load_tokenizer

    fast, plain = default_llms
    prompts = [p.ids for p in stdlib_code_prompts(load_tokenizer(TARGET), 6, seed=7)]
    ref = _chunks(fast, prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    params = []
    for i, chunks in enumerate(ref):
        flat = [t for c in chunks for t in c]
        # a position strictly inside a multi-token step (not its last token) whose token is new so far
        at, pos = None, 0
        for c in chunks:
            for j, t in enumerate(c[:-1]):
                if at is None and len(c) > 1 and t not in flat[:pos + j]:
                    at = pos + j
            pos += len(c)
        assert at is not None, chunks  # the trained head accepts drafts: some step delivered several tokens
        stop_text = fast.engine.tokenizer.decode([flat[at]]).strip()
        kind = i % 4
        if kind == 0:
            params.append(SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[flat[at]], ignore_eos=True))
        elif kind == 1:
            params.append(SamplingParams(temperature=0, max_tokens=at + 1, ignore_eos=True, logprobs=1))
        elif kind == 2 and stop_text:
            params.append(SamplingParams(temperature=0, max_tokens=40, stop=[stop_text], ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[flat[at]],
                                         min_tokens=at + 2, ignore_eos=True))
    before = [llm.engine.counters.snapshot() for llm in (fast, plain)]
    got_fast, got_plain = _run(fast, prompts, params), _run(plain, prompts, params)
    assert got_fast == got_plain
    assert any(len(o[0]) < 40 and o[1] == "stop" for o in got_fast[0])
    (f0, p0), (f1, p1) = before, (fast.engine.counters, plain.engine.counters)
    assert [a - b for a, b in zip(f1.accepted_per_pos, f0.accepted_per_pos)] == \
        [a - b for a, b in zip(p1.accepted_per_pos, p0.accepted_per_pos)]
    assert f1.num_drafts - f0.num_drafts == p1.num_drafts - p0.num_drafts > 0
    assert_clean(fast)
    assert_clean(plain)


def test_slot_params_stage_each_rows_own_values():
    """Requests take and give back slots in random order with random params; every build stages exactly
    each row's own seed / top_k / temperature / top_p / min_p / greedy and the mode of its rows (the
    entries of a slot are re-read when another request turns up in it)."""
    from m3eagle.engine.input_builder import StepBuffers, build_step_input
    from m3eagle.engine.scheduler import ScheduledBatch, ScheduledRow
    from m3eagle.sampling.params import GREEDY_EPS

    rng = random.Random(3)
    bufs = StepBuffers(max_tokens=64, max_rows=8, table_width=4, device=torch.device("cpu"))
    held: dict[int, SimpleNamespace] = {}
    for _ in range(200):
        for s in range(8):
            if s not in held or rng.random() < 0.3:  # the slot's request leaves; a new one takes it
                p = SamplingParams(temperature=rng.choice([0.0, 1e-6, 0.7, 1e300]), top_k=rng.choice([0, 5]),
                                   top_p=rng.choice([1.0, 0.3]), min_p=rng.choice([0.0, 0.1]),
                                   logprobs=rng.choice([None, 1]), presence_penalty=rng.choice([0.0, 0.0, 0.5]))
                held[s] = SimpleNamespace(slot=s, seed=rng.randrange(2**63), params=p, pages=[1],
                                          prompt_token_ids=[1, 2], fork_len=0, fork_src=None)
        slots = rng.sample(range(8), rng.randint(1, 8))
        rows = [ScheduledRow(held[s], 2, [0], 0, True, True, False, 0) for s in slots]
        with warnings.catch_warnings():  # temperature 1e300 is inf in float32 (numpy says so, once per request)
            warnings.simplefilter("ignore", RuntimeWarning)
            inp = build_step_input(ScheduledBatch(rows, []), 4, 4, torch.device("cpu"), bufs, pad_rows_to=8)
        ps = [held[s].params for s in slots]
        n = len(slots)
        st = inp.sampling
        assert st.seed.tolist() == [held[s].seed for s in slots] + [0] * (8 - n)
        assert st.top_k.tolist() == [p.top_k for p in ps] + [0] * (8 - n)
        want = torch.tensor([p.temperature for p in ps] + [0.0] * (8 - n), dtype=torch.float64).float()
        assert torch.equal(st.temperature, want)
        assert st.top_p.tolist() == torch.tensor([p.top_p for p in ps] + [1.0] * (8 - n)).float().tolist()
        assert st.min_p.tolist() == torch.tensor([p.min_p for p in ps] + [0.0] * (8 - n)).float().tolist()
        assert st.greedy.tolist() == [p.temperature < GREEDY_EPS for p in ps] + [True] * (8 - n)
        assert (inp.any_random, inp.want_logprobs, inp.penalties is not None) == (
            any(not p.greedy for p in ps), any(p.logprobs is not None for p in ps), any(p.has_penalties for p in ps))
        assert bufs.step_mode(rows) == (inp.any_random, inp.want_logprobs, inp.penalties is not None)
        assert inp.row_slot.tolist() == slots + [0] * (8 - n)
