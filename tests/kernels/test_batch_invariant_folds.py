"""The deterministic mode's folded launches (batch_invariant/folds.py, batch_invariant/router.py), on CPU under the
Triton interpreter, at tiny shapes.

Each fold must give the bits of its two-launch form -- the GEMM and the activation / argmax launch after it, the
router's GEMV and its route launch -- or the mode's results would move with the fold, and must keep a row's bits
independent of the batch: a row alone, and the same row at M = 2, 17 and 64 in several positions, bit for bit.
The split folds are also run with the interpreter's programs in reversed order, so that a split other than the
last sums the partials and another tile than the last reduces the argmax keys. The interpreter runs programs one
at a time; tests/kernels/test_batch_invariant_folds_gpu.py checks the same on a GPU.

NOTE: TRITON_INTERPRET is set before anything imports triton, and it holds for the whole pytest process.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton` (kernels decorate at import)

from collections.abc import Callable  # noqa: E402
from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
# the activations' exp overflows to inf on the wide-range operands (numpy warns; torch and the GPU do not)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

import triton.runtime.interpreter as interp  # noqa: E402

from m3eagle.kernels.batch_invariant import folds, matmul, router  # noqa: E402
from m3eagle.kernels.batch_invariant.fused import BatchInvariantFused  # noqa: E402
from m3eagle.kernels.fused import reference  # noqa: E402
from tests.helpers.kernel_spy import spy_launches  # noqa: E402

CPU = torch.device("cpu")
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.int64: torch.int64}


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(INT_VIEW[a.dtype]), b.view(INT_VIEW[b.dtype]))


def _rows_invariant(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """x [64, K]: f of row 37 alone, of 2 and 17 rows holding it at positions 1 and 7, and of all 64 rows, agree
    bit for bit on every row they share. Returns f(x)."""
    full = f(x)
    for a, m in ((37, 1), (36, 2), (30, 17)):
        assert _bits_equal(f(x[a:a + m]), full[a:a + m]), f"rows {a}..{a + m} differ from the same rows at M = 64"
    return full


@pytest.fixture
def reversed_grid(monkeypatch) -> None:
    """The interpreter runs each launch's programs in reversed grid order: split 0 of a tile arrives last (it sums
    the partials), and the first column tile of a row block reduces the argmax keys."""
    builder = interp.interpreter_builder
    set_dim, set_idx = builder.set_grid_dim, builder.set_grid_idx
    dims: list[int] = []

    def set_grid_dim(nx: int, ny: int, nz: int) -> None:
        set_dim(nx, ny, nz)
        dims[:] = [nx, ny, nz]

    def set_grid_idx(x: int, y: int, z: int) -> None:
        nx, ny, nz = dims
        set_idx(nx - 1 - x, ny - 1 - y, nz - 1 - z)

    monkeypatch.setattr(builder, "set_grid_dim", set_grid_dim)
    monkeypatch.setattr(builder, "set_grid_idx", set_grid_idx)


def _gemm_case(n: int, k: int, dtype: torch.dtype, splits: int, seed: int):
    """x [64, K], w [N, K] with entries over several decades and both signs (another summation order changes the
    bits), and the engine's config for w with `splits` forced."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, k, generator=g) * torch.exp2(torch.randint(-6, 7, (64, k), generator=g))
    w = torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-6, 7, (n, k), generator=g)) / k
    cfg = replace(matmul.matmul_config(n, k, dtype), splits=splits)
    return x.to(dtype), w.to(dtype), cfg


# ---- the activation fold -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,splits", [(torch.float32, 1), (torch.float32, 2), (torch.bfloat16, 2)])
def test_linear_act_equals_two_launches_and_rows_invariant(dtype, splits):
    """gate_up GEMM + SwiGLU-OAI (64 rows) / SiLU-and-multiply (1 row) in one launch == `matmul.linear` + the
    activation's launch, bit for bit (I = 40: a column tile past the last gate / up column); row-invariant."""
    x, w, cfg = _gemm_case(80, 160, dtype, splits, seed=splits)
    assert matmul.split_plan(160, cfg)[0] == splits
    full = _rows_invariant(lambda a: folds.linear_act(a, w, "swiglu_oai", 1.702, 7.0, cfg), x)  # [64, 40]
    assert _bits_equal(full, folds.linear_act_two_launch(x, w, "swiglu_oai", 1.702, 7.0, cfg))
    one = folds.linear_act(x[:1], w, "silu", config=cfg)
    assert _bits_equal(one, folds.linear_act_two_launch(x[:1], w, "silu", config=cfg))
    assert not matmul.tile_counters(CPU).any()
    ref = reference.swiglu_oai(x.double() @ w.double().T, 1.702, 7.0)
    err = (full.double() - ref).abs().max() / ref.abs().max()
    assert err <= (1e-5 if dtype == torch.float32 else 2e-2), err


