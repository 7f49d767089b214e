"""The sort-free decode MoE path (m3eagle/moe/direct.py) held equal to the dense reference, on CPU under the
Triton interpreter, in fp32 at 1e-5 relative error.

Covers T = 1, 3, 4 (decode and a batch-1 verify) and 17; top-k not a power of two (padded slots); H and I
not multiples of the tiles; every token on one expert; the expert subset (disjoint subsets sum to the full
result, a rank-local shard gives the same bits, other ranks' experts are never read); the shared expert
fused in; bit-equal repeats; and that the engine's default config takes this path for small steps only.

The expert-major gate_up (direct=2, T <= 4) is held to the same reference and to direct=1 bit for bit (act
and output) at T = 1..4, with and without the shared expert; experts nobody picked are never read (nor
other ranks' experts); all tokens on one expert or one set of experts; router ties; repeated ids; and it
refuses T > 4 with an error naming the config.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton` (kernels decorate at import)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from m3eagle.models.layers import SparseMoE  # noqa: E402
from m3eagle.moe import backend, direct, reference, triton_moe, tuning  # noqa: E402
from m3eagle.moe.tuning import MoEConfig  # noqa: E402

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
    em = MoEConfig(16, 8, 256, num_warps=8, num_stages=1, direct=2, down_block_n=8, down_block_k=256)
    assert em.to_dict()["direct"] == 2 and MoEConfig.from_dict(em.to_dict()) == em
    old = MoEConfig(16, 32, 128, 1, 4, 4)
    assert set(old.to_dict()) == {"block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages"}


# ---- direct=2: the expert-major gate_up (one program per (expert, column tile), all its tokens) ----

EM = MoEConfig(16, 16, 16, direct=2, down_block_n=8, down_block_k=16)  # TILES' tiles: several K steps
EM_WIDE = MoEConfig(16, 64, 64, direct=2)  # tiles wider than H / I: masked K, clamped rows
PAIR_MAJOR = {EM: TILES, EM_WIDE: WIDE}  # the direct=1 config of the same tiles


def run_with_act(monkeypatch, cfg: MoEConfig, *args, fill: float = -7.25, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """fused_experts' output and the act buffer its gate_up filled (direct_experts' first torch.empty),
    every buffer pre-filled with `fill`: rows a kernel leaves unwritten keep it (NaN: and must not be read)."""
    made: list[torch.Tensor] = []
    real_empty = torch.empty

    def filled(*a, **k):
        made.append(real_empty(*a, **k).fill_(fill))
        return made[-1]

    with monkeypatch.context() as m:
        m.setattr(torch, "empty", filled)
        out = triton_moe.fused_experts(*args, config=cfg, **kw)
    return out, made[0]


def shared_expert(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    _, _, _, s13, s2 = make(seed, 1, 1, e=1)
    return s13[0], s2[0]


def reference_with(x, w, idx, w13, w2, shared, expert_range=None, scale: float = 1.0) -> torch.Tensor:
    ref = reference.experts(x, w, idx, w13, w2, ALPHA, LIMIT, expert_range) * scale
    if shared is not None:
        t = x.shape[0]
        ref = ref + reference.experts(x, torch.ones(t, 1), torch.zeros(t, 1, dtype=torch.long), shared[0][None],
                                      shared[1][None], ALPHA, LIMIT)
    return ref


def assert_em_matches(monkeypatch, x, w, idx, w13, w2, shared=None, scale: float = 1.0, expert_range=None,
                      configs=(EM, EM_WIDE), ref_weights=None) -> None:
    """direct=2 within 1e-5 of the reference and equal to direct=1 of the same tiles bit for bit: the act
    rows (unwritten ones included) and the output."""
    ref = reference_with(x, w, idx, *(ref_weights or (w13, w2)), shared, expert_range, scale)
    for cfg in configs:
        args = (x, w, idx, w13, w2, ALPHA, LIMIT, expert_range)
        out, act = run_with_act(monkeypatch, cfg, *args, shared=shared, routed_scale=scale)
        assert_close(out, ref)
        out1, act1 = run_with_act(monkeypatch, PAIR_MAJOR[cfg], *args, shared=shared, routed_scale=scale)
        assert torch.equal(act, act1) and torch.equal(out, out1), cfg


@pytest.mark.parametrize("use_shared", [False, True])
@pytest.mark.parametrize("t,k,h,i", [(1, 4, 48, 40), (2, 4, 48, 40), (3, 2, 48, 40), (4, 3, 32, 64), (4, 4, 40, 24)])
def test_expert_major_matches_reference_and_direct1_bit_for_bit(t, k, h, i, use_shared, monkeypatch):
    calls = direct_calls(monkeypatch)
    x, w, idx, w13, w2 = make(40 + t, t, k, h=h, i=i)
    shared = None
    if use_shared:
        _, _, _, s13, s2 = make(50 + t, 1, 1, e=1, h=h, i=i)
        shared = (s13[0], s2[0])
    assert_em_matches(monkeypatch, x, w, idx, w13, w2, shared, scale=2.0 if use_shared else 1.0)
    assert len(calls) == 4  # 2 configs x (direct=2, direct=1): never the sorted path


@pytest.mark.parametrize("use_shared", [False, True])
def test_experts_nobody_picked_are_never_read(use_shared, monkeypatch):
    """Their programs exit before any weight load: NaN-poisoned, they leave the output finite and exact.
    Expert 5 is picked by both tokens, in different slots."""
    x, _, _, w13, w2 = make(60, 2, 2)
    idx, w = torch.tensor([[1, 5], [5, 2]]), torch.tensor([[0.7, 0.3], [0.4, 0.6]])
    p13, p2 = w13.clone(), w2.clone()
    for e in (0, 3, 4, 6, 7):
        p13[e] = float("nan")
        p2[e] = float("nan")
    shared = shared_expert(61) if use_shared else None
    assert_em_matches(monkeypatch, x, w, idx, p13, p2, shared, ref_weights=(w13, w2))


def gate_up_reads(monkeypatch, w: torch.Tensor, fn) -> torch.Tensor:
    """How many times each element of `w` was loaded while `fn()` ran, counted in the Triton interpreter's
    masked load (every tl.load goes through it; internal API, hence the skip if it moves)."""
    interp = pytest.importorskip("triton.runtime.interpreter")
    real = getattr(interp.InterpreterBuilder, "create_masked_load", None)
    if real is None:
        pytest.skip("this Triton's interpreter has no create_masked_load to count loads in")
    counts = np.zeros(w.numel(), dtype=np.int64)
    lo, size = w.data_ptr(), w.element_size()

    def counting(self, ptrs, mask, *a, **kw):
        addr = ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape).astype(bool)].astype(np.int64)
        addr = addr[(addr >= lo) & (addr < lo + w.numel() * size)]
        np.add.at(counts, (addr - lo) // size, 1)
        return real(self, ptrs, mask, *a, **kw)

    with monkeypatch.context() as m:
        m.setattr(interp.InterpreterBuilder, "create_masked_load", counting)
        fn()
    return torch.from_numpy(counts).reshape(w.shape)


def test_each_picked_expert_is_streamed_once_and_the_others_never(monkeypatch):
    """The point of direct=2: with tiles dividing H and I, every gate / up weight of a picked expert (and of
    the shared one) is loaded exactly once however many tokens picked it, and an expert nobody picked not
    at all; direct=1 loads an expert's weights once per pair that picked it (the shared one's once per token)."""
    x, _, _, w13, w2 = make(65, 4, 2, h=48, i=32)
    idx = torch.tensor([[1, 5], [5, 2], [5, 1], [6, 5]])  # expert 5: 4 tokens, 1: 2, 2 and 6: 1
    w = torch.full((4, 2), 0.5)
    s13, s2 = make(66, 1, 1, e=1, h=48, i=32)[3:]
    shared = (s13[0], s2[0])
    picks = torch.bincount(idx.reshape(-1), minlength=8)[:, None, None].expand_as(w13)
    for cfg, want, want_shared in ((EM, (picks > 0).long(), 1), (TILES, picks, 4)):
        def run(cfg=cfg):
            triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, config=cfg, shared=shared)
        assert torch.equal(gate_up_reads(monkeypatch, w13, run), want), cfg
        assert (gate_up_reads(monkeypatch, shared[0], run) == want_shared).all(), cfg  # direct=1: once per token


def test_every_token_on_one_expert_or_one_set_of_experts(monkeypatch):
    x, _, _, w13, w2 = make(70, 4, 1)
    assert_em_matches(monkeypatch, x, torch.ones(4, 1), torch.full((4, 1), 6), w13, w2)
    # all four tokens pick experts {3, 6} (slots in both orders) and {0, 1, 2, 4, 5, 7} get nothing
    idx = torch.tensor([[3, 6], [6, 3], [3, 6], [6, 3]])
    w = torch.tensor([[0.9, 0.1], [0.5, 0.5], [0.2, 0.8], [0.6, 0.4]])
    assert_em_matches(monkeypatch, x, w, idx, w13, w2, shared_expert(71), scale=2.0)


def test_repeated_ids_of_a_token_are_each_served(monkeypatch):
    """Not what top-k produces, but the contract of reference.experts: an expert listed twice by a token
    counts twice. The expert-major program stores the row in every slot that names it."""
    x, _, _, w13, w2 = make(75, 3, 2)
    idx = torch.tensor([[2, 2], [2, 7], [7, 7]])
    w = torch.tensor([[0.3, 0.7], [0.5, 0.5], [0.9, 0.1]])
    assert_em_matches(monkeypatch, x, w, idx, w13, w2, configs=(EM,))


def test_router_ties_give_the_same_layer_output():
    """A router with zero weights scores every expert alike (as test_moe_kernel's tie test): top-k breaks
    the tie and every token picks the same experts; the shared expert (as wide as the routed) is fused."""
    h, i, e = 48, 40, 8
    moe = SparseMoE(h, i, i, e, 2, scaling=2.0, alpha=ALPHA, limit=LIMIT)
    g = torch.Generator().manual_seed(80)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.8 if p.dim() == 3 else 0.3))
        moe.gate.weight.zero_()
    x, _, _, _, _ = make(81, 4, 1, h=h, i=i)
    w, idx = moe.gate(x)
    assert torch.all(w == 0.5) and (idx == idx[:1]).all()  # a real tie, the same pick for every token
    assert moe.can_fuse_shared()
    from m3eagle.ops import Ops

    with torch.no_grad():
        ref = moe(x)
        for cfg in (EM, EM_WIDE):
            ops = Ops(attention=None, moe=backend.create("triton", config=cfg), fused=None)
            out, rest, scale = moe.forward_parts(x, ops)
            assert rest is None and scale == 1.0
            assert_close(out, ref)


def test_expert_major_subsets_never_read_other_ranks_experts(monkeypatch):
    """Other ranks' experts NaN-poisoned in the full stacks and every act buffer NaN-filled: pairs routed
    elsewhere get no program and no row, and down never reads them. A rank-local shard gives the same bits;
    the disjoint subsets sum to the full result."""
    x, w, idx, w13, w2 = make(90, 4, 2)
    full = reference.experts(x, w, idx, w13, w2, ALPHA, LIMIT)
    parts = []
    for e0, e1 in ((0, 3), (3, 4), (4, 8)):
        p13, p2 = w13.clone(), w2.clone()
        for s in (p13, p2):
            s[:e0] = float("nan")
            s[e1:] = float("nan")
        ref = reference.experts(x, w, idx, w13, w2, ALPHA, LIMIT, (e0, e1))
        out, act = run_with_act(monkeypatch, EM, x, w, idx, p13, p2, ALPHA, LIMIT, (e0, e1), fill=float("nan"))
        assert_close(out, ref)
        mine = ((idx >= e0) & (idx < e1)).reshape(-1)
        assert not act[~mine].isfinite().any() and act[mine].isfinite().all()  # exactly the local rows written
        out1 = triton_moe.fused_experts(x, w, idx, p13, p2, ALPHA, LIMIT, (e0, e1), config=TILES)
        assert torch.equal(out, out1)
        shard = triton_moe.fused_experts(x, w, idx, w13[e0:e1].clone(), w2[e0:e1].clone(), ALPHA, LIMIT,
                                         (e0, e1), config=EM)
        assert torch.equal(shard, out)
        parts.append(out)
    assert ((idx < 3) | (idx >= 4)).any()  # the middle rank skips pairs
    assert_close(sum(parts), full)


def test_expert_major_refuses_more_than_four_tokens():
    x, w, idx, w13, w2 = make(95, 5, 2)
    for cfg in (EM, EM_WIDE):
        with pytest.raises(ValueError, match=r"direct=2.*at most 4 tokens.*T=5"):
            triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, config=cfg)
    with pytest.raises(ValueError, match="direct=3"):
        triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, config=MoEConfig(16, 16, 16, direct=3))
