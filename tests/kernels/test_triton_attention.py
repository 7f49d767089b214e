"""The Triton attention backend held equal to the PyTorch reference, on CPU under the Triton interpreter.

Every test draws fresh random inputs (its own seed), poisons what the kernels must overwrite or must not
read, and compares against `reference.paged_attention` in fp32 at ~1e-4, and against
`reference.select_blocks` exactly (the same blocks, listed in ascending id). Steps mix the row kinds the engine
produces: a prompt chunk over a cached prefix, single-token decode rows and 1+K spec-verify rows, with
page tables that run into TRASH_PAGE past each row's held pages. The indexer runs both as one launch and
split over programs (+ merge); ties use integer-valued scores, so that they are exact ties on every
summation order.

NOTE: TRITON_INTERPRET is set before anything imports triton, and it holds for the whole pytest process:
a CUDA test module collected in the same run would run its Triton kernels interpreted too.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton` (kernels decorate at import)

from dataclasses import dataclass, replace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from m3eagle.kernels.attention import backend, reference, triton_kernels  # noqa: E402
from m3eagle.kernels.attention.metadata import TRASH_PAGE, AttnMetadata, build_metadata, gather_slots  # noqa: E402
from m3eagle.kernels.attention.triton_backend import TritonBackend  # noqa: E402
from m3eagle.kernels.ops import REFERENCE  # noqa: E402

CPU = torch.device("cpu")
# Keys a kernel must never let through its masks (slots past kv_len, the trash page) hold this: one such
# key in a softmax moves the output far beyond the tolerance.
POISON = 1e3


@dataclass
class Step:
    meta: AttnMetadata
    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [S, Hkv, D]
    v: torch.Tensor  # [S, Hkv, D]
    iq: torch.Tensor  # [T, Hi, Di]
    ik: torch.Tensor  # [S, Di]


def make_step(seed: int, q_lens: list[int], kv_lens: list[int], page_size: int, hq: int = 4, hkv: int = 2,
              d: int = 16, hi: int = 2, di: int = 8, extra_kv: int = 5, extra_cols: int = 2) -> Step:
    """Random pools and a shuffled page table: row b holds ceil(kv_lens[b] / page_size) pages, the rest of
    its table (extra_cols more than max_kv needs) is TRASH_PAGE. max_kv overshoots every kv_len, as the
    host's optimistic bound does."""
    gen = torch.Generator().manual_seed(seed)
    max_kv = max(kv_lens) + extra_kv
    width = -(-max_kv // page_size) + extra_cols
    held = [-(-n // page_size) for n in kv_lens]
    pages = (torch.randperm(sum(held), generator=gen) + 1).tolist()  # page 0 is the trash page
    table = torch.full((len(q_lens), width), TRASH_PAGE, dtype=torch.int64)
    for r, n in enumerate(held):
        table[r, :n] = torch.tensor(pages[:n], dtype=torch.int64)
        pages = pages[n:]
    meta = build_metadata(q_lens, torch.tensor(kv_lens), table, page_size, CPU, max_kv=max_kv)
    slots = (sum(held) + 1) * page_size
    t = sum(q_lens)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    k, v, ik = rnd(slots, hkv, d), rnd(slots, hkv, d), rnd(slots, di)
    valid = torch.zeros(slots, dtype=torch.bool)
    valid[gather_slots(meta, max_kv)[torch.arange(max_kv)[None, :] < meta.kv_lens[:, None]]] = True
    for pool in (k, v, ik):
        pool[~valid] = POISON  # trash page and the undefined tail of each row's last page
    return Step(meta, rnd(t, hq, d), k, v, rnd(t, hi, di), ik)


def assert_close(out: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all(), "non-finite output: a slot the kernel never wrote, or a bad mask"
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    assert err <= rel, f"max relative error {err:.2e} > {rel:.0e}"


def ref_selection(s: Step, block: int, topk: int, local: int) -> torch.Tensor:
    """reference.select_blocks on padded rows, as flat [T, Hi, k]."""
    meta = s.meta
    ik_rows = s.ik[gather_slots(meta, meta.max_kv)]  # [B, L, Di]
    sel = reference.select_blocks(reference.pad_queries(s.iq, meta), ik_rows, reference.padded_positions(meta),
                                  block, topk, local)  # [B, Hi, Qmax, k]
    return sel[meta.tok_row, :, meta.tok_col]


# Mixed steps: (q_lens, kv_lens, page_size). Row kinds: prompt chunk over a cached prefix (7 new on 36
# cached), a fresh prompt (kv == q), decode rows, 1+K verify rows. Page sizes 5 and 8 divide no length.
MIXED = [([7, 1, 4, 1], [43, 1, 30, 19], 8),
         ([12, 4, 1], [12, 61, 2], 5)]


@pytest.mark.parametrize("q_lens,kv_lens,page_size", MIXED)
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 16), (4, 1, 24), (2, 2, 16)])
def test_dense_matches_reference(q_lens, kv_lens, page_size, hq, hkv, d):
    s = make_step(sum(q_lens) * 100 + hq * 10 + d, q_lens, kv_lens, page_size, hq=hq, hkv=hkv, d=d)
    ref = reference.paged_attention(s.q, s.k, s.v, s.meta, 0.3)
    for splits, block_n in ((1, 16), (3, 16), (1, 32)):
        out = torch.full_like(s.q, float("nan"))  # every (token, head) must be written
        triton_kernels.dense_attention(s.q, s.k, s.v, s.meta, 0.3, num_splits=splits, block_n=block_n, out=out)
        assert_close(out, ref)
    assert_close(TritonBackend().attention(s.q, s.k, s.v, s.meta, 0.3), ref)


def test_dense_token_causal_inside_a_row():
    """Each query of a multi-token row has its own extent: a kernel that let the whole row see its last
    token's keys would pass single-token rows and fail here."""
    s = make_step(11, [6], [6], 4)
    out = TritonBackend().attention(s.q, s.k, s.v, s.meta, 0.5)
    assert_close(out, reference.paged_attention(s.q, s.k, s.v, s.meta, 0.5))
    first = s.v[gather_slots(s.meta, 1)[0, 0]]  # [Hkv, D]: token 0 sees key 0 alone
    torch.testing.assert_close(out[0], first.repeat_interleave(2, 0), rtol=1e-5, atol=1e-6)


def test_lengths_past_the_table_clamp_like_reference():
    """An optimistic kv_len can run past the table (overlap scheduling before the correction): key
    positions past the last column read that column's page, as `slots_for_positions` clamps them."""
    gen = torch.Generator().manual_seed(12)
    table = torch.tensor([[3, 1, 4, 2], [5, 6, TRASH_PAGE, TRASH_PAGE]])  # 4 columns of 4 slots
    meta = build_metadata([3, 2], torch.tensor([22, 13]), table, 4, CPU, max_kv=24)
    q = torch.randn(5, 4, 16, generator=gen)  # [T, Hq, D]
    k, v = torch.randn(28, 2, 16, generator=gen), torch.randn(28, 2, 16, generator=gen)  # [S, Hkv, D]
    iq, ik = torch.randn(5, 2, 8, generator=gen), torch.randn(28, 8, generator=gen)
    assert_close(TritonBackend().attention(q, k, v, meta, 0.3), reference.paged_attention(q, k, v, meta, 0.3))
    args = (q, k, v, meta, 0.3, iq, ik, 4, 2, 1)
    assert_close(TritonBackend().sparse_attention(*args), reference.paged_attention(*args))


# (num_splits, min_blocks_per_split) of the indexer: one launch; split in 3 (runs of several blocks, sized
# from each row's kv_len); split in 40 runs of 2 blocks (more than a row holds: the programs past its last
# block find nothing and exit, and the merge must not read them).
INDEX_SPLITS = [(1, 1), (3, 1), (40, 2)]


@pytest.mark.parametrize("block,topk,local,hi", [(4, 2, 1, 2), (8, 3, 0, 2), (6, 2, 2, 4), (4, 3, 1, 1)])
def test_selection_matches_reference(block, topk, local, hi):
    """The same blocks as the oracle, in its canonical (ascending) listing, one launch or split; contexts several times
    topk * block, none a multiple of the block; multi-token rows; rows with fewer blocks than topk."""
    s = make_step(100 + block * topk + local, [9, 1, 4, 3], [70, 33, 52, 3], 8, hq=4, hi=hi)
    ref = ref_selection(s, block, topk, local)
    assert (ref >= 0).sum(-1).min() < ref.shape[-1] <= (ref >= 0).sum(-1).max()  # -1 padding exercised
    for (splits, min_blocks), small in [(c, 256) for c in INDEX_SPLITS] + [((40, 2), 1), ((3, 1), 1)]:
        # small=1: the merge scans every split's list, not the narrow width (each path forced)
        sel = triton_kernels.select_blocks(s.iq, s.ik, s.meta, block, topk, local, num_splits=splits,
                                           min_blocks_per_split=min_blocks, merge_small_candidates=small)
        assert sel.dtype == ref.dtype and torch.equal(sel, ref), (splits, min_blocks, small)
    sel = TritonBackend(min_index_keys_per_split=block).select_blocks(s.iq, s.ik, s.meta, block, topk, local)
    assert torch.equal(sel, ref)


def integer_step(seed: int, q_lens: list[int], kv_lens: list[int], page_size: int, levels: int, hi: int = 2,
                 di: int = 4) -> Step:
    """A step whose index scores are small integers (exact on every summation order): iq, ik in
    {-levels..levels} over di dims, so many blocks share their maximum and many keys share a score."""
    s = make_step(seed, q_lens, kv_lens, page_size, hi=hi, di=di)
    gen = torch.Generator().manual_seed(seed + 1)
    iq = torch.randint(-levels, levels + 1, s.iq.shape, generator=gen).float()
    ik = torch.randint(-levels, levels + 1, s.ik.shape, generator=gen).float()
    return replace(s, iq=iq, ik=torch.where(s.ik == POISON, POISON, ik))


def boundary_ties(s: Step, block: int, topk: int, local: int) -> int:
    """(token, head) rows whose k-th and (k+1)-th best block scores are equal, as the oracle scores them."""
    meta = s.meta
    ik = s.ik[gather_slots(meta, meta.max_kv)]  # [B, L, Di]
    pos = reference.padded_positions(meta)
    scores = torch.einsum("bqhd,bkd->bhqk", reference.pad_queries(s.iq, meta), ik)
    scores = scores.masked_fill(torch.arange(ik.shape[1]) > pos[:, None, :, None], float("-inf"))
    nb = -(-ik.shape[1] // block)
    scores = torch.nn.functional.pad(scores, (0, nb * block - ik.shape[1]), value=float("-inf"))
    blocks = scores.unflatten(-1, (nb, block)).amax(-1)  # [B, Hi, Qmax, NB]
    for i in range(local):
        own = (torch.div(pos, block, rounding_mode="floor") - i).clamp(min=0)
        blocks.scatter_(-1, own[:, None, :, None].expand(-1, blocks.shape[1], -1, 1), float("inf"))
    top = blocks.sort(-1, descending=True).values
    tie = (top[..., topk - 1] == top[..., topk]) & (top[..., topk] > float("-inf"))
    return int((tie & meta.q_valid[:, None, :]).sum())


@pytest.mark.parametrize("levels,block,topk,local", [(1, 4, 3, 1), (1, 6, 4, 0), (2, 5, 3, 1), (1, 4, 2, 3)])
def test_selection_ties_match_reference(levels, block, topk, local):
    """Exact ties at the top-k boundary: equal block maxima must resolve to the lower block id, as the
    oracle's stable sort does, in one launch and across split lists. (1, 4, 2, 3): three forced local
    blocks for a top-2, so +inf ties decide (the two lowest win)."""
    s = integer_step(500 + levels * 10 + block, [6, 1, 4, 2], [61, 29, 47, 9], 8, levels)
    ref = ref_selection(s, block, topk, local)
    assert boundary_ties(s, block, topk, local) >= 5
    for (splits, min_blocks), small in [(c, 256) for c in INDEX_SPLITS] + [((40, 2), 1)]:
        sel = triton_kernels.select_blocks(s.iq, s.ik, s.meta, block, topk, local, num_splits=splits,
                                           min_blocks_per_split=min_blocks, merge_small_candidates=small)
        assert torch.equal(sel, ref), (splits, min_blocks, small)


# Scores that a float-bits key can get wrong: both zeros, denormals, the extreme normals, both infinities.
ADVERSARIAL = [0.0, -0.0, 1e-45, -1e-45, 3e-45, -3e-45, 1.1754944e-38, -1.1754944e-38, 1.0, -1.0,
               3.4028235e38, -3.4028235e38, float("inf"), float("-inf")]


@triton.jit
def _pack_probe(S, B, Key, Back, N: tl.constexpr):
    """The kernels' own helpers on N (score, block) pairs: packed keys, and the block each decodes to."""
    offs = tl.arange(0, N)
    key = triton_kernels._pack_key(tl.load(S + offs), tl.load(B + offs))
    tl.store(Key + offs, key)
    tl.store(Back + offs, triton_kernels._key_block(key))


def test_pack_key_order_is_the_oracles_order():
    """Integer order of the packed keys == the oracle's order (stable descending sort of the scores over
    blocks in id order) for every pair of real entries; -0.0 and +0.0 are equal scores (torch's sort
    keeps them in id order), ids decode back, and -inf and NaN pack to KEY_NONE, below every real key."""
    n = 128
    gen = torch.Generator().manual_seed(30)
    palette = torch.tensor(ADVERSARIAL + [float("nan")])
    scores = palette[torch.randint(0, len(palette), (n,), generator=gen)]  # [N]
    scores[:2] = torch.tensor([-0.0, 0.0])
    ids = torch.cat([torch.tensor([2**31 - 1, 0, 1, 2**31 - 2]), torch.randperm(10**6, generator=gen)[:n - 4] + 2])
    ids = ids.to(torch.int32)
    keys, back = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int32)
    _pack_probe[(1,)](scores, ids, keys, back, N=n)

    real = scores > float("-inf")  # NaN is not
    assert real.sum() < n - 5 and (scores[real] == 0).sum() > 2
    order = ids[real].argsort()  # the oracle: blocks in id order, then a stable descending sort of scores
    order = order[scores[real][order].sort(descending=True, stable=True).indices]
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order))
    k = keys[real]
    assert torch.equal(k[:, None] > k[None, :], rank[:, None] < rank[None, :])
    assert torch.equal(back[real], ids[real])
    assert (keys[~real] == -(2**63)).all() and (k > -(2**63)).all()


