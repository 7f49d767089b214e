"""Warps of the fused add + RMSNorm kernel at decode, on a GPU (one program per row: latency is its cost).

    python benchmarks/add_norm_warps.py [--json PATH]

For the geometries' hidden sizes (256 embedded, 2048 m3-mini, 4096 m3-8b) and T = 1, 4, 32 rows it times
`triton_fused.add_norm` as the engine calls it between layers (x + x2 * scale + residual, then the Gemma
norm) with 1..16 warps (fused_ops.time_fn: CUDA-graph replay, median of 7), checks each variant bit-equal to the
default's output, and prints the best per width: candidates for `triton_fused.ADD_NORM_WARPS`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fused_ops import time_fn  # noqa: E402  (the script's own folder: one graph timer for the op benchmarks)

from m3eagle.kernels.fused import triton_fused as tf  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []
    for n in (256, 2048, 4096):
        block = 1 << (n - 1).bit_length()
        w = torch.randn(n, device=dev, dtype=dt)
        for t in (1, 4, 32):
            x, x2, res = (torch.randn(t, n, device=dev, dtype=dt) for _ in range(3))
            tf.ADD_NORM_WARPS.pop(block, None)
            want = tf.add_norm(x, res, w, 1e-6, x2, 1.5)
            for warps in (1, 2, 4, 8, 16):
                tf.ADD_NORM_WARPS[block] = warps
                got = tf.add_norm(x, res, w, 1e-6, x2, 1.5)
                equal = all(torch.equal(a, b) for a, b in zip(got, want))
                us = time_fn(lambda x=x, res=res, w=w, x2=x2: tf.add_norm(x, res, w, 1e-6, x2, 1.5), dev, 7) * 1e6
                rows.append({"N": n, "T": t, "warps": warps, "us": us, "bit_equal": equal,
                             "default": warps == tf._warps(block)})
                print(f"N={n:5d} T={t:3d} warps={warps:2d} {us:6.2f} us  bit-equal {equal}"
                      f"{'  (default)' if warps == tf._warps(block) else ''}", flush=True)
            tf.ADD_NORM_WARPS.pop(block, None)
    for n in (256, 2048, 4096):
        best = min((r for r in rows if r["N"] == n and r["T"] == 1 and r["bit_equal"]), key=lambda r: r["us"])
        print(f"best at T=1, N={n}: {best['warps']} warps, {best['us']:.2f} us")
    if args.json:
        args.json.write_text(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
