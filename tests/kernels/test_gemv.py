"""The skinny-GEMM Triton kernel (m3eagle/kernels/fused/gemv.py) held equal to x @ w^T, on CPU under the Triton
interpreter.

fp32 at 1e-5 relative error (max error over the reference's largest magnitude) for T = 1, 3, 8, 16 rows,
K not a multiple of BLOCK_K, N not a multiple of BLOCK_N, x a column slice (row stride > K); both inner
products (elementwise GEMV and tl.dot) with and without split-K; bf16 inputs within bf16 rounding; the
split-K path bit-equal from call to call with its tile counters back at zero; `supports` refusing what the
kernel cannot do. Speed is measured on the GPU by benchmarks/gemv.py.

NOTE: TRITON_INTERPRET is set before anything imports triton, and it holds for the whole pytest process
(as in test_triton_attention.py).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton` (kernels decorate at import)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from m3eagle.kernels.fused import gemv  # noqa: E402
from m3eagle.kernels.fused.gemv import GemvConfig  # noqa: E402
from tests.helpers.kernel_spy import spy_launches  # noqa: E402

N, K = 77, 200  # N % BLOCK_N != 0 and K % BLOCK_K != 0 for every config below
GEMV = {  # elementwise, T <= 4
    "gemv": GemvConfig(block_n=8, block_k=64),
    "gemv_prefetch": GemvConfig(block_n=4, block_k=32, num_stages=2),  # masked next-tile loads
    "gemv_split3": GemvConfig(block_n=16, block_k=32, split_k=3),  # 3 splits of 96 columns (the last 8)
}
DOT = {
    "dot": GemvConfig(block_n=16, block_k=64, use_dot=True),
    "dot_split4": GemvConfig(block_n=32, block_k=16, num_stages=3, split_k=4, use_dot=True),
}
CASES = [(t, name) for t in (1, 3) for name in GEMV] + [(t, name) for t in (1, 3, 8, 16) for name in DOT]
CONFIGS = {**GEMV, **DOT}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make(seed: int, t: int, n: int = N, k: int = K, dtype: torch.dtype = torch.float32,
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] as a column slice of a [T, K + 24] buffer (row stride > K, offset start), w [N, K]."""
    g = gen(seed)
    x = torch.randn(t, k + 24, generator=g)[:, 16:16 + k].to(dtype)
    return x, torch.randn(n, k, generator=g).to(dtype)


def assert_close(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rel: float) -> None:
    ref = x.float() @ w.float().T  # [T, N] fp32
    assert out.shape == ref.shape and out.dtype == x.dtype, (out.shape, out.dtype)
    assert torch.isfinite(out).all(), "non-finite output: an unwritten element was read"
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert err <= rel, f"max relative error {err:.2e} > {rel:.0e}"


@pytest.mark.parametrize("t,name", CASES)
def test_fp32_matches_reference(t, name):
    x, w = make(t, t)
    assert x.stride(0) == K + 24 and x.storage_offset() == 16  # a column slice
    assert gemv.supports(x, w)
    assert_close(gemv.linear(x, w, CONFIGS[name]), x, w, 1e-5)


def test_even_k_prefetch_and_split():
    """K a multiple of BLOCK_K (unmasked loads; the prefetch's whole-tile predicate), with and without split."""
    x, w = make(8, 2, n=40, k=256)
    for cfg in (GemvConfig(block_n=8, block_k=64, num_stages=2), GemvConfig(block_n=8, block_k=32, num_stages=2,
                                                                             split_k=2)):
        assert_close(gemv.linear(x, w, cfg), x, w, 1e-5)


@pytest.mark.parametrize("t", [1, 2, 5])
def test_default_config(t):
    """pick_config's choice for small shapes (one K step or several; split or not) runs and is exact in fp32."""
    for n, k in ((N, K), (40, 1100), (16, 2048)):
        x, w = make(10 + t, t, n, k)
        cfg = gemv.pick_config(t, n, k, x.dtype, x.device)
        assert cfg.block_t(t) >= t and (not cfg.use_dot or min(cfg.block_n, cfg.block_k, cfg.block_t(t)) >= 16)
        assert_close(gemv.linear(x, w), x, w, 1e-5)


