"""The sort-free decode MoE path (m3eagle/kernels/moe/direct.py) held equal to the dense reference, on CPU under the
Triton interpreter, in fp32 at 1e-5 relative error.

Covers T = 1, 3, 4 (decode and a batch-1 verify) and 17; top-k not a power of two (padded slots); H and I
not multiples of the tiles; every token on one expert; the expert subset (disjoint subsets sum to the full
result, a rank-local shard gives the same bits, other ranks' experts are never read); the shared expert
fused in; bit-equal repeats; and that the engine's default config takes this path for small steps only.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton` (kernels decorate at import)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from dataclasses import replace  # noqa: E402

from m3eagle.kernels.moe import backend as moe_backend  # noqa: E402
from m3eagle.kernels.moe import direct, reference, triton_moe, tuning  # noqa: E402
from m3eagle.kernels.moe.tuning import MoEConfig  # noqa: E402
from m3eagle.kernels.ops import Ops  # noqa: E402
from tests.helpers.kernel_spy import spy_launches  # noqa: E402

ALPHA, LIMIT = 1.702, 7.0
# several K steps of both GEMVs; narrow down tiles; and tiles wider than H / I (masked K, clamped rows)
TILES = MoEConfig(16, 16, 16, direct=1, down_block_n=8, down_block_k=16)
WIDE = MoEConfig(16, 64, 64, direct=1)


def make(seed: int, t: int, k: int, e: int = 8, h: int = 48, i: int = 40):
    """x [T, H], weights [T, k] fp32 (renormalised), idx [T, k] distinct, gate_up [E, 2I, H], down [E, H, I].
    Scaled so some gate / up values pass LIMIT (the clamps are live)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    idx = torch.argsort(torch.rand(t, e, generator=g), dim=1)[:, :k]
    w = torch.rand(t, k, generator=g) + 0.05
    w13 = torch.randn(e, 2 * i, h, generator=g) * 0.8
    w2 = torch.randn(e, h, i, generator=g) * 0.2
    return x, w / w.sum(-1, keepdim=True), idx, w13, w2


def assert_close(out: torch.Tensor, ref: torch.Tensor, rel: float = 1e-5) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    err = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
    assert err <= rel, f"max relative error {err:.2e} > {rel:.0e}"


def direct_calls(monkeypatch) -> list[int]:
    """Counts calls of the direct path, so a test fails if the sorted path silently answered instead."""
    calls: list[int] = []
    real = direct.direct_experts

    def spy(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(direct, "direct_experts", spy)
    return calls


@pytest.mark.parametrize("t,k,h,i", [(1, 4, 48, 40), (3, 2, 48, 40), (4, 3, 32, 64), (17, 4, 40, 24)])
def test_matches_reference(t, k, h, i, monkeypatch):
    calls = direct_calls(monkeypatch)
    x, w, idx, w13, w2 = make(t, t, k, h=h, i=i)
    ref = reference.experts(x, w, idx, w13, w2, ALPHA, LIMIT)
    for cfg in (TILES, WIDE):
        assert_close(triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, config=cfg), ref)
    assert len(calls) == 2
    hh = torch.einsum("th,eih->eti", x, w13)  # the clamps are exercised
    assert (hh[..., :i] > LIMIT).any() and (hh[..., i:].abs() > LIMIT).any()


def test_every_token_on_one_expert_and_repeats_are_bit_equal():
    x, _, _, w13, w2 = make(5, 4, 1)
    idx, w = torch.full((4, 1), 6), torch.ones(4, 1)
    out = triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, config=TILES)
    assert_close(out, reference.experts(x, w, idx, w13, w2, ALPHA, LIMIT))
    again = triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, config=TILES)
    assert torch.equal(out, again)


