"""The draft-tree step's layout kernels (engine/tree_layout_kernels.py) held bit-equal to the plain torch layout
(engine/tree_layout.py) on CPU under the Triton interpreter: the node rows of uniform (graph-shaped) and mixed
steps -- tree rows of every verify count, prompt rows, padded rows, deep and wide random trees, and mixed steps
padded to a prefill graph's bucket (max_q the bucket's tokens, wider than every row).

NOTE: TRITON_INTERPRET is set before anything imports triton, and it holds for the whole pytest process.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton` (kernels decorate at import)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from m3eagle.engine import tree_layout, tree_ops  # noqa: E402
from m3eagle.kernels.attention.metadata import AttnMetadata  # noqa: E402

REF, TRI = tree_ops.create("reference"), tree_ops.create("triton")


def stored_trees(slots: int, n: int, depth: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """slots random trees of n nodes in a topological storage order, depth <= `depth` -> (parents, depths)
    [slots, n]: node i (column i - 1) hangs under the root or an earlier node of depth < `depth`."""
    parents = torch.zeros(slots, n, dtype=torch.int64)
    depths = torch.ones(slots, n, dtype=torch.int64)
    for s in range(slots):
        dep = [0]
        for i in range(1, n + 1):
            ok = [p for p in range(i) if dep[p] < depth]
            p = ok[int(torch.randint(0, len(ok), (1,), generator=g))]
            parents[s, i - 1], depths[s, i - 1] = p, dep[p] + 1
            dep.append(dep[p] + 1)
    return parents, depths


def step(q_lens: list[int], drafts: list[int], n: int, depth: int, seed: int, page: int = 4, max_q: int = 0,
         ) -> tuple[AttnMetadata, torch.Tensor, ...]:
    """A verify step of rows with q_lens tokens (num_drafts `drafts`) over random stored trees of n nodes, max_q
    at least `max_q` (a prefill bucket's tokens) -> (metadata, slot_parents, slot_depths, row_slot, row_first,
    num_drafts)."""
    g = torch.Generator().manual_seed(seed)
    b = len(q_lens)
    q = torch.tensor(q_lens)
    first = torch.cumsum(q, 0) - q
    tok_row = torch.repeat_interleave(torch.arange(b), q)
    tok_col = torch.arange(int(q.sum())) - first[tok_row]
    kv = q + torch.randint(0, 30, (b,), generator=g)
    pages = 70  # the largest tree copies its [65, 70] page rows in three chunks
    table = torch.randint(1, 200, (b, pages), generator=g)  # [B, P]
    table[:, -2:] = 0  # trash past the held pages
    meta = AttnMetadata(num_rows=b, max_q=max(*q_lens, max_q), max_kv=int(kv.max()) + 5, page_size=page, q_lens=q,
                        kv_lens=kv, page_table=table, tok_row=tok_row, tok_col=tok_col, q_index=None, q_valid=None,
                        positions=(kv - q)[tok_row] + tok_col, slot_mapping=None)
    sp, sd = stored_trees(b + 2, n, depth, g)
    row_slot = torch.randperm(b + 2, generator=g)[:b]
    return meta, sp, sd, row_slot, first, torch.tensor(drafts)


CASES = [  # (q_lens, num_drafts, N, D, width[, max_q])
    ([17] * 3, [16, 16, 0], 16, 3, 16),  # graph-shaped 3,4,16: two tree rows, a padding row
    ([4] * 5, [3, 2, 0, 3, 1], 16, 3, 3),  # the narrow width: the first 3 nodes
    ([9, 1, 30, 5, 9], [8, 0, 0, 4, 8], 8, 5, 8),  # mixed: prompt rows, a short tree row
    ([65, 65], [64, 40], 64, 8, 64),  # the largest tree
    ([3, 2, 1], [2, 1, 0], 6, 1, 2),  # depth 1
    # prefill buckets: a prompt chunk, narrow tree rows, padding rows of one token and the last of the rest
    ([20, 4, 4, 1, 3], [0, 3, 3, 0, 0], 16, 3, 3, 32),
    ([11, 17, 17, 1, 50], [0, 16, 16, 0, 0], 16, 3, 16, 96),  # full-width tree rows; max_q takes two BLOCK_Q
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_node_rows_equal_the_reference(case):
    q_lens, drafts, n, d, w, *max_q = CASES[case]
    meta, sp, sd, row_slot, first, nd = step(q_lens, drafts, n, d, case, max_q=max_q[0] if max_q else 0)
    b = len(q_lens)
    uniform = sum(q_lens) == b * (w + 1) and meta.max_q == w + 1
    assert uniform == (case < 2 or case == 3)
    consts = (torch.arange(max(n + 1, d)), torch.arange(b), torch.ones(b, dtype=torch.bool))
    ids = torch.randint(0, 1000, meta.tok_row.shape, generator=torch.Generator().manual_seed(case))
    held = torch.randint(1, n + 1, (b + 2,), generator=torch.Generator().manual_seed(case))  # chains and trees
    want = REF.node_rows(meta, ids, sp, sd, row_slot, first, nd, w, d, uniform, *consts, held)
    got = TRI.node_rows(meta, ids, sp, sd, row_slot, first, nd, w, d, uniform, *consts, held)
    for name, x, y in zip(want._fields, want, got):
        assert x.dtype == y.dtype and torch.equal(x, y), (case, name)
    assert torch.equal(want.num_nodes, torch.minimum(nd, held[row_slot]))
    assert (want.num_nodes < nd).any() or max(drafts) <= 3  # the wide cases clip some row to its held nodes
    assert (want.anc[..., 1:] > 0).any() and (want.tail_start < meta.max_kv).any()  # real trees were laid out


# ---- the head's frontier and the trees' slot rows ----------------------------------------------------------


def grow(ops, b: int, k: int, depth: int, hd: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """The frontiers of levels 1..D-1 of b rows over random candidates (bf16-rounded log q: ties everywhere), each
    level's outputs and the candidate parents written so far -> [(frontier fields..., cand_parent)] per level."""
    g = torch.Generator().manual_seed(seed)
    m = k + (depth - 1) * k * k
    cand_score = -(torch.rand(b, m, generator=g) * 4).to(torch.bfloat16).float()
    cand_score[:, 1] = cand_score[:, 0]  # a tie at the top
    cand_tok = torch.randint(0, 50, (b, m), generator=g)
    cand_parent = torch.full((b, m), 99)
    d2t = torch.randint(0, 9, (50,), generator=g)
    base = torch.randint(0, 40, (b,), generator=g)
    page_table = torch.randint(0, 300, (b, 300), generator=g)  # copied in two chunks at K = 8
    out, prev = [], None
    for level in range(1, depth):
        h_next = torch.randn(b * (k if level > 1 else 1), hd, generator=g).to(torch.bfloat16)
        prev = ops.frontier(prev, cand_score, cand_tok, cand_parent, h_next, d2t, base, page_table, level, k,
                            (1000, (depth - 1) * k), torch.arange(b), torch.arange(k))
        out.append((*prev, cand_parent.clone()))
    return out


