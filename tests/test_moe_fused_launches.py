"""The MoE's decode-sized launches folded together, held bit-equal to the unfused launches, on CPU under the
Triton interpreter:

- the down GEMM doing the combine (`fused_experts(counters=...)`): same output bits as down then combine,
  with and without the shared expert and with an expert subset; counters back at zero;
- the router doing the alignment (`route_align`): the same weights and experts as `route_tokens` and the
  same layout as `align`, ties included;
- the whole layer (`moe_layer`, and `SparseMoE.forward_parts` taking it with the triton fused ops only).

The interpreter runs a launch's programs one after another, so it cannot catch a program that reads
another's rows before they are written (the counters' acquire-release ordering); the GPU test file runs
the same equalities on the H200 (tests/test_cuda_graphs.py::test_moe_fused_launches_on_gpu).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton` (kernels decorate at import)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from m3eagle.fused import triton_fused  # noqa: E402
from m3eagle.fused.backend import create as create_fused  # noqa: E402
from m3eagle.models.layers import SparseMoE  # noqa: E402
from m3eagle.moe import backend, triton_moe  # noqa: E402
from m3eagle.moe.align import align  # noqa: E402
from m3eagle.moe.tuning import MoEConfig  # noqa: E402

H, I, E, K = 32, 64, 8, 2
ALPHA, LIMIT = 1.702, 7.0
SMALL = MoEConfig(block_m=16, block_n=16, block_k=16, group_m=1)  # two column blocks over H=32
CPU = torch.device("cpu")


def weights(seed: int, e: int = E) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(e, 2 * I, H, generator=g) * 0.8, torch.randn(e, H, I, generator=g) * 0.2


def routing(seed: int, t: int, k: int = K) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g)
    idx = torch.argsort(torch.rand(t, E, generator=g), dim=1)[:, :k]
    w = torch.rand(t, k, generator=g) + 0.05
    return x, w / w.sum(-1, keepdim=True), idx


def router(seed: int, ties: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """router weight [E, H] fp32 and correction bias [E]; `ties`: experts 2 and 5 score alike (same row,
    same bias), and so do 1 and 6, so selection must break ties by the lowest id."""
    g = torch.Generator().manual_seed(seed)
    rw, bias = torch.randn(E, H, generator=g) * 0.3, torch.randn(E, generator=g) * 0.1
    if ties:
        rw[5], bias[5], rw[6], bias[6] = rw[2], bias[2], rw[1], bias[1]
    return rw, bias


@pytest.mark.parametrize("t", [1, 3, 17, 64])
@pytest.mark.parametrize("shared", [False, True])
def test_down_with_the_combine_is_bit_equal(t, shared):
    w13, w2 = weights(t)
    s13, s2 = weights(t + 100, e=1)
    x, w, idx = routing(t + 1, t)
    sh = (s13[0], s2[0]) if shared else None
    c = triton_moe.new_counters(CPU)
    apart = triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, config=SMALL, shared=sh, routed_scale=1.5)
    fused = triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, config=SMALL, shared=sh, routed_scale=1.5,
                                     counters=c)
    assert torch.equal(fused, apart)
    assert not c.any(), "the fused combine must leave its counters at zero"


@pytest.mark.parametrize("rng", [(0, 3), (3, 8), (2, 2)])
def test_down_with_the_combine_for_an_expert_subset(rng):
    """A rank's experts only: tokens whose pairs are all elsewhere still get their (zero) row written."""
    w13, w2 = weights(7)
    x, w, idx = routing(8, 9)
    c = triton_moe.new_counters(CPU)
    apart = triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, rng, config=SMALL)
    fused = triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, rng, config=SMALL, counters=c)
    assert torch.equal(fused, apart) and not c.any()


def test_steps_past_the_limit_take_the_separate_combine():
    t = triton_moe.FUSE_MAX_T + 1
    assert not triton_moe._fuse_combine(t, H, SMALL, triton_moe.new_counters(CPU))
    assert triton_moe._fuse_combine(t - 1, H, SMALL, triton_moe.new_counters(CPU))
    assert not triton_moe._fuse_combine(1, H, SMALL, None)