def test_expert_subsets_sum_and_other_ranks_experts_are_never_read():
    x, w, idx, w13, w2 = make(7, 3, 2)
    full = reference.experts(x, w, idx, w13, w2, ALPHA, LIMIT)
    parts = []
    for e0, e1 in ((0, 3), (3, 4), (4, 8)):
        # the other ranks' experts poisoned with NaN in the full stacks this rank slices: never read
        p13, p2 = w13.clone(), w2.clone()
        for s in (p13, p2):
            s[:e0] = float("nan")
            s[e1:] = float("nan")
        out = triton_moe.fused_experts(x, w, idx, p13, p2, ALPHA, LIMIT, (e0, e1), config=TILES)
        assert_close(out, reference.experts(x, w, idx, w13, w2, ALPHA, LIMIT, (e0, e1)))
        shard = triton_moe.fused_experts(x, w, idx, w13[e0:e1].clone(), w2[e0:e1].clone(), ALPHA, LIMIT,
                                         (e0, e1), config=TILES)  # a rank holding only its experts
        assert torch.equal(shard, out)
        parts.append(out)
    assert_close(sum(parts), full)
    assert not triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, (2, 2), config=TILES).any()


@pytest.mark.parametrize("gate_rows", [0, 2])
def test_gate_up_stores_nothing_for_other_ranks_pairs(gate_rows):
    """gate_up skips a pair routed to another rank's expert: its act row is left as it was (down never reads
    it either, so only the row itself can show a skip that stopped working), both gate_up kernels."""
    t, k, i = 3, 2, 40
    x, w, idx, w13, w2 = make(8, t, k, i=i)
    e0, e1 = 2, 6
    act = torch.full((t * k, i), float("nan"))  # given act: gate_up runs the routed pairs only
    cfg = replace(TILES, gate_rows=gate_rows)
    direct.direct_experts(x, w, idx, w13[e0:e1].clone(), w2[e0:e1].clone(), e0, ALPHA, LIMIT, cfg, act=act)
    local = ((idx >= e0) & (idx < e1)).reshape(-1)
    assert 0 < local.sum() < t * k
    assert torch.isnan(act[~local]).all() and torch.isfinite(act[local]).all()


@pytest.mark.parametrize("t,k", [(1, 4), (4, 3)])
def test_shared_expert_fused(t, k, monkeypatch):
    calls = direct_calls(monkeypatch)
    x, w, idx, w13, w2 = make(11 + t, t, k)
    _, _, _, s13, s2 = make(12 + t, 1, 1, e=1)
    out = triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, config=TILES, shared=(s13[0], s2[0]),
                                   routed_scale=2.0)
    ref = reference.experts(x, w, idx, w13, w2, ALPHA, LIMIT) * 2.0 + reference.experts(
        x, torch.ones(t, 1), torch.zeros(t, 1, dtype=torch.long), s13, s2, ALPHA, LIMIT)
    assert_close(out, ref)
    assert calls == [1]


def test_act_rows_of_skipped_pairs_are_never_read():
    """Pairs of other ranks' experts store no act row: poisoned with NaN (an act buffer that the gate_up
    kernel only partly writes), the down kernel must not read them."""
    x, w, idx, w13, w2 = make(13, 3, 2)
    e0, e1 = 2, 6
    real_empty = torch.empty

    def poisoned(*a, **kw):
        return real_empty(*a, **kw).fill_(float("nan"))

    torch.empty = poisoned
    try:
        out = triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, (e0, e1), config=TILES)
    finally:
        torch.empty = real_empty
    assert ((idx < e0) | (idx >= e1)).any()  # some pairs are skipped
    assert_close(out, reference.experts(x, w, idx, w13, w2, ALPHA, LIMIT, (e0, e1)))


def test_the_default_config_takes_the_direct_path_for_small_steps_only(monkeypatch):
    cpu = torch.device("cpu")
    for t in (1, 2, 4):
        assert tuning.get_config(t, 8, 48, 40, 2, torch.float32, cpu).direct == 1
    assert tuning.get_config(5, 8, 48, 40, 2, torch.float32, cpu).direct == 0
    calls = direct_calls(monkeypatch)
    for t in (1, 4, 9):
        x, w, idx, w13, w2 = make(20 + t, t, 2)
        assert_close(triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT),
                     reference.experts(x, w, idx, w13, w2, ALPHA, LIMIT))
    assert len(calls) == 2  # T = 1 and 4 direct, T = 9 sorted
    # a stack without unit stride along H / I is left to the sorted path (which takes any strides)
    x, w, idx, w13, w2 = make(30, 1, 2)
    w13_t = w13.transpose(1, 2).contiguous().transpose(1, 2)
    assert not direct.usable(w13_t, w2, None)
    assert_close(triton_moe.fused_experts(x, w, idx, w13_t, w2, ALPHA, LIMIT),
                 reference.experts(x, w, idx, w13, w2, ALPHA, LIMIT))
    assert len(calls) == 2


