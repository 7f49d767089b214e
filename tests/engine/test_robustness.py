"""Faults and bad values never poison the engine:

- SamplingParams refuse out-of-range values up front (seeds past int64, bools for ints, logprobs=5);
  a huge top_k means "no limit"; temperatures below 1e-5 are greedy;
- prompts of the wrong type raise RequestError naming the prompt and its type; numpy/torch integer
  ids are accepted; a duplicate request id raises;
- an exception or KeyboardInterrupt anywhere in a step (planning, input building, model execution,
  output processing, detokenization) leaves the engine consistent: check_integrity passes, every page
  and slot is free, and the next generate() returns exactly the tokens of a clean engine;
- check_integrity sees leaked slots and pages, lost requests and waiting requests holding state;
- one unschedulable request fails alone; two threads calling generate() get correct tokens;
- finished requests are not kept: nothing grows with the number of requests served.
Every fault is injected deterministically (monkeypatch), never hoped for.
"""

from __future__ import annotations

import gc
import threading
import weakref

import numpy as np
import pytest
import torch

from m3eagle import LLM, SamplingParams
from m3eagle.engine.llm_engine import RequestError
from m3eagle.sampling.params import SamplingParamsError
from tests.helpers.engine_utils import assert_clean

PROMPTS = [[9, 21, 33, 4], [50, 51, 52, 53, 54, 55, 56, 57, 58, 59], [7, 8], [60, 61, 62, 63, 64, 65, 66]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(model_dir):
    llm = LLM(model_dir, device="cpu", page_size=4, max_model_len=64)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def small_llm(model_dir, head_dir=None, k: int = 0, overlap: bool = False, **kw) -> LLM:
    kw = {"device": "cpu", "page_size": 4, "max_model_len": 64, "max_num_tokens": 8, "max_num_seqs": 4, **kw}
    return LLM(model_dir, draft=head_dir if k else None, num_draft_tokens=k, overlap=overlap, **kw)


# ------------------------------------------------------------------------------------------------
# values
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, field", [
    ({"seed": 2**63}, "seed"), ({"seed": 2**70}, "seed"), ({"seed": True}, "seed"),
    ({"max_tokens": 2**63}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"top_k": True}, "top_k"), ({"temperature": True}, "temperature"), ({"top_p": False}, "top_p"),
    ({"logprobs": 21}, "logprobs"), ({"logprobs": "yes"}, "logprobs"), ({"ignore_eos": 1}, "ignore_eos"),
    ({"stop_token_ids": [True]}, "stop_token_ids"), ({"stop_token_ids": [2**64]}, "stop_token_ids"),
    ({"stop": [3]}, "stop"), ({"stop": 3}, "stop"),
])
def test_sampling_params_refuse_out_of_range_and_wrong_types(kw, field):
    with pytest.raises(SamplingParamsError, match=field):
        SamplingParams(**kw)


def test_huge_top_k_means_no_limit_and_runs(model_dir):
    """top_k >= 2**63 used to pass validation and then overflow inside the step after admission (and
    every later generate() failed the same way)."""
    sp = SamplingParams(top_k=2**63 + 5, seed=2**63 - 1, temperature=1.0, max_tokens=4)
    assert sp.top_k == 0
    llm = small_llm(model_dir)
    assert len(llm.generate(PROMPTS[0], sp)[0].outputs[0].token_ids) == 4
    assert_clean(llm)


def test_temperature_below_eps_is_greedy(model_dir, reference):
    """1e-40 is below fp32's normal range: 1/T overflowed and the request silently returned EOS."""
    llm = small_llm(model_dir)
    for t in (1e-40, 1e-6):
        sp = SamplingParams(temperature=t, max_tokens=12, ignore_eos=True, seed=3)
        assert sp.greedy
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)] == reference
    assert not SamplingParams(temperature=1e-4).greedy


