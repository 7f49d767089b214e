"""The automatic choice between the full draft tree and its first D nodes (draft_tree.verify_width): the threshold
is a pure function of measured step costs (or of the shape), and a request whose steps switch between the two
widths mid-request -- a second request joining and leaving with tree_max_batch=1 -- keeps every invariant:
greedy == plain greedy (eager and padded to graph buckets, random and scripted trees), seeded sampling
reproducible, the deterministic mode == plain, and the narrow step stays free of host reads. A narrow step grows a
chain (top-1 per level, D nodes) for the next step, and a full step after it verifies only those D nodes."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton` (see test_triton_attention.py)

import pytest  # noqa: E402
import torch  # noqa: E402

from m3eagle import LLM, SamplingParams  # noqa: E402
from m3eagle.bench.geometries import tiny  # noqa: E402
from m3eagle.engine.draft_tree import (  # noqa: E402
    SHAPE_RULE_TOKENS,
    TreeSpec,
    expected_gain,
    narrow_width,
    rerank,
    tree_max_batch_from_costs,
    tree_max_batch_from_shape,
    verify_width,
)
from m3eagle.engine.graph_runner import NARROW  # noqa: E402
from tests.engine.test_draft_tree import scripted_trees  # noqa: E402
from tests.engine.test_tree_graphs import _guard_execute, _NoSync  # noqa: E402
from tests.helpers.engine_utils import assert_clean  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

KW = dict(device="cpu", load_format="dummy", max_model_len=96, page_size=8)
SPEC = "3,3,8"  # narrow width 3


# ---- the rule ---------------------------------------------------------------------------------------------


def test_threshold_is_a_pure_function_of_the_costs():
    costs = {1: (1.0, 0.9), 2: (1.1, 1.0), 4: (1.5, 1.0), 8: (1.2, 1.1)}
    assert tree_max_batch_from_costs(costs, 1.13) == 2  # 4 does not pay; 8 would, but past a bucket that does not
    assert tree_max_batch_from_costs(dict(reversed(costs.items())), 1.13) == 2  # order of the measurements
    assert tree_max_batch_from_costs(costs, 1.6) == 8
    assert tree_max_batch_from_costs({1: (1.26, 0.23), 32: (2.27, 0.46)}, 1.13) == 0  # the H100 pair: never
    assert tree_max_batch_from_costs({}, 2.0) == 0


def test_prior_gain_shape_rule_and_width():
    spec = TreeSpec.parse("3,4,16")
    assert 1.10 < expected_gain(spec) < 1.17  # the H100 embedded pair measures MAL 3.82 / 3.39
    assert expected_gain(TreeSpec.parse("3,4,16")) > expected_gain(TreeSpec.parse("3,4,6")) > 1.0
    assert tree_max_batch_from_shape(spec) == SHAPE_RULE_TOKENS // 17
    assert narrow_width(spec) == 3 and narrow_width(TreeSpec.parse("4,1,2")) == 2
    assert [verify_width(spec, 2, b) for b in (1, 2, 3, 64)] == [16, 16, 3, 3]


def test_score_order_prefixes_are_best_trees():
    """Every prefix of the score-ordered rerank is the best tree of that budget: closed under ancestors (a parent
    is stored before its children) and the `m` best candidates."""
    g = torch.Generator().manual_seed(0)
    k, depth = 3, 3
    parents = [-1] * k
    for lv in range(1, depth):  # each level: k children under each of the previous level's first k
        base = k + (lv - 2) * k * k if lv > 1 else 0
        parents += [base + f for f in range(k) for _ in range(k)]
    par = torch.tensor([parents] * 4)
    lp = -torch.rand(4, len(parents), generator=g)
    scores = lp.clone()
    for i, p in enumerate(parents):  # cumulative: a child never outscores its parent
        if p >= 0:
            scores[:, i] = scores[:, p] + lp[:, i]
    sel, spar = rerank(scores, par, 12, score_order=True)
    for m in range(1, 13):
        assert (spar[:, :m] < torch.arange(1, m + 1)).all()  # parents stored before children
        best = scores.sort(dim=-1, descending=True, stable=True).indices[:, :m]
        assert torch.equal(sel[:, :m].sort(-1).values, best.sort(-1).values)


# ---- engines ----------------------------------------------------------------------------------------------


def _prompts(seed: int, lengths: tuple[int, ...], vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


def _staggered(llm: LLM, prompts: list[list[int]], sps: list[SamplingParams], join_after: int = 3,
               ) -> tuple[list[list[int]], list[list[int]]]:
    """Request 0 alone for `join_after` steps, then request 1 joins (and leaves first). -> (tokens per request,
    the drafts per row of every step's rows)."""
    eng, widths = llm.engine, []
    schedule = eng.scheduler.schedule

    def spy(*a, **k):
        batch = schedule(*a, **k)
        widths.append([r.num_drafts for r in batch.rows])
        return batch

    eng.scheduler.schedule = spy
    try:
        first = eng.add_request(prompts[0], sps[0], stream_text=False)
        done = []
        for _ in range(join_after):
            done += [d.output for d in eng.step() if d.output is not None]
        second = eng.add_request(prompts[1], sps[1], stream_text=False)
        done += eng.run()
    finally:
        del eng.scheduler.schedule
    by_id = {o.request_id: o.outputs[0].token_ids for o in done}
    return [by_id[first.request_id], by_id[second.request_id]], widths


def _switched(widths: list[list[int]], n: int, d: int) -> bool:
    """Full trees alone, then narrow ones with the second request, then full ones alone again."""
    kinds = [w[0] if len(w) == 1 else (d if all(x in (0, d) for x in w) and d in w else None) for w in widths]
    narrow = [i for i, k in enumerate(kinds) if k == d and len(widths[i]) == 2]
    full = [i for i, w in enumerate(widths) if w == [n]]
    return bool(narrow) and any(i < narrow[0] for i in full) and any(i > narrow[-1] for i in full)


@pytest.fixture(scope="module")
def geometry():
    t, h = tiny()
    return t, h


@pytest.mark.parametrize("graph_shapes", [False, True], ids=["eager", "buckets"])
def test_greedy_switching_width_equals_plain(geometry, graph_shapes):
    """tree_max_batch=1: the long request verifies full trees alone, the first D nodes while the second runs, full
    ones again after: the plain greedy tokens, with the random head's trees and with scripted ones (paths down
    second branches, rejections, partial paths). `buckets`: narrow decode steps padded to their own buckets."""
    t, h = geometry
    prompts = _prompts(5, (23, 11), t.vocab_size)
    sps = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (24, 6)]
    ref = [o.outputs[0].token_ids for o in LLM(t, num_draft_tokens=0, **KW).generate(prompts, sps)]
    tree = LLM(t, draft=h, draft_tree=SPEC, tree_max_batch=1, graph_shapes=graph_shapes, **KW)
    assert tree.engine.scheduler.tree_max_batch == 1 and tree.engine.cfg.tree_max_batch == 1
    seen: list[object] = []
    build = tree.engine.graphs.build
    tree.engine.graphs.build = lambda batch, bucket, *args: (seen.append(bucket), build(batch, bucket, *args))[1]
    got, widths = _staggered(tree, prompts, sps)
    assert got == ref and _switched(widths, 8, 3), widths
    used = scripted_trees(tree, {tuple(p): p + r for p, r in zip(prompts, ref)}, t.vocab_size)
    tree.reset_stats()
    got, widths = _staggered(tree, prompts, sps)
    assert got == ref and _switched(widths, 8, 3), widths
    assert set(used) == {0, 1, 2} and tree.engine.counters.accept_hist[3] > 0
    if graph_shapes:
        assert (NARROW, 2, 3) in seen and 1 in seen, seen
    assert_clean(tree)