@pytest.mark.parametrize("name", ["gemv_prefetch", "dot_split4"])
def test_bf16_within_rounding(name):
    """bf16 in, bf16 out: the fp32 sum rounded once (the interpreter truncates, so up to 2^-7 relative)."""
    x, w = make(3, 3, dtype=torch.bfloat16)
    assert_close(gemv.linear(x, w, CONFIGS[name]), x, w, 1e-2)


@pytest.mark.parametrize("name", ["gemv_split3", "dot_split4"])
def test_split_k_deterministic_and_counters_reset(name):
    x, w = make(4, 3)
    counters = gemv.SplitCounters()
    a = gemv.linear(x, w, CONFIGS[name], counters)
    cnt = counters.get(x.device)
    assert int(cnt.abs().sum()) == 0, "a tile counter was left non-zero"
    b = gemv.linear(x, w, CONFIGS[name], counters)
    assert torch.equal(a, b)
    assert int(cnt.abs().sum()) == 0
    # the split sum is the unsplit one in another order; without counters the config runs unsplit
    assert_close(a, x, w, 1e-5)
    assert_close(gemv.linear(x, w, CONFIGS[name]), x, w, 1e-5)
    assert counters.get(x.device) is cnt and gemv.SplitCounters().get(x.device) is not cnt  # one per owner


def test_small_n_and_single_row_weight():
    """N below BLOCK_N (rows clamped, stores masked) and a w that is a row slice of a wider matrix."""
    x, _ = make(5, 2, k=48)
    wide = torch.randn(3, 64, generator=gen(6))
    w = wide[:, :48]  # row stride 64 > K
    for cfg in (GemvConfig(block_n=8, block_k=32), GemvConfig(block_n=16, block_k=16, use_dot=True, split_k=2)):
        assert_close(gemv.linear(x, w, cfg), x, w, 1e-5)


def test_gemv_refuses_more_than_four_rows():
    x, w = make(9, 5)
    with pytest.raises(ValueError, match="T <= 4"):
        gemv.linear(x, w, GEMV["gemv"])


def test_supports_refuses():
    x, w = make(7, 2)
    assert gemv.supports(x, w)
    assert not gemv.supports(x, w[None])  # 3-D weight
    assert not gemv.supports(x[None], w)  # 3-D input
    assert not gemv.supports(x[:, :-1], w)  # K mismatch
    assert not gemv.supports(x, w.to(torch.bfloat16))  # dtype mismatch
    assert not gemv.supports(x.double(), w.double())  # unsupported dtype
    assert not gemv.supports(x, torch.randn(K, N).T)  # weight columns not contiguous
    assert not gemv.supports(torch.randn(K, 2).T, w)  # input columns not contiguous
    assert not gemv.supports(x[:0], w)  # no rows
    assert not gemv.supports(torch.randn(gemv.MAX_T + 1, K), w)  # too many rows for a skinny GEMM
    assert gemv.supports(torch.randn(gemv.MAX_T, K), w)


def test_engine_linear_takes_the_kernel_where_preferred_only(monkeypatch):
    """TritonFused.linear (what every paged-path projection calls): the kernel for few rows of a small
    weight (gemv.prefers), F.linear itself -- bit for bit -- for many rows or gemv_max_t=0; the table rules
    out shapes where cuBLAS won. Off the GPU the engine's default is F.linear (gemv_max_t=None), so the test opts in."""
    from m3eagle.kernels.fused.triton_backend import TritonFused

    calls = []
    kernel = gemv.linear
    monkeypatch.setattr(gemv, "linear", lambda *a, **kw: calls.append(a[0].shape[0]) or kernel(*a, **kw))
    x, w = make(1, 1, n=64, k=64)  # a 64 x 64 weight: small, so preferred up to DEFAULT_MAX_T rows
    assert gemv.prefers(1, 64, 64) and not gemv.prefers(gemv.DEFAULT_MAX_T + 1, 64, 64)
    ops = TritonFused(gemv_max_t=gemv.MAX_T)
    assert_close(ops.linear(x, w), x, w, 1e-5)
    assert torch.equal(TritonFused().linear(x, w), torch.nn.functional.linear(x, w))  # CPU default: F.linear
    wide, _ = make(2, 40, n=64, k=64)
    assert torch.equal(ops.linear(wide, w), torch.nn.functional.linear(wide, w))
    assert torch.equal(TritonFused(gemv_max_t=0).linear(x, w), torch.nn.functional.linear(x, w))
    assert calls == [1]  # the one preferred call ran the kernel; the CPU default, 40 rows and max_t=0 did not
    assert not gemv.prefers(3, 5120, 4096)  # measured: cuBLAS wins there at T = 2


