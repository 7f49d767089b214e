"""Multi-step iterations (EngineConfig.num_scheduler_steps): one host plan, N device sub-steps.

What must hold: the tokens (and logprobs, finish reasons, texts) are exactly those of one step at a time --
greedy and seeded sampling, speculation on and off, overlap on and off, stops landing inside an iteration,
penalties, logprobs, samples of n, aborts and forced preemptions -- the engine really ran multi-step
iterations (fewer host iterations than device steps), and every page comes back (make_llm's teardown).
The embedded model and its trained Eagle3 head on the CPU, graph-shaped steps run eagerly."""

from __future__ import annotations

import pytest
import torch

from m3eagle import LLM, SamplingParams
from m3eagle.loader.assets import default_model_paths

TARGET, HEAD = default_model_paths()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(5, 8000, (n,), generator=g).tolist() for n in (9, 30, 17, 4, 23)]


def build(steps: int, k: int, overlap: bool = True, graph_shapes: bool = True, **kw) -> LLM:
    kw = {"max_num_seqs": 8, **kw}
    return LLM(TARGET, draft=HEAD if k else None, num_draft_tokens=k, device="cpu", max_model_len=256,
               overlap=overlap, graph_shapes=graph_shapes, num_scheduler_steps=steps, **kw)


class Wasted:
    """Counts sub-step outputs processed for a request that an earlier sub-step (or step) already finished:
    the condition "a stop inside an iteration" that the stop tests rely on."""

    def __init__(self, llm: LLM):
        eng, self.n = llm.engine, 0
        process = eng._process_plain  # every row of a step without logprobs passes here

        def spy(rows, new_tokens, num_new):
            self.n += sum(r.req.finished for r in rows)
            process(rows, new_tokens, num_new)

        eng._process_plain = spy


def outputs(llm: LLM, prompts, params) -> list[tuple]:
    res = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text,
             o.outputs[0].logprobs) for o in res]


def check(prompts, params, k: int, steps: int = 4, **kw) -> tuple[LLM, LLM]:
    """Run the same requests one step at a time and `steps` at a time; everything equal, multi-step used."""
    one, multi = build(1, k, **kw), build(steps, k, **kw)
    want, got = outputs(one, prompts, params), outputs(multi, prompts, params)
    assert got == want
    eng = multi.engine
    assert eng.num_iterations < eng.num_steps  # iterations of several sub-steps really ran
    assert one.engine.num_iterations == one.engine.num_steps
    for llm in (one, multi):
        assert llm.engine.is_idle_and_clean()
    return one, multi


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_greedy_equals_one_step_at_a_time(prompts, k, overlap):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 7, 33, 60, 21)]
    check(prompts, params, k, overlap=overlap)


@pytest.mark.parametrize("k", [0, 3])
def test_unpadded_steps_equal_one_step_at_a_time(prompts, k):
    """graph_shapes off: eager steps of the real rows only, whose KV bound is a host value -- a multi-step
    iteration's must cover its last sub-step."""
    params = SamplingParams(temperature=0, max_tokens=45, ignore_eos=True)
    check(prompts, params, k, graph_shapes=False, steps=5)