def test_seeded_switching_reproducible_and_deterministic_equals_plain(geometry):
    """Seeded sampling across forced switches gives the same tokens run after run; the deterministic mode's
    coupled walk across them gives plain decoding's draws."""
    t, h = geometry
    prompts = _prompts(8, (17, 9), t.vocab_size)
    sps = [SamplingParams(temperature=0.9, top_p=0.95, seed=3 + i, max_tokens=m, ignore_eos=True)
           for i, m in enumerate((20, 5))]
    tree = LLM(t, draft=h, draft_tree=SPEC, tree_max_batch=1, **KW)
    first, widths = _staggered(tree, prompts, sps)
    again, _ = _staggered(tree, prompts, sps)
    assert first == again and _switched(widths, 8, 3), widths
    assert_clean(tree)
    kw = dict(KW, deterministic=True)
    ref = [o.outputs[0].token_ids for o in LLM(t, num_draft_tokens=0, **kw).generate(prompts, sps)]
    det = LLM(t, draft=h, draft_tree=SPEC, tree_max_batch=1, **kw)
    got, widths = _staggered(det, prompts, sps)
    assert got == ref and _switched(widths, 8, 3), widths
    assert_clean(det)


def test_narrow_steps_are_sync_free_and_override_zero_never_verifies_the_full_tree(geometry):
    """tree_max_batch=0: every verify row carries the first D nodes, in graph buckets of their own, and the step
    reads nothing back to the host; the tokens are plain greedy's."""
    t, h = geometry
    prompts = _prompts(9, (19, 12, 7), t.vocab_size)
    sps = [SamplingParams(temperature=0, max_tokens=10 + 3 * i, ignore_eos=True) for i in range(3)]
    ref = [o.outputs[0].token_ids for o in LLM(t, num_draft_tokens=0, **KW).generate(prompts, sps)]
    tree = LLM(t, draft=h, draft_tree=SPEC, tree_max_batch=0, graph_shapes=True, **KW)
    counts: dict[str, int] = {}
    _guard_execute(tree, counts)
    scripted_trees(tree, {tuple(p): p + r for p, r in zip(prompts, ref)}, t.vocab_size)
    tree.engine.runner._grow_tree = _NoSync.allowed(tree.engine.runner._grow_tree)  # the script reads tokens
    widths: list[int] = []
    schedule = tree.engine.scheduler.schedule

    def spy(*a, **k):
        batch = schedule(*a, **k)
        widths.extend(r.num_drafts for r in batch.rows)
        return batch

    tree.engine.scheduler.schedule = spy
    assert [o.outputs[0].token_ids for o in tree.generate(prompts, sps)] == ref
    assert set(widths) <= {0, 3} and 3 in widths and counts.get("decode", 0) > 3, (widths, counts)
    assert tree.engine.counters.accept_hist[1] > 0  # the scripted right node among the first D
    assert_clean(tree)