@pytest.mark.parametrize("prompts, typename", [
    (None, "NoneType"), (123, "int"), ((3, 4, 5), "tuple"), (b"abc", "bytes"), ({"a": 1}, "dict"),
    (True, "bool"), ([True, False, True], "bool"), ([[3, True]], "bool"), ([3, 4.0], "float"),
    (np.int64(5), "int64"), (torch.tensor(5), "Tensor"), ([[3, 4], (5, 6)], "tuple"), ([None], "NoneType"),
    ([np.array([3.0, 4.0])], "ndarray"), (torch.tensor([True, False]), "Tensor"),
])
def test_prompts_of_the_wrong_type_name_the_type(model_dir, prompts, typename):
    llm = small_llm(model_dir)
    with pytest.raises(RequestError, match=typename) as err:
        llm.generate(prompts, GREEDY)
    assert "prompt" in str(err.value)
    assert_clean(llm)


def test_numpy_and_torch_integer_ids_are_accepted(model_dir, reference):
    llm = small_llm(model_dir)
    p = PROMPTS[1]
    variants = [[np.int64(t) for t in p], [np.int32(t) for t in p], [torch.tensor(t) for t in p],
                np.array(p), torch.tensor(p), [np.array(p)], [torch.tensor(p, dtype=torch.int32)]]
    for v in variants:
        assert llm.generate(v, GREEDY)[0].outputs[0].token_ids == reference[1], type(v)
    assert_clean(llm)


def test_duplicate_request_id_raises(model_dir):
    llm = small_llm(model_dir)
    eng = llm.engine
    eng.add_request(PROMPTS[0], GREEDY, request_id="a")
    with pytest.raises(RequestError, match="request_id='a'"):
        eng.add_request(PROMPTS[1], GREEDY, request_id="a")
    eng.run()
    eng.add_request(PROMPTS[1], GREEDY, request_id="a")  # a finished id may be reused
    eng.run()
    assert_clean(llm)


# ------------------------------------------------------------------------------------------------
# faults inside a step
# ------------------------------------------------------------------------------------------------


class Once:
    """Wrap a callable so that its n-th call raises `exc` (before or after running the original)."""

    def __init__(self, fn, n: int, exc: BaseException, after: bool = False):
        self.fn, self.n, self.exc, self.after, self.calls = fn, n, exc, after, 0

    def __call__(self, *a, **kw):
        self.calls += 1
        if self.calls == self.n and not self.after:
            raise self.exc
        out = self.fn(*a, **kw)
        if self.calls == self.n:
            raise self.exc
        return out


def _inject(monkeypatch, llm: LLM, where: str, n: int, exc: BaseException) -> Once:
    """Make the n-th call of one stage of the step raise `exc`."""

    eng = llm.engine
    owner, name, after = {
        "schedule": (eng.scheduler, "schedule", True),  # after the plan allocated pages, admitted requests
        "build": (eng.graphs, "build", False),
        "execute": (eng.runner, "execute", False),
        "execute_after": (eng.runner, "execute", True),  # launched, its outputs never processed
        "process": (eng, "_process_iteration", False),  # a step's (or a multi-step iteration's) outputs
    }[where]
    once = Once(getattr(owner, name), n, exc, after)
    monkeypatch.setattr(owner, name, once)
    return once


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), RuntimeError("injected")], ids=["ctrl-c", "error"])
@pytest.mark.parametrize("where", ["schedule", "build", "execute", "execute_after", "process"])
@pytest.mark.parametrize("k, overlap, steps", [(0, False, 1), (3, True, 1), (0, True, 4), (3, True, 4)],
                         ids=["plain", "spec-overlap", "plain-multistep", "spec-multistep"])