def adversarial_step(seed: int) -> Step:
    """A step whose block maxima are ADVERSARIAL values, exactly: every key of a block holds one value v on
    index dim 0 (0 elsewhere), index head 0 queries +1 and head 1 -1 on dim 0, so scores are v and -v.
    Row 3 has three -inf blocks (for head 0) among its six, so its tokens' top-4 ends in -1. Every token
    sees more than 4 blocks (the all-visible shortcut takes blocks whatever their scores, -inf included)."""
    s = make_step(seed, [5, 1, 3, 2], [61, 37, 26, 22], 8, hq=4, hi=2, di=4)
    gen = torch.Generator().manual_seed(seed + 1)
    meta, block = s.meta, 4
    slots = gather_slots(meta, meta.max_kv)  # [B, L]
    nb = meta.max_kv // block + 1
    # [B, blocks]: one value per block, from five of the values per row (so that blocks tie)
    five = torch.stack([torch.randperm(len(ADVERSARIAL), generator=gen)[:5] for _ in range(meta.num_rows)])
    values = torch.tensor(ADVERSARIAL)[five.gather(1, torch.randint(0, 5, (meta.num_rows, nb), generator=gen))]
    values[3, [0, 2, 3]] = float("-inf")
    ik = s.ik.clone()
    for r, n in enumerate(meta.kv_lens.tolist()):
        ik[slots[r, :n]] = 0.0
        ik[slots[r, :n], 0] = values[r, torch.arange(n) // block]
    iq = torch.zeros_like(s.iq)
    iq[:, 0, 0], iq[:, 1, 0] = 1.0, -1.0
    return replace(s, iq=iq, ik=ik)


@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul")  # padding query rows (0) x inf keys
@pytest.mark.parametrize("local", [0, 1])
def test_selection_adversarial_scores_match_reference(local):
    """Block maxima from ADVERSARIAL (negative scores, denormals, +-inf, many equal): the same blocks as the
    oracle, one launch or split, direct lists or insertion; blocks whose maximum is -inf emit -1. (A dot
    sums from +0.0, so it never scores -0.0; the pack test above holds -0.0 == +0.0.)"""
    block, topk = 4, 4
    s = adversarial_step(950 + local)
    ref = ref_selection(s, block, topk, local)
    assert (ref < 0).any() and boundary_ties(s, block, topk, local) >= 5
    for (splits, min_blocks), direct in [(c, True) for c in INDEX_SPLITS] + [((40, 2), False)]:
        sel = triton_kernels.select_blocks(s.iq, s.ik, s.meta, block, topk, local, num_splits=splits,
                                           min_blocks_per_split=min_blocks, direct_lists=direct)
        assert torch.equal(sel, ref), (splits, min_blocks, direct)


# (num_splits, min_blocks_per_split, topk, direct): runs of 2 blocks in lists of 2 slots (long-context
# decode's shape: a block written one slot too far falls off), of 3 in lists of 3 (4 slots), and runs of
# several blocks longer than their list of 3 (insertion, whatever direct_lists says).
LIST_PATHS = [(40, 2, 2, True), (40, 3, 3, True), (3, 1, 3, False)]


@pytest.mark.parametrize("splits,min_blocks,topk,direct", LIST_PATHS)
def test_selection_direct_lists_and_insertion(splits, min_blocks, topk, direct):
    """A run whose blocks all fit its list takes each block into its own slot (DIRECT, no comparison);
    forcing insertion instead (direct_lists=False) must give the same lists. Both against the oracle, on
    integer scores with ties at the top-k boundary."""
    block, local = 4, 1
    s = integer_step(960 + min_blocks, [6, 1, 4, 2], [61, 29, 47, 9], 8, levels=1)
    ref = ref_selection(s, block, topk, local)
    assert boundary_ties(s, block, topk, local) >= 5
    nb = -(-s.meta.max_kv // block)
    assert triton_kernels.index_plan(nb, topk, block, splits, min_blocks).direct == direct
    for direct_lists in (True, False):
        sel = triton_kernels.select_blocks(s.iq, s.ik, s.meta, block, topk, local, num_splits=splits,
                                           min_blocks_per_split=min_blocks, direct_lists=direct_lists)
        assert torch.equal(sel, ref), direct_lists


def test_index_keys_per_iter_changes_the_loop_not_the_selection():
    """TritonBackend(index_keys_per_iter=...) scores more blocks per loop iteration (capped at the blocks
    a split scans); the selection is the oracle's either way. On CPU the backend splits 17 blocks in 6 runs
    of 3 (direct lists), in 2 runs of 9 (insertion), or not at all."""
    block, topk, local = 4, 3, 1
    s = integer_step(970, [6, 1, 4], [61, 29, 47], 8, levels=1)
    ref = ref_selection(s, block, topk, local)
    nb = -(-s.meta.max_kv // block)
    for kpi, min_keys in ((16, 8), (32, 32), (32, 400)):
        tri = TritonBackend(min_index_keys_per_split=min_keys, index_keys_per_iter=kpi)
        assert torch.equal(tri.select_blocks(s.iq, s.ik, s.meta, block, topk, local), ref), (kpi, min_keys)
    assert [triton_kernels.index_plan(nb, topk, block, 1, 1, kpi).blocks_per_iter for kpi in (16, 32)] == [4, 8]


def test_index_plan_fits_every_run_when_direct():
    """DIRECT is a constexpr, so the host must prove it for every row: a row's run holds
    max(cdiv(row_blocks, splits), min_bps) blocks for any row_blocks <= NB, never more than the list."""
    for nb in range(1, 300, 7):
        for k in (1, 2, 3, 16):
            for splits in (1, 2, 3, 40, 256, 4000):
                for min_bps in (1, 2, 3):
                    plan = triton_kernels.index_plan(nb, min(k, nb), 128, splits, min_bps)
                    most = max(max(-(-rb // plan.splits), min_bps) for rb in range(1, nb + 1))
                    assert plan.direct == (most <= plan.cap), (nb, k, splits, min_bps)
                    assert plan.cap <= plan.block_k and plan.splits * plan.block_k <= triton_kernels.MAX_MERGE_CANDIDATES


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_selection_mixed_dtypes(dtypes):
    """iq and index-K of different dtypes score in fp32, as the oracle does; integer data keeps the sums
    exact, so the selection must equal the fp32 oracle's. (bf16 x bf16 takes the native dot, which the
    Triton 3.9 interpreter computes wrongly; benchmarks/msa_step.py checks it on the GPU.)"""
    s = integer_step(600, [5, 1, 3], [50, 37, 21], 8, levels=2)
    ref = ref_selection(s, 4, 3, 1)
    iq, ik = s.iq.to(dtypes[0]), s.ik.to(dtypes[1])
    for splits in (1, 4):
        sel = triton_kernels.select_blocks(iq, ik, s.meta, 4, 3, 1, num_splits=splits)
        assert torch.equal(sel, ref), splits


@pytest.mark.parametrize("local", [0, 1, 2])
def test_selection_for_tokens_that_see_nothing(local):
    """kv_len < q_len puts a row's first tokens at positions below 0: they see no key, and the oracle still
    forces its clamped local block 0 for them (none when local is 0). The indexer does the same."""
    s = make_step(650 + local, [3, 1, 2], [1, 20, 9], 4, hq=4, hi=2)
    assert (s.meta.positions < 0).sum() == 2
    ref = ref_selection(s, 4, 2, local)
    for splits, min_blocks in INDEX_SPLITS:
        sel = triton_kernels.select_blocks(s.iq, s.ik, s.meta, 4, 2, local, num_splits=splits,
                                           min_blocks_per_split=min_blocks)
        assert torch.equal(sel, ref), (splits, min_blocks)


def widen(s: Step, max_kv: int) -> Step:
    """The same step under a graph-style KV bound: max_kv far past every real length, the page table as
    wide as that bound needs (the new columns hold TRASH_PAGE)."""
    meta = s.meta
    cols = -(-max_kv // meta.page_size) + 2
    table = torch.cat([meta.page_table, torch.full((meta.num_rows, cols - meta.page_table.shape[1]), TRASH_PAGE)], 1)
    q_lens = meta.q_lens.tolist()
    return replace(s, meta=build_metadata(q_lens, meta.kv_lens, table, meta.page_size, CPU, max_kv=max_kv))


def test_graph_style_fixed_max_kv_gives_the_same_result():
    """A CUDA graph captures max_kv = max_model_len; the real lengths live on the device. The selection
    must be the oracle's under that bound (same blocks, more -1 padding when k grows with the bound), its
    real blocks the same as under a tight bound, and attention (dense, sparse, split or not) unchanged."""
    block, topk, local = 4, 3, 1
    s = make_step(700, [5, 1, 4], [29, 13, 22], 8, hq=4, hi=2)
    wide = widen(s, 400)  # 100 blocks where the rows hold at most 8
    tight_sel = ref_selection(s, block, topk, local)
    ref_sel = ref_selection(wide, block, topk, local)
    assert torch.equal(ref_sel[..., :tight_sel.shape[-1]], tight_sel)
    for splits, min_blocks in INDEX_SPLITS:
        sel = triton_kernels.select_blocks(wide.iq, wide.ik, wide.meta, block, topk, local, num_splits=splits,
                                           min_blocks_per_split=min_blocks)
        assert torch.equal(sel, ref_sel), (splits, min_blocks)
    args = (s.q, s.k, s.v, s.meta, 0.3, s.iq, s.ik, block, topk, local)
    ref_sparse, ref_dense = reference.paged_attention(*args), reference.paged_attention(*args[:5])
    wargs = (wide.q, wide.k, wide.v, wide.meta, 0.3, wide.iq, wide.ik, block, topk, local)
    for tri in (TritonBackend(), TritonBackend(min_keys_per_split=8, block_n=16, min_index_keys_per_split=4)):
        assert_close(tri.sparse_attention(*wargs), ref_sparse)
        assert_close(tri.attention(*wargs[:5]), ref_dense)


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # the interpreter's max over the long row's NaN keys
@pytest.mark.parametrize("local", [0, 1, 2])
def test_rows_whose_blocks_all_fit_select_them_without_reading_index_k(local):
    """A token that sees at most k blocks selects every one of them, whatever the scores; a tile of such
    tokens (a short row under a graph's long KV bound) writes that without reading index-K. So NaN in
    those rows' index-K changes nothing, while the same poison in a long row's index-K does. Row kinds: a
    1+3 verify row that crosses the boundary (own blocks 2, 2, 3, 3 for a top-3: scored as usual), a
    decode row that fits, a long row, and a row whose first token sees nothing."""
    block, topk = 4, 3
    s = widen(make_step(900 + local, [4, 1, 3, 2], [14, 9, 40, 1], 8, hq=4, hi=2), 200)
    meta = s.meta
    ref = ref_selection(s, block, topk, local)
    tok = torch.cumsum(torch.tensor([0, 4, 1, 3]), 0)  # first token of each row
    assert ref[tok[1]].tolist() == [[0, 1, 2]] * 2  # decode row at position 8: blocks 0..2
    first = [0, -1, -1] if local else [-1, -1, -1]  # position -1: only the forced local block 0
    assert ref[tok[3]].tolist() == [first] * 2 and ref[tok[3] + 1].tolist() == [[0, -1, -1]] * 2
    slots = gather_slots(meta, meta.max_kv)  # [B, L]
    in_row = torch.arange(meta.max_kv)[None, :] < meta.kv_lens[:, None]

    def poisoned(rows: list[int]) -> torch.Tensor:
        ik = s.ik.clone()
        for r in rows:
            ik[slots[r][in_row[r]]] = float("nan")
        return ik

    short, long = poisoned([1, 3]), poisoned([2])
    for splits, min_blocks in INDEX_SPLITS:
        sel = triton_kernels.select_blocks(s.iq, short, meta, block, topk, local, num_splits=splits,
                                           min_blocks_per_split=min_blocks)
        assert torch.equal(sel, ref), (splits, min_blocks)
        sel = triton_kernels.select_blocks(s.iq, long, meta, block, topk, local, num_splits=splits,
                                           min_blocks_per_split=min_blocks)
        assert not torch.equal(sel[tok[2]:tok[3]], ref[tok[2]:tok[3]]), "the poison must show where read"


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty returns poison (+inf floats, 3 for integers, and for int64 -- the split lists' packed
    keys -- 2^63 - 4: a key above every real one that names block 3): a kernel that reads a scratch entry
    it never wrote (a split list of a program that exited early, an attention partial) changes the result."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        x = empty(*args, **kwargs)
        if x.is_floating_point():
            return x.fill_(float("inf"))
        return x.fill_(2**63 - 4 if x.dtype == torch.int64 else 3)

    monkeypatch.setattr(torch, "empty", poisoned)


def test_split_scratch_is_written_before_read(poisoned_empty):
    block, topk, local = 4, 3, 1
    s = widen(make_step(701, [4, 1, 2], [30, 9, 21], 8, hq=4, hi=2), 200)
    args = (s.q, s.k, s.v, s.meta, 0.3, s.iq, s.ik, block, topk, local)
    ref = reference.paged_attention(*args)
    for splits, min_blocks in INDEX_SPLITS:
        sel = triton_kernels.select_blocks(s.iq, s.ik, s.meta, block, topk, local, num_splits=splits,
                                           min_blocks_per_split=min_blocks)
        assert torch.equal(sel, ref_selection(s, block, topk, local))
    assert_close(TritonBackend(min_keys_per_split=8, min_index_keys_per_split=4).sparse_attention(*args), ref)


def test_empty_attention_splits_are_neither_written_nor_read(poisoned_empty):
    """A graph-shaped step (max_kv far past the rows' keys) spreads short rows over many splits: the empty
    ones store only lse = -inf and the combine skips their partial outputs, which stay poisoned (inf:
    a read would turn into NaN or inf)."""
    s = widen(make_step(702, [1, 4, 1], [9, 21, 3], 8, hq=4), 200)
    ref = reference.paged_attention(s.q, s.k, s.v, s.meta, 0.3)
    for splits, block_n in ((12, 16), (7, 32)):
        out = triton_kernels.dense_attention(s.q, s.k, s.v, s.meta, 0.3, num_splits=splits, block_n=block_n)
        assert_close(out, ref)


def test_long_context_chunked_prefill():
    """An 8k-token row on CPU: a 32-token prompt chunk over 8160 cached tokens plus a 1+3 verify row,
    with a graph-style KV bound. The oracle processes queries in chunks (no [queries x context] blow-up
    per head), and the triton path equals it."""
    block, topk, local = 256, 4, 1
    s = widen(make_step(800, [32, 4], [8192, 3000], 64, hq=4, hkv=2, d=16, hi=2, di=16), 8704)
    args = (s.q, s.k, s.v, s.meta, 0.3, s.iq, s.ik, block, topk, local)
    ref = reference.paged_attention(*args)
    sel = TritonBackend().select_blocks(s.iq, s.ik, s.meta, block, topk, local)
    assert torch.equal(sel, ref_selection(s, block, topk, local))
    assert_close(TritonBackend().sparse_attention(*args), ref)


def test_reference_query_chunks_do_not_change_the_result(monkeypatch):
    s = make_step(801, [9, 1, 4], [70, 33, 52], 8, hq=4, hi=2)
    args = (s.q, s.k, s.v, s.meta, 0.3, s.iq, s.ik, 4, 3, 1)
    whole = reference.paged_attention(*args)
    monkeypatch.setattr(reference, "QUERY_CHUNK_ELEMS", 1)  # one query per chunk
    torch.testing.assert_close(reference.paged_attention(*args), whole, rtol=0, atol=1e-6)


def test_reference_ties_go_to_the_lower_block():
    """The oracle's rule, stated on a hand-made case: scores 5 at blocks 1, 2, 4 and a top-2 (no local
    block) picks 1 and 2, not 4; a top-4 adds block 0 (score 1) and drops block 3 (score 0). The set is
    listed in ascending id, -1 padding last."""
    ik = torch.tensor([1.0, 5.0, 5.0, 0.0, 5.0]).repeat_interleave(2)[None, :, None]  # [1, 10, 1], block 2
    iq = torch.ones(1, 1, 1, 1)
    pos = torch.tensor([[9]])
    assert reference.select_blocks(iq, ik, pos, 2, 2, 0).flatten().tolist() == [1, 2]
    assert reference.select_blocks(iq, ik, pos, 2, 4, 0).flatten().tolist() == [0, 1, 2, 4]
    assert reference.select_blocks(iq, ik, torch.tensor([[4]]), 2, 5, 0).flatten().tolist() == [0, 1, 2, -1, -1]


def padded_keep(sel: torch.Tensor, meta: AttnMetadata, block: int, hq: int) -> torch.Tensor:
    """Flat sel [T, Hi, k] -> the oracle's keep mask [B, Hq, Qmax, L]."""
    sel_p = sel[meta.q_index].permute(0, 2, 1, 3)  # [B, Hi, Qmax, k]; padding queries copy token 0
    return reference.block_keep_mask(sel_p, meta.max_kv, block, hq)


@pytest.mark.parametrize("block,hi", [(4, 2), (6, 4), (8, 1)])
def test_sparse_kernel_given_selection(block, hi):
    """The attention half alone: an arbitrary selection (own block always in it, -1 padding in the
    middle too) against the oracle's attend() with the same keep mask."""
    s = make_step(200 + block, [5, 1, 3], [50, 37, 21], 8, hq=4, hi=hi)
    gen = torch.Generator().manual_seed(block)
    meta, t = s.meta, s.q.shape[0]
    nb = -(-meta.max_kv // block)
    sel = torch.randint(0, nb, (t, hi, 4), generator=gen)
    sel = torch.where(torch.rand(t, hi, 4, generator=gen) < 0.25, -1, sel)
    sel[:, :, 0] = torch.div(meta.positions, block, rounding_mode="floor")[:, None]  # every query sees a key
    sel = torch.stack([_distinct(r) for r in sel.view(-1, 4)]).view(t, hi, 4)
    slots = gather_slots(meta, meta.max_kv)
    ref = reference.attend(reference.pad_queries(s.q, meta), s.k[slots], s.v[slots],
                           reference.padded_positions(meta), 0.3, padded_keep(sel, meta, block, 4))
    ref = ref[meta.tok_row, meta.tok_col]
    for splits in (1, 3):
        out = torch.full_like(s.q, float("nan"))
        triton_kernels.sparse_attention(s.q, s.k, s.v, meta, 0.3, sel, block, num_splits=splits, out=out)
        assert_close(out, ref)


def _distinct(r: torch.Tensor) -> torch.Tensor:
    """Selections hold distinct blocks: later repeats of a block become -1."""
    seen: set[int] = set()
    out = []
    for x in r.tolist():
        out.append(-1 if x in seen else x)
        if x >= 0:
            seen.add(x)
    return torch.tensor(out)


SPARSE_BACKENDS = {
    "per_token": TritonBackend(),
    "per_token_split": TritonBackend(min_keys_per_split=8, block_n=16),
    "tiled": TritonBackend(sparse_tile_min_q=1, block_n=16),  # keep mask checked per key (block 4)
    "tiled_split": TritonBackend(sparse_tile_min_q=1, min_keys_per_split=8, block_n=16),
    "tiled_per_tile": TritonBackend(sparse_tile_min_q=1, block_n=4),  # one keep flag per tile
}


@pytest.mark.parametrize("name", list(SPARSE_BACKENDS))
@pytest.mark.parametrize("q_lens,kv_lens,page_size", MIXED)
def test_sparse_matches_reference(name, q_lens, kv_lens, page_size):
    block, topk, local = 4, 3, 1
    s = make_step(300 + len(name) + page_size, q_lens, kv_lens, page_size, hq=4, hkv=2, hi=2)
    args = (s.q, s.k, s.v, s.meta, 0.3, s.iq, s.ik, block, topk, local)
    ref = reference.paged_attention(*args)
    dense = reference.paged_attention(s.q, s.k, s.v, s.meta, 0.3)
    assert ((ref - dense).abs().max() / ref.abs().max()) > 1e-2, "sparsity is not active in this step"
    assert_close(SPARSE_BACKENDS[name].sparse_attention(*args), ref)


def test_sparse_gqa_index_heads_differ_from_kv_heads():
    """Hq=8, Hkv=2, Hi=4: each program's heads must share both a KV head and an index head."""
    s = make_step(401, [6, 1, 4], [48, 30, 44], 8, hq=8, hkv=2, hi=4, d=16)
    args = (s.q, s.k, s.v, s.meta, 0.25, s.iq, s.ik, 4, 2, 1)
    ref = reference.paged_attention(*args)
    for tri in (TritonBackend(), TritonBackend(sparse_tile_min_q=1, block_n=16)):
        assert_close(tri.sparse_attention(*args), ref)


def test_sparse_covering_everything_equals_dense():
    """topk * block >= context: the sparse layer is dense attention."""
    s = make_step(402, [5, 1], [20, 14], 8)
    out = TritonBackend().sparse_attention(s.q, s.k, s.v, s.meta, 0.3, s.iq, s.ik, 4, 16, 1)
    assert_close(out, reference.paged_attention(s.q, s.k, s.v, s.meta, 0.3))


def tiny_model(seed: int):
    from m3eagle.config import DENSE_MLP, FULL, MOE_MLP, SPARSE, M3Config
    from m3eagle.models.minimax_m3 import MiniMaxM3

    cfg = M3Config(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, rotary_dim=8, rope_theta=10000.0, rms_norm_eps=1e-6,
                   intermediate_size=16, dense_intermediate_size=32, shared_intermediate_size=16,
                   num_local_experts=4, num_experts_per_tok=2, routed_scaling_factor=2.0, swiglu_alpha=1.702,
                   swiglu_limit=7.0, layer_types=(FULL, SPARSE, SPARSE), mlp_layer_types=(DENSE_MLP, MOE_MLP,
                                                                                         DENSE_MLP),
                   index_n_heads=2, index_head_dim=8, index_block_size=4, index_topk_blocks=2,
                   index_local_blocks=1)
    torch.manual_seed(seed)
    model = MiniMaxM3(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.1)
    return model


def run_steps(model, name: str, max_kv: int = 22) -> list[torch.Tensor]:
    """Two engine-like steps on fresh caches with attention backend `name`: a prefill of two prompts (one
    in two chunks), then a step with one decode row and one 1+3 verify row. Returns each step's logits.
    The backend reaches the model as the engine hands it: `meta.ops`."""
    page, width = 4, -(-max_kv // 4) + 2
    table = torch.zeros(2, width, dtype=torch.int64)
    table[0, :6] = torch.tensor([3, 9, 1, 7, 11, 5])  # 24 slots
    table[1, :5] = torch.tensor([2, 10, 4, 8, 6])  # 20 slots; columns 5.. stay TRASH_PAGE
    caches = model.new_caches(12 * page, torch.float32, CPU)
    for c in caches:  # contents the kernels must not read (reserved tails, the trash page)
        c.k.fill_(POISON), c.v.fill_(POISON)
        if c.idx_k is not None:
            c.idx_k.fill_(POISON)
    gen = torch.Generator().manual_seed(5)
    steps = [([12, 9], [12, 9]), ([6, 1], [18, 10]), ([1, 4], [19, 14])]  # (q_lens, kv_lens after the step)
    ops = replace(REFERENCE, attention=backend.create(name))
    logits = []
    with torch.no_grad():
        for q_lens, kv_lens in steps:
            meta = build_metadata(q_lens, torch.tensor(kv_lens), table, page, CPU, max_kv=max_kv)
            meta = replace(meta, ops=ops)
            ids = torch.randint(0, 64, (sum(q_lens),), generator=gen)
            logits.append(model.compute_logits(model(ids, meta.positions, meta, caches)))
    return logits


def test_model_logits_match_reference_backend():
    model = tiny_model(0)
    ref = run_steps(model, "reference")
    for max_kv in (22, 96):  # the step's own bound, and a graph-style fixed one
        for r, t in zip(ref, run_steps(model, "triton", max_kv)):
            assert_close(t, r)
