"""What a norm / residual fold into the decode GEMV costs on the critical path (GPU only).

    python benchmarks/fold_chain.py [--geometry embedded|m3-mini|m3-8b] [--t 1] [--reps 20] [--iters 200]

The Eagle3 head's layer without its attention, at a geometry's head shapes (SHAPES), as a chain of
dependent launches captured in one PDL graph (`pdl.scope(True)`, as the engine's small-batch graphs):
input norms + q/k/v, o_proj + residual + post-attention norm, gate_up + silu, down + residual + final
norm, lm_head, argmax (the next iteration's token). The o_proj / gate_up boundary runs either as separate
launches (o_proj, add_rms_norm, gate_up + silu) or folded (design note 51: the residual add in o_proj's
epilogue, the norm in gate_up's prologue); both are timed as wall time per chain iteration (`--reps`
iterations per graph, median of 5 timings of `--iters` replays), alternating `--rounds` times. One JSON
line per timing. (Commit 5df9124's version also folded the input norms into q/k/v and the final norm into
lm_head: they did not pay, design note 51.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from m3eagle.kernels import pdl  # noqa: E402
from m3eagle.kernels.fused import gemv  # noqa: E402
from m3eagle.kernels.fused.triton_fused import TritonFused  # noqa: E402

# geometry -> (H, heads * head_dim, packed q/k/v rows, intermediate, draft vocabulary): the heads of
# m3eagle/bench/geometries.py and the embedded pair's
SHAPES = {"embedded": (256, 256, 512, 640, 8192), "m3-mini": (2048, 2048, 2560, 4096, 32000),
          "m3-8b": (4096, 4096, 5120, 12288, 32000)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--geometry", choices=sorted(SHAPES), default="embedded")
    ap.add_argument("--t", type=int, default=1)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape, s=0.05):
        return (torch.randn(*shape, generator=g, device="cuda") * s).bfloat16()

    t, f = a.t, TritonFused()
    hid, att, nqkv, inter, vocab = SHAPES[a.geometry]
    table, nw = rnd(32000, hid, s=1.0), [rnd(hid, s=1.0) + 1 for _ in range(4)]
    w_qkv, w_o, w_gu = rnd(nqkv, 2 * hid), rnd(hid, att), rnd(2 * inter, hid)
    w_down, w_lm = rnd(hid, inter), rnd(vocab, hid)
    ids = torch.randint(0, 32000, (t,), device="cuda")
    h0 = rnd(t, hid, s=1.0)

    def chain(fold: bool) -> torch.Tensor:
        h, tok = h0, ids
        for _ in range(a.reps):
            x = torch.empty(t, 2 * hid, dtype=h.dtype, device="cuda")
            f.rms_norm_cat((table, h), (nw[0], nw[1]), 1e-6, x, gemma=False, ids=tok)
            o = f.linear(x, w_qkv)[:, :att].contiguous()  # stands for the attention output
            if fold:
                h = gemv.linear_add(o, w_o, h)
                act = gemv.norm_linear(h, nw[2], 1e-6, w_gu, act="silu")
            else:
                hn, h = f.add_rms_norm(f.linear(o, w_o), h, nw[2], 1e-6, gemma=False)
                act = f.linear_silu_mul(hn, w_gu)
            hn, h = f.add_rms_norm(f.linear(act, w_down), h, nw[3], 1e-6, gemma=False)
            tok = f.argmax(f.linear(hn, w_lm))  # < 32000: a table row  # the next iteration's token, as in a draft step
        return h

    graphs = {}
    for fold in (False, True):
        chain(fold)  # compile
        torch.cuda.synchronize()
        with pdl.scope(True):
            graphs[fold] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[fold]):
                chain(fold)
    for _ in range(a.rounds):
        for fold, graph in graphs.items():
            for _ in range(20):
                graph.replay()
            times = []
            for _ in range(5):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(a.iters):
                    graph.replay()
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) / a.iters / a.reps * 1e6)
            med = round(statistics.median(times), 3)
            print(json.dumps({"geometry": a.geometry, "t": t, "fold": fold, "us_per_iter": med,
                              "min": round(min(times), 3), "max": round(max(times), 3)}), flush=True)


if __name__ == "__main__":
    main()