def test_linear_act_split_fixup_any_arrival(reversed_grid):
    """Split 0 of every tile arrives last: the fixup's sum and activation are still the two launches' bits."""
    x, w, cfg = _gemm_case(64, 160, torch.float32, 4, seed=3)
    fold = folds.linear_act(x[:3], w, "swiglu_oai", 1.702, 7.0, cfg)
    assert _bits_equal(fold, folds.linear_act_two_launch(x[:3], w, "swiglu_oai", 1.702, 7.0, cfg))
    assert not matmul.tile_counters(CPU).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_act_inner_splits_same_bits(dtype, monkeypatch):
    """With enough output tiles the fold sums its splits inside each program (grid S = 1): the same bits as the
    split launch and the two launches, at 1, 3 and 64 rows."""
    x, w, cfg = _gemm_case(80, 160, dtype, 4, seed=9)
    split = [folds.linear_act(x[:m], w, "swiglu_oai", 1.702, 7.0, cfg) for m in (1, 3, 64)]
    monkeypatch.setattr(matmul, "INNER_SPLIT_TILES", 1)
    grids = spy_launches(monkeypatch, folds, "_matmul_act_kernel", record=lambda grid, kw: grid)
    for m, ref in zip((1, 3, 64), split):
        inner = folds.linear_act(x[:m], w, "swiglu_oai", 1.702, 7.0, cfg)
        assert grids[-1][1] == 1
        assert _bits_equal(inner, ref)
        assert _bits_equal(inner, folds.linear_act_two_launch(x[:m], w, "swiglu_oai", 1.702, 7.0, cfg))
    assert not matmul.tile_counters(CPU).any()


def test_linear_act_mutation_fails():
    """The equality check can fail: the fold at another K split than the plain GEMM's differs from it."""
    x, w, cfg = _gemm_case(64, 160, torch.float32, 1, seed=4)
    fold = folds.linear_act(x[:2], w, "silu", config=replace(cfg, splits=4))
    assert not _bits_equal(fold, folds.linear_act_two_launch(x[:2], w, "silu", config=cfg))


# ---- the greedy pick -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("splits", [1, 2])
def test_linear_argmax_equals_two_launches_and_rows_invariant(splits):
    """LM head + argmax in one launch (no logits stored) == `matmul.linear` + the argmax launch, with offsets and
    the scatter store; ties and NaN as torch.argmax; row-invariant."""
    g = torch.Generator().manual_seed(5)
    x, w, cfg = _gemm_case(200, 64, torch.bfloat16, splits, seed=5 + splits)
    w[150] = w[7]
    x[2] = w[7] * 64  # row 2: equal best logits in two tiles (the lower column wins)
    w[190, 0], x[5, 0] = 0.0, float("inf")  # row 5: one NaN logit (inf * 0) among +-inf ones; the NaN wins
    off = torch.randint(0, 9, (200,), generator=g)
    full = _rows_invariant(lambda a: folds.linear_argmax(a, w, off, config=cfg), x)  # [64]
    ref = matmul.linear(x, w, cfg).float().argmax(1)  # torch.argmax of the two-launch logits
    assert _bits_equal(full, ref + off[ref]) and ref[2] == 7 and ref[5] == 190
    buf, ref_buf = torch.zeros(70, 3, dtype=torch.int64), torch.zeros(70, 3, dtype=torch.int64)
    rows = torch.randperm(70, generator=g)[:3]
    out = folds.linear_argmax(x[:3], w, off, scatter=(buf, rows, 2), config=cfg)
    two = folds.linear_argmax_two_launch(x[:3], w, off, scatter=(ref_buf, rows, 2), config=cfg)
    assert _bits_equal(out, two) and _bits_equal(buf, ref_buf)
    assert not matmul.tile_counters(CPU).any()
    assert not folds.best_keys(CPU).any()


def test_linear_argmax_any_arrival(reversed_grid):
    x, w, cfg = _gemm_case(200, 64, torch.float32, 2, seed=8)
    assert _bits_equal(folds.linear_argmax(x[:5], w, config=cfg), folds.linear_argmax_two_launch(x[:5], w, config=cfg))
    assert not matmul.tile_counters(CPU).any()
    assert not folds.best_keys(CPU).any()