def test_config_round_trip_keeps_old_table_rows():
    cfg = MoEConfig(16, 32, 256, direct=1, down_block_n=8, down_block_k=128)
    assert MoEConfig.from_dict(cfg.to_dict()) == cfg
    old = MoEConfig(16, 32, 128, 1, 4, 4)
    assert set(old.to_dict()) == {"block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages"}


# ---- down's weight preload and the router + shared-expert launch -------------------------------------------

# one down tile covers I (40 -> a 64-wide masked tile; 32 -> exact): the preload variant applies
PRELOAD = MoEConfig(16, 16, 16, direct=1, down_block_n=8, down_block_k=64, down_preload=1)
PRELOAD_EVEN = MoEConfig(16, 16, 16, direct=1, down_block_n=8, down_block_k=32, down_preload=1)


def launch_flags(monkeypatch, kernel: str, flag: str) -> list:
    """The constexpr `flag` of every launch of direct.`kernel`, so a test fails if that kernel (or that
    variant of it) never ran."""
    return spy_launches(monkeypatch, direct, kernel, lambda grid, kw: kw[flag])


def preload_flags(monkeypatch) -> list[bool]:
    """The PRELOAD constexpr of every one-tile down launch."""
    return launch_flags(monkeypatch, "_direct_down_kernel", "PRELOAD")


@pytest.mark.parametrize("t,k,i,cfg", [(1, 4, 40, PRELOAD), (3, 3, 32, PRELOAD_EVEN), (4, 2, 40, PRELOAD)])
def test_down_preload_is_bit_equal_to_the_loop(t, k, i, cfg, monkeypatch):
    """Loading down's weights before the PDL wait changes when they are read, not what is computed: the
    same bits as the K loop, with and without the shared expert and on an expert subset."""
    seen = preload_flags(monkeypatch)
    x, w, idx, w13, w2 = make(40 + t, t, k, i=i)
    _, _, _, s13, s2 = make(41 + t, 1, 1, e=1, i=i)
    loop = MoEConfig(16, 16, 16, direct=1, down_block_n=8, down_block_k=cfg.down_block_k)
    for kw in ({}, {"shared": (s13[0], s2[0]), "routed_scale": 2.0}):
        a = triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, config=cfg, **kw)
        b = triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, config=loop, **kw)
        assert torch.equal(a, b)
    assert_close(a, reference.experts(x, w, idx, w13, w2, ALPHA, LIMIT) * 2.0 + reference.experts(
        x, torch.ones(t, 1), torch.zeros(t, 1, dtype=torch.long), s13, s2, ALPHA, LIMIT))
    sub = triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, (2, 6), config=cfg)
    assert_close(sub, reference.experts(x, w, idx, w13, w2, ALPHA, LIMIT, (2, 6)))
    assert seen == [True, False, True, False, True]
    # a tile narrower than I cannot preload the whole range: the loop runs
    narrow = MoEConfig(16, 16, 16, direct=1, down_block_n=8, down_block_k=16, down_preload=1)
    triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, config=narrow)
    assert seen[-1] is False