def test_option_validation_and_default_rule(geometry):
    t, h = geometry
    with pytest.raises(ValueError, match="tree_max_batch"):
        LLM(t, draft=h, num_draft_tokens=3, tree_max_batch=4, **KW)
    with pytest.raises(ValueError, match="tree_max_batch"):
        LLM(t, draft=h, draft_tree=SPEC, tree_max_batch=-1, **KW)
    tree = LLM(t, draft=h, draft_tree=SPEC, **KW)  # CPU: the shape rule
    assert tree.engine.cfg.tree_max_batch == tree_max_batch_from_shape(TreeSpec.parse(SPEC))


def test_engine_takes_the_threshold_from_measured_costs(geometry, monkeypatch):
    """With step costs measured (injected here: CPU has no graphs to time), the engine's threshold is the rule's on
    them and the shape's prior gain; the scheduler narrows the steps past it."""
    from m3eagle.engine.graph_runner import GraphRunner

    t, h = geometry
    costs = {1: (1.0, 0.95), 2: (1.05, 1.0), 4: (2.0, 1.0), 8: (2.0, 1.0)}
    monkeypatch.setattr(GraphRunner, "step_costs", lambda self: costs)
    tree = LLM(t, draft=h, draft_tree=SPEC, graph_shapes=True, **KW)
    want = tree_max_batch_from_costs(costs, expected_gain(TreeSpec.parse(SPEC)))
    assert want == 2 and tree.engine.cfg.tree_max_batch == 2 and tree.engine.scheduler.tree_max_batch == 2