def test_weight_preload_is_bit_equal(monkeypatch):
    """With PDL's weight preload (the GEMV's first weight tile read before the wait: pdl.preload_weights,
    forced on here; the interpreter has no wait) the GEMV computes the same bits as without it -- one and
    several K steps, EVEN_K or masked, split or not, configs with and without the prefetch -- and the dot
    path never takes it."""
    from m3eagle.kernels import pdl

    counters = gemv.SplitCounters()
    cases = [(t, n, k, cfg) for t in (1, 3) for n, k, cfg in (  # BLOCK_T 1 and 4 (a clamped row)
        (N, K, GEMV["gemv"]), (N, K, GEMV["gemv_prefetch"]), (N, K, GEMV["gemv_split3"]),
        (40, 256, GemvConfig(block_n=8, block_k=256)), (40, 256, GemvConfig(block_n=8, block_k=64, split_k=2)))]
    cases.append((3, N, K, DOT["dot"]))
    want = [gemv.linear(*make(30 + i, t, n, k, torch.bfloat16), cfg, counters) for i, (t, n, k, cfg) in enumerate(cases)]
    launches = spy_launches(monkeypatch, gemv, "_linear_kernel")
    monkeypatch.setattr(pdl, "preload_weights", lambda launch: True)
    for i, (t, n, k, cfg) in enumerate(cases):
        got = gemv.linear(*make(30 + i, t, n, k, torch.bfloat16), cfg, counters)
        assert torch.equal(got, want[i]), (t, n, k, cfg)
        assert launches[-1]["PRELOAD"] is (not cfg.use_dot) and launches[-1]["PREFETCH"] is (not cfg.use_dot)
    assert int(counters.get("cpu").abs().sum()) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gate_up_activation_epilogue_is_bit_equal_to_the_gemv_then_its_launch(dtype, monkeypatch):
    """An MLP's gate_up GEMV with its activation in the epilogue (silu(gate) * up; M3's swiglu-oai): bit-equal
    to `linear` on the packed weight followed by `silu_mul` / `swiglu_oai` -- T = 1..3 (BLOCK_T 1, 2, 4 with a
    clamped row), I not a multiple of the program's columns, K masked or whole, with and without the prefetch
    and (bf16) the PDL weight preload. Each program owns the gate and up rows of its columns: a mutation
    pairing a gate with another column's up fails it."""
    from m3eagle.kernels import pdl
    from m3eagle.kernels.fused.activation import silu_mul, swiglu_oai

    inter = 37  # 2I = 74 weight rows
    masked, whole = GemvConfig(block_n=4, block_k=64, num_stages=2), GemvConfig(block_n=16, block_k=128, num_stages=2)
    cases = [(1, K, masked), (3, K, masked), (2, 256, GemvConfig(block_n=2, block_k=256)), (1, 256, whole),
             (3, 256, whole)]  # BLOCK_T 1, 2, 4 (a clamped row)
    # the preload itself is held bit-equal by test_weight_preload_is_bit_equal: here once per K form, with ACT
    runs = [(False, i) for i in range(len(cases))] + ([(True, 1), (True, 4)] if dtype == torch.bfloat16 else [])
    for preload, i in runs:
        monkeypatch.setattr(pdl, "preload_weights", lambda launch, on=preload: on)
        t, k, cfg = cases[i]
        x, w = make(50 + i, t, 2 * inter, k, dtype)
        w = w * 0.3  # activations in silu's curved range
        y = gemv.linear(x, w, cfg)
        for act, want in (("silu", silu_mul(*y.chunk(2, -1))), ("swiglu_oai", swiglu_oai(y, 1.702, 1.5))):
            got = gemv.linear_act(x, w, act, 1.702, 1.5, cfg)  # limit 1.5: the clamps bite
            assert got.shape == (t, inter) and got.dtype == dtype
            assert torch.equal(got, want), (act, t, k, cfg, preload)
    with pytest.raises(ValueError, match="unsplit GEMV"):
        gemv.linear_act(x, w, "silu", config=GemvConfig(block_n=64, block_k=64, use_dot=True))
    with pytest.raises(ValueError, match="packed"):
        gemv.linear_act(x, w[:-1], "silu")
    with pytest.raises(ValueError, match="choose one of"):
        gemv.linear_act(x, w, "gelu")


