"""The deterministic mode's cross-rank sum (`TPGroup.all_reduce` with deterministic=True) on CPU with gloo.

Three ranks, because with two the order question does not arise (a + b == b + a in IEEE arithmetic): with three,
(p0 + p1) + p2 and p0 + (p1 + p2) differ, and the partials below are built so that they do. Each rank checks
that a row's sum has the same bits whether the reduced tensor holds that row alone or many rows (at several
positions), that the sum is the rank-order one, (p0 + p1) + p2 in fp32, rounded once into the input's dtype, and
that every rank holds the same bits. Both ways of computing it are checked: one all-gather of the partials (small
messages, CUDA-graph captures) and two phases (an all-to-all of slices, each rank's slice summed, an all-gather of
the sums: large messages), which must agree bit for bit since the choice follows the row count. The ranks are
spawned processes joined through the engine's own `init_group`, so the mode's hand-off from the engine to the
group is covered too. gloo's own all-reduce fails these checks on the same partials (asserted as a control).
"""

from __future__ import annotations

import multiprocessing as mp
import traceback

import pytest
import torch

from m3eagle.distributed.parallel_state import (
    TWO_PHASE_MIN_BYTES,
    TPGroup,
    fixed_order_all_reduce,
    rank_order_sum,
)

WORLD = 3
ROWS, HIDDEN = 37, 40


def partial(rank: int, dtype: torch.dtype, rows: int = ROWS) -> torch.Tensor:
    """Rank `rank`'s partial sum [rows, HIDDEN]: magnitudes over eight decades with random signs, so the three
    partials cancel and the summation order shows in the bits."""
    g = torch.Generator().manual_seed(100 + rank)
    mag = torch.pow(10.0, torch.empty(rows, HIDDEN).uniform_(-4, 4, generator=g))
    sign = torch.randint(0, 2, (rows, HIDDEN), generator=g) * 2 - 1
    return (mag * sign).to(dtype)


def expected(dtype: torch.dtype, rows: int = ROWS) -> torch.Tensor:
    """((p0 + p1) + p2) in fp32, one rounding into dtype: what every rank must hold."""
    p = [partial(r, dtype, rows).float() for r in range(WORLD)]
    return ((p[0] + p[1]) + p[2]).to(dtype)


def _rank_main(rank: int, init: str, out: mp.Queue) -> None:
    from m3eagle.engine import executor as launch

    torch.set_num_threads(1)
    try:
        tp = launch.init_group(rank, WORLD, init, torch.device("cpu"), deterministic=True)
        assert tp.deterministic
        for dtype in (torch.float32, torch.bfloat16):
            mine = partial(rank, dtype)
            whole = tp.all_reduce(mine.clone())  # [ROWS, HIDDEN]
            assert torch.equal(whole, expected(dtype)), dtype
            for i in (0, 5, ROWS - 1):
                alone = tp.all_reduce(mine[i:i + 1].clone())  # [1, HIDDEN]
                assert torch.equal(alone[0], whole[i]), (dtype, i)
                few = tp.all_reduce(mine[[i, (i + 7) % ROWS, (i + 3) % ROWS]].clone())  # row i first of 3
                assert torch.equal(few[0], whole[i]), (dtype, i)
            # a 1-D view of the same rows (the collective's message shape changes, an element's sum does not)
            flat = tp.all_reduce(mine.reshape(-1).clone())
            assert torch.equal(flat.view(ROWS, HIDDEN), whole), dtype
            # the two-phase path (all-to-all, sum of this rank's slice, all-gather) gives the same bits: for
            # element counts that split evenly over the ranks (3 rows) and that do not (1 row, 37 rows)
            for rows in ((2, 3, 4), (6,), tuple(range(ROWS))):
                two = fixed_order_all_reduce(mine[list(rows)].clone(), WORLD, tp.group, two_phase=True)
                assert torch.equal(two, whole[list(rows)]), (dtype, len(rows))
            # a message past TWO_PHASE_MIN_BYTES takes the two-phase path by itself: its rows are whole's
            big = mine.repeat(180, 1)  # [180 * ROWS, HIDDEN]
            if big.numel() * big.element_size() >= TWO_PHASE_MIN_BYTES:
                assert torch.equal(tp.all_reduce(big).view(180, ROWS, HIDDEN), whole.expand(180, -1, -1)), dtype
            else:
                assert dtype == torch.bfloat16  # half the bytes of the fp32 message, which does cross it
            # every rank holds the same bits: the gathered sums of rank 0's result are equal
            parts = [torch.empty_like(whole) for _ in range(WORLD)]
            torch.distributed.all_gather(parts, whole, group=tp.group)
            assert all(torch.equal(p, whole) for p in parts), dtype
        # The control that keeps the checks above meaningful: gloo's own all-reduce, on the same partials, is not
        # the rank-order sum (and a row alone gets other bits than inside the 37 rows).
        plain = TPGroup(rank=rank, size=WORLD, group=tp.group)
        assert not torch.equal(plain.all_reduce(partial(rank, torch.float32)), expected(torch.float32))
        # integers keep the backend's all-reduce (exact in any order)
        n = tp.all_reduce(torch.tensor([rank + 1], dtype=torch.int64))
        assert n.item() == WORLD * (WORLD + 1) // 2
        out.put((rank, None))
    except BaseException:
        out.put((rank, traceback.format_exc()))
    finally:
        launch.leave_group(10.0)


def test_rank_order_sum_is_the_ordered_fp32_sum_and_order_shows():
    """The local half, without processes: rank_order_sum is ((p0 + p1) + p2) with fp32 accumulation and one
    rounding; the partials make another order differ (so the spawned test below can tell orders apart)."""
    for dtype in (torch.float32, torch.bfloat16):
        parts = torch.stack([partial(r, dtype) for r in range(WORLD)])  # [W, ROWS, HIDDEN]
        out = torch.empty(ROWS, HIDDEN, dtype=dtype)
        assert rank_order_sum(parts, out) is out
        assert torch.equal(out, expected(dtype))
        p = parts.float()
        # another order, rounded into dtype at each hop as a ring does: other bits
        assert not torch.equal(((p[2] + p[1]).to(dtype).float() + p[0]).to(dtype), out), dtype
        # a row alone: the same bits as inside the 37 rows
        one = torch.empty(1, HIDDEN, dtype=dtype)
        assert torch.equal(rank_order_sum(parts[:, 11:12], one)[0], out[11])
    single = torch.ones(1, 4)
    assert torch.equal(rank_order_sum(single[None], torch.empty(1, 4)), single)
    # the one-process group has nothing to sum: the input comes back untouched
    x = torch.randn(3, 4)
    assert TPGroup(deterministic=True).all_reduce(x) is x


@pytest.mark.slow
def test_fixed_order_all_reduce_over_three_gloo_ranks():
    from m3eagle.engine import executor as launch

    ctx = mp.get_context("spawn")
    init, out = launch.free_tcp_address(), ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, init, out), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=120) for _ in range(WORLD))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    failed = {r: tb for r, tb in results.items() if tb is not None}
    assert not failed, "\n".join(f"rank {r}:\n{tb}" for r, tb in failed.items())
    assert [p.exitcode for p in procs] == [0] * WORLD
