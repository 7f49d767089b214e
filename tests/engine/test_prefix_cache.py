"""Automatic prefix caching through the engine, CPU fp32: outputs with the cache on equal the cache off,
token for token, for plain and speculative decoding, overlap on and off, sparse-attention contexts past
the selection threshold, n > 1, seeded sampling, forced preemption (its pages re-hit), forced eviction,
a hit on a prefix another request is still computing, and faults. Every scenario forces its hits (the
second wave is sent after the first has computed the prefix) and asserts them, and every engine is
checked for leaked pages. The cached pages carry the draft head's KV and the index-K: compared
directly with what the request computes without the cache."""

from __future__ import annotations

import pytest
import torch

from m3eagle import LLM, SamplingParams
from tests.helpers.engine_utils import Counters, assert_clean, greedy

PS = 8
NEW = 6


@pytest.fixture(scope="module")
def prompts():
    """Two shared prefixes (45 and 70 tokens: past the tiny model's sparse selection of 2 blocks of 8)
    and unique suffixes of 0-19 tokens; one prompt is exactly the prefix."""
    g = torch.Generator().manual_seed(11)
    pre = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (45, 70)]
    out = []
    for i, n in enumerate((5, 19, 1, 0)):
        out.append(pre[i % 2] + torch.randint(3, 96, (n,), generator=g).tolist())
    return out


def llm_for(model_dir, head_dir, k: int, overlap: bool, caching: bool, **kw) -> LLM:
    kw = {"device": "cpu", "page_size": PS, "max_model_len": 160, "max_num_tokens": 64, **kw}
    return LLM(model_dir, draft=head_dir if k else None, num_draft_tokens=k, overlap=overlap,
               enable_prefix_caching=caching, **kw)


def two_waves(llm: LLM, prompts, params) -> list:
    """The first prompt of each prefix alone, then all of them: the second wave hits the first's pages."""
    first = llm.generate(prompts[:2], params)
    return first + llm.generate(prompts, params)