# one row, and the widest T the path takes; H 28: not a multiple of any rows' span (8, 12, 20 with 4-wide tiles)
@pytest.mark.parametrize("t,k,i,h", [(1, 4, 40, 28), (4, 2, 40, 28)])
def test_down_rows_are_bit_equal_to_one_tile_per_program(t, k, i, h, monkeypatch):
    """Several column tiles per down program (`down_rows`: the next tile's weights loaded while this one's
    sums run; act and the routing read once) computes the same products and sums per tile: bit-equal to
    one tile per program, with and without the preload, the shared expert (as wide and narrower) and an
    expert subset; H not a multiple of the rows' span (the last program's tiles past H store nothing); and
    where one K tile does not span I the one-tile kernel answers."""
    launches = launch_flags(monkeypatch, "_direct_down_rows_kernel", "ROWS")
    x, w, idx, w13, w2 = make(90 + t, t, k, h=h, i=i)
    _, _, _, s13, s2 = make(91 + t, 1, 1, e=1, h=h, i=i)
    _, _, _, n13, n2 = make(92 + t, 1, 1, e=1, h=h, i=24)
    one = MoEConfig(16, 64, 64, direct=1, down_block_n=4, down_block_k=64)  # gate_up (not the subject): one tile
    kws = ({}, {"shared": (s13[0], s2[0]), "routed_scale": 2.0}, {"shared": (n13[0], n2[0]), "routed_scale": 2.0})
    # one tile per program, computed once per (preload, shared expert): what every rows count must equal
    want = {(pre, j): triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, config=replace(one, down_preload=pre),
                                               **kw) for pre in (0, 1) for j, kw in enumerate(kws)}
    want_sub = triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, (2, 6), config=one)
    counts = (2, 3, 5) if t < 4 else (2, 5)  # CI time: the widest step skips the middle count
    runs = [(rows, pre) for rows in counts for pre in ((0, 1) if rows == counts[0] else (1,))]  # CI time:
    # the loop without the preload at the first count only (the preload's own test covers it further)
    for rows, pre in runs:
        cfg = replace(one, down_rows=rows, down_preload=pre)
        assert direct.down_rows(cfg, i, i) == rows
        for j, kw in enumerate(kws):
            a = triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, config=cfg, **kw)
            assert torch.equal(a, want[pre, j]), (rows, pre, kw.keys())
        sub = triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, (2, 6), config=cfg)
        assert torch.equal(sub, want_sub)
    assert launches == [r for r, _ in runs for _ in range(4)]
    assert_close(a, reference.experts(x, w, idx, w13, w2, ALPHA, LIMIT) * 2.0 + reference.experts(
        x, torch.ones(t, 1), torch.zeros(t, 1, dtype=torch.long), n13, n2, ALPHA, LIMIT))
    narrow = replace(one, down_block_k=16, down_rows=4)  # I 32-40 needs a 64-wide tile
    assert direct.down_rows(narrow, i, i) == 1
    triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, config=narrow)
    assert len(launches) == 4 * len(runs)


# one row, and the widest T the path takes; the pair widths (I 40 / 20, the shared expert's 24) are not
# multiples of the rows' spans (16, 24)
@pytest.mark.parametrize("t,k,h,i", [(1, 4, 48, 40), (4, 2, 64, 20)])
def test_gate_rows_are_bit_equal_to_one_tile_per_program(t, k, h, i, monkeypatch):
    """Several gate_up column tiles per program (`gate_rows`: one unrolled sequence of K steps with the next
    step's weights loaded first) runs the same FMAs per tile: bit-equal to one tile per program, over
    several K steps, a masked K tail (h 40 / 48 with 32-wide steps), a narrower shared expert, an expert
    subset and a pair width not a multiple of the rows' span."""
    launches = launch_flags(monkeypatch, "_direct_gate_up_rows_kernel", "ROWS")
    x, w, idx, w13, w2 = make(95 + t, t, k, h=h, i=i)
    _, _, _, n13, n2 = make(96 + t, 1, 1, e=1, h=h, i=24)
    one = MoEConfig(16, 8, 32, direct=1, down_block_n=16, down_block_k=64)  # down: several tiles, few programs
    kws = ({}, {"shared": (n13[0], n2[0]), "routed_scale": 2.0})
    want = [triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, config=one, **kw) for kw in kws]  # one tile
    want_sub = triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, (2, 6), config=one)
    for rows in (2, 3):
        cfg = replace(one, gate_rows=rows)
        for kw, ref in zip(kws, want):
            a = triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, config=cfg, **kw)
            assert torch.equal(a, ref)
        sub = triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, (2, 6), config=cfg)
        assert torch.equal(sub, want_sub)
        both = replace(cfg, down_rows=2)  # with several down tiles too
        assert torch.equal(triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, config=both, **kw), a)
    assert launches == [2, 2, 2, 2, 3, 3, 3, 3]
    assert_close(a, reference.experts(x, w, idx, w13, w2, ALPHA, LIMIT) * 2.0 + reference.experts(
        x, torch.ones(t, 1), torch.zeros(t, 1, dtype=torch.long), n13, n2, ALPHA, LIMIT))


