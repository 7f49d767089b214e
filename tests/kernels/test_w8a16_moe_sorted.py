"""The sorted grouped-GEMM MoE on MXFP8 experts (`triton_moe.mx_fused_experts`: fp8 tiles dequantized in
registers) held equal to the dense reference on the dequantized weights, on CPU under the Triton interpreter:
fp32 at 1e-5 relative error, bf16 / fp16 within their rounding; expert ranges and ids outside them; mis-applied
scales caught; and `TritonMoE` sending prompt-sized MXFP8 steps here and decode-sized ones to the per-pair GEMVs.

NOTE: TRITON_INTERPRET is set before anything imports triton, and it holds for the whole pytest process.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton` (kernels decorate at import)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from m3eagle.kernels.moe import backend, reference, triton_moe, tuning  # noqa: E402
from m3eagle.kernels.moe.tuning import MoEConfig  # noqa: E402
from m3eagle.kernels.quant import w8a16  # noqa: E402
from m3eagle.kernels.quant.mxfp8 import MxWeight, quantize_mx  # noqa: E402
from tests.helpers.kernel_spy import count_calls  # noqa: E402

E, H, I, K = 4, 96, 64, 2  # experts, hidden (3 scale groups: a partial 64-wide K tile), intermediate, top-k
ALPHA, LIMIT = 1.702, 7.0
BK32 = MoEConfig(16, 32, 32, 1, 4, 3)  # several K steps, one scale group each
BK64 = MoEConfig(16, 16, 64, 2, 4, 3, down_block_n=32)  # two groups a step, masked last gate_up step, grouped order


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def mx_stack(seed: int, e: int, n: int, k: int, scale: float) -> MxWeight:
    """quantize_mx of [e, n, k] whose 32-blocks span ~2**5 in magnitude, so each block's scale matters."""
    g = gen(seed)
    blocks = torch.exp2(torch.randint(-3, 3, (e, n, k // 32), generator=g).float()).repeat_interleave(32, dim=-1)
    return MxWeight(*quantize_mx(torch.randn(e, n, k, generator=g) * blocks * scale))


def experts(seed: int, e: int = E) -> tuple[MxWeight, MxWeight]:
    """gate_up [E, 2I, H], down [E, H, I]; gate_up large enough that the SwiGLU clamps are live."""
    return mx_stack(seed, e, 2 * I, H, 0.6), mx_stack(seed + 1, e, H, I, I ** -0.5)


def routing(seed: int, t: int, dtype: torch.dtype = torch.float32, e: int = E):
    g = gen(seed)
    x = torch.randn(t, H, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:K] for _ in range(t)])  # [T, k] distinct per token
    return x, torch.rand(t, K, generator=g) + 0.05, ids


def ref(x, wts, ids, w13: MxWeight, w2: MxWeight, expert_range=None) -> torch.Tensor:
    return reference.experts(x, wts, ids, w13.dequantize(x.dtype), w2.dequantize(x.dtype), ALPHA, LIMIT, expert_range)


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    assert out.shape == want.shape and out.dtype == want.dtype
    assert torch.isfinite(out).all(), "non-finite output: an unwritten row was read"
    return ((out.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-30)).item()


@pytest.mark.parametrize("t,cfg", [(9, BK32), (17, BK64), (64, None)])
def test_fp32_matches_reference(t, cfg):
    w13, w2 = experts(t)
    x, wts, ids = routing(t + 1, t)
    out = triton_moe.mx_fused_experts(x, wts, ids, w13, w2, ALPHA, LIMIT, config=cfg)
    assert rel_err(out, ref(x, wts, ids, w13, w2)) <= 1e-5
    h = torch.einsum("th,eih->eti", x, w13.dequantize())  # the clamps are exercised
    assert (h[..., :I] > LIMIT).any() and (h[..., I:].abs() > LIMIT).any()


@pytest.mark.parametrize("dtype,cfg", [(torch.bfloat16, BK64), (torch.float16, MoEConfig(16, 32, 32, 1, 4, 3))])
def test_half_activations(dtype, cfg):
    """bf16: the weight tile rounded to bf16 (exact) into the MMA; fp16: q into the MMA, scaled per 32-column group
    after it (GROUP_SCALE). Within the reference's own rounding (the interpreter truncates to bf16)."""
    w13, w2 = experts(3)
    x, wts, ids = routing(4, 17, dtype)
    out = triton_moe.mx_fused_experts(x, wts, ids, w13, w2, ALPHA, LIMIT, config=cfg)
    assert rel_err(out, ref(x, wts, ids, w13, w2)) <= (3e-2 if dtype == torch.bfloat16 else 5e-3)
    with pytest.raises(ValueError, match="block_k"):  # fp16 steps are one scale group
        triton_moe.mx_fused_experts(x.half(), wts, ids, w13, w2, ALPHA, LIMIT, config=BK64)


def test_expert_ranges_and_ids_outside_them():
    """A range of the full stacks and the same range as a rank-local shard agree with the reference's range;
    disjoint ranges sum to the whole; pairs routed outside the range (ids -1 and >= E too) contribute zero."""
    w13, w2 = experts(5, e=6)
    x, wts, ids = routing(6, 17, e=6)
    ids[0, 0], ids[3, 1] = -1, 9  # nobody's expert
    full = ref(x, wts, ids, w13, w2)
    parts = []
    for e0, e1 in ((0, 2), (2, 5), (5, 6)):
        want = ref(x, wts, ids, w13, w2, (e0, e1))
        got = triton_moe.mx_fused_experts(x, wts, ids, w13, w2, ALPHA, LIMIT, (e0, e1), config=BK32)
        shard = triton_moe.mx_fused_experts(x, wts, ids, MxWeight(w13.q[e0:e1], w13.scale[e0:e1]),
                                            MxWeight(w2.q[e0:e1], w2.scale[e0:e1]), ALPHA, LIMIT, (e0, e1),
                                            config=BK32)
        assert rel_err(got, want) <= 1e-5 and torch.equal(got, shard)
        parts.append(got)
    assert rel_err(sum(parts), full) <= 1e-5
    assert (full[0] != 0).any()  # token 0 keeps its one local pair


def test_misapplied_scale_fails():
    """The scale shifted one block, laid out transposed, or applied as its inverse misses the reference by far
    (in gate_up's and in down's scales alike), while the right one matches it."""
    w13, w2 = experts(7)
    x, wts, ids = routing(8, 9)
    want = ref(x, wts, ids, w13, w2)
    assert rel_err(triton_moe.mx_fused_experts(x, wts, ids, w13, w2, ALPHA, LIMIT, config=BK64), want) <= 1e-5

    def mutations(s: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"shifted one block": torch.roll(s, 1, dims=-1),
                "transposed": s.transpose(-1, -2).contiguous().reshape(s.shape),
                "2**(127-s)": (254 - s.int()).to(torch.uint8)}

    for which in ("gate_up", "down"):
        w = w13 if which == "gate_up" else w2
        for what, bad in mutations(w.scale).items():
            assert not torch.equal(bad, w.scale), what
            args = (MxWeight(w13.q, bad), w2) if which == "gate_up" else (w13, MxWeight(w2.q, bad))
            out = triton_moe.mx_fused_experts(x, wts, ids, *args, ALPHA, LIMIT, config=BK64)
            assert rel_err(out, want) > 1e-2, (which, what)


def test_fused_combine_is_bit_equal():
    """Steps of <= 16 tokens with counters sum in the down launch (as the bf16 path): the same bits as the separate
    combine, counters left zero for the next launch."""
    w13, w2 = experts(9)
    x, wts, ids = routing(10, 9)
    counters = torch.zeros(8, dtype=torch.int32)
    fused = triton_moe.mx_fused_experts(x, wts, ids, w13, w2, ALPHA, LIMIT, config=BK32, combine_counters=counters)
    assert torch.equal(fused, triton_moe.mx_fused_experts(x, wts, ids, w13, w2, ALPHA, LIMIT, config=BK32))
    assert not counters.any()


def test_config_rule():
    """Every rule config has whole scale groups per K step (32 for fp16) and is a sorted-path config."""
    for t in (1, 9, 64, 256, 2048, 8192):
        for e, k in ((128, 4), (16, 4), (32, 8)):
            for dtype in (torch.bfloat16, torch.float32, torch.float16):
                cfg = tuning.mx_config(t, e, k, dtype)
                assert not cfg.direct and cfg.block_k % 32 == 0 and cfg.down().block_k % 32 == 0
                assert (cfg.block_k == 32) == (dtype == torch.float16)


def test_refuses_what_it_cannot_do():
    w13, w2 = experts(11)
    x, wts, ids = routing(12, 9)
    with pytest.raises(ValueError, match="block_k"):
        triton_moe.mx_fused_experts(x, wts, ids, w13, w2, ALPHA, LIMIT, config=MoEConfig(16, 32, 16, 1))
    with pytest.raises(TypeError, match="MxWeight"):
        triton_moe.mx_fused_experts(x, wts, ids, w13, w2.dequantize(), ALPHA, LIMIT)
    with pytest.raises(ValueError, match="shared expert"):  # the MXFP8 layers run it apart
        triton_moe.gate_up(x, w13, None, K, ALPHA, LIMIT, BK32, shared_gate_up=w13.q[0])


@pytest.mark.parametrize("t,sorted_path", [(9, True), (4, False)])
def test_triton_backend_dispatch(monkeypatch, t, sorted_path):
    """TritonMoE.experts runs MXFP8 experts on the sorted kernels past w8a16.GEMV_MAX_T rows and on the per-pair
    GEMVs up to it; both equal the reference, with an expert range too."""
    assert w8a16.GEMV_MAX_T == 8
    sorted_calls = count_calls(monkeypatch, triton_moe, "gate_up")
    gemv_calls = count_calls(monkeypatch, w8a16, "mx_moe_experts")
    impl = backend.create("triton")
    w13, w2 = experts(13)
    x, wts, ids = routing(14, t)
    for er in (None, (1, 3)):
        out = impl.experts(x, wts, ids, w13, w2, ALPHA, LIMIT, er)
        assert rel_err(out, ref(x, wts, ids, w13, w2, er)) <= 1e-5
    assert (len(sorted_calls), len(gemv_calls)) == ((2, 0) if sorted_path else (0, 2))