def test_engine_mlp_takes_the_epilogue_where_the_gemv_runs_unsplit(monkeypatch):
    """TritonFused.linear_silu_mul / linear_swiglu_oai: one `_linear_kernel` launch with ACT (no activation
    launch) where the
    GEMV takes the shape; tl.dot shapes keep the two launches; the reference backend's op is the plain
    chunk + silu_mul. All three agree."""
    from m3eagle.kernels.fused import activation
    from m3eagle.kernels.fused.backend import ReferenceFused
    from m3eagle.kernels.fused.triton_backend import TritonFused

    gemv_l = spy_launches(monkeypatch, gemv, "_linear_kernel", lambda grid, kw: kw["ACT"] > 0)
    act_l = spy_launches(monkeypatch, activation, "_silu_mul_kernel")
    ops = TritonFused(gemv_max_t=gemv.MAX_T)
    x, w = make(3, 1, n=128, k=64)
    got = ops.linear_silu_mul(x, w)
    assert gemv_l == [True] and act_l == []
    ref = ReferenceFused().linear_silu_mul(x, w)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    wide, _ = make(4, 8, n=128, k=64)  # 8 rows: F.linear (not preferred), then the activation's launch
    torch.testing.assert_close(ops.linear_silu_mul(wide, w), ReferenceFused().linear_silu_mul(wide, w),
                               rtol=1e-5, atol=1e-6)
    assert gemv_l == [True] and len(act_l) == 1
    # M3's swiglu-oai MLP: the same, against its own launch
    sw_l = spy_launches(monkeypatch, activation, "_swiglu_kernel")
    got = ops.linear_swiglu_oai(x, w, 1.702, 7.0)
    assert gemv_l == [True, True] and sw_l == []
    torch.testing.assert_close(got, ReferenceFused().linear_swiglu_oai(x, w, 1.702, 7.0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("t", [1, 3])  # 3: BLOCK_T = 4 with a clamped padding row
def test_norm_prologue_and_residual_epilogue_equal_their_separate_launches(t):
    """The GEMV's folds: norm_linear (rms_norm in the GEMV's prologue; Llama and Gemma scaling, with and
    without the silu epilogue) equals rms_norm's launch followed by the GEMV of the same config to within the
    norm's fp32 sum order (the interpreter happens to sum in the same order: equal here); linear_add (the
    residual in the epilogue) equals the GEMV followed by the backend's residual add, bit for bit."""
    from m3eagle.kernels.fused.triton_backend import TritonFused

    f = TritonFused()
    g = torch.Generator().manual_seed(t)
    x = (torch.randn(t, 96, generator=g) * 3).bfloat16()
    nw = torch.randn(96, generator=g).bfloat16()
    for n, act in ((40, None), (80, "silu")):
        w = (torch.randn(n, 96, generator=g) * 0.1).bfloat16()
        cfg = gemv.GemvConfig(block_n=4, block_k=64)  # two K steps, the second masked (96 = 64 + 32)
        for gemma in (False, True):
            xn = f.rms_norm(x, nw, 1e-6, gemma)
            want = gemv.linear_act(xn, w, act, config=cfg) if act else gemv.linear(xn, w, cfg)
            got = gemv.norm_linear(x, nw, 1e-6, w, gemma, act, cfg)
            assert got.shape == want.shape
            assert (got.float() - want.float()).abs().max() <= 1e-2 * want.float().abs().max()
            assert torch.equal(got, want)
    w = (torch.randn(40, 96, generator=g) * 0.1).bfloat16()
    res = (torch.randn(t, 40, generator=g) * 2).bfloat16()
    cfg = gemv.GemvConfig(block_n=4, block_k=64)
    assert torch.equal(gemv.linear_add(x, w, res, cfg), f.add_residual(gemv.linear(x, w, cfg), res))
    with pytest.raises(ValueError, match="unsplit GEMV"):
        gemv.linear_add(x, w, res, gemv.GemvConfig(block_n=32, block_k=32, use_dot=True))


def test_argmax_epilogue_equals_the_gemv_then_the_argmax_launch(monkeypatch):
    """ARGMAX (gemv.linear_argmax): the GEMV's logits and, picked by its last program from one key per tile,
    each row's argmax + offset, written to a strided `out` and scattered into a slot buffer -- equal to
    `gemv.linear` then `fused_argmax.argmax` under the same config, with the argmax's tie and NaN rules
    forced: a column tied with the maximum in a later tile (the lower column wins), NaN columns among
    infinities (the first NaN wins, as torch.argmax), an all-zero row (column 0). The counter is left zero;
    TritonFused takes the fold for T <= 4 (no argmax launch) and the two launches past it."""
    from m3eagle.kernels.fused import argmax as fused_argmax
    from m3eagle.kernels.fused.triton_backend import TritonFused

    t = 3  # BLOCK_T 4 with a padding row (CI time: one T here; the H200 test runs T = 1 and 4)
    g = torch.Generator().manual_seed(40 + t)
    n, k = 77, 96
    counters = gemv.SplitCounters().get("cpu")
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(t, k, generator=g).to(dtype)
        w = torch.randn(n, k, generator=g)
        w[5] = x[0].float() * 0.5  # row 0's maximum at column 5 ...
        w[60] = w[5]  # ... tied at column 60, 14 tiles on: column 5 must win
        x[1, 0] = float("inf")  # row 1: +-inf everywhere but NaN (inf * 0) at columns 33 and 41: 33 wins
        w[33, 0] = w[41, 0] = 0.0
        x[2] = 0.0  # row 2: all zero: column 0
        w = w.to(dtype)
        x = x.to(dtype)
        offsets = torch.randint(-3, 3, (n,), generator=g)
        cfg = GemvConfig(block_n=4, block_k=64)  # 20 tiles, the last masked; K masked in the second step
        want_y = gemv.linear(x, w, cfg)
        buf_want, buf_got = torch.zeros(6, 3, dtype=torch.int64), torch.zeros(6, 3, dtype=torch.int64)
        rows = torch.tensor([4, 1, 5, 0][:t])
        want = fused_argmax.argmax(want_y, offsets, scatter=(buf_want, rows, 2))
        out = torch.full((t, 3), -1, dtype=torch.int64)[:, 1]  # strided
        y, ids = gemv.linear_argmax(x, w, counters, offsets, out, (buf_got, rows, 2), cfg)
        torch.testing.assert_close(y, want_y, rtol=0, atol=0, equal_nan=True)  # the logits as the GEMV's
        assert ids is out and torch.equal(out, want) and torch.equal(buf_got, buf_want)
        assert want[0] == 5 + offsets[5]
        assert want[1] == 33 + offsets[33] and want[2] == offsets[0]
        assert int(counters.abs().sum()) == 0
        plain = gemv.linear_argmax(x, w, counters, config=cfg)[1]  # no offsets / out / scatter
        assert torch.equal(plain, fused_argmax.argmax(want_y))
    xf, wf = torch.randn(2, k, generator=g), torch.randn(n, k, generator=g)  # distinct fp32 values, no NaN:
    assert torch.equal(gemv.linear_argmax(xf, wf, counters, config=cfg)[1], (xf @ wf.T).argmax(-1))  # torch's

    ops = TritonFused(gemv_max_t=gemv.MAX_T)
    for rows_t, folded in ((1, True), (5, False)):  # T = 5: the projection, then the argmax launch
        xb, wb = make(50 + rows_t, rows_t, n=256, k=256, dtype=torch.bfloat16)  # a shape the GEMV takes at T <= 4
        want = fused_argmax.argmax(gemv.linear(xb, wb))
        gemv_l = spy_launches(monkeypatch, gemv, "_linear_kernel", lambda grid, kw: kw["ARGMAX"])
        am_l = spy_launches(monkeypatch, fused_argmax, "_argmax_kernel", lambda grid, kw: True)
        assert torch.equal(ops.linear_argmax(xb, wb), want)
        assert (gemv_l == [True] and am_l == []) if folded else (True not in gemv_l and am_l == [True])
        monkeypatch.undo()
