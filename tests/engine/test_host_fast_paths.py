"""The host step's fast paths equal the plain ones they sit beside.

- `LLMEngine._extend` (a step's tokens appended in one go when `_may_stop` says nothing can end the output
  inside them) against `_append`'s per-token checks: random multi-token steps with stop ids, EOS, stop
  strings, min_tokens, max_tokens, max_model_len and logprobs, on both detokenizers;
- end to end with speculation (the embedded model's trained head, so verify steps accept several tokens):
  stops placed inside multi-token steps, the per-token path forced against the default, same outputs and
  the same streaming deltas;
- `SlotParams`: the staged per-row sampling values equal the params' own, when requests come, go, share
  slots over time and carry another mode;
- `LLMEngine._process_plain` (steady rows' tight path, the projection adjusted instead of recomputed) and
  `Scheduler._schedule_steady` against the per-row path and the general plan, end to end with the device
  replaced by random multi-token outputs: requests with every kind of stop entering, finishing, aborted and
  preempted, samples of n, logprobs, overlap on and off; identical deltas, request and scheduler state,
  page ids, speculation counters, and the per-position counts the per-position increments gave;
- `Scheduler._schedule_steady` against `Scheduler._schedule` on copies of random scheduler states (pages
  short, budget short, requests waiting, finished, in flight);
- `IncrementalDetokenizer.extend` against `add` token by token; the speculation histograms against
  per-position counts.
"""

from __future__ import annotations

import copy
import random
import warnings
from types import SimpleNamespace

import pytest
import torch

from m3eagle import LLM, SamplingParams
from m3eagle.engine.request import Logprob, Request, Status, per_position_counts
from m3eagle.engine.scheduler import NeedSync, Scheduler
from m3eagle.kvcache.page_pool import PagePool
from tests.entrypoints.test_default_model import TARGET
from tests.helpers.engine_utils import assert_clean

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def default_llms():
    """Two engines on the embedded model (tokenizer, trained head, K=3): the default one and one without the
    fast paths and whose `_may_stop` always says yes, so every step takes `_append`'s per-token path."""
    fast = LLM(device="cpu", num_draft_tokens=3, max_model_len=256)
    plain = LLM(device="cpu", num_draft_tokens=3, max_model_len=256)
    _plain(plain.engine)
    plain.engine._may_stop = lambda req, tokens: True
    return fast, plain


def _plain(eng) -> None:
    """Turn the engine's fast paths off: every row takes `_process_row`, every plan the general loop."""
    eng.fast_paths = False
    eng.scheduler.fast_path = False


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

        def extended(self, token_ids):
            new = self.fork()
            new.extend(token_ids)
            return new

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


class _OracleDrafts:
    """Within the block, every sampling row's K drafts are the target's own greedy continuation (`seqs`: prompt
    -> prompt + greedy output), written over what the head proposed: under greedy verification each draft
    is accepted, so steps deliver K + 1 tokens whatever the trained head would have guessed. Greedy outputs
    do not depend on the drafts (verification is lossless), so `seqs` stays the truth inside the block."""

    def __init__(self, llm: LLM, seqs: dict[tuple[int, ...], list[int]]):
        self.runner, self.eng, self.seqs = llm.engine.runner, llm.engine, seqs

    def __enter__(self) -> _OracleDrafts:
        runner, orig = self.runner, self.runner._draft

        def draft(inp, meta, aux, s, last_idx, shifted, at, at_slots):
            drafts = orig(inp, meta, aux, s, last_idx, shifted, at, at_slots)  # [B, K]; the head's caches as usual
            by_slot = {r.slot: r for r in self.eng.scheduler.running}
            # at[0]: position of the row's last accepted input token; the bonus token the step sampled sits
            # at at[0] + 1, so draft j is the token at at[0] + 2 + j
            for i, (slot, pos) in enumerate(zip(s.tolist(), at[0].tolist())):
                req = by_slot.get(slot)
                if req is not None:
                    seq = self.seqs[tuple(req.prompt_token_ids)]
                    drafts[i] = torch.tensor([seq[p] if p < len(seq) else 0
                                              for p in range(pos + 2, pos + 2 + drafts.shape[1])])
            runner.slot_drafts.index_copy_(0, s, drafts)
            return drafts

        runner._draft = draft
        return self

    def __exit__(self, *exc) -> None:
        del self.runner._draft  # the class's method again