def route_layer(seed: int, e: int = 8, h: int = 48, i: int = 40, k: int = 3, s_i: int | None = None):
    """A SparseMoE (shared expert as wide as the routed ones unless s_i says otherwise) with random weights,
    a random router and a random correction bias."""
    from m3eagle.models.layers import SparseMoE

    moe = SparseMoE(h, i, s_i or i, e, k, scaling=2.5, alpha=ALPHA, limit=LIMIT)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.8 if p.dim() == 3 else 0.3))
        moe.gate.e_score_correction_bias.copy_(torch.randn(e, generator=g) * 0.1)
    return moe


def route_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = direct.route_direct_experts

    def spy(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(direct, "route_direct_experts", spy)
    return calls


@pytest.mark.parametrize("t", [1, 3])
def test_router_and_shared_expert_in_one_launch(t, monkeypatch):
    """route_direct_experts == the fused router's route_tokens, then direct_experts with the shared expert:
    the same weights and experts, the same output bits; the counters are left zero; and it is the layer."""
    from m3eagle.kernels.fused import registry as fused_backend
    from m3eagle.kernels.moe import router

    moe = route_layer(50 + t)
    g, ex, sh = moe.gate, moe.experts, moe.shared_experts
    x = torch.randn(t, 48, generator=torch.Generator().manual_seed(t))
    shared = (sh.gate_up_proj.weight.detach(), sh.down_proj.weight.detach())
    cfg = replace(PRELOAD, route_shared=1)
    counters = torch.zeros(64, dtype=torch.int32)
    with torch.no_grad():
        w, idx = router.route_tokens(x, g.weight, g.e_score_correction_bias, 3, torch.zeros(64, dtype=torch.int32))
        sep = direct.direct_experts(x, w, idx, ex.gate_up_proj, ex.down_proj, 0, ALPHA, LIMIT, cfg, shared, 2.5)
        one = direct.route_direct_experts(x, g.weight, g.e_score_correction_bias, 3, counters, ex.gate_up_proj,
                                          ex.down_proj, ALPHA, LIMIT, cfg, shared, 2.5)
        assert torch.equal(one, sep)
        assert not counters.any()
        assert_close(one, moe(x))
        # through the layer: the triton MoE with a route_shared entry takes it, bit-equal to the entry without
        calls = route_calls(monkeypatch)
        fused = fused_backend.create("triton")
        on = Ops(attention=None, moe=moe_backend.create("triton", config=cfg), fused=fused)
        off = Ops(attention=None, moe=moe_backend.create("triton", config=PRELOAD), fused=fused)
        a, rest, scale = moe.forward_parts(x, on)
        b, _, _ = moe.forward_parts(x, off)
        assert rest is None and scale == 1.0 and torch.equal(a, b) and torch.equal(a, one)
        assert calls == [1]
        # with the reference ops the routing is theirs: the launch is not used
        ref_ops = Ops(attention=None, moe=moe_backend.create("triton", config=cfg), fused=fused_backend.create("reference"))
        moe.forward_parts(x, ref_ops)
        assert calls == [1]


def test_route_shared_preloading_its_weights_is_bit_equal(monkeypatch):
    """The route + shared launch with PDL's weight preload (its router programs read their expert rows, its
    shared-expert programs their first K step's gate / up tiles, before the wait: pdl.preload_weights forced
    on; the interpreter has no wait) gives the same bits as without it, K a multiple of the step or not,
    counters left zero."""
    from m3eagle.kernels import pdl
    from m3eagle.kernels.moe import router

    moe = route_layer(61)
    g, ex, sh = moe.gate, moe.experts, moe.shared_experts
    shared = (sh.gate_up_proj.weight.detach(), sh.down_proj.weight.detach())
    cfgs = (replace(PRELOAD, route_shared=1), replace(PRELOAD, route_shared=1, block_k=32))  # K 48: 3 / 1.5 steps
    counters = torch.zeros(64, dtype=torch.int32)

    def run(x, cfg):
        return direct.route_direct_experts(x, g.weight, g.e_score_correction_bias, 3, counters, ex.gate_up_proj,
                                           ex.down_proj, ALPHA, LIMIT, cfg, shared, 2.5)

    cases = [(torch.randn(t, 48, generator=torch.Generator().manual_seed(70 + t)), cfg) for t in (1, 3) for cfg in cfgs]
    with torch.no_grad():
        want = [run(x, cfg) for x, cfg in cases]
        launches = spy_launches(monkeypatch, direct, "_route_shared_kernel")
        monkeypatch.setattr(pdl, "preload_weights", lambda launch: True)
        for (x, cfg), w in zip(cases, want):
            assert torch.equal(run(x, cfg), w), cfg
    assert [kw["PRELOAD"] for kw in launches] == [True] * 4 and not counters.any()
    assert [kw["EVEN_K"] for kw in launches] == [True, False] * 2
    assert router.router_preload({"PDL": True}, 4096, 4097) is False  # past one H tile: never


def test_router_and_shared_launch_falls_back_where_it_cannot_match(monkeypatch):
    """A warp count other than the router's (another reduction order), a step past the decode router, or
    a narrower shared expert: the layer routes and runs the experts apart, still exact."""
    from m3eagle.kernels.fused import registry as fused_backend
    from m3eagle.kernels.moe import router

    calls = route_calls(monkeypatch)
    moe = route_layer(60)
    x = torch.randn(2, 48, generator=torch.Generator().manual_seed(2))
    fused = fused_backend.create("triton")
    assert router.router_gemv_blocks(2, 8, 48)[2] == 4
    for cfg in (MoEConfig(16, 16, 16, num_warps=2, direct=1, route_shared=1),
                MoEConfig(16, 16, 16, direct=1, route_shared=0)):
        ops = Ops(attention=None, moe=moe_backend.create("triton", config=cfg), fused=fused)
        with torch.no_grad():
            out, _, _ = moe.forward_parts(x, ops)
            assert_close(out, moe(x))
    assert calls == []
    big = torch.randn(router.ROUTER_GEMV_MAX_T + 1, 48)
    assert not direct.can_route(big, moe.gate.weight, 3, MoEConfig(16, 16, 16, direct=1, route_shared=1))


SHARED_DOWN_VARIANTS = [dict(shared_down=1), dict(shared_down=2), dict(shared_down=4),
                        dict(shared_down=2, gate_rows=2, down_rows=3), dict(shared_down=1, down_preload=0)]


@pytest.mark.parametrize("t,h,i,s_i", [(1, 48, 40, None), (2, 40, 32, 56)])  # same-width and wider shared expert
def test_shared_down_in_the_gate_up_launch_is_bit_equal(t, h, i, s_i, monkeypatch):
    """The shared expert's down as programs of the routed gate_up launch (shared_down: 1 / 2 / 4 tiles a
    program, its rounded rows added by down), alone, with several gate_up / down tiles and without down's
    preload: bit-equal to the route + shared launch without it, shared experts as wide, narrower and wider
    than the routed ones (its rows' programs spanning H unevenly); the variants' launches ran (SD / SD_DONE);
    a down K tile narrower than the widths turns it off."""
    sd = launch_flags(monkeypatch, "_direct_gate_up_rows_kernel", "SD")
    sd_done = launch_flags(monkeypatch, "_direct_down_rows_kernel", "SD_DONE")
    moe = route_layer(70 + t, h=h, i=i, s_i=s_i)
    g, ex, sh = moe.gate, moe.experts, moe.shared_experts
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(t))
    shared = (sh.gate_up_proj.weight.detach(), sh.down_proj.weight.detach())
    base = MoEConfig(16, 8, 16, direct=1, down_block_n=4, down_block_k=64, down_preload=1, route_shared=1)

    def layer(cfg):
        counters = torch.zeros(t, dtype=torch.int32)
        out = direct.route_direct_experts(x, g.weight, g.e_score_correction_bias, 3, counters, ex.gate_up_proj,
                                          ex.down_proj, ALPHA, LIMIT, cfg, shared, 2.5)
        assert not counters.any()
        return out

    with torch.no_grad():
        want = layer(base)
        for kw in SHARED_DOWN_VARIANTS:
            assert torch.equal(layer(replace(base, **kw)), want), kw
        narrow = replace(base, shared_down=2, down_block_k=16)
        assert direct.shared_down_tiles(narrow, i, s_i or i) == 0
        assert torch.equal(layer(replace(base, down_block_k=16)), layer(narrow))
    assert sd == [True] * len(SHARED_DOWN_VARIANTS)  # (the narrow tile runs the one-tile kernels)
    assert sd_done == [True] * len(SHARED_DOWN_VARIANTS)
    assert_close(want, moe(x))
    with pytest.raises(ValueError, match="shared_down=3: use 0"):
        direct.shared_down_tiles(replace(base, shared_down=3), i, i)