@pytest.mark.parametrize("k", [0, 3])
def test_stops_inside_an_iteration(prompts, k):
    """Stop ids taken from each request's own greedy output (so each stops at a known position), EOS left
    on, a stop string: a request finishing at a sub-step that is not its iteration's last, whose later
    sub-steps are then computed and dropped (counted), gives the same tokens, reason and text."""
    free = outputs(build(1, k), prompts, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    params = []
    for i, (toks, *_rest) in enumerate(free):
        at = 6 + 5 * i  # a different position per request
        params.append(SamplingParams(temperature=0, max_tokens=50, stop_token_ids=[toks[at]]))
    text = free[1][2]
    params[1] = SamplingParams(temperature=0, max_tokens=50, stop=[text[len(text) // 3:len(text) // 3 + 3]])
    one, multi = build(1, k), build(5, k)
    wasted = Wasted(multi)
    want, got = outputs(one, prompts, params), outputs(multi, prompts, params)
    assert got == want
    assert {r for _, r, *_ in want} == {"stop"}
    assert wasted.n > 0  # some sub-step ran for a request an earlier one had finished
    assert multi.engine.num_iterations < multi.engine.num_steps


@pytest.mark.parametrize("k", [0, 3])
def test_seeded_sampling_logprobs_and_penalties(prompts, k):
    """Seeded temperature / top-p sampling (rejection sampling with K > 0), logprobs of each token, and
    penalties (a step mode with device-side history) are the same per token."""
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=7 + i, max_tokens=30, ignore_eos=True)
              for i in range(5)]
    params[2] = SamplingParams(temperature=0.8, seed=3, max_tokens=30, ignore_eos=True, logprobs=2)
    params[3] = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, presence_penalty=0.7,
                               repetition_penalty=1.2)
    check(prompts, params, k)


def test_samples_of_n(prompts):
    params = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=25, ignore_eos=True)
    one, multi = build(1, 3), build(4, 3)
    want = one.generate(prompts[:2], params, use_tqdm=False)
    got = multi.generate(prompts[:2], params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    assert multi.engine.num_iterations < multi.engine.num_steps


@pytest.mark.parametrize("k", [0, 3])
def test_abort_inside_an_iteration_frees_everything(prompts, k):
    """Aborts while a multi-step iteration is in flight: the aborted outputs are prefixes of the free runs,
    the others are whole, and every page and slot comes back. 64 tokens: the aborted requests hold at most 27
    when aborted (K=3), 43 with the iteration in flight, so each abort lands mid-request (asserted)."""
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    want = [t for t, *_ in outputs(build(1, k), prompts, sp)]
    llm = build(4, k)
    eng = llm.engine
    reqs = [eng.add_request(p, sp) for p in prompts]
    for i in range(6):
        eng.step()
        if i == 2:
            eng.abort(reqs[1].request_id)
        if i == 4:
            eng.abort(reqs[3].request_id)
        eng.check_integrity()
    eng.run()
    for i, r in enumerate(reqs):
        assert r.output_token_ids == want[i][:len(r.output_token_ids)]
        assert (r.finish_reason == "abort") == (i in (1, 3))
        if i not in (1, 3):
            assert len(r.output_token_ids) == 64
    assert eng.num_iterations < eng.num_steps
    assert eng.is_idle_and_clean()


@pytest.mark.parametrize("k", [0, 3])
def test_forced_preemption(prompts, k):
    """A preemption forced every 4th plan (the scheduler's own path; under overlap it first drains the
    iteration in flight) with multi-step iterations between them: the same tokens."""
    from tests.helpers.engine_utils import Counters

    sp = SamplingParams(temperature=0, max_tokens=36, ignore_eos=True)
    want = outputs(build(1, k), prompts, sp)
    llm = build(4, k)
    c = Counters(llm, force_every=4)
    assert outputs(llm, prompts, sp) == want
    assert c.preempted > 0
    assert llm.engine.num_iterations < llm.engine.num_steps
    assert llm.engine.is_idle_and_clean()


def _steady(k: int, pages: int, max_pages: int = 64, max_tokens: int = 200):
    """A scheduler holding one request in the steady state (prompt processed, one sample, nothing in
    flight), and the request."""
    from m3eagle.engine.request import Request, StopConditions
    from m3eagle.engine.scheduler import Scheduler
    from m3eagle.kvcache.page_pool import PagePool

    pool = PagePool(pages, 4)
    s = Scheduler(pool, max_num_tokens=64, max_num_seqs=4, num_draft_tokens=k, max_pages_per_seq=max_pages)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    r = Request("r", list(range(3, 9)), params, 0, 0)
    r.stops = StopConditions.of(params, 6, 10_000, frozenset(), False)
    r.proj_known = r.num_known
    s.add(r)
    b = s.schedule()
    s.commit(b)
    r.inflight_rows.remove(b.rows[0])  # processed: the prompt's sample is out
    r.num_computed = 6
    r.output_token_ids.append(7)
    r.reproject()
    return s, pool, r


@pytest.mark.parametrize("k", [0, 3])
def test_scheduler_reserves_every_sub_step_and_falls_back(k):
    """The steady plan for N sub-steps holds pages for the last one (+ the drafter's K - 1 lookahead) and
    commits fold N times; a request whose output limit falls inside the iteration gets the sub-steps it
    could use with every draft accepted (the host drops what follows its limit), one step when that is 1;
    near the end of the page table fewer sub-steps (none: one step); and a pool without the pages for N
    gets a one-step plan (pages for one step only)."""
    k1, la = k + 1, max(k - 1, 0)
    s, pool, r = _steady(k, 64)
    b = s.schedule(4)
    assert b.steps == 4 and len(b.rows) == 1
    row = b.rows[0]
    assert row.start == 6 and len(r.pages) == pool.pages_for(row.kv_len + 3 * k1 + la)
    s.commit(b, b.steps)  # one scaled fold, as four: the same projection and four rows in flight
    assert r.proj_computed == 6 + 4 * k1 and r.proj_known == r.num_known + 4 * k1
    assert r.inflight_rows == [row] * 4
    before = (r.proj_computed, r.proj_known)
    r.reproject()  # host truth + four folds of the row
    assert (r.proj_computed, r.proj_known) == before
    with pytest.raises(ValueError, match="steady rows"):  # a prompt chunk's fold sets the length: no repeats
        _steady(k, 64)[0].commit(type(b)([type(row)(r, 0, [1, 2], 0, False, False, False, 3)], []), 2)

    for left, want in ((2 * k1 + 1, 3), (2 * k1, 2), (k1, 1), (1, 1)):  # tokens the request may still emit
        s, pool, r = _steady(k, 64, max_tokens=1 + left)
        b = s.schedule(4)
        assert b.steps == want and len(r.pages) == pool.pages_for(6 + want * k1 + la)

    for max_pages in (5, 4, 3):  # a table of 20, 16, 12 positions
        s, pool, r = _steady(k, 64, max_pages)
        fit = (max_pages * 4 - la - 6) // k1  # sub-steps whose rows (+ lookahead) fit the table
        b = s.schedule(4)
        assert b.steps == (min(4, fit) if fit >= 2 else 1)
        assert len(r.pages) == pool.pages_for(6 + b.steps * k1 + la) <= max_pages

    # a pool with pages for one step but not for four
    s, pool, r = _steady(k, 1 + pool.pages_for(6 + k1 + la))
    b = s.schedule(4)
    assert b.steps == 1 and len(b.rows) == 1 and pool.num_free == 0


def test_served_streams_equal_one_step_at_a_time():
    """`m3eagle serve --num-scheduler-steps 4`: eight concurrent streamed completions through the official
    openai client (requests arriving while iterations run) give the texts an N = 1 engine gives offline, and
    the engine ends idle with every page back."""
    import threading

    import openai

    from m3eagle.entrypoints.server import OpenAIServer, ServerThread

    texts = ["def add(a, b):", "import os\n", "class Stack:", "for i in range(10):", "def fib(n):\n    if n",
             "while True:", "x = [1, 2, 3]\n", "def main():\n    args ="]
    sp = SamplingParams(temperature=0, max_tokens=24)
    want = [o.outputs[0].text for o in build(1, 3).generate(texts, sp, use_tqdm=False)]
    llm = build(4, 3, max_num_seqs=16)
    got = [None] * len(texts)
    with ServerThread(OpenAIServer(llm, log_interval=0)) as st:
        c = openai.OpenAI(base_url=st.url + "/v1", api_key="none", max_retries=0, timeout=60)

        def one(i: int) -> None:
            parts = [ch.choices[0].text for ch in c.completions.create(
                model="m3eagle-default", prompt=texts[i], max_tokens=24, temperature=0, stream=True) if ch.choices]
            got[i] = "".join(parts)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(texts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert got == want
    eng = llm.engine
    assert eng.num_iterations < eng.num_steps
    assert eng.is_idle_and_clean() and eng.owner is None


def test_auto_takes_eight_sub_steps_only_for_small_models_replaying_graphs():
    """num_scheduler_steps='auto' resolves from the device, graphs and the weights' size alone (never a
    timing): 8 for a CUDA engine replaying graphs of a model up to 1 GiB, 1 for anything bigger, eager or
    on the CPU; an int passes through; anything else is refused naming the option."""
    from m3eagle.engine.llm_engine import AUTO_MAX_WEIGHT_BYTES, max_scheduler_steps, resolve_scheduler_steps, weight_bytes

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_scheduler_steps("auto", cuda, True, 24 << 20) == 8
    assert resolve_scheduler_steps("auto", cuda, True, AUTO_MAX_WEIGHT_BYTES) == 8
    assert resolve_scheduler_steps("auto", cuda, True, AUTO_MAX_WEIGHT_BYTES + 1) == 1
    assert resolve_scheduler_steps("auto", cuda, False, 24 << 20) == 1  # enforce_eager
    assert resolve_scheduler_steps("auto", cpu, True, 24 << 20) == 1
    assert resolve_scheduler_steps(3, cuda, True, 24 << 20) == 3
    assert max_scheduler_steps("auto") == 8 and max_scheduler_steps(2) == 2
    for bad in (0, "8", 1.0, None, True):
        with pytest.raises(ValueError, match="num_scheduler_steps"):
            resolve_scheduler_steps(bad, cuda, True, 0)
    # A table two modules share counts once (the Eagle3 head reads the target's embeddings).
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
    b.weight = a.weight
    assert weight_bytes(a, b, None) == (16 + 4 + 2) * 4


def test_auto_resolves_to_one_step_on_the_cpu():
    """LLM keeps 'auto' in its own config; the engine's config holds what it runs (1 on the CPU)."""
    llm = LLM(TARGET, draft=HEAD, num_draft_tokens=3, device="cpu", max_model_len=128, max_num_seqs=2,
              num_scheduler_steps="auto")
    assert llm.config.num_scheduler_steps == "auto" and llm.engine.cfg.num_scheduler_steps == 1
    assert len(llm.engine.runner.host_bufs) == 2


def test_one_sub_step_after_a_step_with_prompt_rows(prompts):
    """After a step with prompt rows the next iteration runs one sub-step (under overlap the prompt's first
    token is processed once that iteration is launched, not after N launches); steady iterations after it
    run N. Forced: a request arrives into a running multi-step batch."""
    llm = build(4, 3)
    eng = llm.engine
    plans = []
    schedule = eng.scheduler.schedule

    def spy(steps=1):
        batch = schedule(steps)
        plans.append((all(r.gather for r in batch.rows), batch.steps))
        return batch

    eng.scheduler.schedule = spy
    sp = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    eng.add_request(prompts[0], sp)
    for _ in range(6):
        eng.step()
    eng.add_request(prompts[1], sp)  # its prompt step lands among steady iterations
    eng.run()
    prompt_at = [i for i, (steady, _) in enumerate(plans) if not steady]
    assert len(prompt_at) >= 2 and any(n > 1 for _, n in plans)
    for i in prompt_at:
        if i + 1 < len(plans):
            assert plans[i + 1][1] == 1, plans
    assert plans[prompt_at[0] + 2][1] > 1, plans  # then N again
