"""The Triton routed-experts kernels held equal to the dense PyTorch reference, on CPU under the Triton
interpreter, in fp32 at 1e-5 relative error.

Covers step sizes of decode (T = 1, 3), a verify-sized step (17) and a prompt chunk (300); experts that get
no token; every token on one expert (segments spanning several row blocks); router ties; the expert-subset
mode (disjoint subsets sum to the full result; full weights and rank-local shards agree); the alignment's
layout invariants; and a whole model's logits with the Triton impl against the reference impl.

NOTE: TRITON_INTERPRET is set before anything imports triton, and it holds for the whole pytest process
(as in test_triton_attention.py).
"""

from __future__ import annotations

import json
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton` (kernels decorate at import)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from m3eagle.kernels.fused.gemv import SplitCounters  # noqa: E402
from m3eagle.kernels.moe import backend, reference, triton_moe, tuning  # noqa: E402
from m3eagle.kernels.moe.align import align, max_blocks  # noqa: E402
from m3eagle.kernels.moe.tuning import MoEConfig  # noqa: E402
from m3eagle.models.layers import SparseMoE  # noqa: E402

H, I, E = 32, 64, 8  # hidden, expert intermediate, experts
ALPHA, LIMIT = 1.702, 7.0
SMALL = MoEConfig(block_m=16, block_n=32, block_k=16, group_m=1)  # several K steps over H=32
WIDE = MoEConfig(block_m=32, block_n=16, block_k=32, group_m=4)  # one K step, narrow N tiles, grouped order


def make_weights(seed: int, e: int = E) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [E, 2I, H], down [E, H, I]. Scaled so some gate/up values pass LIMIT: the clamps are live."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(e, 2 * I, H, generator=g) * 0.8, torch.randn(e, H, I, generator=g) * 0.2


def make_routing(seed: int, t: int, k: int, e: int = E) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H], weights [T, k] (renormalised, fp32), idx [T, k] distinct experts per token."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g)
    idx = torch.argsort(torch.rand(t, e, generator=g), dim=1)[:, :k]
    w = torch.rand(t, k, generator=g) + 0.05
    return x, w / w.sum(-1, keepdim=True), idx


def assert_close(out: torch.Tensor, ref: torch.Tensor, rel: float = 1e-5) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all(), "non-finite output: an unwritten row was read"
    err = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
    assert err <= rel, f"max relative error {err:.2e} > {rel:.0e}"


def run_both(x, w, idx, w13, w2, cfg: MoEConfig | None, expert_range=None) -> tuple[torch.Tensor, torch.Tensor]:
    ref = reference.experts(x, w, idx, w13, w2, ALPHA, LIMIT, expert_range)
    out = triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, expert_range, config=cfg)
    return out, ref


@pytest.mark.parametrize("t,k,cfgs", [(1, 2, (SMALL, WIDE)), (3, 4, (SMALL, WIDE)), (17, 2, (SMALL, WIDE)),
                                      (300, 2, (SMALL,))])
def test_matches_reference(t, k, cfgs):
    w13, w2 = make_weights(t)
    x, w, idx = make_routing(t + 1, t, k)
    for cfg in cfgs:
        assert_close(*run_both(x, w, idx, w13, w2, cfg))
    # the clamps must be exercised, or the epilogue's clamp could be wrong unseen
    h = torch.einsum("th,eih->eti", x, w13)
    assert (h[..., :I] > LIMIT).any() and (h[..., I:].abs() > LIMIT).any()


def test_down_gemm_with_its_own_tiles(monkeypatch):
    """down_block_n / down_block_k give the sorted path's down GEMM other tiles than gate_up's (same row
    blocks, the alignment is shared): the down launch gets them, and the result is still the reference's,
    with and without the shared expert."""
    cfg = MoEConfig(block_m=16, block_n=32, block_k=16, down_block_n=16, down_block_k=32)
    assert cfg.down() == MoEConfig(block_m=16, block_n=16, block_k=32) and SMALL.down() is SMALL
    tiles, real_down = [], triton_moe.down

    def spy(act, w2, weights, al, c, *a, **kw):
        tiles.append((c.block_n, c.block_k))
        return real_down(act, w2, weights, al, c, *a, **kw)

    monkeypatch.setattr(triton_moe, "down", spy)
    x, w, idx = make_routing(31, 19, 2)
    w13, w2 = make_weights(31)
    assert_close(*run_both(x, w, idx, w13, w2, cfg))
    moe = make_layer(32)
    from m3eagle.kernels.ops import Ops

    with torch.no_grad():
        out, rest, _ = moe.forward_parts(x, Ops(attention=None, moe=backend.create("triton", config=cfg), fused=None))
        assert rest is None
        assert_close(out, moe(x))
    assert tiles == [(16, 32), (16, 32)]


def test_split_tail_blocks_match_the_reference():
    """split_tail: row blocks holding at most block_m / 2 pairs run a half-height tile in both GEMMs. The
    routing forces each case -- tails of 8 and exactly 16 pairs (half tiles), 28 and 17 (full tiles), a
    full block with no tail, an expert with no pairs -- and the output is the reference's, with the expert
    subset mode and with the shared expert (its 83 rows end in a 19-row tail)."""

    cfg = MoEConfig(block_m=32, block_n=16, block_k=16, group_m=2, split_tail=1)
    counts = {0: 40, 1: 60, 2: 16, 3: 17, 4: 32, 5: 0, 6: 1, 7: 0}  # pairs per expert, k = 2
    slots = torch.tensor([e for e, c in counts.items() for _ in range(c)])
    order = torch.randperm(slots.numel(), generator=torch.Generator().manual_seed(3))
    first, second = slots[order[0::2]], slots[order[1::2]]
    t = first.numel()
    assert t == second.numel() and t == 83
    idx = torch.stack([first, second], 1)
    # a token's two experts must differ: swap seconds with a later token's until they do
    for i in range(t):
        if idx[i, 0] == idx[i, 1]:
            j = next(j for j in range(t) if idx[j, 1] != idx[i, 0] and idx[j, 0] != idx[i, 1] and j != i)
            idx[i, 1], idx[j, 1] = idx[j, 1].clone(), idx[i, 1].clone()
    assert (idx[:, 0] != idx[:, 1]).all() and torch.bincount(idx.flatten(), minlength=E).tolist() == list(counts.values())
    al = align(idx, 0, E, 32)
    valid = (al.sorted_ids[: int(al.num_blocks) * 32].view(-1, 32) < al.num_pairs).sum(1).tolist()
    assert sorted(valid) == sorted([32, 8, 32, 28, 16, 17, 32, 1]), valid  # half tiles: 8, 16, 1
    x, w, _ = make_routing(40, t, 2)
    w13, w2 = make_weights(41)
    assert_close(*run_both(x, w, idx, w13, w2, cfg))
    assert_close(*run_both(x, w, idx, w13, w2, cfg, expert_range=(1, 5)))
    moe = make_layer(42)
    with torch.no_grad():
        ref = moe.experts(x, w, idx) * moe.routed_scaling_factor + moe.shared_experts(x)
        out, rest, _ = moe.expert_parts(x, w, idx, backend.create("triton", config=cfg))
        assert rest is None
        assert_close(out, ref)


def test_default_config_from_the_table():
    x, w, idx = make_routing(5, 9, 2)
    assert_close(*run_both(x, w, idx, *make_weights(5), None))


def test_experts_without_tokens():
    """Only experts 1 and 5 are chosen: the other six get empty segments and no row block."""
    w13, w2 = make_weights(7)
    x, w, _ = make_routing(8, 21, 2)
    idx = torch.tensor([[1, 5], [5, 1]] * 10 + [[5, 1]])
    assert_close(*run_both(x, w, idx, w13, w2, SMALL))
    al = align(idx, 0, E, 16)
    assert int(al.num_blocks) == 4  # ceil(21 / 16) blocks for each of the two experts


def test_every_token_on_one_expert():
    """k = 1, all 40 tokens on expert 6: one segment over three row blocks, the last one part padding."""
    w13, w2 = make_weights(9)
    x, _, _ = make_routing(10, 40, 1)
    idx = torch.full((40, 1), 6)
    w = torch.ones(40, 1)
    assert_close(*run_both(x, w, idx, w13, w2, SMALL))
    assert int(align(idx, 0, E, 16).num_blocks) == 3


def test_router_ties_give_the_same_layer_output():
    """A router with zero weights scores every expert alike: top-k breaks the tie, and both impls must
    consume the same choice (SparseMoE routes once and hands idx to the impl)."""
    moe = SparseMoE(H, I, 24, E, 2, scaling=2.0, alpha=ALPHA, limit=LIMIT)
    w13, w2 = make_weights(11)
    with torch.no_grad():
        moe.experts.gate_up_proj.copy_(w13)
        moe.experts.down_proj.copy_(w2)
        moe.gate.weight.zero_()
        for p in moe.shared_experts.parameters():
            p.normal_(0.0, 0.2)
    x, _, _ = make_routing(12, 17, 2)
    w, idx = moe.gate(x)
    assert torch.all(w == 0.5)  # a real tie
    with torch.no_grad():
        ref = moe(x)
        out = moe(x, impl=backend.create("triton", config=SMALL))
    assert_close(out, ref)


@pytest.mark.parametrize("t", [3, 33])
def test_expert_subsets_sum_to_the_full_result(t):
    w13, w2 = make_weights(13)
    x, w, idx = make_routing(14, t, 2)
    full = reference.experts(x, w, idx, w13, w2, ALPHA, LIMIT)
    parts = []
    for e0, e1 in ((0, 3), (3, 4), (4, 8)):
        out, ref = run_both(x, w, idx, w13, w2, SMALL, (e0, e1))
        assert_close(out, ref)
        shard = triton_moe.fused_experts(x, w, idx, w13[e0:e1].clone(), w2[e0:e1].clone(), ALPHA, LIMIT,
                                         (e0, e1), config=SMALL)  # a rank holding only its experts
        torch.testing.assert_close(shard, out, rtol=0, atol=0)
        parts.append(out)
    assert_close(sum(parts), full)
    # an empty subset contributes exactly zero
    assert not triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, (2, 2), config=SMALL).any()


def test_other_ranks_experts_are_never_read():
    """Under an expert range the weights of the experts outside it are never read: poisoned with NaN (in the
    full stacks a rank would slice), they must not reach the output, whose pairs routed elsewhere add zero."""
    w13, w2 = make_weights(17)
    x, w, idx = make_routing(18, 5, 2)
    e0, e1 = 2, 6
    ref = reference.experts(x, w, idx, w13, w2, ALPHA, LIMIT, (e0, e1))
    for stack in (w13, w2):
        stack[:e0] = float("nan")
        stack[e1:] = float("nan")
    assert_close(triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, (e0, e1), config=SMALL), ref)

def test_unwritten_rows_are_never_read():
    """act rows of padding entries and contrib rows of other ranks' pairs are left unwritten (no memset):
    poisoned with NaN, they must not reach the output."""
    w13, w2 = make_weights(15)
    x, w, idx = make_routing(16, 19, 2)
    e0, e1 = 2, 7
    cfg = SMALL
    al = align(idx, e0, e1 - e0, cfg.block_m)
    real = al.sorted_ids < al.num_pairs
    act = triton_moe.gate_up(x, w13[e0:e1], al, 2, ALPHA, LIMIT, cfg)
    act[~real] = float("nan")
    contrib = triton_moe.down(act, w2[e0:e1], w.reshape(-1), al, cfg)
    local = ((idx >= e0) & (idx < e1)).reshape(-1)
    contrib[~local] = float("nan")
    out = triton_moe.combine(contrib, idx, e0, e1 - e0, x.dtype)
    assert_close(out, reference.experts(x, w, idx, w13, w2, ALPHA, LIMIT, (e0, e1)))


@pytest.mark.parametrize("cfg", [SMALL, WIDE, MoEConfig(32, 16, 16, 2, 4, 3, split_tail=1)])
def test_down_unmasked_k_loop_is_bit_equal_to_the_masked_one(cfg):
    """Where I, the shared width and H divide into whole tiles, the sorted down GEMM loads without masks
    (padding rows read act's unwritten rows, NaN here, and are never stored): its rows equal the masked
    loop's bit for bit, the shared expert's too; it refuses an act without every padded row."""
    w13, w2 = make_weights(27)
    s13, s2 = make_weights(28, e=1)
    x, w, idx = make_routing(29, 37, 3)
    al = align(idx, 0, E, cfg.block_m, shared=True)
    real = al.sorted_ids < al.num_pairs
    act = triton_moe.gate_up(x, w13, al, 3, ALPHA, LIMIT, cfg, s13[0])
    act[~real] = float("nan")  # what the unmasked A loads of padding rows may read
    contribs = [triton_moe.down(act, w2, w, al, cfg, s2[0], 1.5, even=even) for even in (False, True)]
    assert torch.isfinite(contribs[1]).all() and torch.equal(contribs[0], contribs[1])
    with pytest.raises(ValueError, match="even=False"):
        triton_moe.down(act[: act.shape[0] - 1], w2, w, al, cfg, s2[0], 1.5, even=True)

# chunk: pairs per alignment program; 16 spreads a few pairs over many programs (histogram path); None takes
# align.chunk_size's (1,100 x 4 pairs: 35 programs of 128)
@pytest.mark.parametrize("t,k,e0,e1,bm,chunk", [(1, 2, 0, 8, 16, None), (37, 3, 0, 8, 16, None),
                                                (37, 3, 0, 8, 16, 16), (300, 4, 2, 7, 32, None),
                                                (300, 4, 2, 7, 16, 64), (5, 2, 0, 8, 64, None),
                                                (40, 1, 6, 7, 16, 16), (1100, 4, 0, 8, 32, None)])
def test_alignment_invariants(t, k, e0, e1, bm, chunk):
    g = torch.Generator().manual_seed(t * 7 + bm)
    idx = torch.argsort(torch.rand(t, E, generator=g), dim=1)[:, :k]
    if t == 40:
        idx[:] = 6
    n, num_local = t * k, e1 - e0
    al = align(idx, e0, num_local, bm, chunk)
    nb = max_blocks(n, num_local, bm)
    assert al.sorted_ids.shape == (nb * bm,) and al.block_expert.shape == (nb,) and al.max_blocks == nb
    ids, blk = al.sorted_ids.tolist(), al.block_expert.tolist()
    flat = idx.reshape(-1).tolist()
    used = int(al.num_blocks)

    counts = [sum(1 for e in flat if e == g_e) for g_e in range(e0, e1)]
    assert used == sum(-(-c // bm) for c in counts)
    # every local (token, k) pair exactly once; no pair of another rank's expert
    placed = [p for p in ids if p != n]
    assert sorted(placed) == [p for p in range(n) if e0 <= flat[p] < e1]
    # nothing but padding past the used blocks; those blocks have no expert
    assert all(p == n for p in ids[used * bm:]) and all(b == -1 for b in blk[used:])
    # each used block: one expert, ascending expert order, real pairs first (in idx order), then padding
    prev = -1
    for b in range(used):
        e = blk[b]
        assert prev <= e < num_local
        prev = e
        rows = ids[b * bm:(b + 1) * bm]
        real = [p for p in rows if p != n]
        assert real and rows[:len(real)] == real and real == sorted(real)
        assert all(flat[p] - e0 == e for p in real)
    # segments are whole blocks: an expert's pairs fill its blocks in order before any padding
    for e in range(num_local):
        seg = [p for b in range(used) if blk[b] == e for p in ids[b * bm:(b + 1) * bm]]
        real = [p for p in seg if p != n]
        assert len(seg) == -(-counts[e] // bm) * bm and seg[:len(real)] == real and len(real) == counts[e]


def expected_alignment(idx: torch.Tensor, e0: int, num_local: int, bm: int, shared: bool) -> tuple[list, list, int]:
    """The layout align() must write, in plain Python: each local routed expert's pairs in idx order, padded
    to bm, experts ascending; with `shared` the T pairs T*k + t (in order) as column num_local, last.
    -> (sorted ids of the used blocks, their experts, used blocks)."""
    flat = idx.reshape(-1).tolist()
    routed = len(flat)
    n = routed + (idx.shape[0] if shared else 0)
    segs = [(e, [p for p in range(routed) if flat[p] - e0 == e]) for e in range(num_local)]
    if shared:
        segs.append((num_local, list(range(routed, n))))
    ids, blocks = [], []
    for e, pairs in segs:
        nblk = -(-len(pairs) // bm)
        ids += pairs + [n] * (nblk * bm - len(pairs))
        blocks += [e] * nblk
    return ids, blocks, len(blocks)


# (t, k, e0, e1, bm, chunk): a single placing program (decode), the histogram path over several chunks,
# a rank's expert subset, every token on one expert, a segment longer than a block
@pytest.mark.parametrize("t,k,e0,e1,bm,chunk", [(1, 2, 0, 8, 16, None), (4, 4, 0, 8, 32, None),
                                                (37, 3, 0, 8, 16, 16), (300, 4, 2, 7, 16, 64),
                                                (40, 1, 6, 7, 16, 16), (5, 2, 0, 8, 64, None)])
@pytest.mark.parametrize("shared", [False, True])
def test_alignment_equals_the_plain_layout(t, k, e0, e1, bm, chunk, shared):
    """sorted_ids / block_expert / num_blocks equal expected_alignment exactly, padding past the used blocks
    included: with a shared expert its segment is placed by arithmetic (no one-hot column), and must come
    out as the column-of-its-own layout did."""
    if shared and (e0, e1) != (0, E):
        e0, e1 = 0, E  # the shared expert is fused only with all experts local
    g = torch.Generator().manual_seed(t * 13 + bm + shared)
    idx = torch.argsort(torch.rand(t, E, generator=g), dim=1)[:, :k]
    if t == 40:
        idx[:] = e0
    al = align(idx, e0, e1 - e0, bm, chunk, shared=shared)
    ids, blocks, used = expected_alignment(idx, e0, e1 - e0, bm, shared)
    n = t * k + (t if shared else 0)
    assert (al.num_pairs, al.routed_pairs, int(al.num_blocks)) == (n, t * k, used)
    assert al.max_blocks == max_blocks(n, e1 - e0 + shared, bm)
    assert al.sorted_ids.tolist() == ids + [n] * (al.max_blocks * bm - len(ids))
    assert al.block_expert.tolist() == blocks + [-1] * (al.max_blocks - used)


def count_combines(monkeypatch) -> list[int]:
    """Counts the separate combine's launches (one list entry, incremented per call)."""
    calls = [0]
    real = triton_moe.combine

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_moe, "combine", counted)
    return calls


@pytest.mark.parametrize("t,k,cfg,shared,expert_range", [(1, 2, SMALL, False, None), (3, 4, WIDE, True, None),
                                                          (4, 2, SMALL, True, None), (16, 2, WIDE, False, (2, 7)),
                                                          (16, 3, SMALL, True, None), (5, 2, SMALL, False, (6, 8))])
def test_combine_fused_into_down_is_bit_equal_and_leaves_counters_zero(t, k, cfg, shared, expert_range,
                                                                       monkeypatch):
    """Steps of up to COMBINE_FUSE_MAX_T tokens sum their rows in the down launch's last program per column
    tile: bit-equal to the separate combine (one helper sums both), again on a second call (the counters
    were zeroed: a stale count would leave out unwritten), with a shared expert and with an expert subset
    (other ranks' rows masked); the reference within fp32 rounding."""
    w13, w2 = make_weights(40 + t)
    s13, s2 = make_weights(41 + t, e=1)
    x, w, idx = make_routing(42 + t, t, k)
    if expert_range == (6, 8):  # every pair on another rank's experts: no block in use, out must be zeros
        idx = idx % 6
    sh = (s13[0], s2[0]) if shared else None
    counters = SplitCounters().get("cpu")
    empty = torch.empty

    def poisoned(*args, **kwargs):  # every float buffer starts as NaN: an unwritten output cannot pass
        out = empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty", poisoned)
    combines = count_combines(monkeypatch)
    plain = triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, expert_range, config=cfg, shared=sh,
                                     routed_scale=1.5)
    assert combines == [1]  # the separate combine ran for the unfused result
    for _ in range(2):
        fused = triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, expert_range, config=cfg, shared=sh,
                                         routed_scale=1.5, combine_counters=counters)
        assert combines == [1]  # and never for the fused one
        assert torch.equal(fused, plain)
        assert not counters.any()
    monkeypatch.undo()
    ref = reference.experts(x, w, idx, w13, w2, ALPHA, LIMIT, expert_range) * 1.5
    if expert_range == (6, 8):
        assert not ref.any() and not fused.any()
    if shared:
        ref = ref + reference.experts(x, torch.ones(t, 1), torch.zeros(t, 1, dtype=torch.long), s13, s2, ALPHA, LIMIT)
    assert_close(fused, ref)


def test_fused_combine_refuses_what_it_cannot_do(monkeypatch):
    """Past COMBINE_FUSE_MAX_T tokens fused_experts takes the separate combine; down() itself names the
    limits; the backend makes its counters on the first eager call and can be told not to fuse."""
    w13, w2 = make_weights(50)
    t = triton_moe.COMBINE_FUSE_MAX_T + 1
    x, w, idx = make_routing(51, t, 2)
    counters = SplitCounters().get("cpu")
    combines = count_combines(monkeypatch)
    out = triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, config=SMALL, combine_counters=counters)
    assert combines == [1]  # 17 tokens: the separate combine, counters or not
    assert torch.equal(out, triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, config=SMALL))
    al = align(idx, 0, E, SMALL.block_m)
    act = triton_moe.gate_up(x, w13, al, 2, ALPHA, LIMIT, SMALL)
    with pytest.raises(ValueError, match="fused combine: 17 tokens"):
        triton_moe.down(act, w2, w, al, SMALL, combine_into=(idx.contiguous(), torch.empty_like(x), counters, 0, E))
    combines[0] = 0
    impl = backend.create("triton", config=SMALL)
    impl.experts(x[:2], w[:2], idx[:2], w13, w2, ALPHA, LIMIT)
    assert set(impl._counters._bufs) == {torch.device("cpu")} and combines == [0]  # fused
    off = backend.create("triton", config=SMALL, fuse_combine=False)
    off.experts(x[:2], w[:2], idx[:2], w13, w2, ALPHA, LIMIT)
    assert not off._counters._bufs and combines == [1]  # told not to fuse: the combine launch


def make_layer(seed: int, shared_inter: int = I, scaling: float = 2.5) -> SparseMoE:
    """A SparseMoE with random weights (a random router too, so routing is not a tie)."""
    moe = SparseMoE(H, I, shared_inter, E, 2, scaling=scaling, alpha=ALPHA, limit=LIMIT)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.8 if p.dim() == 3 else 0.3))
    return moe


@pytest.mark.parametrize("t,cfg", [(1, SMALL), (3, WIDE), (17, SMALL), (300, SMALL)])
def test_shared_expert_fused_into_the_routed_kernels(t, cfg):
    """A shared expert as wide as the routed ones runs as one more expert of the same launches: the layer's
    paged output (routed * scale + shared, as one tensor) equals the reference layer."""
    from m3eagle.kernels.ops import Ops

    moe = make_layer(t)
    assert moe.can_fuse_shared()
    x, _, _ = make_routing(t + 2, t, 2)
    ops = Ops(attention=None, moe=backend.create("triton", config=cfg), fused=None)
    with torch.no_grad():
        out, rest, scale = moe.forward_parts(x, ops)
        ref = moe(x)
    assert rest is None and scale == 1.0
    assert_close(out, ref)


def test_shared_expert_fused_with_every_token_on_one_expert():
    """All tokens on one expert (k = 1): its segment spans several row blocks, and so does the shared one."""
    w13, w2 = make_weights(21)
    s13, s2 = make_weights(22, e=1)
    x, _, _ = make_routing(23, 40, 1)
    idx, w = torch.full((40, 1), 3), torch.ones(40, 1)
    out = triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, config=SMALL, shared=(s13[0], s2[0]),
                                   routed_scale=2.0)
    ref = reference.experts(x, w, idx, w13, w2, ALPHA, LIMIT) * 2.0 + reference.experts(
        x, w, torch.zeros_like(idx), s13, s2, ALPHA, LIMIT)
    assert_close(out, ref)
    al = align(idx, 0, E, 16, shared=True)
    assert (al.num_pairs, al.routed_pairs, int(al.num_blocks)) == (80, 40, 6)  # 3 blocks each
    blk = al.block_expert.tolist()
    assert blk[:6] == [3, 3, 3, E, E, E]
    assert sorted(al.sorted_ids[3 * 16:6 * 16].tolist()[:40]) == list(range(40, 80))  # token t's pair 40 + t


def test_shared_expert_rows_unwritten_rows_never_read():
    """With the shared expert, padding rows of act stay unwritten: poisoned with NaN, they must not leak."""
    w13, w2 = make_weights(24)
    s13, s2 = make_weights(25, e=1)
    x, w, idx = make_routing(26, 5, 2)
    al = align(idx, 0, E, SMALL.block_m, shared=True)
    act = triton_moe.gate_up(x, w13, al, 2, ALPHA, LIMIT, SMALL, s13[0])
    act[al.sorted_ids >= al.num_pairs] = float("nan")
    contrib = triton_moe.down(act, w2, w, al, SMALL, s2[0], 1.5)
    out = triton_moe.combine(contrib, idx, 0, E, x.dtype, shared=True)
    ref = reference.experts(x, w, idx, w13, w2, ALPHA, LIMIT) * 1.5 + reference.experts(
        x, torch.ones(5, 1), torch.zeros(5, 1, dtype=torch.long), s13, s2, ALPHA, LIMIT)
    assert_close(out, ref)


@pytest.mark.parametrize("t,s_i", [(3, 24), (17, 24), (40, 56), (120, 24)])  # 120: several tiles a segment
def test_shared_expert_of_another_width_in_the_sorted_gemms(t, s_i):
    """A shared expert narrower or wider than the routed ones (the embedded target: 128 vs 160) runs in the
    grouped GEMMs as one more segment with its own width and row stride: the layer's output equals the
    reference layer, with split-tail tiles and the fused combine (T <= 16) too."""
    from m3eagle.kernels.ops import Ops

    moe = make_layer(t + 40, shared_inter=s_i)
    assert not moe.can_fuse_shared() and moe.shared_joinable()
    x, _, _ = make_routing(t + 41, t, 2)
    with torch.no_grad():
        ref = moe(x)
        for cfg in (SMALL, WIDE, MoEConfig(64, 32, 16, 4, 4, 3, split_tail=1)):
            out, rest, scale = moe.forward_parts(x, Ops(attention=None, moe=backend.create("triton", config=cfg),
                                                        fused=None))
            assert rest is None and scale == 1.0, cfg
            assert_close(out, ref)


def test_shared_expert_fusion_refuses_what_it_cannot_do():
    w13, w2 = make_weights(27)
    s13, s2 = make_weights(28, e=1)
    x, w, idx = make_routing(29, 3, 2)
    with pytest.raises(ValueError, match="expert_range=None"):
        triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, (0, 4), config=SMALL, shared=(s13[0], s2[0]))
    with pytest.raises(ValueError, match="gate_up \\[2I_s, H\\] and down \\[H, I_s\\]"):
        triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, config=SMALL, shared=(s13[0, :8], s2[0]))
    # another inner layout is refused, not copied behind the caller's back (that would be a copy per step)
    s2_t = s2[0].t().contiguous().t()  # [H, I] values, column-major
    with pytest.raises(ValueError, match="inner strides"):
        triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, config=SMALL, shared=(s13[0], s2_t))
    from m3eagle.kernels.ops import Ops

    # a same-width shared expert whose weights have another layout is not fused either
    moe = make_layer(31)
    with torch.no_grad():
        w_sh = moe.shared_experts.down_proj.weight
        w_sh.data = w_sh.data.t().contiguous().t()
    assert not moe.can_fuse_shared()
    with torch.no_grad():
        routed, shared, scale = moe.forward_parts(x, Ops(attention=None, moe=backend.create("triton", config=SMALL),
                                                         fused=None))
        assert shared is not None
        assert_close(routed * scale + shared, moe(x))


def test_model_logits_equal_with_the_triton_impl():
    """A whole tiny model (3 MoE layers) through the paged forward: logits with the engine's ops carrying
    the Triton MoE equal those with the reference ops (the contiguous forward_seq always runs the reference)."""
    from m3eagle.kernels.attention.metadata import build_metadata
    from m3eagle.kernels.ops import REFERENCE, Ops
    from m3eagle.models.minimax_m3 import MiniMaxM3
    from m3eagle.training.target import init_weights, model_config

    torch.manual_seed(0)
    model = MiniMaxM3(model_config("tiny", vocab_size=96)).eval()
    init_weights(model, seed=3, std=0.2)
    moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
    assert len(moes) == 3 and all(m.can_fuse_shared() for m in moes)  # the shared expert rides along
    ids = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(4))
    cpu = torch.device("cpu")
    table = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    fast = Ops(attention=REFERENCE.attention, moe=backend.create("triton", config=SMALL))
    outs = []
    with torch.no_grad():
        for ops in (REFERENCE, fast):
            meta = build_metadata([13, 13], torch.tensor([13, 13]), table, 4, cpu, 13)
            meta.ops = ops
            caches = model.new_caches(9 * 4, torch.float32, cpu)
            outs.append(model.compute_logits(model(ids.reshape(-1), meta.positions, meta, caches)))
        seq = model.compute_logits(model.forward_seq(ids)[0]).reshape(26, -1)
    assert_close(outs[1], outs[0])
    assert_close(outs[0], seq)


@pytest.mark.slow
def test_registry_and_lazy_triton_import():
    import subprocess
    import sys

    # Vacuous (not failing) if something else in the package already imports triton.
    code = ("import sys, torch; from m3eagle.models import layers; from m3eagle.kernels.moe import backend; "
            "before = 'triton' in sys.modules; m = layers.Experts(4, 8, 16, 1.7, 7.0); "
            "[torch.nn.init.normal_(p) for p in m.parameters()]; "
            "m(torch.randn(3, 8), torch.rand(3, 2), torch.tensor([[0, 1], [2, 3], [1, 2]])); "
            "assert backend.create('reference').name == 'reference'; "
            "assert ('triton' in sys.modules) == before, 'the reference path imported triton'")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert backend.names() == ["batch_invariant", "reference", "triton"]
    assert backend.create("triton").name == "triton"
    with pytest.raises(ValueError, match="moe_backend"):
        backend.create("cutlass")


def test_tuning_table_is_well_formed():
    raw = json.loads(tuning.TABLE_PATH.read_text())
    table = tuning.load_table()
    assert table, "tuned_configs.json holds no device"
    for dev, shapes in table.items():
        assert dev in raw
        for key, per in shapes.items():
            assert key.startswith("E=") and set(per) <= set(tuning.BUCKETS), key
            for cfg in per.values():
                if cfg.direct:  # GEMV tiles (no tl.dot): any powers of two
                    tiles = (cfg.block_n, cfg.block_k, cfg.down_block_n or 1, cfg.down_block_k or 1)
                    assert all(v >= 1 and v & (v - 1) == 0 for v in tiles), (key, cfg)
                    continue
                for v in (cfg.block_m, cfg.block_n, cfg.block_k, cfg.down().block_n, cfg.down().block_k):
                    assert v >= 16 and v & (v - 1) == 0, (key, cfg)  # tl.dot tiles
    # no entry for CPU: the heuristic answers, by tokens per expert
    cpu = torch.device("cpu")
    assert tuning.get_config(1, 32, 2048, 1024, 4, torch.bfloat16, cpu).block_m == 16
    assert tuning.get_config(8192, 32, 2048, 1024, 4, torch.bfloat16, cpu).block_m == 64
    assert tuning.bucket(1) == 1 and tuning.bucket(300) == 512 and tuning.bucket(10 ** 6) == tuning.BUCKETS[-1]