@pytest.mark.parametrize("b,k,depth,hd", [(2, 4, 3, 600), (3, 1, 4, 8), (1, 8, 3, 40), (2, 3, 5, 24)])
def test_frontier_equals_the_reference(b, k, depth, hd):
    """Every level's frontier (scores, candidates, tokens, parents, target ids, hidden rows, positions, scratch
    slots, page table, tail start) and the candidate parents written, on tie-heavy candidates, hidden rows wider
    than one block, K = 1 and deep trees."""
    want, got = grow(REF, b, k, depth, hd, depth), grow(TRI, b, k, depth, hd, depth)
    names = tree_layout.Frontier._fields + ("cand_parent",)
    for level, (w, x) in enumerate(zip(want, got), 1):
        for name, a, c in zip(names, w, x):
            assert a.dtype == c.dtype and torch.equal(a, c), (level, name)
    assert (want[-1][-1] != 99).all() and (want[-1][3] > 0).any() == (k > 1)  # every parent written; real picks


@pytest.mark.parametrize("n", [6, 3], ids=["full", "chain"])
def test_store_equals_the_reference(n):
    """Full trees (n = N) and a narrow step's chains (n = D < N: the first n columns, the rest stale) with the
    held counts."""
    g = torch.Generator().manual_seed(0)
    trees = tuple(torch.randint(0, 100, (3, n), generator=g) for _ in range(3))
    want = tuple(torch.randint(0, 100, (5, 6), generator=g) for _ in range(3)) + (torch.full((5,), 9),)
    got = tuple(x.clone() for x in want)
    slot = torch.tensor([4, 0, 2])
    REF.store(slot, trees, want[:3], want[3])
    TRI.store(slot, trees, got[:3], got[3])
    assert all(torch.equal(w, x) for w, x in zip(want, got)) and torch.equal(want[1][2, :n], trees[1][2])
    assert want[3].tolist() == [n, 9, n, 9, n]


