"""The deterministic mode's GEMM (m3eagle/kernels/batch_invariant/matmul.py) against the configuration space it
may choose from, on a CUDA GPU: which (BLOCK_N, BLOCK_K, stages, warps, K splits) at 64-row tiles streams each
weight shape fastest at decode, and what that choice costs at T = 32, 128 (a batch-32 K = 3 verify) and at
prompt size.

    python benchmarks/batch_invariant_gemm.py --geometry m3-mini --json bi_gemm.json
    python benchmarks/batch_invariant_gemm.py --device cpu --geometry embedded --t 1 --quick   # smoke test

A configuration must be one per weight shape, whatever the row count (that is what makes rows batch-invariant),
so the sweep ranks candidates by the decode time (T = 1) and reports the leaders' T = 32 and T = --prompt-t
times beside the current rule (`matmul_config`) and cuBLAS (F.linear, which is not batch-invariant: the
ceiling). Every candidate is checked to be row-invariant (a row alone == the same row in a batch of 64, bit
for bit) before it is timed; one that is not is reported and dropped.

Timing as benchmarks/gemv.py: calls captured back to back in one CUDA graph over weight copies that span
--rotate-mb, median of --replays replays, per call; a split candidate's time includes its split sum (done in
the same launch, by each tile's last program).
"""

from __future__ import annotations

import sys

from _interpreter import use_interpreter_for_cpu  # noqa: E402  (the script's own folder)

use_interpreter_for_cpu(sys.argv)  # before anything imports triton

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
from dataclasses import asdict, replace  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gemv import all_shapes, copy_bandwidth, graph_time, weight_copies  # noqa: E402

from m3eagle.kernels.batch_invariant import matmul  # noqa: E402


def candidates(quick: bool) -> list[matmul.MatmulConfig]:
    """The sweep's configurations (splits are added per shape: they need no new compile)."""
    if quick:
        return [matmul.MatmulConfig(16, 32, 64, 1, 4, 2)]
    out = []
    for (bn, bk), stages, warps in itertools.product(((32, 128), (64, 128), (32, 256), (64, 64), (128, 64),
                                                      (128, 128)), (3, 4, 5), (4, 8)):
        if (bk == 256 or bn * bk >= 128 * 128) and stages >= 4:  # operand stages past shared memory
            continue
        out.append(matmul.MatmulConfig(64, bn, bk, 1, warps, stages))  # 64 rows: matmul_config's MMA for every M
    return out