# ---- the router ----------------------------------------------------------------------------------------------


def _router_case(seed: int, e: int = 4, h: int = 32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, h, generator=g).to(torch.bfloat16)
    w, bias = torch.randn(e, h, generator=g) / 4, torch.randn(e, generator=g) * 0.1
    return x, w, bias


def test_router_one_launch_equals_two_launches_and_rows_invariant():
    """The router GEMV + route in one launch == `router_logits` + `route`, bit for bit; a token's route is the
    same alone and at M = 2, 17, 64; and it is the fp32 reference's route."""
    x, w, bias = _router_case(9)
    for m in (1, 5):
        one, two = router.route_tokens(x[:m], w, bias, 2), router.route_tokens_two_launch(x[:m], w, bias, 2)
        assert all(_bits_equal(a, b) for a, b in zip(one, two)), m
    full = _rows_invariant(lambda a: torch.cat([t.float() for t in router.route_tokens(a, w, bias, 2)], 1), x)
    assert not matmul.tile_counters(CPU).any()
    ref_w, ref_idx = reference.route(reference.router_logits(x, w), bias, 2)
    assert torch.equal(full[:, 2:].long(), ref_idx) and (full[:, :2] - ref_w).abs().max() <= 1e-6


def test_router_tokens_per_program_change_no_bits():
    """Programs that take 1, 3 (not dividing T) or 8 tokens each route every token as the two launches do; the
    default share follows T (one token per program up to 31 tokens, then more)."""
    x, w, bias = _router_case(11)
    x = x[:37]  # [37, H]
    two = router.route_tokens_two_launch(x, w, bias, 2)
    for per in (1, 3, 8):
        assert all(_bits_equal(a, b) for a, b in zip(router.route_tokens(x, w, bias, 2, tokens=per), two)), per
    assert not matmul.tile_counters(CPU).any()
    assert [router.tokens_per_program(t) for t in (1, 31, 32, 128, 8192)] == [1, 1, 2, 8, 8]


def test_router_without_counters_same_bits(monkeypatch):
    """More tokens than the shared counters (or none yet, inside a capture): a zeroed buffer of the call's own,
    the same kernel and bits."""
    x, w, bias = _router_case(10)
    ref = router.route_tokens(x[:9], w, bias, 2)
    monkeypatch.setattr(matmul, "MAX_TILES", 4)
    assert all(_bits_equal(a, b) for a, b in zip(router.route_tokens(x[:9], w, bias, 2), ref))
    assert not matmul.tile_counters(CPU).any()


# ---- the fused ops: one launch each --------------------------------------------------------------------------


def test_fused_ops_take_one_launch_each(monkeypatch):
    """BatchInvariantFused's gate_up + activation, LM head + argmax and router are one launch each at batch 1 (the
    GEMM, the activation / argmax, and the router's cast + GEMM + route were 2, 2 and 3), with the bits of the
    unfolded forms."""
    launched: list[str] = []
    run = interp.InterpretedFunction.run

    def recording(self, *args, **kwargs):
        launched.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    f = BatchInvariantFused()
    x, w, cfg = _gemm_case(64, 256, torch.bfloat16, 1, seed=11)
    xr, wr, bias = _router_case(12)
    monkeypatch.setattr(interp.InterpretedFunction, "run", recording)
    cases = {
        "swiglu": (lambda: f.linear_swiglu_oai(x[:1], w, 1.702, 7.0),
                   lambda: folds.linear_act_two_launch(x[:1], w, "swiglu_oai", 1.702, 7.0)),
        "silu": (lambda: f.linear_silu_mul(x[:1], w), lambda: folds.linear_act_two_launch(x[:1], w, "silu")),
        "argmax": (lambda: f.linear_argmax(x[:1], w), lambda: folds.linear_argmax_two_launch(x[:1], w)),
        "router": (lambda: torch.cat([t.float() for t in f.route_tokens(xr[:1], wr, bias, 4)], 1),
                   lambda: torch.cat([t.float() for t in router.route_tokens_two_launch(xr[:1], wr, bias, 4)], 1)),
    }
    for name, (folded, unfolded) in cases.items():
        launched.clear()
        got = folded()
        assert len(launched) == 1, (name, launched)
        launched.clear()
        assert _bits_equal(got, unfolded()) and len(launched) == 2, (name, launched)