def test_config_round_trip_keeps_the_new_flags():
    cfg = MoEConfig(16, 4, 512, num_stages=1, direct=1, down_block_n=1, down_block_k=1024, down_preload=1,
                    route_shared=1)
    assert MoEConfig.from_dict(cfg.to_dict()) == cfg
    assert "route_shared" not in MoEConfig(16, 4, 512, direct=1).to_dict()


# ---- a shared expert of another width than the routed ones (the embedded model: I 160, shared 128) ---------


@pytest.mark.parametrize("t,s_i", [(1, 24), (3, 56), (4, 40)])
def test_shared_expert_of_another_width_on_the_direct_path(t, s_i):
    """The direct kernels index the shared expert apart, so it may be narrower or wider than the routed
    experts: equal to the reference's routed * scale + shared, with the K loop and with the preload (one
    tile over both widths), and the two bit-equal."""
    x, w, idx, w13, w2 = make(70 + t, t, 3)
    _, _, _, s13, s2 = make(71 + t, 1, 1, e=1, i=s_i)
    ref = reference.experts(x, w, idx, w13, w2, ALPHA, LIMIT) * 2.0 + reference.experts(
        x, torch.ones(t, 1), torch.zeros(t, 1, dtype=torch.long), s13, s2, ALPHA, LIMIT)
    steps = MoEConfig(16, 16, 16, direct=1, down_block_n=8, down_block_k=16)  # several K steps of each width
    loop = MoEConfig(16, 16, 16, direct=1, down_block_n=8, down_block_k=64)  # one K step, loaded after the wait
    pre = replace(loop, down_preload=1)
    assert direct.preloads(pre, 40, s_i) and not direct.preloads(loop, 40, s_i)
    assert not direct.preloads(replace(steps, down_preload=1), 40, s_i)
    got = {}
    for name, cfg in (("steps", steps), ("loop", loop), ("pre", pre)):
        got[name] = triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, config=cfg, shared=(s13[0], s2[0]),
                                             routed_scale=2.0)
        assert_close(got[name], ref)
    assert torch.equal(got["loop"], got["pre"])
    # the sorted path takes it too (its own segment: tests/kernels/test_moe_kernel.py)
    assert_close(triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, config=MoEConfig(16, 16, 16),
                                          shared=(s13[0], s2[0]), routed_scale=2.0), ref)


def test_layer_fuses_a_narrower_shared_expert(monkeypatch):
    """SparseMoE.forward_parts: a narrower shared expert rides in the direct kernels (rest None), and with a
    route_shared entry in the router's launch too, bit-equal to routing apart; and in the sorted GEMMs. All
    within fp32 rounding of the reference layer."""
    from m3eagle.kernels.fused import registry as fused_backend

    moe = route_layer(80, s_i=24)
    assert not moe.can_fuse_shared() and moe.shared_joinable()
    fused = fused_backend.create("triton")
    x = torch.randn(2, 48, generator=torch.Generator().manual_seed(8))
    calls = route_calls(monkeypatch)
    with torch.no_grad():
        want = moe(x)
        outs = {}
        for name, cfg in (("direct", PRELOAD), ("route", replace(PRELOAD, route_shared=1)),
                          ("sorted", MoEConfig(16, 16, 16))):
            a, rest, scale = moe.forward_parts(x, Ops(attention=None, moe=moe_backend.create("triton", config=cfg),
                                                      fused=fused))
            assert rest is None, name
            outs[name] = a if rest is None else a * scale + rest
            assert_close(outs[name], want)
    assert torch.equal(outs["direct"], outs["route"]) and calls == [1]
