"""Draft-tree node rows on the Triton attention kernels, held equal to the reference backend under the interpreter.

The node rows come from the tree runner's own layout (`tree_layout.node_rows_from_trees`, the torch reference):
each tree row's nodes are one-token rows whose keys are the committed context, then their ancestors at their depth
positions (the metadata's tail override). Dense attention, the lightning indexer (exactly the same blocks) and
sparse attention, split and unsplit, on a mixed step (tree rows beside a prompt chunk: whole sub-rows and empty
ones) and on a uniform one (every row N + 1 wide: one-token sub-rows, a prompt row's tokens causal). Slots no
node may read -- siblings, other branches, the trash page -- hold a poison value."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton` (kernels decorate at import)

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from m3eagle.engine.draft_tree import ancestors, full_tree  # noqa: E402
from m3eagle.engine.tree_layout import node_rows_from_trees  # noqa: E402
from m3eagle.engine.tree_runner import TreeModelRunner  # noqa: E402
from m3eagle.kernels.attention import reference, triton_kernels  # noqa: E402
from m3eagle.kernels.attention.backend import ReferenceBackend  # noqa: E402
from m3eagle.kernels.attention.metadata import TRASH_PAGE, build_metadata, row_key_slots  # noqa: E402
from m3eagle.kernels.attention.triton_backend import TritonBackend  # noqa: E402

POISON = 1e3
# root -> 1, 2; 1 -> 3, 4; 3 -> 5  and  root -> 1 -> 2 -> 3 -> 4; root -> 5
TREES = [([0, 0, 1, 1, 3], [1, 1, 2, 2, 3]), ([0, 1, 2, 3, 0], [1, 2, 3, 4, 1])]
DEPTH, PAGE = 4, 4


def node_step(seed: int, rows: list[tuple[str, int, int]], hq: int = 4, hkv: int = 2, d: int = 16, hi: int = 2,
              di: int = 8):
    """rows: ("tree", p0, tree index) or ("prompt", q_len, kv_len). -> (node-row metadata, q, k, v, iq, ik)."""
    g = torch.Generator().manual_seed(seed)
    n1 = len(TREES[0][0]) + 1
    q_lens = [n1 if kind == "tree" else a for kind, a, _ in rows]
    kv_lens = [a + n1 if kind == "tree" else b for kind, a, b in rows]
    max_kv = max(kv_lens) + 3
    width = -(-max_kv // PAGE) + 1
    held = [-(-n // PAGE) for n in kv_lens]
    pages = (torch.randperm(sum(held), generator=g) + 1).tolist()
    table = torch.full((len(rows), width), TRASH_PAGE, dtype=torch.int64)
    for r, n in enumerate(held):
        table[r, :n] = torch.tensor(pages[:n])
        pages = pages[n:]
    meta = build_metadata(q_lens, torch.tensor(kv_lens), table, PAGE, torch.device("cpu"), max_kv=max_kv)
    parents = torch.stack([torch.tensor(TREES[i][0] if k == "tree" else TREES[0][0]) for k, _, i in rows])
    depths = torch.stack([torch.tensor(TREES[i][1] if k == "tree" else TREES[0][1]) for k, _, i in rows])
    fp, fd = full_tree(parents, depths)
    anc = ancestors(fp, fd, DEPTH)
    b, t = len(rows), sum(q_lens)
    nd = torch.tensor([n1 - 1 if kind == "tree" else 0 for kind, _, _ in rows])
    first = torch.tensor([0] + q_lens[:-1]).cumsum(0)
    inp = SimpleNamespace(num_rows=b, num_tokens=t)
    p0 = meta.kv_lens - meta.q_lens
    lay = node_rows_from_trees(meta, fp, fd, anc, p0, first, nd, n1 - 1, TreeModelRunner._uniform(inp, meta, n1 - 1),
                               torch.arange(max(n1, DEPTH)), torch.arange(b), torch.ones(b, dtype=torch.bool))
    tmeta = TreeModelRunner._node_meta(meta, lay)
    slots = (sum(held) + 1) * PAGE

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    k, v, ik = rnd(slots, hkv, d), rnd(slots, hkv, d), rnd(slots, di)
    seen = row_key_slots(tmeta, max_kv)[torch.arange(max_kv)[None, :] < tmeta.kv_lens[:, None]]
    valid = torch.zeros(slots, dtype=torch.bool)
    valid[seen] = True
    for pool in (k, v, ik):
        pool[~valid] = POISON  # what no node row may read
    return tmeta, rnd(t, hq, d), k, v, rnd(t, hi, di), ik


STEPS = {"mixed": [("tree", 13, 0), ("prompt", 4, 22), ("tree", 30, 1)],
         "uniform": [("tree", 17, 1), ("prompt", 6, 9), ("tree", 9, 0)]}


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.isfinite(out).all()
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    assert err <= 1e-4, f"max relative error {err:.2e}"


@pytest.mark.parametrize("name", list(STEPS))
def test_tree_dense_attention_matches_reference(name):
    meta, q, k, v, _, _ = node_step(1, STEPS[name])
    assert meta.max_q == (1 if name == "uniform" else 6)
    ref = ReferenceBackend().attention(q, k, v, meta, 0.4)
    assert ref.abs().max() < POISON / 10  # no poisoned key reached the reference either
    for splits in (1, 3):
        out = torch.full_like(q, float("nan"))
        triton_kernels.dense_attention(q, k, v, meta, 0.4, num_splits=splits, block_n=16, out=out)
        _close(out, ref)
    _close(TritonBackend().attention(q, k, v, meta, 0.4), ref)


@pytest.mark.parametrize("name", list(STEPS))
def test_tree_sparse_selection_and_attention_match_reference(name):
    """Blocks of 4 keys, top-2 with one local block: contexts of up to 40 keys select for real."""
    meta, q, k, v, iq, ik = node_step(2, STEPS[name])
    block, topk, local = 4, 2, 1
    ik_rows = ik[row_key_slots(meta, meta.max_kv)]  # [B', L, Di]
    want = reference.select_blocks(reference.pad_queries(iq, meta), ik_rows, reference.padded_positions(meta),
                                   block, topk, local)[meta.tok_row, :, meta.tok_col]  # [T, Hi, k]
    for splits in (1, 4):
        got = triton_kernels.select_blocks(iq, ik, meta, block, topk, local, num_splits=splits)
        assert torch.equal(got, want)
    ref = ReferenceBackend().sparse_attention(q, k, v, meta, 0.4, iq, ik, block, topk, local)
    assert ref.abs().max() < POISON / 10
    _close(TritonBackend().sparse_attention(q, k, v, meta, 0.4, iq, ik, block, topk, local), ref)
    _close(triton_kernels.sparse_attention(q, k, v, meta, 0.4, want, block, num_splits=2), ref)


# The TAIL-on variants of the recorded dense, sparse and indexer launches -- what a tree step launches on the
# GPU -- compile for sm_90 in test_kernels_compile.py's pass over the recorded launches (one compile pass).