def tokens(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def expected_hit(prompt: list[int], done: list[list[int]]) -> int:
    """Tokens a prompt finds once the sequences `done` (prompt + output, finished) are cached: full pages
    whose tokens and next token it shares with one of them -- (common prefix - 1) // PS pages, which also
    leaves the prompt's last token and the sequence's uncomputed last token out."""
    def common(a: list[int], b: list[int]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    return max((max(common(prompt, d), 1) - 1) // PS * PS for d in done)


@pytest.mark.parametrize("k, overlap", [(0, False), (0, True), (3, False), (3, True)],
                         ids=["plain", "plain-overlap", "spec", "spec-overlap"])
def test_greedy_identical_on_off(model_dir, head_dir, prompts, k, overlap):
    off = llm_for(model_dir, head_dir, k, overlap, False)
    on = llm_for(model_dir, head_dir, k, overlap, True)
    want, got = two_waves(off, prompts, greedy(NEW)), two_waves(on, prompts, greedy(NEW))
    assert tokens(got) == tokens(want)
    cached = [o.num_cached_tokens for o in got]
    assert cached[:2] == [0, 0]
    # the second wave: each prompt finds what the first wave (or the same prefix's earlier prompt) left
    done = [o.prompt_token_ids + o.outputs[0].token_ids for o in got[:2]]
    assert cached[2:] == [expected_hit(p, done) for p in prompts]
    assert all(o.num_cached_tokens is None for o in want)
    eng = on.engine
    assert eng.prefix_cache_hits == sum(cached) > 0
    assert eng.prefix_cache_queries == sum(len(p) for p in prompts[:2] + prompts)
    assert_clean(on)
    assert_clean(off)


def test_seeded_sampling_and_n_identical_on_off(model_dir, head_dir, prompts):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=NEW, n=2, ignore_eos=True)
    got = two_waves(llm_for(model_dir, head_dir, 3, True, True), prompts, params)
    want = two_waves(llm_for(model_dir, head_dir, 3, True, False), prompts, params)
    assert tokens(got) == tokens(want)
    assert all(len(o.outputs) == 2 for o in got) and sum(o.num_cached_tokens for o in got) > 0


def test_draft_kv_and_index_k_really_come_with_the_pages(model_dir, head_dir, prompts):
    """A hit's pages hold the target K/V, the sparse layers' index-K and the Eagle3 head's KV that the
    request itself computes without the cache (allclose: another batch computed them)."""
    def run(caching: bool):
        llm = llm_for(model_dir, head_dir, 3, False, caching)
        sched, seen = llm.engine.scheduler, {}
        release = sched.release

        def spy(req):
            seen[req.request_id] = list(req.pages)
            release(req)

        sched.release = spy
        first = llm.generate(prompts[:1], greedy(NEW))[0].request_id
        out = llm.generate(prompts[2:3], greedy(NEW))  # 45 + 1 after 45 + 5: 40 tokens hit
        return llm, seen[next(r for r in seen if r != first)], out[0]

    on, pages_on, out_on = run(True)
    off, pages_off, out_off = run(False)
    assert out_on.num_cached_tokens == 40 and out_on.outputs[0].token_ids == out_off.outputs[0].token_ids
    n = 40 // PS

    def slots(pages):
        return torch.tensor([p * PS + i for p in pages[:n] for i in range(PS)])

    def pools(llm):
        r = llm.engine.runner
        return [*r.caches, r.draft_cache]

    s_on, s_off = slots(pages_on), slots(pages_off)
    checked_idx = 0
    for c_on, c_off in zip(pools(on), pools(off)):
        torch.testing.assert_close(c_on.k[s_on], c_off.k[s_off], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(c_on.v[s_on], c_off.v[s_off], rtol=1e-4, atol=1e-5)
        if c_on.idx_k is not None:
            torch.testing.assert_close(c_on.idx_k[s_on], c_off.idx_k[s_off], rtol=1e-4, atol=1e-5)
            checked_idx += 1
    assert checked_idx > 0
    assert float(on.engine.runner.draft_cache.k[s_on].abs().sum()) > 0


def test_forced_preemption_rehits_its_own_pages(model_dir, head_dir, prompts):
    """Preempted requests register their pages on the way out; readmitted, they hit them."""
    kw = {"max_num_tokens": 24, "max_num_seqs": 4}
    want = llm_for(model_dir, head_dir, 3, True, False, **kw).generate(prompts, greedy(NEW))
    llm = llm_for(model_dir, head_dir, 3, True, True, **kw)
    counters = Counters(llm, force_every=5)
    admissions: dict[str, list[int]] = {}
    sched = llm.engine.scheduler
    count = sched._count_lookup

    def spy(req, hit):
        admissions.setdefault(req.request_id, []).append(len(hit or ()))
        count(req, hit)

    sched._count_lookup = spy
    got = llm.generate(prompts, greedy(NEW))
    assert tokens(got) == tokens(want)
    assert counters.preempted > 0
    assert any(any(later) for hits in admissions.values() for later in [hits[1:]])  # a readmission re-hit
    assert_clean(llm)


def test_forced_eviction_keeps_outputs_and_accounting(model_dir, head_dir, prompts):
    """A pool too small to keep every prefix evicts cached pages (least recently freed first) and still
    gives the cache-off tokens."""
    kw = {"num_pages": 16, "max_num_seqs": 1, "max_model_len": 100}
    want = llm_for(model_dir, head_dir, 0, True, False, **kw)
    llm = llm_for(model_dir, head_dir, 0, True, True, **kw)
    for llm_ in (want, llm):
        llm_.outs = [llm_.generate([p], greedy(NEW))[0] for p in prompts * 2]
    assert tokens(llm.outs) == tokens(want.outs)
    assert llm.engine.pool.num_evictions > 0
    llm.engine.check_integrity()
    assert_clean(llm)


def test_hit_on_a_prefix_still_being_computed(model_dir, head_dir, prompts):
    """B arrives while A's long prompt is mid-prefill (chunks of 24, overlap): B hits only pages A has
    finished -- never one a step in flight is still writing -- computes the rest itself, and both equal
    the cache off."""
    def run(caching: bool):
        llm = llm_for(model_dir, head_dir, 3, True, caching, max_num_tokens=24)
        eng, at_admission = llm.engine, {}
        count = eng.scheduler._count_lookup

        def spy(req, hit):
            at_admission[req.request_id] = (a.num_computed, a.proj_computed, len(hit or ()) * PS)
            count(req, hit)

        eng.scheduler._count_lookup = spy
        a = eng.add_request(prompts[1], greedy(NEW), request_id="a")
        outs, b = {}, None
        while eng.has_work() or eng.has_output():
            if b is None and a.num_computed >= 24:
                b = eng.add_request(prompts[1][:-1] + [5], greedy(NEW), request_id="b")
            for d in eng.step():
                if d.output is not None:
                    outs[d.request_id] = d.output
        assert_clean(llm)
        return outs, at_admission

    (on, seen), (off, _) = run(True), run(False)
    assert {r: o.outputs[0].token_ids for r, o in on.items()} == {r: o.outputs[0].token_ids for r, o in off.items()}
    a_done, a_launched, hit = seen["b"]
    assert a_done < a_launched < len(prompts[1])  # A still computing its prompt, a step of it in flight
    assert 0 < hit == on["b"].num_cached_tokens <= a_done  # what A had finished, not what it was writing


def test_reset_prefix_cache(model_dir, head_dir, prompts):
    llm = llm_for(model_dir, head_dir, 0, False, True)
    p = prompts[0]
    assert [llm.generate([p], greedy(4))[0].num_cached_tokens for _ in range(2)] == [0, (len(p) - 1) // PS * PS]
    assert llm.engine.reset_prefix_cache() is True
    assert llm.engine.pool.num_cached == 0
    assert llm.generate([p], greedy(4))[0].num_cached_tokens == 0
    assert_clean(llm)


def test_requests_reading_the_prompt_take_no_hits(model_dir, head_dir, prompts):
    """Prompt logprobs and a repetition penalty read the prompt itself: no hit, and their outputs equal
    the cache off; they do register their pages for others."""
    llm = llm_for(model_dir, head_dir, 0, False, True)
    off = llm_for(model_dir, head_dir, 0, False, False)
    p = prompts[0]
    for params in (greedy(4, prompt_logprobs=1), greedy(4, repetition_penalty=1.3)):
        llm.generate([p], greedy(4))
        a, b = llm.generate([p], params)[0], off.generate([p], params)[0]
        assert a.num_cached_tokens == 0 and a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.prompt_logprobs == b.prompt_logprobs or params.prompt_logprobs is None
    assert llm.generate([p], greedy(4))[0].num_cached_tokens > 0
    assert_clean(llm)


def test_fault_drops_the_cache_and_leaks_nothing(monkeypatch, model_dir, head_dir, prompts):
    llm = llm_for(model_dir, head_dir, 3, True, True)
    llm.generate(prompts[:2], greedy(NEW))
    assert llm.engine.pool.num_cached > 0
    runner, calls = llm.engine.runner, [0]
    execute = runner.execute

    def boom(*a, **kw):
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("injected")
        return execute(*a, **kw)

    monkeypatch.setattr(runner, "execute", boom)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate(prompts, greedy(NEW))
    monkeypatch.undo()
    assert llm.engine.pool.num_cached == 0
    assert_clean(llm)
    want = llm_for(model_dir, head_dir, 3, True, False).generate(prompts, greedy(NEW))
    assert tokens(llm.generate(prompts, greedy(NEW))) == tokens(want)
    assert_clean(llm)


@pytest.mark.parametrize("k", [0, 3])
def test_a_request_finished_by_its_first_token_caches_its_prompt(model_dir, head_dir, prompts, k):
    """max_tokens=1 (classification, prompt-only benchmarks): the prompt's pages are registered when the
    request finishes inside the step that computes its prompt."""
    llm = llm_for(model_dir, head_dir, k, False, True)
    p = prompts[1]
    got = [llm.generate([p], greedy(1))[0].num_cached_tokens for _ in range(2)]
    assert got == [0, (len(p) - 1) // PS * PS]
    assert_clean(llm)