def test_greedy_switching_under_overlap_equals_plain(geometry):
    """Under overlap the host plans a narrow step while a full one runs (and back): the device's length correction
    follows each row's own drafts, and the tokens stay plain greedy's."""
    t, h = geometry
    prompts = _prompts(6, (21, 13), t.vocab_size)
    sps = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (22, 7)]
    ref = [o.outputs[0].token_ids for o in LLM(t, num_draft_tokens=0, **KW).generate(prompts, sps)]
    tree = LLM(t, draft=h, draft_tree=SPEC, tree_max_batch=1, overlap=True, **KW)
    scripted_trees(tree, {tuple(p): p + r for p, r in zip(prompts, ref)}, t.vocab_size)
    got, widths = _staggered(tree, prompts, sps)
    assert got == ref and _switched(widths, 8, 3), widths
    assert_clean(tree)


class _Spy:
    """Per executed step: (its verify width, the nodes each row's walk verified, the grown trees [B, n] x 3)."""

    def __init__(self, llm: LLM) -> None:
        runner, self.steps = llm.engine.runner, []
        execute, grow, tree_ops = runner.execute, runner._grow_tree, runner._tree_ops
        spy = self

        class Ops:  # the step's tree ops, its walk recording num_nodes
            def __init__(self, ops):
                self.ops = ops

            def __getattr__(self, name):
                return getattr(self.ops, name)

            def walk(self, greedy, tokens, parents, num_nodes, *a):
                spy.steps[-1][1] = num_nodes.tolist()
                return self.ops.walk(greedy, tokens, parents, num_nodes, *a)

        def run(inp):
            self.steps.append([inp.draft_width, None, None])
            return execute(inp)

        def record(*a, **k):
            out = grow(*a, **k)
            self.steps[-1][2] = tuple(x.clone() for x in out)
            return out

        runner.execute, runner._grow_tree, runner._tree_ops = run, record, lambda meta: Ops(tree_ops(meta))


@pytest.mark.parametrize("ops", ["reference", "triton"])
def test_narrow_steps_grow_chains_and_full_steps_verify_only_them(geometry, ops):
    """tree_max_batch=1 with graph-shaped buckets: every narrow step (two rows, width D = 3) grows exactly D nodes per
    row, node i under node i - 1 at depth i (the head's greedy path); every full step grows N; the first full step
    after a narrow one verifies D nodes (the held count), not N; the tokens are plain greedy's, and the kernels'
    growth equals the reference's bit for bit."""
    t, h = geometry
    prompts = _prompts(5, (23, 11), t.vocab_size)
    sps = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (24, 6)]
    ref = [o.outputs[0].token_ids for o in LLM(t, num_draft_tokens=0, **KW).generate(prompts, sps)]
    llms = [LLM(t, draft=h, draft_tree=SPEC, tree_max_batch=1, graph_shapes=True, **KW) for _ in range(2)]
    if ops == "triton":
        from tests.engine.test_tree_kernels import use_tree_kernels

        use_tree_kernels(llms[1])
    spies = [_Spy(llm) for llm in llms]
    for llm in llms:
        got, widths = _staggered(llm, prompts, sps)
        assert got == ref and _switched(widths, 8, 3), widths
        assert_clean(llm)
    steps = spies[1].steps
    chain = torch.tensor([[0, 1, 2]]), torch.tensor([[1, 2, 3]])
    narrow = [i for i, (w, _, trees) in enumerate(steps) if w == 3]
    assert narrow and all(steps[i][2][0].shape == (2, 3) for i in narrow), [s[0] for s in steps]
    for i in narrow:
        _, parents, depths = steps[i][2]
        assert torch.equal(parents, chain[0].expand(2, 3)) and torch.equal(depths, chain[1].expand(2, 3))
    full = [i for i, (w, _, trees) in enumerate(steps) if w == 8]
    assert all(steps[i][2][0].shape[1] == 8 for i in full)
    after = [i for i in full if i - 1 in narrow]
    assert after and all(steps[i][1] == [3] for i in after), [(s[0], s[1]) for s in steps]
    assert all(steps[i][1] == [8] for i in full if i - 1 in full)
    for (w, nn, want), (w2, nn2, got) in zip(spies[0].steps, steps, strict=True):
        assert (w, nn) == (w2, nn2) and all(torch.equal(a, b) for a, b in zip(want, got))