def test_a_fault_anywhere_in_a_step_leaves_the_engine_consistent(monkeypatch, model_dir, head_dir, reference, where,
                                                                 exc, k, overlap, steps):
    """With num_scheduler_steps=4 the n-th execute is a sub-step inside an iteration (the budget of 32
    tokens holds every row with its drafts, so iterations run; asserted)."""
    kw = {"num_scheduler_steps": steps, "max_num_tokens": 32} if steps > 1 else {}
    llm = small_llm(model_dir, head_dir, k, overlap, **kw)
    for n in (2, 5):  # two faults, at different steps, on the same engine
        once = _inject(monkeypatch, llm, where, n, exc)
        with pytest.raises(type(exc)):
            llm.generate(PROMPTS, GREEDY)
        monkeypatch.undo()
        assert once.calls >= n
        assert_clean(llm)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
        assert_clean(llm)
    eng = llm.engine
    assert (eng.num_iterations < eng.num_steps) == (steps > 1)


def test_repeated_interrupts_never_stop_admission(monkeypatch, model_dir, head_dir, reference):
    """With max_num_seqs=4, each Ctrl-C used to leak a slot and 5-10 pages, until the LLM admitted
    nothing ("cannot be scheduled... raise num_pages" with 510 pages free)."""
    llm = small_llm(model_dir, head_dir, 3, True)
    for i in range(8):
        _inject(monkeypatch, llm, "execute" if i % 2 else "process", 3 + i % 3, KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, GREEDY)
        monkeypatch.undo()
        assert_clean(llm)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference


def test_an_interrupted_engine_resumes_its_requests_exactly(monkeypatch, model_dir, head_dir, reference):
    """Driving the engine directly (no LLM.generate to abort them), the requests of a faulted step are
    rolled back to host truth and recomputed: they still finish with exactly the clean tokens."""
    llm = small_llm(model_dir, head_dir, 3, True)
    eng = llm.engine
    reqs = [eng.add_request(p, GREEDY) for p in PROMPTS]
    for _ in range(4):
        eng.step()
    _inject(monkeypatch, llm, "execute", 1, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        eng.step()
    monkeypatch.undo()
    eng.check_integrity()
    assert any(r.output_token_ids for r in reqs) and not any(r.finished for r in reqs)
    eng.run()
    assert [r.output_token_ids for r in reqs] == reference
    assert_clean(llm)


@pytest.fixture(scope="module")
def default_llm():
    return LLM(device="cpu", num_draft_tokens=3, max_num_seqs=4, max_num_tokens=32)


@pytest.mark.parametrize("stop", [[], ["\n\n\n\n"]], ids=["no-stop-string", "stop-string"])
def test_detokenizer_exception_fails_only_its_request(monkeypatch, default_llm, stop):
    """One exception in detokenization made the next generate() spin forever. Now the request being
    detokenized finishes with finish_reason "error" (and the error), the others are untouched, and the
    engine serves the next call. The fault is injected where generate()'s requests are detokenized: token
    by token with a stop string (the incremental detokenizer), once at the end without one (generate()
    reads only finished outputs, so those requests defer their text)."""
    from m3eagle.engine.detokenizer import FinalTextDetokenizer, IncrementalDetokenizer

    llm = default_llm
    prompts = ["def add(a, b):", "import os\n", "class Foo:"]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop=stop)
    ref = llm.generate(prompts, sp)
    cls, name = (IncrementalDetokenizer, "add") if stop else (FinalTextDetokenizer, "finish")
    orig = getattr(cls, name)
    calls = [0]

    def bad(self, *args):
        calls[0] += 1
        if calls[0] == 1:
            raise ValueError("broken detokenizer")
        return orig(self, *args)

    monkeypatch.setattr(cls, name, bad)
    outs = llm.generate(prompts, sp)
    monkeypatch.undo()
    reasons = [o.outputs[0].finish_reason for o in outs]
    assert reasons.count("error") == 1, reasons
    bad = reasons.index("error")
    assert "broken detokenizer" in outs[bad].outputs[0].error
    for i, (o, r) in enumerate(zip(outs, ref)):
        if i != bad:
            a, b = o.outputs[0], r.outputs[0]
            assert a.token_ids == b.token_ids and a.text == b.text and a.error is None
    assert_clean(llm)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == [r.outputs[0].token_ids for r in ref]


