"""The draft-tree step's fused Triton ops (engine/tree_ops.py 'triton': the top-k of the tree's growth, the
verification walk, the KV compaction, the rerank and the node rows' layout) held bit-equal to the plain torch
ops they replace, on CPU under the Triton interpreter: op by op on random and scripted trees (full-depth paths,
nothing accepted, partial paths, several rows, padded rows), then inside the engine -- the same trees, tokens
and KV as the reference ops, greedy equal to plain decoding, sync-free.

NOTE: TRITON_INTERPRET is set before anything imports triton, and it holds for the whole pytest process.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton` (kernels decorate at import)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from m3eagle import LLM, SamplingParams  # noqa: E402
from m3eagle.bench.geometries import tiny  # noqa: E402
from m3eagle.engine import draft_tree, step_ops, tree_ops  # noqa: E402
from m3eagle.engine.pool_table import PoolTable  # noqa: E402
from tests.engine.test_draft_tree import scripted_trees, tiny_tree_and_reference  # noqa: E402

REF, TRI = tree_ops.create("reference"), tree_ops.create("triton")


def use_tree_kernels(llm: LLM) -> None:
    """The engine's tree ops and step bookkeeping on the Triton kernels (what a CUDA engine takes); the models
    stay on their CPU backends."""
    runner = llm.engine.runner
    book, tops = step_ops.create("triton"), tree_ops.create("triton")
    runner._step_ops = lambda meta: book
    runner._tree_ops = lambda meta: tops


def record_trees(llm: LLM) -> list[tuple[torch.Tensor, ...]]:
    """Every tree the engine grows, as (tokens, parents, depths) [B, N] each, in step order."""
    runner, seen = llm.engine.runner, []
    grow = runner._grow_tree

    def spy(*a, **k):
        out = grow(*a, **k)
        seen.append(tuple(t.clone() for t in out))
        return out

    runner._grow_tree = spy
    return seen


# ---- growth: expand and the frontier's top-k -------------------------------------------------------------


def test_expand_and_best_equal_the_reference_on_tied_log_probs():
    g = torch.Generator().manual_seed(0)
    for b, f, k, vd in ((1, 1, 4, 6144), (3, 4, 4, 6144), (2, 8, 8, 1000), (4, 2, 1, 33)):
        logp = torch.log_softmax(torch.randn(b, f, vd, generator=g), -1).to(torch.bfloat16).float()
        logp[0, 0, : vd // 2] = float("-inf")  # a masked node
        parent = torch.randn(b, f, generator=g).to(torch.bfloat16).float()
        for want, got in zip(REF.expand(parent, logp, k), TRI.expand(parent, logp, k)):
            assert torch.equal(want, got), (b, f, k, vd)
        scores = REF.expand(parent, logp, k)[1]
        for want, got in zip(REF.best(scores, min(k, scores.shape[1])), TRI.best(scores, min(k, scores.shape[1]))):
            assert torch.equal(want, got)
        m = scores.shape[1]
        parents = torch.randint(-1, 1, (b, m), generator=g)  # every candidate under the root: a valid tree
        n = min(m, 16)
        for want, got in zip(draft_tree.rerank(scores, parents, n, True),
                             draft_tree.rerank(scores, parents, n, True, topk=TRI.best)):
            assert torch.equal(want, got)


def random_candidates(b: int, m: int, vd: int, seed: int) -> tuple[torch.Tensor, ...]:
    """b rows of m candidates as the growth makes them: candidate c hangs under the root or an earlier one, its
    score its parent's plus a bf16-rounded log q <= 0 (ties everywhere, zeros too: a child ties its parent)
    -> (scores [B, M], parents [B, M] (-1: the root), draft ids [B, M], depths [M] (row 0's))."""
    g = torch.Generator().manual_seed(seed)
    parents = (torch.rand(b, m, generator=g) * (torch.arange(m) + 1)).long() - 1  # [B, M] in -1..c-1
    parents[:, : min(m, 4)] = -1
    logq = -(torch.rand(b, m, generator=g) * 3).to(torch.bfloat16).float()
    logq[torch.rand(b, m, generator=g) < 0.1] = 0.0
    scores = torch.zeros(b, m)
    depth = torch.zeros(b, m, dtype=torch.int64)
    for c in range(m):  # in creation order: each parent's score is final before its children's
        p = parents[:, c]
        base = torch.where(p >= 0, scores.gather(1, p.clamp(min=0)[:, None])[:, 0], 0.0)
        scores[:, c] = base + logq[:, c]
        depth[:, c] = torch.where(p >= 0, depth.gather(1, p.clamp(min=0)[:, None])[:, 0], 0) + 1
    return scores, parents, torch.randint(0, vd, (b, m), generator=g), depth[0]


def test_finish_equals_the_reference_rerank():
    """The final rerank + token map + depths on tie-heavy candidate sets, budgets from 1 to every candidate,
    up to the largest tree (8 + 7 * 64 candidates, 64 nodes)."""
    d2t = torch.randint(0, 50, (300,))
    for seed, (b, m, n) in enumerate([(1, 36, 16), (4, 36, 1), (3, 12, 12), (2, 456, 64), (5, 100, 33)]):
        scores, parents, toks, depth = random_candidates(b, m, 300, seed)
        want = tree_ops.finish_reference(scores, parents, toks, d2t, depth, n)
        got = TRI.finish(scores, parents, toks, d2t, depth, n)
        for w, x in zip(want, got):
            assert torch.equal(w, x), (seed, b, m, n)
        assert (want[1] < torch.arange(1, n + 1)).all() and ((want[1] > 0).any() or n == 1)  # closed, topological


# ---- verification walk and compaction ----------------------------------------------------------------------


def random_trees(b: int, n: int, vocab: int, seed: int) -> tuple[torch.Tensor, ...]:
    """b random trees of n nodes in a topological storage order (node i + 1 hangs under one of i - 2..i: deep
    trees), tokens from a
    small vocabulary (siblings often share one: the walk takes the first), and argmax tokens that follow many
    of them -> (greedy_tok [B, N+1], tokens [B, N], parents [B, N], num_nodes [B]: full, partial and 0)."""
    g = torch.Generator().manual_seed(seed)
    parents = (torch.arange(n) - torch.randint(0, 3, (b, n), generator=g)).clamp(min=0)  # [B, N] in i-2..i
    tokens = torch.randint(0, vocab, (b, n), generator=g)
    greedy = torch.randint(0, vocab, (b, n + 1), generator=g)
    follow = torch.rand(b, n, generator=g) < 0.6  # the parent's argmax is this child's token: deep paths
    greedy = greedy.scatter(1, torch.where(follow, parents, n + 1).clamp(max=n), torch.where(follow, tokens, 0))
    greedy[:, n] = torch.randint(0, vocab, (b,), generator=g)  # the column the scatter used as a dump
    num_nodes = torch.randint(0, n + 1, (b,), generator=g)
    num_nodes[0], num_nodes[-1] = n, 0  # a full row, a padded row
    return greedy, tokens, parents, num_nodes


def test_walk_equals_the_reference_on_random_and_scripted_trees():
    """Random trees (full-depth paths, nothing accepted, partial, padded rows) at several depths and widths."""
    depth_seen = set()
    for seed, (b, n, d) in enumerate([(1, 16, 3), (4, 16, 3), (8, 8, 4), (5, 64, 8), (3, 6, 1), (6, 12, 5)]):
        greedy, tokens, parents, num_nodes = random_trees(b, n, 3, seed)
        for width in (n + 1, d + 1, max(d - 1, 1)):
            want = REF.walk(greedy, tokens, parents, num_nodes, d, width)
            got = TRI.walk(greedy, tokens, parents, num_nodes, d, width)
            for w, x in zip(want, got):
                assert torch.equal(w, x), (seed, width)
            depth_seen.update(want[1].tolist())
    assert {1, 2, 4, 5} <= depth_seen  # nothing accepted, partial, full depth (d = 3, 4) ran
    # scripted: the right path down the second branch to full depth (d = 3) or to its leaf (d = 6); the parents
    # a [B, N+1] view's columns (strided)
    greedy = torch.tensor([[7, 5, 9, 11, 13, 15, 17]])
    toks = torch.tensor([[6, 7, 9, 11, 13, 15]])  # node 1 is wrong, 3..6 chain under node 2
    full = torch.tensor([[0, 0, 0, 2, 3, 4, 5]])
    for d in (3, 6):
        want = REF.walk(greedy, toks, full[:, 1:], torch.tensor([6]), d, 7)
        got = TRI.walk(greedy, toks, full[:, 1:], torch.tensor([6]), d, 7)
        assert all(torch.equal(w, x) for w, x in zip(want, got)) and int(got[1]) == min(d, 5) + 1


def _pools(slots: int, seed: int) -> list[torch.Tensor]:
    """Pools of a layer stack: bf16 K [S, 2, 8], fp32 V [S, 2, 4], an index-K [S, 6] (rows of 12..32 bytes)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(slots, 2, 8, generator=g).to(torch.bfloat16), torch.randn(slots, 2, 4, generator=g),
            torch.randn(slots, 6, generator=g).to(torch.bfloat16), torch.randn(slots, 2, 8, generator=g)]


@pytest.mark.parametrize("byte_pool", [False, True], ids=["words", "bytes"])
def test_compact_equals_the_reference_on_walked_paths(byte_pool):
    """Paths from walks of random trees (full, partial, none, padded rows) over shuffled page tables: every pool
    equals the reference's after the copy; `bytes`: a 1-byte pool of odd rows makes the kernel copy bytes."""
    page, b, n, d = 4, 6, 16, 4
    for seed in range(4):
        greedy, tokens, parents, num_nodes = random_trees(b, n, 3, seed)
        _, num_new, path = REF.walk(greedy, tokens, parents, num_nodes, d, n + 1)
        num_new = torch.where(num_nodes > 0, num_new, 0)  # rows that sample nothing copy nothing
        g = torch.Generator().manual_seed(seed)
        pages = 6 * b + 2
        page_table = torch.randperm(pages, generator=g)[: 6 * b].view(b, 6)  # [B, 6] 24 positions a row
        p0 = torch.randint(0, 24 - n - 1, (b,), generator=g)
        want = _pools(pages * page, seed)
        if byte_pool:
            want.append(torch.randint(0, 100, (pages * page, 3), dtype=torch.uint8, generator=g))
        got = [p.clone() for p in want]
        table = PoolTable(got)
        assert table.current() and table.word == (1 if byte_pool else 4)
        tree_ops.compact_reference(want, page_table, page, p0, path, num_new)
        TRI.compact(table, page_table, page, p0, path, num_new)
        for w, x in zip(want, got):
            assert torch.equal(w.view(torch.uint8), x.view(torch.uint8)), seed
        assert any(not torch.equal(w, p) for w, p in zip(want, _pools(pages * page, seed)))  # something moved


# ---- the engine --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_reference():
    """(prompts, params, plain greedy tokens, vocab) of the engine test's parametrizations, decoded once: 10
    tokens a request give each row over 5 trees and the scripted trees every pattern (4 + 1 + 2 tokens)."""
    _, prompts, sp, plain, vocab = tiny_tree_and_reference("3,3,8", 7, (30, 41, 19), 10)
    return prompts, sp, plain, vocab


@pytest.mark.parametrize("graph_shapes", [False, True, "prefill"], ids=["eager", "buckets", "prefill"])
def test_engine_on_tree_kernels_grows_the_reference_trees(graph_shapes, plain_reference):
    """The head's own trees on the tiny geometry: the kernels' engine grows exactly the reference engine's trees
    step by step and emits the plain greedy tokens; then scripted trees (full paths down second branches,
    nothing accepted, partial paths) through the kernels' walk and compaction, still the plain tokens.
    `prefill`: prompt and mixed steps padded to prefill buckets too (the node rows' query width the bucket's)."""
    prompts, sp, plain, vocab = plain_reference
    kw = dict(graph_shapes=True, prefill_graphs=graph_shapes == "prefill") if graph_shapes else {}
    ref_llm = _tiny_tree("3,3,8", **kw)
    t_llm = _tiny_tree("3,3,8", **kw)
    use_tree_kernels(t_llm)
    want_trees, got_trees = record_trees(ref_llm), record_trees(t_llm)
    assert [o.outputs[0].token_ids for o in ref_llm.generate(prompts, sp)] == plain
    assert [o.outputs[0].token_ids for o in t_llm.generate(prompts, sp)] == plain
    assert len(got_trees) == len(want_trees) > 5
    for w, g in zip(want_trees, got_trees):
        assert all(torch.equal(a, b) for a, b in zip(w, g))
    used = scripted_trees(t_llm, {tuple(p): p + r for p, r in zip(prompts, plain)}, vocab)
    assert [o.outputs[0].token_ids for o in t_llm.generate(prompts, sp)] == plain
    assert set(used) == {0, 1, 2} and t_llm.engine.counters.accept_hist[3] > 0
    t_llm.engine.check_integrity()


def _tiny_tree(spec: str, **kw) -> LLM:
    """A tree LLM on the tiny geometry's dummy weights (tiny_tree_and_reference's engine, other options)."""
    t, h = tiny()
    return LLM(t, draft=h, draft_tree=spec, device="cpu", load_format="dummy", max_model_len=160, page_size=8, **kw)


def test_seeded_engine_on_tree_kernels_equals_the_reference_ops():
    """Sampled rows (seeded, top_p, logprobs): the kernels' engine emits the reference ops' tokens and logprobs."""
    ref_llm, prompts, _, _, _ = tiny_tree_and_reference("3,2,6", 5, (23, 35), 1)
    t_llm = _tiny_tree("3,2,6")
    use_tree_kernels(t_llm)
    sp = [SamplingParams(temperature=0.9, top_p=0.9, seed=3 + i, max_tokens=12, logprobs=2, ignore_eos=True)
          for i in range(len(prompts))]
    want, got = ref_llm.generate(prompts, sp), t_llm.generate(prompts, sp)
    for w, g in zip(want, got):
        assert w.outputs[0].token_ids == g.outputs[0].token_ids
        assert w.outputs[0].logprobs == g.outputs[0].logprobs