@pytest.mark.parametrize("t", [1, 5, 16, 17, 40])
@pytest.mark.parametrize("ties", [False, True])
def test_route_align_equals_route_tokens_then_align(t, ties):
    """t <= 16 aligns inside the router's launch, 17 and 40 route alone then align: either way the same
    routing as `route_tokens` and the same layout, entry for entry, as `align`."""
    rw, bias = router(t, ties)
    x, _, _ = routing(t + 3, t)
    c = triton_moe.new_counters(CPU)
    w, idx, al = triton_moe.route_align(x, rw, bias, K, 16, c)
    w_ref, idx_ref = triton_fused.route_tokens(x, rw, bias, K, torch.zeros(64, dtype=torch.int32))
    assert torch.equal(w, w_ref) and torch.equal(idx, idx_ref)
    ref = align(idx_ref, 0, E, 16, shared=True)
    assert (al.max_blocks, al.num_pairs, al.routed_pairs) == (ref.max_blocks, ref.num_pairs, ref.routed_pairs)
    assert torch.equal(al.num_blocks, ref.num_blocks)
    assert torch.equal(al.sorted_ids, ref.sorted_ids) and torch.equal(al.block_expert, ref.block_expert)
    assert not c.any()
    if ties:  # the tied pairs: never the higher id of a pair when only one of the two is taken
        for row in idx.tolist():
            assert not (5 in row and 2 not in row) and not (6 in row and 1 not in row)


@pytest.mark.parametrize("t", [1, 4, 16, 33])
def test_moe_layer_equals_the_unfused_layer(t):
    rw, bias = router(t + 9)
    w13, w2 = weights(t + 10)
    s13, s2 = weights(t + 11, e=1)
    x, _, _ = routing(t + 12, t)
    c = triton_moe.new_counters(CPU)
    out = triton_moe.moe_layer(x, rw, bias, K, w13, w2, (s13[0], s2[0]), ALPHA, LIMIT, 2.5, c, config=SMALL)
    w, idx = triton_fused.route_tokens(x, rw, bias, K, torch.zeros(64, dtype=torch.int32))
    ref = triton_moe.fused_experts(x, w, idx, w13, w2, ALPHA, LIMIT, config=SMALL, shared=(s13[0], s2[0]),
                                   routed_scale=2.5)
    assert out is not None and torch.equal(out, ref) and not c.any()


def test_moe_layer_declines_what_it_does_not_fuse():
    rw, bias = router(1)
    w13, w2 = weights(2)
    s13, s2 = weights(3, e=1)
    c = triton_moe.new_counters(CPU)
    args = (w13, w2, (s13[0], s2[0]), ALPHA, LIMIT, 1.0, c)
    big, _, _ = routing(4, triton_moe.FUSE_MAX_T + 1)
    assert triton_moe.moe_layer(big, rw, bias, K, *args, config=SMALL) is None  # a prompt chunk
    x, _, _ = routing(5, 2)
    assert triton_moe.moe_layer(x, rw.double(), bias, K, *args, config=SMALL) is None  # not an fp32 router
    assert triton_moe.moe_layer(x[:0], rw, bias, K, *args, config=SMALL) is None


def test_forward_parts_takes_the_fused_layer_with_triton_fused_ops_only():
    """SparseMoE.forward_parts: with the triton MoE and triton fused ops a decode-sized step runs
    `layer` (and equals the reference layer); with the reference fused ops it routes with the reference
    router instead (the fused layer's router kernel sums the GEMV in another order)."""
    from m3eagle.ops import Ops

    moe = SparseMoE(H, I, I, E, K, scaling=1.5, alpha=ALPHA, limit=LIMIT)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.8 if p.dim() == 3 else 0.3))
    x, _, _ = routing(6, 5)
    impl = backend.create("triton", config=SMALL)
    calls: list[int] = []
    layer = impl.layer
    impl.layer = lambda *a, **kw: calls.append(1) or layer(*a, **kw)
    with torch.no_grad():
        out, rest, scale = moe.forward_parts(x, Ops(attention=None, moe=impl, fused=create_fused("triton")))
        assert calls == [1] and rest is None and scale == 1.0
        ref = moe(x)
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        assert err <= 1e-5, err
        moe.forward_parts(x, Ops(attention=None, moe=impl, fused=create_fused("reference")))
    assert calls == [1]