def test_unschedulable_request_fails_alone(model_dir, reference):
    """A request that can never get pages (here: pages taken by an outside holder) used to raise from
    step() and fail every request in the engine. Now it finishes with an error, the rest complete."""
    llm = small_llm(model_dir, max_num_tokens=64, num_pages=18)
    eng = llm.engine
    ghost = eng.pool.allocate("ghost", eng.pool.num_free - 3)  # 3 pages = 12 tokens left
    big = eng.add_request(list(range(3, 40)), GREEDY)  # needs 10 pages for its first chunk
    small = eng.add_request(PROMPTS[2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    done = eng.run()
    assert {r.request_id for r in done} == {big.request_id, small.request_id}
    assert big.finish_reason == "error" and "cannot be scheduled" in big.error and not big.output_token_ids
    assert small.finish_reason == "length" and small.output_token_ids == reference[2][:4]
    eng.pool.free("ghost", ghost)
    assert_clean(llm)


# ------------------------------------------------------------------------------------------------
# integrity, threads, memory
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("damage, match", [
    ("leak_slot", "slots"), ("leak_pages", "leaked pages"), ("lose_request", "lost"),
    ("waiting_holds_pages", "waiting request"), ("stray_inflight", "in flight"),
])
def test_check_integrity_sees_damaged_states(model_dir, damage, match):
    llm = small_llm(model_dir)
    eng = llm.engine
    reqs = [eng.add_request(p, GREEDY) for p in PROMPTS]
    eng.step()
    eng.check_integrity()
    running = eng.scheduler.running[0]
    if damage == "leak_slot":
        eng.scheduler.free_slots.pop()
    elif damage == "leak_pages":
        eng.pool.allocate("nobody", 2)
    elif damage == "lose_request":
        eng.scheduler.running.remove(running)
    elif damage == "waiting_holds_pages":
        w = eng.scheduler.waiting[0] if eng.scheduler.waiting else None
        if w is None:
            w = eng.add_request(PROMPTS[0], GREEDY)
        w.pages = eng.pool.allocate(w.request_id, 1)
    elif damage == "stray_inflight":
        running.inflight_rows.append(object())
    with pytest.raises(AssertionError, match=match):
        eng.check_integrity()
    assert reqs


def test_two_threads_share_one_llm(model_dir, reference):
    """Two threads calling generate() on one LLM used to interleave steps: wrong tokens, leaked pages.
    Calls are serialised now; each thread gets exactly its tokens."""
    llm = small_llm(model_dir, max_num_seqs=8)
    results: dict[int, list] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def work(i: int) -> None:
        try:
            start.wait()
            for _ in range(3):
                results.setdefault(i, []).append([o.outputs[0].token_ids for o in llm.generate(PROMPTS[i::2], GREEDY)])
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    for i in (0, 1):
        assert results[i] == [reference[i::2]] * 3
    assert_clean(llm)


def test_finished_requests_are_not_kept(model_dir):
    """engine.finished and LLM._all_outputs grew with every request served. Now a finished request is
    handed back once and forgotten: once the caller drops its outputs, the engine's Request objects are
    garbage, and the speculation stats are running sums that still count every request."""
    llm = small_llm(model_dir)
    eng = llm.engine
    made: list[weakref.ref] = []
    add = eng.add_request

    def tracked(*a, **kw):
        req = add(*a, **kw)
        made.append(weakref.ref(req))
        return req

    eng.add_request = tracked
    for _ in range(5):
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    del outs
    gc.collect()
    assert len(made) == 20 and all(r() is None for r in made)
    assert llm.stats()["num_requests"] == 20 and llm.stats()["num_generated_tokens"] == 60
    assert_clean(llm)