@pytest.mark.parametrize("case", [1, 2, 3])
def test_path_perm_equals_the_reference(case):
    """Accepted paths of every length (none, partial, full depth) in tree rows that sample or not, beside prompt
    rows and padded rows: the permutation, the permuted ids and aux rows (wider than one block, strided) and the
    sampling rows' num_new."""
    q_lens, drafts, n, d, _ = CASES[case]
    meta, *_ = step(q_lens, drafts, n, d, case)
    g = torch.Generator().manual_seed(case)
    b = len(q_lens)
    path = torch.zeros(b, d + 1, dtype=torch.int64)
    num_new = torch.ones(b, dtype=torch.int64)
    for r, nd in enumerate(drafts):
        moves = min(d, max(nd - 1, 0), r % (d + 1) + 1) if r else 0  # none in row 0, then longer paths
        path[r, 1:moves + 1] = torch.arange(nd - moves + 1, nd + 1)  # the last nodes: every token moves
        num_new[r] = moves + 1
    num_new[torch.tensor(drafts) == 0] = 2  # rows without a tree never move, whatever they emit
    moving = (num_new > 1).nonzero().flatten().tolist()  # tree rows with a path
    samples = torch.ones(b, dtype=torch.bool)
    if len(moving) > 1:
        samples[moving[-1]] = False  # a tree row with a path that samples nothing moves nothing
    ids = torch.randint(0, 1000, (meta.tok_row.shape[0],), generator=g)
    aux = torch.randn(ids.shape[0] + 3, 200, generator=g).to(torch.bfloat16)[:-3, 10:170]  # [T, 160] strided rows
    args = (ids, aux, torch.cumsum(meta.q_lens, 0) - meta.q_lens, num_new, samples, torch.tensor(drafts), path,
            meta.tok_row, meta.tok_col)
    want, got = REF.path_perm(*args), TRI.path_perm(*args)
    assert all(w.dtype == x.dtype and torch.equal(w, x) for w, x in zip(want, got))
    assert not torch.equal(want[1], torch.arange(ids.shape[0]))  # something moved


def test_every_tree_kernel_waits_first_when_pdl_is_on():
    """As every engine kernel (tests/kernels/test_pdl.py): the tree's kernels take PDL and their first statement
    after the docstring is `pdl_wait(PDL)`, so a kernel launched early touches no memory before its predecessor
    ends."""
    import ast
    import inspect

    from m3eagle.engine import tree_kernels, tree_layout_kernels
    from m3eagle.kernels.topk import triton_topk

    seen = []
    for mod in (tree_kernels, tree_layout_kernels, triton_topk):
        for name, fn in vars(mod).items():
            if name.endswith("_kernel") and inspect.isfunction(getattr(fn, "fn", None)):
                body = ast.parse(inspect.getsource(fn.fn).lstrip()).body[0].body
                assert "PDL" in inspect.signature(fn.fn).parameters, name
                assert ast.unparse(body[1]) == "pdl_wait(PDL)", name
                seen.append(name)
    assert len(seen) == 8, seen