def row_invariant(cfg: matmul.MatmulConfig, w: torch.Tensor) -> bool:
    """A row alone, and rows 0..2 / 61..63, equal the same rows of a 64-row batch bit for bit."""
    x = torch.randn(64, w.shape[1], device=w.device).to(w.dtype)
    full = matmul.linear(x, w, config=cfg)
    return all(torch.equal(matmul.linear(x[a:a + m], w, config=cfg), full[a:a + m])
               for a, m in ((0, 1), (37, 1), (63, 1), (0, 3), (61, 3)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--geometry", default="m3-mini", help="comma list of embedded, m3-mini, m3-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    p.add_argument("--t", default="1", help="rows of the ranking calls (the first is the rank key)")
    p.add_argument("--prompt-t", type=int, default=2048)
    p.add_argument("--top", type=int, default=3, help="leaders per shape timed at 32 and --prompt-t rows")
    p.add_argument("--rotate-mb", type=float, default=256.0)
    p.add_argument("--max-copies", type=int, default=512)
    p.add_argument("--replays", type=int, default=10)
    p.add_argument("--min-calls", type=int, default=50)
    p.add_argument("--quick", action="store_true", help="one candidate (the CPU smoke test)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("batch_invariant_gemm.py: needs a CUDA GPU (or --device cpu for a smoke test)")
        return 2
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    torch.manual_seed(0)
    bw = copy_bandwidth(dev)
    ts = [int(t) for t in args.t.split(",")]
    doc: dict[str, Any] = {"command": " ".join(["python", "benchmarks/batch_invariant_gemm.py", *(argv or sys.argv[1:])]),
                           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                           "copy_gb_s": bw, "shapes": []}
    print(f"copy bandwidth {bw:.0f} GB/s")
    for shape in all_shapes(args.geometry.split(","), head=True):
        n, k = shape["n"], shape["k"]
        ws = weight_copies(n, k, dtype, dev, args.rotate_mb if dev.type == "cuda" else 0, args.max_copies)
        nbytes = n * k * 2
        rule = matmul.matmul_config(n, k, dtype)
        rows: list[dict[str, Any]] = []
        tried = [rule] + [replace(c, splits=s) for c in candidates(args.quick) for s in (1, 2, 4, 8, 16)
                          if s <= max(1, -(-k // c.block_k) // 2)]
        for cfg in dict.fromkeys(tried):  # the rule first; duplicates once
            try:
                ok = row_invariant(cfg, ws[0])
                row: dict[str, Any] = {"config": asdict(cfg), "rule": cfg == rule, "row_invariant": ok}
                if ok:
                    for t in ts:
                        x = torch.randn(t, k, device=dev).to(dtype)
                        us = graph_time(lambda a, b, c=cfg: matmul.linear(a, b, config=c), x, ws,
                                        args.replays, args.min_calls)
                        row[f"us_t{t}"] = us
                        row[f"gb_s_t{t}"] = nbytes / us / 1e3
            except Exception as e:  # a candidate that does not compile or launch (shared memory): reported
                row = {"config": asdict(cfg), "rule": cfg == rule, "error": f"{type(e).__name__}: {e}"[:200]}
            rows.append(row)
        timed = [r for r in rows if f"us_t{ts[0]}" in r]
        timed.sort(key=lambda r: r[f"us_t{ts[0]}"])
        leaders = timed[:args.top] + [r for r in timed if r["rule"] and r not in timed[:args.top]]
        for r in leaders:  # the leaders and the rule at 32 rows and at prompt size
            cfg = matmul.MatmulConfig(**r["config"])
            for t in (32, 128, args.prompt_t):
                x = torch.randn(t, k, device=dev).to(dtype)
                r[f"us_t{t}"] = graph_time(lambda a, b, c=cfg: matmul.linear(a, b, config=c), x,
                                           ws, args.replays, max(4, args.min_calls // (8 if t > 64 else 1)))
        cublas = {}
        for t in sorted({*ts, 32, 128, args.prompt_t}):
            x = torch.randn(t, k, device=dev).to(dtype)
            cublas[f"us_t{t}"] = graph_time(lambda a, b: F.linear(a, b), x, ws, args.replays,
                                            max(4, args.min_calls // (8 if t > 64 else 1)))
        doc["shapes"].append({"n": n, "k": k, "uses": shape["uses"], "weight_bytes": nbytes, "cublas": cublas,
                              "best": timed[0] if timed else None, "candidates": rows})
        best = timed[0] if timed else None
        rule_row = next(r for r in rows if r["rule"])

        def fmt(r: dict[str, Any] | None) -> str:
            if r is None or "error" in r:
                return "-"
            c = r["config"]
            return (f"M{c['block_m']} N{c['block_n']} K{c['block_k']} s{c['splits']} st{c['num_stages']}: "
                    + f" w{c['num_warps']} "
                    + " ".join(f"t{t} {r[f'us_t{t}']:.1f}" for t in (ts[0], 32, 128, args.prompt_t) if f"us_t{t}" in r))
        print(f"{n}x{k} ({', '.join(shape['uses'])}) cuBLAS "
              + " ".join(f"t{t} {v:.1f}" for t, v in ((kk[4:], vv) for kk, vv in cublas.items())) + " us")
        print(f"   rule {fmt(rule_row)}")
        print(f"   best {fmt(best)}")
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