def test_stops_inside_verify_steps_equal_the_per_token_path(default_llms):
    """Speculation with steps that deliver several tokens -- forced: the drafts are the target's own greedy
    continuation (`_OracleDrafts`), so every draft is accepted. A stop id, a stop string, max_tokens and
    min_tokens placed inside such a step give the same outputs, finish reasons, text, logprobs, acceptance
    and streamed deltas with the fast path as with the per-token path."""
    from m3eagle.training.evaluate import stdlib_code_prompts
    from m3eagle.training.tokenizer import load_tokenizer

    fast, plain = default_llms
    prompts = [p.ids for p in stdlib_code_prompts(load_tokenizer(TARGET), 6, seed=7)]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    seqs = {tuple(p): list(p) + [t for c in chunks for t in c] for p, chunks in zip(prompts, _chunks(fast, prompts, greedy))}
    with _OracleDrafts(fast, seqs), _OracleDrafts(plain, seqs):
        _test_stops_inside_verify_steps(fast, plain, prompts, seqs)


def _test_stops_inside_verify_steps(fast: LLM, plain: LLM, prompts: list[list[int]], seqs: dict) -> None:
    ref = _chunks(fast, prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert [list(p) + [t for c in chunks for t in c] for p, chunks in zip(prompts, ref)] == list(seqs.values())
    assert max(len(c) for chunks in ref for c in chunks) == fast.engine.k + 1  # the oracle's drafts were taken
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
        assert at is not None, chunks  # the oracle's drafts: steps deliver several tokens
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


def test_a_graph_step_looks_its_rows_up_once(monkeypatch):
    """The GraphRunner asks for a step's mode (its graph key) and then builds its inputs from the same rows:
    the slot entries are looked up once for both, and looked up again for the next build (the memo lives
    for one step: a slot that changes hands between steps is re-read)."""
    from m3eagle.engine.input_builder import SlotParams, StepBuffers, build_step_input
    from m3eagle.engine.scheduler import ScheduledBatch, ScheduledRow

    calls = []
    real = SlotParams.rows
    monkeypatch.setattr(SlotParams, "rows", lambda self, reqs, slots: calls.append(slots) or real(self, reqs, slots))
    bufs = StepBuffers(max_tokens=16, max_rows=4, table_width=4, device=torch.device("cpu"))

    def req(slot, temperature):
        return SimpleNamespace(slot=slot, seed=slot, params=SamplingParams(temperature=temperature), pages=[1],
                               prompt_token_ids=[1, 2], fork_len=0, fork_src=None)

    a, b = req(0, 0.0), req(1, 0.0)
    rows = [ScheduledRow(q, 2, [0], 0, True, True, False, 0) for q in (a, b)]
    assert bufs.step_mode(rows) == (False, False, False)
    inp = build_step_input(ScheduledBatch(rows, []), 4, 4, torch.device("cpu"), bufs)
    assert len(calls) == 1 and not inp.any_random
    # the next step: another request (random sampling) took slot 1; the same rows list object is re-read
    rows[1] = ScheduledRow(req(1, 0.7), 2, [0], 0, True, True, False, 0)
    assert bufs.step_mode(rows) == (True, False, False)
    assert build_step_input(ScheduledBatch(rows, []), 4, 4, torch.device("cpu"), bufs).any_random
    assert len(calls) == 2


# ------------------------------------------------------------------------------------------------
# the tight path of `_process` and the steady plan, end to end without a device
# ------------------------------------------------------------------------------------------------


class _HostOutput:
    """A step's outputs as `_process` reads them (already on the host): no device, no copy."""

    def __init__(self, host: dict[str, torch.Tensor]):
        self.host = host

    def copy_to_host(self, bufs, drafts: bool = False) -> None:
        pass

    def wait(self) -> dict[str, torch.Tensor]:
        return self.host


class _NoDevice:
    """Stands in for the model in one engine: a launched step's outputs are drawn from a seeded RNG -- per
    sampling row 1..nd+1 tokens from `pool` (stop ids, EOS, stop-string characters, others), so stops land
    inside multi-token steps and acceptance varies; logprobs when the step wants them. Two engines that plan
    the same steps get the same outputs. It records every plan, and the per-position counts as the
    per-position increments gave them (the reference for the histograms)."""

    def __init__(self, eng, seed: int, pool: list[int]):
        self.eng, self.rng, self.pool, self.k = eng, random.Random(seed), pool, eng.k
        self.plans: list[tuple] = []
        self.steady_rows = 0  # rows processed that verified / sampled on the slot buffers, request unfinished
        self.accepted = {}  # request id -> accepted per position (the per-position increments)
        self.drafted = {}
        self.total = [0] * eng.k
        commit, process = eng.scheduler.commit, eng._process

        def commit_(batch, times=1):
            self.batch = batch
            self.plans.append(_plan(batch) + (times,))
            commit(batch, times)

        def process_(batch, out):
            # the engine counts a verify row unless its request finished before the step was processed
            num_new = out.host["num_new"].tolist()
            for row, n in zip(batch.rows, num_new):
                req, nd = row.req, row.num_drafts
                if req.status is Status.FINISHED or not row.samples:
                    continue
                self.steady_rows += row.gather
                if not nd:
                    continue
                acc = self.accepted.setdefault(req.request_id, [0] * self.k)
                dr = self.drafted.setdefault(req.request_id, [0] * self.k)
                for j in range(nd):
                    dr[j] += 1
                for j in range(min(n - 1, nd)):
                    acc[j] += 1
                    self.total[j] += 1
            process(batch, out)

        eng.scheduler.commit, eng._process, eng._execute = commit_, process_, self.execute

    def execute(self, inp, bucket) -> _HostOutput:
        rng, rows, k1 = self.rng, self.batch.rows, self.k + 1
        new, num = [[0] * k1 for _ in rows], [0] * len(rows)
        for i, r in enumerate(rows):
            if r.samples:
                num[i] = n = rng.randint(1, r.num_drafts + 1)
                new[i][:n] = [rng.choice(self.pool) for _ in range(n)]
        host = {"new_tokens": torch.tensor(new, dtype=torch.int64), "num_new": torch.tensor(num, dtype=torch.int64)}
        if inp.want_logprobs:
            b, nt = len(rows), 3
            host["lp_logprob"] = torch.tensor([[-rng.random() for _ in range(k1)] for _ in range(b)])
            host["lp_rank"] = torch.tensor([[rng.randint(1, 9) for _ in range(k1)] for _ in range(b)])
            host["lp_top_logprobs"] = torch.tensor([[sorted((-rng.random() for _ in range(nt)), reverse=True)
                                                     for _ in range(k1)] for _ in range(b)])
            host["lp_top_ids"] = torch.tensor([[[rng.choice(self.pool) for _ in range(nt)] for _ in range(k1)]
                                               for _ in range(b)])
        return _HostOutput(host)


def _plan(batch) -> tuple:
    """A plan, comparable across engines and schedulers."""
    return ([(r.req.request_id, r.start, list(r.tokens), r.num_drafts, r.samples, r.gather, r.correct, r.next_token,
              r.num_tokens, r.kv_len) for r in batch.rows], [r.request_id for r in batch.preempted])


def _request_state(r: Request) -> tuple:
    lps = [sorted((t, v.logprob, v.rank, v.decoded_token) for t, v in d.items()) for d in r.logprobs]
    return (r.request_id, r.status, list(r.output_token_ids), r.finish_reason, r.stop_reason, r.error, r.text, lps,
            r.detok.pending if r.detok is not None else None, r.num_computed, r.proj_computed, r.proj_known,
            list(r.pages), r.slot, r.slot_valid, r.pending_free, r.inflight, r.num_tokens_sent, r.num_text_sent,
            r.num_accepted, list(r.draft_hist), list(r.accept_hist))


def _projection_is_current(r: Request) -> bool:
    """The request's projection is what `reproject` makes of its host truth and rows in flight."""
    q = copy.copy(r)
    q.reproject()
    return (q.proj_computed, q.proj_known) == (r.proj_computed, r.proj_known)


def _engine_state(eng, reqs: list[Request]) -> tuple:
    s, c = eng.scheduler, eng.counters
    return ([_request_state(r) for r in reqs], [r.request_id for r in s.waiting], [r.request_id for r in s.running],
            list(s.free_slots), list(eng.pool._free), (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens,
                                                         list(c.accept_hist)), eng.num_steps)


def _random_request(rng: random.Random, s_id: int, t_id: int) -> tuple[list[int], SamplingParams, bool]:
    p: dict = dict(temperature=0, max_tokens=rng.randint(1, 80), ignore_eos=rng.random() < 0.5)
    if rng.random() < 0.3:
        p["stop_token_ids"] = rng.choice([[7], [11, s_id]])
    if rng.random() < 0.15:
        p["stop"] = rng.choice([["ST"], ["T", "SS"]])
        p["include_stop_str_in_output"] = rng.random() < 0.5
    if rng.random() < 0.2:
        p["min_tokens"] = rng.randint(1, min(6, p["max_tokens"]))
    if rng.random() < 0.07:
        p["logprobs"] = rng.randint(0, 2)
    if rng.random() < 0.1:
        p["n"] = 2
    n = rng.choice([rng.randint(1, 30), rng.randint(150, 220)])  # long ones run into max_model_len
    return [rng.randrange(3, 200) for _ in range(n)], SamplingParams(**p), rng.random() < 0.5


def _lockstep(engines: list, devices: list, rng: random.Random, ids: tuple[int, int], steps: int, add_until: int,
              add_p: float) -> list[list[Request]]:
    """Step two engines together until `steps` steps have run and both are idle, feeding both the same random
    requests (with probability add_p per step, until step add_until) and aborts; after every step assert
    the same deltas, plans and engine state, and a current projection for every unfinished request of the
    first. Returns each engine's requests."""
    fast, plain = engines
    reqs: list[list[Request]] = [[], []]
    n = 0
    while n < steps or any(eng.has_work() for eng in engines):
        n += 1
        if n < add_until and rng.random() < add_p:
            prompt, sp, stream = _random_request(rng, *ids)
            for eng, mine in zip(engines, reqs):
                first = eng.add_request(list(prompt), sp, stream_text=stream)
                mine += first.group.members if first.group is not None else [first]
        if rng.random() < 0.04 and fast.request_ids():
            rid = rng.choice(fast.request_ids())
            for eng in engines:
                eng.abort(rid.split("#")[0])
        deltas = [eng.step() for eng in engines]
        assert deltas[0] == deltas[1], n
        assert devices[0].plans == devices[1].plans, n
        assert _engine_state(fast, reqs[0]) == _engine_state(plain, reqs[1]), n
        assert all(_projection_is_current(r) for r in reqs[0] if not r.finished), n
        assert n < 6 * steps
    return reqs


@pytest.mark.parametrize("cfg", [dict(num_draft_tokens=3, overlap=True, max_num_tokens=64, num_pages=40),
                                 dict(num_draft_tokens=3, overlap=False, max_num_tokens=28, num_pages=36),
                                 dict(num_draft_tokens=0, overlap=True, max_num_tokens=64, num_pages=45)],
                         ids=["k3-overlap", "k3-budget", "k0-overlap"])
def test_fast_paths_equal_the_general_ones_end_to_end(cfg):
    """Two engines on the embedded model, one with the fast paths and one without, fed the same random
    requests, aborts and device outputs: after every step the same deltas, requests (tokens, text, finish
    and stop reasons, logprobs, lengths and projections, pages, slots, speculation counts), queues, free
    pages and counters, and the same plans. Both the fast and the general paths are taken, and requests
    are preempted (small pools) and recomputed. The histograms give the per-position increments' counts."""
    k = cfg["num_draft_tokens"]
    engines = [LLM(device="cpu", max_model_len=256, max_num_seqs=8, **cfg).engine for _ in range(2)]
    fast, plain = engines
    _plain(plain)
    tok = fast.tokenizer
    s_id, t_id = tok.encode("S")[0], tok.encode("T")[0]
    pool = [0, 7, 11, s_id, t_id, s_id, t_id] + list(range(40, 100))
    devices = [_NoDevice(eng, 3, pool) for eng in engines]
    general_rows, steady_plans, preempted = [0], [0], [0]
    process_row, steady, preempt = fast._process_row, fast.scheduler._schedule_steady, fast.scheduler._preempt

    def count_general(req, row, tokens, lps):
        general_rows[0] += row.samples and row.gather  # a steady row that could stop, or in a step with logprobs
        return process_row(req, row, tokens, lps)

    def count_steady():
        got = steady()
        steady_plans[0] += got is not None
        return got

    def count_preempt(req):
        preempted[0] += 1
        preempt(req)

    fast._process_row, fast.scheduler._schedule_steady, fast.scheduler._preempt = \
        count_general, count_steady, count_preempt
    reqs = _lockstep(engines, devices, random.Random(k * 10 + cfg["overlap"]), (s_id, t_id), 1000, 900, 0.15)
    for eng, dev, mine in zip(engines, devices, reqs):
        eng.check_integrity()
        assert eng.is_idle_and_clean()
        assert eng.counters.accepted_per_pos == dev.total
        assert sum(eng.counters.accepted_per_pos) == eng.counters.num_accepted_tokens
        for r in mine:
            assert r.accepted_per_position == dev.accepted.get(r.request_id, [0] * k)
            assert r.drafted_per_position == dev.drafted.get(r.request_id, [0] * k)
            assert r.num_drafted == sum(r.drafted_per_position)
            assert r.num_verify_steps == (r.drafted_per_position[0] if k else 0)
    outs = [r for r in reqs[0] if r.finished]
    assert len(outs) == len(reqs[0]) > 100
    assert {r.finish_reason for r in outs} >= {"stop", "length", "abort"}
    plans = len(devices[0].plans)
    assert 50 < steady_plans[0] < plans - 50, (steady_plans, plans)
    assert preempted[0] > 0
    # steady rows: the tight path took most, the per-row path some (a stop within reach, logprobs)
    tight = devices[0].steady_rows - general_rows[0]
    assert tight > 500 and general_rows[0] > 100, (tight, general_rows)


@pytest.mark.parametrize("k", [3, 0])
def test_multi_step_processing_equals_per_step_end_to_end(k):
    """num_scheduler_steps=4 on two engines with the same plans (the steady plan's multi-step iterations on
    both), fed the same random requests, aborts and device outputs: one processes an iteration's sub-steps
    with `_process_plain_steps` (a row that nothing can stop inside the iteration taken once for all of
    them), the other sub-step by sub-step through the per-row path. After every step the same deltas,
    plans, requests (tokens, text, reasons, lengths, projections, pages, counts) and engine state. Rows
    taken once for the iteration and rows taken sub-step by sub-step (stops within reach, finished
    requests) both occur (counted); two mutations (no projection adjustment; the sub-step rows' first
    sub-step after the combined rows) fail it."""
    cfg = dict(num_draft_tokens=k, overlap=True, max_num_tokens=64, num_pages=45, num_scheduler_steps=4)
    engines = [LLM(device="cpu", max_model_len=256, max_num_seqs=8, **cfg).engine for _ in range(2)]
    fast, plain = engines
    plain.fast_paths = False  # every sub-step, every row through `_process_row`; the plans stay the same
    tok = fast.tokenizer
    s_id, t_id = tok.encode("S")[0], tok.encode("T")[0]
    pool = [0, 7, 11, s_id, t_id, s_id, t_id] + list(range(40, 100))
    devices = [_NoDevice(eng, 5, pool) for eng in engines]
    seen = {"rows": 0, "one_by_one": 0}
    steps_, plain_ = fast._process_plain_steps, fast._process_plain
    inside = [False]

    def count_steps(rows, new_tokens, num_new):
        seen["rows"] += len(rows) * len(num_new)
        inside[0] = True
        try:
            steps_(rows, new_tokens, num_new)
        finally:
            inside[0] = False

    def count_plain(rows, new_tokens, num_new):
        seen["one_by_one"] += len(rows) if inside[0] else 0
        plain_(rows, new_tokens, num_new)

    fast._process_plain_steps, fast._process_plain = count_steps, count_plain
    reqs = _lockstep(engines, devices, random.Random(17 + k), (s_id, t_id), 500, 450, 0.12)
    for eng in engines:
        eng.check_integrity()
        assert eng.is_idle_and_clean()
        assert eng.num_iterations < eng.num_steps
    assert {r.finish_reason for r in reqs[0] if r.finished} >= {"stop", "length", "abort"}
    combined = seen["rows"] - seen["one_by_one"]
    assert combined > 200 and seen["one_by_one"] > 50, seen


def test_tight_path_is_taken_and_transactional():
    """A steady step of a request that cannot stop takes the tight path (no `_process_row`); a detokenizer
    fault there fails the request alone and leaves its tokens and text as they were, as `_extend` does."""
    llm = LLM(device="cpu", num_draft_tokens=3, max_model_len=256, max_num_seqs=4)
    eng = llm.engine
    _NoDevice(eng, 1, list(range(40, 60)))
    calls = []
    process_row = eng._process_row
    eng._process_row = lambda *a: (calls.append(a[1].gather), process_row(*a))[1]
    ok = eng.add_request(list(range(5, 20)), SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                         stream_text=True)
    bad = eng.add_request(list(range(5, 20)), SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                          stream_text=True)
    for _ in range(6):
        eng.step()
    assert calls and not any(calls)  # only the prompt rows took the per-row path
    before = (list(bad.output_token_ids), bad.text, bad.detok)

    class Faulty:
        stop, deferred, pending = (), False, 0

        def extended(self, token_ids):
            raise RuntimeError("tokenizer fault")

        def fork(self):
            return self

        def finish(self, token_ids):
            pass

        def safe_length(self, finished):
            return 0

    bad.detok = Faulty()
    while not bad.finished:
        eng.step()
    assert bad.finish_reason == "error" and "tokenizer fault" in bad.error
    assert (bad.output_token_ids, bad.text) == before[:2]
    assert not ok.finished
    eng.abort(ok.request_id)
    eng.run()
    eng.check_integrity()
    assert eng.is_idle_and_clean()


# ------------------------------------------------------------------------------------------------
# the steady plan against the general one, on random scheduler states
# ------------------------------------------------------------------------------------------------


def _sched_state(s: Scheduler) -> tuple:
    reqs = [*s.waiting, *s.running]
    return ([r.request_id for r in s.waiting], [r.request_id for r in s.running], list(s.free_slots),
            list(s.pool._free), sorted((p, tuple(o)) for p, o in s.pool._owners.items()),
            [(r.request_id, r.status, list(r.pages), r.slot, r.num_computed, r.proj_computed, r.proj_known,
              r.slot_valid, r.pending_free, r.inflight) for r in reqs])


def _sim_process(s: Scheduler, batch, rng: random.Random, k: int) -> None:
    """What the engine does with a processed step, without a model: random acceptance, random finishes."""
    for row in batch.rows:
        req = row.req
        req.inflight_rows.remove(row)
        if req.finished:
            if req.pending_free and not req.inflight_rows:
                s.release(req)
            continue
        start = req.num_computed
        if row.samples:
            a = rng.randint(0, row.num_drafts)
            req.output_token_ids += [5] * (a + 1)
            req.num_computed = start + row.num_tokens - row.num_drafts + a
        else:
            req.num_computed = start + row.num_tokens
        req.reproject()
        if len(req.output_token_ids) >= req.params.max_tokens:
            s.finish(req, "length")


def test_steady_plan_equals_the_general_plan():
    """Random request streams through schedulers of random sizes (overlap emulated: a step stays in flight
    while the next is planned). Before every plan the scheduler is copied; `schedule()` (the steady plan
    where it applies) and the copy's general `_schedule()` give the same rows, preemptions, page ids and
    state, or both raise NeedSync -- and where the steady plan is refused, it left the state exactly as it
    was. Small pools and budgets (changed now and then) make it refuse for every reason: the budget, a row
    that is not steady (a prompt chunk, a recompute), pages short."""
    refused = {"budget": 0, "row": 0, "pages": 0}
    steady_plans = needsync = 0
    configs = [(3, 12, 48), (3, 20, 32), (3, 28, 40), (3, 64, 32), (3, 64, 48), (0, 5, 48), (0, 64, 32), (0, 64, 48)]
    for seed, (k, budget, pages) in enumerate(configs):  # K, token budget, pages of 4 tokens
        rng = random.Random(seed)
        s = Scheduler(PagePool(pages, 4), budget, 8, k, 40)
        steady = s._schedule_steady
        before: list[tuple] = []

        def count_steady(s=s, steady=steady, before=before, k=k):
            nonlocal steady_plans
            live = [r for r in s.running if r.status is Status.RUNNING]
            got = steady()
            if got is not None:
                steady_plans += 1
                return got
            assert _sched_state(s) == before[-1]  # refused before changing anything
            if any(r.proj_known - r.proj_computed != 1 or not r.slot_valid for r in live):
                refused["row"] += 1
            elif len(s.running) * (k + 1) > s.max_num_tokens:
                refused["budget"] += 1
            else:
                refused["pages"] += 1
            return None

        s._schedule_steady = count_steady
        pending, arrival = None, 0
        for _ in range(600):
            if rng.random() < 0.08:
                arrival += 1
                req = Request(f"r{arrival}", [rng.randrange(3, 90) for _ in range(rng.randint(1, 30))],
                              SamplingParams(temperature=0, max_tokens=rng.randint(1, 60)), 0, arrival)
                req.proj_known = req.num_known
                s.add(req)
            live = [r for r in s.running if not r.finished]
            if live and rng.random() < 0.03:
                s.finish(rng.choice(live), "abort")
            # now and then a budget that the running rows may not fit (states the admission rarely reaches)
            s.max_num_tokens = rng.randint(1, 24) if rng.random() < 0.2 else budget
            while True:
                snap = copy.deepcopy(s)
                snap._schedule_steady = None  # the copy plans by the general loop only
                before.append(_sched_state(s))
                try:
                    batch = s.schedule()
                except NeedSync:
                    needsync += 1
                    with pytest.raises(NeedSync):
                        snap._schedule()
                    assert _sched_state(s) == _sched_state(snap)
                    _sim_process(s, pending[0], rng, k)
                    pending = None
                    continue
                want = snap._schedule()
                assert _plan(batch) == _plan(want)
                assert _sched_state(s) == _sched_state(snap)
                break
            s.commit(batch)
            assert all(_projection_is_current(r) for r in s.running if not r.finished)
            if pending is not None:
                _sim_process(s, pending[0], rng, k)
            pending = (batch,)
    assert steady_plans > 1000 and min(refused.values()) >= 5 and needsync, (steady_plans, refused, needsync)


# ------------------------------------------------------------------------------------------------
# detokenizer bulk append, histograms
# ------------------------------------------------------------------------------------------------


def test_extend_equals_add_token_by_token():
    """`extend` / `extended` leave the text and pending count that `add(t, False)` per token leaves, on random
    ids (partial UTF-8 characters, special tokens); `extended` does not touch the detokenizer it forks."""
    from tokenizers import Tokenizer as HFTokenizer

    from m3eagle.engine.detokenizer import IncrementalDetokenizer
    from m3eagle.loader.assets import ASSETS
    from m3eagle.loader.tokenizer import Tokenizer

    tok = Tokenizer(HFTokenizer.from_file(str(ASSETS / "target" / "tokenizer.json")))
    rng = random.Random(1)
    vocab = tok.tok.get_vocab_size()
    partial = 0
    for _ in range(200):
        a, b = IncrementalDetokenizer(tok), IncrementalDetokenizer(tok)
        for _ in range(rng.randint(1, 8)):
            ids = [rng.randrange(vocab) for _ in range(rng.randint(0, 4))]
            for t in ids:
                a.add(t, False)
            before = (b.text, b.pending)
            c = b.extended(ids)
            assert (b.text, b.pending) == before
            b = c
            assert (a.text, a.pending) == (b.text, b.pending)
            partial += a.pending > 0
    assert partial


def test_per_position_counts_of_histograms():
    """Entry j of the per-position counts is the number of steps whose count exceeded j."""
    rng = random.Random(2)
    for _ in range(100):
        k = rng.randint(0, 6)
        counts = [rng.randint(0, k) for _ in range(rng.randint(0, 30))]
        hist = [counts.count(i) for i in range(k + 1)]
        assert per_position_counts(hist) == [sum(c > j for c in counts) for j in range(k)]
