"""The one-launch MoE layer (router + gate_up + down in one grid, m3eagle/moe/direct.py `direct_layer`) on CPU
under the Triton interpreter, in fp32.

The interpreter runs a grid's programs one after another in index order, so the ticket order equals the
index order and no wait ever spins: these tests hold the roles' arithmetic, the routing rule, the counters'
reset and the engine's choice of path; the concurrent hand-offs (release / acquire, the ticket) run on the
GPU (tests/test_cuda_graphs.py::test_moe_layer_on_gpu...).

- Bit-equal to the fused router (`route_tokens`) followed by the two-launch direct path with the same tiles
  (same helpers, same numpy math), and within 1e-5 of the dense reference layer: T = 1..4, top-k 4 and 3
  (padded slots), H / I not multiples of the tiles, ties in the router (lowest expert id wins).
- Counters are zero after every launch, and launches of other sizes in between change nothing.
- SparseMoE.forward_parts takes the one launch exactly when the config says direct == 2 (and a triton
  fused-ops backend is present), and otherwise the router + experts path.
"""

from __future__ import annotations

import os
from dataclasses import replace

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton` (kernels decorate at import)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from m3eagle.fused import backend as fused_backend  # noqa: E402
from m3eagle.fused.gemv import SplitCounters  # noqa: E402
from m3eagle.models.layers import SparseMoE  # noqa: E402
from m3eagle.moe import backend, direct, triton_moe  # noqa: E402
from m3eagle.moe.tuning import MoEConfig  # noqa: E402
from m3eagle.ops import Ops  # noqa: E402

ALPHA, LIMIT = 1.702, 7.0
# several K steps of both GEMVs, narrow down tiles; and tiles wider than H / I (masked K, clamped rows)
LAYER = MoEConfig(16, 8, 16, direct=2, down_block_n=8, down_block_k=16)
LAYER_WIDE = MoEConfig(16, 64, 64, direct=2)


def make_layer(seed: int, e: int = 8, k: int = 4, h: int = 48, i: int = 40, scaling: float = 2.5) -> SparseMoE:
    """A SparseMoE whose shared expert has the routed width (so it can be fused), random weights including
    the router and its correction bias; scaled so the SwiGLU-OAI clamps are live."""
    moe = SparseMoE(h, i, i, e, k, scaling=scaling, alpha=ALPHA, limit=LIMIT)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.8 if p.dim() == 3 else 0.3))
        moe.gate.e_score_correction_bias.copy_(torch.randn(e, generator=g) * 0.1)
    assert moe.can_fuse_shared()
    return moe


def layer_args(moe: SparseMoE) -> tuple:
    g, sh, ex = moe.gate, moe.shared_experts, moe.experts
    return (g.weight, g.e_score_correction_bias, g.top_k, ex.gate_up_proj, ex.down_proj,
            (sh.gate_up_proj.weight, sh.down_proj.weight), ALPHA, LIMIT, moe.routed_scaling_factor)


def two_launch(moe: SparseMoE, x: torch.Tensor, cfg: MoEConfig) -> torch.Tensor:
    """The fused router, then the direct experts with the same tiles (the shared expert fused)."""
    fused = fused_backend.create("triton")
    w, idx = moe.gate(x, fused)
    sh = moe.shared_experts
    return triton_moe.fused_experts(x, w, idx, moe.experts.gate_up_proj, moe.experts.down_proj, ALPHA, LIMIT,
                                    config=cfg, shared=(sh.gate_up_proj.weight, sh.down_proj.weight),
                                    routed_scale=moe.routed_scaling_factor)


def assert_close(out: torch.Tensor, ref: torch.Tensor, rel: float = 1e-5) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype and torch.isfinite(out).all()
    err = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
    assert err <= rel, f"max relative error {err:.2e} > {rel:.0e}"


@pytest.mark.parametrize("t,k,h,i", [(1, 4, 48, 40), (2, 3, 48, 40), (3, 4, 40, 24), (4, 3, 32, 64)])
def test_layer_equals_router_then_direct_experts_and_the_reference(t, k, h, i):
    moe = make_layer(10 + t, k=k, h=h, i=i)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(t))
    counters = SplitCounters(direct.COUNTERS)
    with torch.no_grad():
        ref = moe(x)  # the dense reference layer (reference router, every expert)
        for cfg in (LAYER, LAYER_WIDE):
            out = direct.direct_layer(x, *layer_args(moe), cfg, counters)
            assert torch.equal(out, two_launch(moe, x, cfg))
            assert_close(out, ref)
            assert counters.get(x.device).eq(0).all()  # left zero for the next launch
    hh = torch.einsum("th,eih->eti", x, moe.experts.gate_up_proj)  # the clamps are exercised
    assert (hh[..., :i] > LIMIT).any() and (hh[..., i:].abs() > LIMIT).any()


def test_router_ties_go_to_the_lowest_expert_id():
    """Experts 1, 3, 5 have the same router row and bias: equal scores, so the lowest ids are taken first
    (the fused router's and torch.topk's rule); a different choice would change the output."""
    moe = make_layer(30, k=2)
    with torch.no_grad():
        moe.gate.weight[3].copy_(moe.gate.weight[1])
        moe.gate.weight[5].copy_(moe.gate.weight[1])
        moe.gate.e_score_correction_bias[[1, 3, 5]] = 5.0  # these three beat every other expert
    x = torch.randn(2, 48, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        w, idx = moe.gate(x)  # reference routing
        assert idx.sort(-1).values.tolist() == [[1, 3], [1, 3]]
        out = direct.direct_layer(x, *layer_args(moe), LAYER, SplitCounters(direct.COUNTERS))
        assert_close(out, moe(x))
    assert not torch.equal(moe.experts.gate_up_proj[3], moe.experts.gate_up_proj[5])  # picking 5 would show


def test_counters_reset_across_launches_of_different_sizes():
    moe = make_layer(40)
    counters = SplitCounters(direct.COUNTERS)
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(t, 48, generator=g) for t in (1, 4, 2, 1)]
    with torch.no_grad():
        first = [direct.direct_layer(x, *layer_args(moe), LAYER, counters) for x in xs]
        again = [direct.direct_layer(x, *layer_args(moe), LAYER, counters) for x in reversed(xs)][::-1]
    for a, b, x in zip(first, again, xs):
        assert torch.equal(a, b)
        assert_close(a, moe(x))
    assert counters.get("cpu").eq(0).all()


def spy_layer(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = direct.direct_layer

    def spy(*a, **kw):
        calls.append(a[0].shape[0])
        return real(*a, **kw)

    monkeypatch.setattr(direct, "direct_layer", spy)
    return calls


def test_forward_parts_takes_the_one_launch_when_the_config_says_so(monkeypatch):
    calls = spy_layer(monkeypatch)
    moe = make_layer(50)
    fused = fused_backend.create("triton")
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for t in (1, 4):
            x = torch.randn(t, 48, generator=g)
            out, rest, scale = moe.forward_parts(x, Ops(attention=None, moe=backend.create("triton", config=LAYER),
                                                        fused=fused))
            assert rest is None and scale == 1.0
            two, _, _ = moe.forward_parts(x, Ops(attention=None, fused=fused, moe=backend.create(
                "triton", config=MoEConfig(16, 8, 16, direct=1, down_block_n=8, down_block_k=16))))
            assert torch.equal(out, two)  # same tiles, same routing: the same bits
        assert calls == [1, 4]
        # not taken: more tokens than the layer kernel's limit, a reference fused-ops backend, or direct == 1
        x5 = torch.randn(5, 48, generator=g)
        out5, _, _ = moe.forward_parts(x5, Ops(attention=None, moe=backend.create("triton", config=LAYER),
                                               fused=fused))
        assert_close(out5, moe(x5))
        x1 = torch.randn(1, 48, generator=g)
        moe.forward_parts(x1, Ops(attention=None, moe=backend.create("triton", config=LAYER),
                                  fused=fused_backend.create("reference")))
        moe.forward_parts(x1, Ops(attention=None, moe=backend.create("triton", config=replace(LAYER, direct=1)),
                                  fused=fused))
    assert calls == [1, 4]


def test_layer_not_usable_falls_back():
    """bf16 router weights (the fused router needs fp32) or an expert-parallel shard: None, the caller routes."""
    moe = make_layer(60)
    x = torch.randn(1, 48)
    args = list(layer_args(moe))
    args[0] = args[0].to(torch.bfloat16)
    assert triton_moe.fused_layer(x, *args, LAYER, SplitCounters(direct.COUNTERS)) is None
    args = list(layer_args(moe))
    args[3] = args[3][:4]  # 4 of 8 experts: another rank holds the rest
    assert triton_moe.fused_layer(x, *args, LAYER, SplitCounters(direct.COUNTERS)) is None
    assert triton_moe.fused_layer(x, *layer_args(moe), LAYER, SplitCounters(direct.COUNTERS)) is not None
