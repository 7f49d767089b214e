"""The batch-invariant GEMM's one-launch split-K (m3eagle/kernels/batch_invariant/matmul.py), on CPU under the
Triton interpreter.

`linear` sums a split weight's fp32 partials in the GEMM's own launch (each output tile's last program to arrive,
found with a per-tile counter); `linear_two_launch` sums them in a second launch. Both must give the same bits
-- the deterministic mode's results must not move -- and every launch must leave the counters zero, because
nothing else clears them between calls and CUDA-graph replays. The interpreter runs a launch's programs one
after another, grid order by default (split S-1 of a tile arrives last); the `arrival` fixture reorders them
(reversed, shuffled) so that another split reduces, as on a GPU. Bits are compared as integers as well as with
torch.equal, which takes -0.0 for +0.0.

NOTE: TRITON_INTERPRET is set before anything imports triton, and it holds for the whole pytest process.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton` (kernels decorate at import)

import random  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import replace  # noqa: E402
from typing import NoReturn  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

import triton.runtime.interpreter as interp  # noqa: E402

from m3eagle.kernels.batch_invariant import matmul  # noqa: E402
from tests.helpers.kernel_spy import spy_launches  # noqa: E402

CPU = torch.device("cpu")
SPLITS = (1, 2, 4, 8)
ROWS = (1, 3, 64, 130)  # one row, a partial row tile, one full tile, three tiles (the last with 2 rows)
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a, b) and torch.equal(a.view(INT_VIEW[a.dtype]), b.view(INT_VIEW[b.dtype]))


def _operands(dtype: torch.dtype, splits: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, matmul.MatmulConfig]:
    """x [max(ROWS), K], w [N, K] and the config for a forced split count: N = 100 (not a multiple of the 32- or
    64-column tile), K = 7 whole K steps and 5/8 of one, so 8 steps divide into exactly `splits` splits and the
    last step is ragged. Entries span several decades with both signs, so that another summation order changes
    fp32 bits; in the even output columns each split's first product is also +-2^24 (+ in even splits, - in odd
    ones): those partials cancel in pairs, leaving a sum far below them whose bits follow the order even after
    the rounding to bf16."""
    g = torch.Generator().manual_seed(seed)
    n = 100
    block_k = matmul.matmul_config(n, 4096, dtype).block_k
    k = 7 * block_k + 5 * block_k // 8
    cfg = replace(matmul.matmul_config(n, k, dtype), splits=splits)
    x = torch.randn(max(ROWS), k, generator=g) * torch.exp2(torch.randint(-8, 9, (max(ROWS), k), generator=g))
    w = torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-8, 9, (n, k), generator=g))
    for s in range(splits):
        col = s * (8 // splits) * block_k  # split s's first K column
        x[:, col], w[::2, col] = 1.0, (-1) ** s * 2.0**24
    return x.to(dtype), w.to(dtype), cfg


def _effective_splits(cfg: matmul.MatmulConfig, k: int) -> int:
    steps = -(-k // cfg.block_k)
    per = -(-steps // min(cfg.splits, steps))
    return -(-steps // per)


class _NoSecondLaunch:
    """Stands in for `_split_sum_kernel` where the one-launch path must not reach it."""

    def __getitem__(self, grid: tuple) -> NoReturn:
        raise AssertionError("linear launched _split_sum_kernel: the split-K sum left the GEMM's launch")


# (S, arrival order): every split count in grid order; the reorders where a split other than S-1 can reduce
CASES = [(s, "grid") for s in SPLITS] + [(s, order) for order in ("reversed", "shuffled") for s in (2, 8)]


@pytest.fixture
def arrival(request, monkeypatch) -> str:
    """The order in which the interpreter runs a launch's programs: grid order (a tile's split S-1 arrives
    last), reversed (split 0 last) or a seeded shuffle of the whole grid (tiles interleaved, any split last)."""
    order = request.param
    if order == "grid":
        return order
    builder = interp.interpreter_builder
    set_dim, set_idx = builder.set_grid_dim, builder.set_grid_idx
    state: dict[str, list] = {}

    def set_grid_dim(nx: int, ny: int, nz: int) -> None:
        set_dim(nx, ny, nz)
        ids = [(a, b, c) for a in range(nx) for b in range(ny) for c in range(nz)]
        state["ids"] = ids[::-1] if order == "reversed" else random.Random(nx * 1_000 + ny).sample(ids, len(ids))
        state["dims"] = [nx, ny, nz]

    def set_grid_idx(x: int, y: int, z: int) -> None:  # the loop's position -> the program that runs there
        _, ny, nz = state["dims"]
        set_idx(*state["ids"][(x * ny + y) * nz + z])

    monkeypatch.setattr(builder, "set_grid_dim", set_grid_dim)
    monkeypatch.setattr(builder, "set_grid_idx", set_grid_idx)
    return order


def _one_launch(x: torch.Tensor, w: torch.Tensor, cfg: matmul.MatmulConfig, monkeypatch) -> torch.Tensor:
    """`linear` with `_split_sum_kernel` forbidden and its buffers (y, the partials) NaN-filled when allocated: the
    CPU allocator hands back the block the reference call just freed, whose stale partials and outputs would
    hide a read before a partial is stored or a tile that no program writes."""
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs) -> torch.Tensor:
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    with monkeypatch.context() as m:
        m.setattr(matmul, "_split_sum_kernel", _NoSecondLaunch())
        m.setattr(torch, "empty", poisoned_empty)
        return matmul.linear(x, w, config=cfg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits,arrival", CASES, indirect=["arrival"])
def test_one_launch_equals_two_launches(dtype: torch.dtype, splits: int, arrival: str, monkeypatch) -> None:
    """For S = 1, 2, 4, 8 and M = 1, 3, 64, 130: `linear` (one launch, no `_split_sum_kernel`) has the bits of
    `linear_two_launch`, whichever program of a tile arrives last; the counters are zero after every call; and
    a second call gives the same bits again (so the first left its counters ready)."""
    x, w, cfg = _operands(dtype, splits, seed=splits)
    assert _effective_splits(cfg, x.shape[1]) == splits
    counters = matmul.tile_counters(CPU)
    for m in ROWS:
        a = x[:m]
        ref = matmul.linear_two_launch(a, w, config=cfg)  # [m, N]
        assert not counters.any()
        for call in range(2):
            y = _one_launch(a, w, cfg, monkeypatch)
            assert _bits_equal(y, ref), f"S={splits} M={m} call {call}: one launch differs from two"
            assert not counters.any(), f"S={splits} M={m} call {call}: counters left {counters.nonzero().tolist()}"


def test_the_engine_config_takes_one_launch(monkeypatch) -> None:
    """`matmul_config`'s own split (what the engine runs) goes through the one-launch path with the same bits,
    and the tests above use the engine's tiles (only the split count is forced there)."""
    x = torch.randn(5, 2048, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    w = torch.randn(96, 2048, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    cfg = matmul.matmul_config(*w.shape, w.dtype)
    assert cfg.splits > 1
    ref = matmul.linear_two_launch(x, w)
    assert _bits_equal(_one_launch(x, w, cfg, monkeypatch), ref)
    assert not matmul.tile_counters(CPU).any()


def test_without_counters_two_launches(monkeypatch) -> None:
    """Where the counters cannot serve (more output tiles than MAX_TILES; a CUDA-graph capture before they exist
    behaves alike), `linear` takes the two launches: the same bits, and the counters untouched."""
    x, w, cfg = _operands(torch.float32, 4, seed=11)
    ref = matmul.linear_two_launch(x, w, config=cfg)
    counters = matmul.tile_counters(CPU)  # made at full size before MAX_TILES shrinks below
    launched: list[tuple] = []
    real = matmul._split_sum_kernel

    class Recording:
        def __getitem__(self, grid: tuple) -> Callable:
            launched.append(grid)
            return real[grid]

    monkeypatch.setattr(matmul, "MAX_TILES", 3)  # 130 rows x 100 columns in 32 x 32 tiles: 20 tiles
    monkeypatch.setattr(matmul, "_split_sum_kernel", Recording())
    assert _bits_equal(matmul.linear(x, w, config=cfg), ref) and len(launched) == 1
    assert not counters.any()


def test_tile_counters_are_one_zeroed_buffer_per_device() -> None:
    c = matmul.tile_counters(CPU)
    assert c is matmul.tile_counters("cpu") and c.dtype == torch.int32 and c.shape == (matmul.MAX_TILES,)
    assert not c.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [2, 8])
def test_inner_splits_equal_split_launch(dtype: torch.dtype, splits: int, monkeypatch) -> None:
    """A step with enough output tiles sums its splits inside each tile's program (`split_ordered_acc`, grid
    S = 1, no partials, no counters); its bits equal the split-K launch's and the two launches' at every M, so
    switching schedule with the row count moves no row."""
    x, w, cfg = _operands(dtype, splits, seed=20 + splits)
    counters = matmul.tile_counters(CPU)
    for m in ROWS:
        a = x[:m]
        ref = matmul.linear_two_launch(a, w, config=cfg)  # [m, N]
        with monkeypatch.context() as mp:
            mp.setattr(matmul, "INNER_SPLIT_TILES", 1)  # every call takes the inner splits
            grids = spy_launches(mp, matmul, "_matmul_kernel", record=lambda grid, kw: grid)
            y = _one_launch(a, w, cfg, monkeypatch)
        assert grids == [(grids[0][0], 1)], f"S={splits} M={m}: the inner path launched {grids}"
        assert _bits_equal(y, ref), f"S={splits} M={m}: inner splits differ from the split launch"
        assert not counters.any()

