"""What does a grid-wide barrier inside one persistent Triton kernel cost, against a dependent launch? (GPU only)

    python benchmarks/grid_barrier.py [--phases 20] [--programs 8,16,32,64,128] [--iters 200]

Issue 9's last target needs the Eagle3 head's draft step, a chain of ~11 dependent latency-bound launches
(~1.3 us each under PDL, design note 51), several times shorter. A persistent kernel whose programs
meet at a grid barrier between phases (an arrival counter in global memory, one release atomic per program,
a spin on an acquire load) replaces each launch boundary by a barrier. This times the same chain both ways:
--phases dependent GEMV phases y = W x (W [256, 256] bf16, each program its ceil(256 / G) rows, x read from the
previous phase's output), as --phases PDL launches in one CUDA graph and as one launch of a persistent
kernel with a barrier after each phase; per program count G. Both read the weights every phase and give
bit-equal outputs (checked). One JSON line per (G, form): microseconds per phase, median of 5.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from m3eagle.kernels import pdl  # noqa: E402
from m3eagle.kernels.pdl import pdl_wait  # noqa: E402

N = K = 256


@triton.jit
def _load_acquire(ptr):
    """ld.acquire.gpu of one int32: what this thread reads after it sees every write released before it."""
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _grid_sync(counter_ptr, target):
    """All programs' earlier stores visible to every program after it: CTA barrier, one release arrival
    per program, every thread spins on an acquire load until `target` arrivals."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    cur = _load_acquire(counter_ptr)
    while cur < target:
        cur = _load_acquire(counter_ptr)


@triton.jit
def _phase(w_ptr, src, dst, pid, ROWS: tl.constexpr, K: tl.constexpr):
    rows = pid * ROWS + tl.arange(0, ROWS)
    ks = tl.arange(0, K)
    w = tl.load(w_ptr + rows[:, None] * K + ks[None, :], mask=rows[:, None] < K, other=0.0).to(tl.float32)
    x = tl.load(src + ks, cache_modifier=".cg").to(tl.float32)
    y = tl.sum(w * x[None, :], 1)
    tl.store(dst + rows, y.to(tl.bfloat16), mask=rows < K)


@triton.jit
def _launch_phase_kernel(w_ptr, src, dst, ROWS: tl.constexpr, K: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    _phase(w_ptr, src, dst, tl.program_id(0), ROWS, K)


@triton.jit
def _persistent_kernel(w_ptr, buf, counter_ptr, PHASES: tl.constexpr, G: tl.constexpr, ROWS: tl.constexpr,
                       K: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    pid = tl.program_id(0)
    for p in range(PHASES):
        _phase(w_ptr, buf + (p % 2) * K, buf + ((p + 1) % 2) * K, pid, ROWS, K)
        _grid_sync(counter_ptr, (p + 1) * G)
    # the last program out resets the counters for the next launch (every other one has left its spin)
    out = tl.atomic_add(counter_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if out == G - 1:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(counter_ptr + 1, 0, sem="relaxed", scope="gpu")


def timed(graph: torch.cuda.CUDAGraph, iters: int) -> float:
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phases", type=int, default=20)
    ap.add_argument("--programs", default="8,16,32,64,128")
    ap.add_argument("--iters", type=int, default=200)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("grid_barrier.py needs a CUDA device (a grid barrier deadlocks under the interpreter)")
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(N, K, generator=g, device="cuda") * 0.06).bfloat16()
    x0 = torch.randn(K, generator=g, device="cuda").bfloat16()
    for G in (int(x) for x in a.programs.split(",")):
        case(G, a.phases, a.iters, w, x0)


def case(G: int, phases: int, iters: int, w: torch.Tensor, x0: torch.Tensor) -> None:
    rows = triton.next_power_of_2(triton.cdiv(N, G))
    bufs = torch.zeros(phases + 1, K, dtype=torch.bfloat16, device="cuda")
    ping = torch.zeros(2, K, dtype=torch.bfloat16, device="cuda")
    counter = torch.zeros(2, dtype=torch.int32, device="cuda")

    def launches() -> None:
        bufs[0].copy_(x0)
        for p in range(phases):
            _launch_phase_kernel[(G,)](w, bufs[p], bufs[p + 1], ROWS=rows, K=K, **pdl.args(w))

    def persistent() -> None:
        ping[0].copy_(x0)
        _persistent_kernel[(G,)](w, ping, counter, PHASES=phases, G=G, ROWS=rows, K=K, **pdl.args(w))

    graphs = {}
    for name, fn in (("launches", launches), ("persistent", persistent)):
        with pdl.scope(True):
            fn()  # compile
            torch.cuda.synchronize()
            graphs[name] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[name]):
                fn()
    graphs["launches"].replay()
    graphs["persistent"].replay()
    torch.cuda.synchronize()
    same = torch.equal(bufs[phases], ping[phases % 2])
    assert counter.tolist() == [0, 0], counter.tolist()
    res: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(5):
        for name, graph in graphs.items():
            res[name].append(timed(graph, iters) / phases * 1e6)
    for name, times in res.items():
        print(json.dumps({"programs": G, "form": name, "phases": phases, "us_per_phase":
                          round(statistics.median(times), 3), "min": round(min(times), 3),
                          "bit_equal": same}), flush=True)


if __name__ == "__main__":
    main()
