"""The one-launch decode MoE layer (m3eagle/moe/one_launch.py) on CPU under the Triton interpreter, in fp32.

Held bit-equal to the three-launch direct path it fuses (`direct.route_direct_experts`: same routing, same
act, same down sums -- under the interpreter both compute in numpy, so contraction cannot differ) and within
1e-5 of the reference layer; T = 1..5 and a prompt-sized 17; top-k not a power of two; H and I off the tile
sizes; a shared expert narrower and wider than the routed ones. Its counters are left zero (the next launch,
or a CUDA-graph replay, starts from them). Through the layer:
the entry's flag takes it, `fits` declines where it cannot run, and the fallbacks stay exact. The GPU half
(PDL graphs, bf16, m3-mini and embedded shapes) is in tests/test_cuda_graphs.py.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton` (kernels decorate at import)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from dataclasses import replace  # noqa: E402

from m3eagle.moe import backend as moe_backend  # noqa: E402
from m3eagle.moe import direct, one_launch  # noqa: E402
from m3eagle.moe.tuning import MoEConfig  # noqa: E402
from m3eagle.ops import Ops  # noqa: E402

ALPHA, LIMIT = 1.702, 7.0
# gate_up: 16 columns x 16 of H per step (H 48: three K steps); down: 8 rows, one K tile over I 40 (masked)
ONE = MoEConfig(16, 16, 16, direct=1, down_block_n=8, down_block_k=64, down_preload=1, one_launch=1)


def layer(seed: int, e: int = 8, h: int = 48, i: int = 40, k: int = 3, s_i: int | None = None):
    """A SparseMoE with random weights, router and correction bias (clamps of SwiGLU-OAI live)."""
    from m3eagle.models.layers import SparseMoE

    moe = SparseMoE(h, i, s_i or i, e, k, scaling=2.5, alpha=ALPHA, limit=LIMIT)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.8 if p.dim() == 3 else 0.3))
        moe.gate.e_score_correction_bias.copy_(torch.randn(e, generator=g) * 0.1)
    return moe


def args(moe):
    g, ex, sh = moe.gate, moe.experts, moe.shared_experts
    return (g.weight, g.e_score_correction_bias, g.top_k), (ex.gate_up_proj, ex.down_proj), (
        sh.gate_up_proj.weight.detach(), sh.down_proj.weight.detach())


def assert_close(out: torch.Tensor, ref: torch.Tensor, rel: float = 1e-5) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype and torch.isfinite(out).all()
    err = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
    assert err <= rel, f"max relative error {err:.2e} > {rel:.0e}"


def spy(monkeypatch, mod, name: str) -> list[int]:
    calls: list[int] = []
    real = getattr(mod, name)

    def wrapped(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(mod, name, wrapped)
    return calls


@pytest.mark.parametrize("t,k,e,h,i,s_i", [(1, 3, 8, 48, 40, None), (2, 4, 8, 48, 40, 24), (3, 2, 6, 40, 24, 56),
                                           (5, 3, 8, 48, 40, 40), (17, 4, 8, 32, 16, 16)])
def test_equals_the_three_launches_bit_for_bit_and_the_reference(t, k, e, h, i, s_i):
    """moe_layer == route_direct_experts (router + shared gate_up, routed gate_up, down) bit for bit, and
    within 1e-5 of the dense reference layer; both launches leave their counters zero."""
    moe = layer(10 * t + k, e=e, h=h, i=i, k=k, s_i=s_i)
    router, (w13, w2), shared = args(moe)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(t))
    cfg = replace(ONE, down_block_k=64)
    assert one_launch.fits(cfg, t, i, s_i or i)
    counters = torch.zeros(64, dtype=torch.int32)
    sync = torch.zeros(one_launch.SYNC_SLOTS, dtype=torch.int32)
    with torch.no_grad():
        one = one_launch.moe_layer(x, *router, counters, sync, w13, w2, ALPHA, LIMIT, cfg, shared, 2.5)
        assert not sync.any() and not counters.any()
        three = direct.route_direct_experts(x, *router, counters, w13, w2, ALPHA, LIMIT, cfg, shared, 2.5)
        assert torch.equal(one, three)
        assert_close(one, moe(x))
        # again on the same counters: the same bits (a graph replay reuses them the same way)
        assert torch.equal(one_launch.moe_layer(x, *router, counters, sync, w13, w2, ALPHA, LIMIT, cfg, shared, 2.5),
                           one)
        assert not sync.any()


def test_even_tiles_and_one_expert_per_step():
    """H and I multiples of the tiles (the unmasked loads), top-1 routing."""
    moe = layer(3, e=4, h=32, i=32, k=1, s_i=32)
    router, (w13, w2), shared = args(moe)
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(4))
    cfg = replace(ONE, down_block_k=32)
    with torch.no_grad():
        sync = torch.zeros(one_launch.SYNC_SLOTS, dtype=torch.int32)
        counters = torch.zeros(64, dtype=torch.int32)
        one = one_launch.moe_layer(x, *router, counters, sync, w13, w2, ALPHA, LIMIT, cfg, shared, 2.5)
        assert torch.equal(one, direct.route_direct_experts(x, *router, counters, w13, w2, ALPHA, LIMIT, cfg, shared,
                                                            2.5))
        assert_close(one, moe(x))


def test_fits():
    assert one_launch.fits(ONE, 1, 40, 40) and one_launch.fits(ONE, 64, 64, 24)
    assert not one_launch.fits(replace(ONE, one_launch=0), 1, 40, 40)  # not asked for
    assert not one_launch.fits(ONE, 1, 65, 40) and not one_launch.fits(ONE, 1, 40, 65)  # K tile < max(I, I_s)
    assert not one_launch.fits(ONE, 65, 40, 40)  # past the decode router
    assert one_launch.SYNC_SLOTS <= one_launch.triton_fused.ROUTER_GEMV_MAX_T * 3 + 1


@pytest.mark.parametrize("t", [1, 3])
def test_the_layer_takes_it_where_the_entry_asks(t, monkeypatch):
    """SparseMoE.forward_parts with the triton ops and a one_launch entry runs the one launch (once per
    call, the whole sum: rest None, scale 1), bit-equal to the route + shared entry's three launches; with
    the reference fused ops (another routing) it does not; where it does not fit (a down K tile under I)
    the entry's other flags answer, still exact."""
    from m3eagle.fused import backend as fused_backend

    moe = layer(20 + t, s_i=24)
    x = torch.randn(t, 48, generator=torch.Generator().manual_seed(20 + t))
    ones = spy(monkeypatch, one_launch, "moe_layer")
    threes = spy(monkeypatch, direct, "route_direct_experts")
    fused = fused_backend.create("triton")

    def ops(cfg, f=fused):
        return Ops(attention=None, moe=moe_backend.create("triton", config=cfg), fused=f)

    with torch.no_grad():
        want = moe(x)
        a, rest, scale = moe.forward_parts(x, ops(ONE))
        assert (ones, threes) == ([1], []) and rest is None and scale == 1.0
        b, _, _ = moe.forward_parts(x, ops(replace(ONE, one_launch=0, route_shared=1)))
        assert (ones, threes) == ([1], [1]) and torch.equal(a, b)
        assert_close(a, want)
        moe.forward_parts(x, ops(ONE, fused_backend.create("reference")))
        assert ones == [1]
        narrow = replace(ONE, down_block_k=32)  # I 40 needs 64
        for cfg, routed in ((narrow, 0), (replace(narrow, route_shared=1), 1)):
            c, _, _ = moe.forward_parts(x, ops(cfg))
            assert ones == [1] and len(threes) == 1 + routed
            assert_close(c, want)
