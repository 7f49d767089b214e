"""The batch-invariant GEMM's one-launch split-K on a GPU: the memory ordering the CPU interpreter cannot exercise.

Run: `python -m pytest -q -m gpu tests/kernels/test_batch_invariant_splitk_gpu.py` (one H100 / H200, seconds).
tests/kernels/test_batch_invariant_splitk.py holds the sum's order to `linear_two_launch` under the interpreter,
which runs a launch's programs one at a time; here the programs of a tile race for its counter on real SMs (CTA
barrier, acq_rel atomic, .cg loads of other SMs' partials), back to back, with programmatic dependent launch and
inside a CUDA graph, and every result must still have the two-launch path's bits and leave the counters zero.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# m3-mini's split decode projections (N, K) in bf16, and one N off the 64-column tile
SHAPES = ((2560, 2048), (2048, 2048), (1024, 2048), (1000, 2048))
ROWS = (1, 4, 33, 130)


def _operands(n: int, k: int, m: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)  # [M, K]
    w = (torch.randn(n, k, generator=g, device="cuda") * 0.02).to(torch.bfloat16)  # [N, K]
    return x, w


@pytest.mark.parametrize("pdl_mode", ["0", "1"])
def test_one_launch_equals_two_launches_back_to_back(pdl_mode: str, monkeypatch) -> None:
    """Every (shape, rows) pair, 20 times over in one stream without a sync between launches (so the programs
    that arrive last vary, and a launch's counter reset races the next launch's atomics): the two-launch bits
    every time, and the counters zero at the end. With M3EAGLE_PDL=1 each launch may start before the previous
    one drains (sm_90+)."""
    from m3eagle.kernels.batch_invariant import matmul

    monkeypatch.setenv("M3EAGLE_PDL", pdl_mode)
    cases = [_operands(n, k, m, seed=i) for i, ((n, k), m) in enumerate((s, m) for s in SHAPES for m in ROWS)]
    assert all(matmul.matmul_config(*w.shape, w.dtype).splits > 1 for _, w in cases)
    refs = [matmul.linear_two_launch(x, w) for x, w in cases]
    outs = [[matmul.linear(x, w) for x, w in cases] for _ in range(20)]
    torch.cuda.synchronize()
    assert not matmul.tile_counters("cuda").any()
    for rep in outs:
        for y, ref, (x, w) in zip(rep, refs, cases):
            assert torch.equal(y.view(torch.int16), ref.view(torch.int16)), (tuple(w.shape), x.shape[0])


@pytest.mark.parametrize("fresh_counters", [False, True])
def test_graph_replay_equals_two_launches(fresh_counters: bool, monkeypatch) -> None:
    """Captured after eager warm-ups on a side stream, as the GraphRunner does, replays give the two-launch bits
    and leave the counters zero. fresh_counters: no eager call made the counters before the capture, so the
    captured GEMM takes the two launches (no allocation inside the capture), with the same bits."""
    from m3eagle.kernels.batch_invariant import matmul
    from m3eagle.kernels.split_counters import SplitCounters

    monkeypatch.setenv("M3EAGLE_PDL", "1")
    x, w = _operands(2560, 2048, 4, seed=1)
    ref = matmul.linear_two_launch(x, w)
    if fresh_counters:
        monkeypatch.setattr(matmul, "_COUNTERS", SplitCounters(matmul.MAX_TILES))
    else:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                matmul.linear(x, w)
        torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = matmul.linear(x, w)
    assert (len(matmul._COUNTERS) == 0) == fresh_counters  # captured without counters: none were made in the capture
    for _ in range(10):
        graph.replay()
        assert torch.equal(y.view(torch.int16), ref.view(torch.int16))
    torch.cuda.synchronize()
    if not fresh_counters:
        assert not matmul.tile_counters("cuda").any()


def test_inner_splits_equal_two_launches_on_the_gpu() -> None:
    """Prompt-sized steps (>= INNER_SPLIT_TILES output tiles) sum each tile's splits inside its program: the
    compiled loop (split 0, then += split 1 .. S-1) keeps the two-launch path's bits, at prompt size and with the
    threshold lowered so that 1 and 33 rows take it too; the fold's activation likewise."""
    from m3eagle.kernels.batch_invariant import folds, matmul

    x, w = _operands(2560, 2048, 2048, seed=7)
    assert matmul.inner_splits(-(-2048 // 64) * -(-2560 // 64))  # the prompt-sized call takes the inner path
    for m in (2048, 33, 1):
        ref = matmul.linear_two_launch(x[:m], w)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(matmul, "INNER_SPLIT_TILES", 1)
            y = matmul.linear(x[:m], w)
            act = folds.linear_act(x[:m], w, "swiglu_oai", 1.702, 7.0)
        assert torch.equal(y.view(torch.int16), ref.view(torch.int16)), m
        ref_act = folds.linear_act_two_launch(x[:m], w, "swiglu_oai", 1.702, 7.0)
        assert torch.equal(act.view(torch.int16), ref_act.view(torch.int16)), m
