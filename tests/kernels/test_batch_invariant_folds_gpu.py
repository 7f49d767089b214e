"""The deterministic mode's folded launches on a GPU (batch_invariant/folds.py, batch_invariant/router.py).

Run: `python -m pytest -q -m gpu tests/kernels/test_batch_invariant_folds_gpu.py` (one H100 / H200, under a minute).
tests/kernels/test_batch_invariant_folds.py holds the folds to their two-launch forms under the interpreter, which
runs a launch's programs one at a time with numpy math; here the programs race for their counters on real SMs,
the MMAs are the GPU's, the activation is libdevice's, and each fold must still give the two-launch bits, keep a
row's bits at every M, and leave the counters zero: at m3-mini's decode shapes, back to back with and without
programmatic dependent launch, and inside a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# m3-mini: the shared experts' gate_up [2 x 1024, 2048] (4 K splits), the dense MLPs' [2 x 4096, 2048] (2), the
# draft head's [2 x 4096, 2048]; an odd I off the 32-column half tile
ACT_SHAPES = ((2048, 2048), (8192, 2048), (2 * 1000, 2048))
ROWS = (1, 4, 33, 130)


def _bits(a: torch.Tensor) -> torch.Tensor:
    return a.view({torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.int64: torch.int64}[a.dtype])


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)  # [M, K]


def _w(n: int, k: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(n, k, generator=g, device="cuda") * k ** -0.5).to(dtype)  # [N, K]


@pytest.mark.parametrize("pdl_mode", ["0", "1"])
def test_linear_act_equals_two_launches_back_to_back(pdl_mode: str, monkeypatch) -> None:
    """Every (shape, rows, activation), 10 times over without a sync: the two-launch bits every time; the
    counters zero at the end."""
    from m3eagle.kernels.batch_invariant import folds, matmul

    monkeypatch.setenv("M3EAGLE_PDL", pdl_mode)
    cases = [(_x(m, k, i), _w(n, k, 100 + i), act) for i, ((n, k), m, act) in
             enumerate((s, m, a) for s in ACT_SHAPES for m in ROWS for a in ("swiglu_oai", "silu"))]
    refs = [folds.linear_act_two_launch(x, w, act, 1.702, 7.0) for x, w, act in cases]
    outs = [[folds.linear_act(x, w, act, 1.702, 7.0) for x, w, act in cases] for _ in range(10)]
    torch.cuda.synchronize()
    assert not matmul.tile_counters("cuda").any()
    for rep in outs:
        for y, ref, (x, w, act) in zip(rep, refs, cases):
            assert torch.equal(_bits(y), _bits(ref)), (tuple(w.shape), x.shape[0], act)


def test_folds_rows_invariant() -> None:
    """A row alone, at M = 2, 17, 64 and 130 in several positions: the same bits (activation, argmax, router)."""
    from m3eagle.kernels.batch_invariant import folds, router

    x = _x(130, 2048, 1)
    w_act, w_head, w_router = _w(2048, 2048, 2), _w(32000, 2048, 3), _w(32, 2048, 4, torch.float32)
    bias = torch.randn(32, device="cuda") * 0.01
    fns = {"act": lambda a: folds.linear_act(a, w_act, "swiglu_oai", 1.702, 7.0),
           "argmax": lambda a: folds.linear_argmax(a, w_head),
           "router": lambda a: torch.cat([t.float() for t in router.route_tokens(a, w_router, bias, 4)], 1)}
    for name, f in fns.items():
        full = f(x)
        for a, m in ((0, 1), (37, 1), (129, 1), (36, 2), (30, 17), (64, 64), (1, 64)):
            assert torch.equal(_bits(f(x[a:a + m])), _bits(full[a:a + m])), (name, a, m)


@pytest.mark.parametrize("n", [32000, 1000])
def test_linear_argmax_equals_two_launches(n: int) -> None:
    """LM head + argmax (m3-mini's 32,000-column head, unsplit; a 1,000-column head, split), with offsets and the
    scatter store: the two launches' ids, 10 times over without a sync."""
    from m3eagle.kernels.batch_invariant import folds, matmul

    w = _w(n, 2048, 5)
    off = torch.randint(0, 7, (n,), device="cuda")
    for m in ROWS:
        x = _x(m, 2048, m)
        rows = torch.randperm(200, device="cuda")[:m]
        ref_buf = torch.zeros(200, 4, dtype=torch.int64, device="cuda")
        ref = folds.linear_argmax_two_launch(x, w, off, scatter=(ref_buf, rows, 3))
        for _ in range(10):
            buf = torch.zeros_like(ref_buf)
            assert torch.equal(folds.linear_argmax(x, w, off, scatter=(buf, rows, 3)), ref), (n, m)
            assert torch.equal(buf, ref_buf)
    torch.cuda.synchronize()
    assert not matmul.tile_counters("cuda").any() and not folds.best_keys("cuda").any()


@pytest.mark.parametrize("t", [1, 4, 64, 8192])
def test_router_one_launch_equals_two_launches(t: int) -> None:
    """m3-mini's router (32 experts of 2,048 fp32 columns, top 4), decode to a prompt chunk of 8,192 tokens:
    the bits of the GEMV + route launches; the counters zero after."""
    from m3eagle.kernels.batch_invariant import matmul, router

    x, w = _x(t, 2048, t), _w(32, 2048, 6, torch.float32)
    bias = torch.randn(32, device="cuda") * 0.01
    one, two = router.route_tokens(x, w, bias, 4), router.route_tokens_two_launch(x, w, bias, 4)
    torch.cuda.synchronize()
    assert torch.equal(_bits(one[0]), _bits(two[0])) and torch.equal(one[1], two[1])
    assert not matmul.tile_counters("cuda").any()


def test_graph_replay_equals_eager(monkeypatch) -> None:
    """Captured after eager warm-ups on a side stream (the counters exist), as the GraphRunner does, with PDL:
    replays give the eager bits of every fold and leave the counters zero."""
    from m3eagle.kernels.batch_invariant import folds, matmul, router

    monkeypatch.setenv("M3EAGLE_PDL", "1")
    x = _x(4, 2048, 7)
    w_act, w_head, w_router = _w(2048, 2048, 8), _w(32000, 2048, 9), _w(32, 2048, 10, torch.float32)
    bias = torch.zeros(32, device="cuda")

    def step() -> list[torch.Tensor]:
        return [folds.linear_act(x, w_act, "swiglu_oai", 1.702, 7.0), folds.linear_argmax(x, w_head),
                *router.route_tokens(x, w_router, bias, 4)]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ref = [step() for _ in range(2)][-1]
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(10):
        graph.replay()
        for o, r in zip(outs, ref):
            assert torch.equal(_bits(o), _bits(r))
    torch.cuda.synchronize()
    assert not matmul.tile_counters("cuda").any() and not folds.best_keys("cuda").any()
