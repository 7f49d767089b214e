"""What a norm / residual fold into the decode GEMV costs on the critical path (GPU only).

    python benchmarks/fold_chain.py [--t 1] [--reps 20] [--iters 200]

The Eagle3 head's layer without its attention, at the embedded pair's shapes, as a chain of dependent
launches captured in one PDL graph (`pdl.scope(True)`, as the engine's small-batch graphs): input norms +
q/k/v (512 x 512), o_proj (256 x 256) + residual + post-attention norm, gate_up + silu (1280 x 256),
down (256 x 640) + residual + final norm, lm_head (8192 x 256), argmax (the next iteration's token). Each of the three boundaries runs either as
today's separate launches or folded (design note 51: the norm in the next GEMV's prologue, the residual
add in the previous GEMV's epilogue); the eight combinations are timed as wall time per chain iteration
(`--reps` iterations per graph, median of 5 timings of `--iters` replays). One JSON line per combination.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from m3eagle import pdl  # noqa: E402
from m3eagle.fused import gemv  # noqa: E402
from m3eagle.fused.triton_fused import TritonFused  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--t", type=int, default=1)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--iters", type=int, default=200)
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape, s=0.05):
        return (torch.randn(*shape, generator=g, device="cuda") * s).bfloat16()

    t, f = a.t, TritonFused()
    table, nw = rnd(32000, 256, s=1.0), [rnd(256, s=1.0) + 1 for _ in range(4)]
    w_qkv, w_o, w_gu, w_down, w_lm = rnd(512, 512), rnd(256, 256), rnd(1280, 256), rnd(256, 640), rnd(8192, 256)
    ids = torch.randint(0, 32000, (t,), device="cuda")
    h0 = rnd(t, 256, s=1.0)

    def chain(fold_in: bool, fold_mid: bool, fold_out: bool) -> torch.Tensor:
        h, tok = h0, ids
        for _ in range(a.reps):
            if fold_in:
                qkv = gemv.norm_linear((table, h), (nw[0], nw[1]), 1e-6, w_qkv, ids=tok)
            else:
                x = torch.empty(t, 512, dtype=h.dtype, device="cuda")
                f.rms_norm_cat((table, h), (nw[0], nw[1]), 1e-6, x, gemma=False, ids=tok)
                qkv = f.linear(x, w_qkv)
            o = qkv[:, :256]  # stands for the attention output
            if fold_mid:
                h = gemv.linear_add(o.contiguous(), w_o, h)
                act = gemv.norm_linear((h,), (nw[2],), 1e-6, w_gu, act="silu")
            else:
                hn, h = f.add_rms_norm(f.linear(o.contiguous(), w_o), h, nw[2], 1e-6, gemma=False)
                act = f.linear_silu_mul(hn, w_gu)
            if fold_out:
                h = gemv.linear_add(act, w_down, h)
                logits = gemv.norm_linear((h,), (nw[3],), 1e-6, w_lm)
            else:
                hn, h = f.add_rms_norm(f.linear(act, w_down), h, nw[3], 1e-6, gemma=False)
                logits = f.linear(hn, w_lm)
            tok = f.argmax(logits)  # the next iteration's token, as in a draft step
        return h

    for combo in itertools.product((False, True), repeat=3):
        chain(*combo)  # compile
        torch.cuda.synchronize()
        with pdl.scope(True):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                chain(*combo)
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
        print(json.dumps({"t": t, "fold_in": combo[0], "fold_mid": combo[1], "fold_out": combo[2],
                          "us_per_iter": round(statistics.median(times), 3),
                          "min": round(min(times), 3), "max": round(max(times), 3)}), flush=True)


if __name__ == "__main__":
    main()
