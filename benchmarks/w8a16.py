"""W8A16 MXFP8 kernels (m3eagle/kernels/quant/w8a16.py) vs bf16 on a CUDA GPU: `mx_linear` against bf16
F.linear (cuBLAS) and the bf16 decode GEMV (m3eagle/kernels/fused/gemv.py), and the MXFP8 routed MoE as the
Triton backend runs it (`TritonMoE.experts`: `mx_moe_experts`' per-pair GEMVs at T <= 8, the sorted grouped GEMMs
`triton_moe.mx_fused_experts` above) against the bf16 Triton MoE (m3eagle/kernels/moe/triton_moe.py); at decode
sizes also the layer with a shared expert of width I, inside the MoE's launches (`experts_and_shared`, the engine's
path) and apart (its own gate_up + activation and down GEMMs).

    python benchmarks/w8a16.py                         # M3 + m3-8b + m3-mini shapes, T in 1, 2, 4, 8, 2048, + MoE
    python benchmarks/w8a16.py --json w8a16.json       # also write every number to one JSON document
    python benchmarks/w8a16.py --models m3 --t 1,2048 --no-moe
    python benchmarks/w8a16.py --tune --write          # sweep GEMV / tiled configs at T <= 8 (and the MoE's); write
                                                       # the winners to m3eagle/kernels/quant/w8a16_configs.json
    python benchmarks/w8a16.py --tune --write --tune-only --no-tune-moe --models m3,m3-8b
                                                       # the decode sweep of M3's and m3-8b's shapes only (13
                                                       # shapes x T 1, 2, 4, 8: ~2,500 timings, 36 compiles on
                                                       # --jobs processes first); the MoE's entry is kept
    python benchmarks/w8a16.py --tune --dry-run --models m3,m3-8b   # that sweep's size, without a GPU

The sweep (`tune_candidates`): per shape and T bucket, the table's / rule's config, the tiled kernel unsplit (BN 64
/ 128, BK 128 / 256, 3 / 4 stages), the tiled kernel split along K into 2, 3, 4, 6 or 8 programs per output tile
(one launch; each split >= 2 K steps), and at T <= 2 the lean GEMV (unsplit, split 2 / 4); the fastest wins.

Shapes (one row per distinct N x K, the projections that have it listed): MiniMax-M3 (hidden 6144): packed q/k/v
[64*128 + 2*4*128, 6144] = [9216, 6144], o_proj [6144, 8192], dense MLP gate_up [24576, 6144] / down [6144, 12288],
shared expert gate_up [6144, 6144] / down [6144, 3072] (lm_head stays bf16: not here); m3-8b and m3-mini from
m3eagle/bench/geometries.py (q/k/v of full and sparse layers -- the latter with the indexer's rows -- o_proj,
dense MLP, shared expert). MoE: M3's experts, E = 128, k = 4, H = 6144, I = 3072, at T = 1 and 2048.

Prompt sizes (T >= 64): mx_linear's own path (from DEQUANT_MIN_T rows the one-launch dequantization into a bf16
scratch + cuBLAS, below it the tiled kernel) and the other one (`alt_path` / `alt_us`), each row timing both.

Timing: each implementation is captured in a CUDA graph of back-to-back calls cycling through weight copies that
span --rotate-mb (so each call reads its weight from HBM, as decode does); median over --replays replays, per
call. GB/s counts the bytes read: weights (fp8 + ue8m0 scales, or bf16) and activations; "%copy" is that over a
measured 1 GiB device-to-device copy's bandwidth (bytes read + written). err: max |y - ref| / max |ref| against
x.float() @ dequantize_mx(q, s).T (bf16 rounding of y alone gives ~4e-3). On a CPU the script exits with a message.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gemv import graph_time  # noqa: E402  (benchmarks/, the script's directory: one graph timer)

from m3eagle.bench.roofline import measure_copy_bandwidth  # noqa: E402

M3_SHAPES = [  # (what, N, K)
    ("qkv", 9216, 6144), ("o_proj", 6144, 8192), ("dense gate_up", 24576, 6144), ("dense down", 6144, 12288),
    ("shared gate_up", 6144, 6144), ("shared down", 6144, 3072),
]


def geometry_shapes(name: str) -> list[tuple[str, int, int]]:
    """The projections of an m3eagle/bench/geometries.py target (no head, no lm_head)."""
    from m3eagle.bench import geometries

    cfg = {"m3-mini": geometries.m3_mini, "m3-8b": geometries.m3_8b}[name]()[0]
    h, d = cfg.hidden_size, cfg.head_dim
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d
    return [("qkv full", qkv, h), ("qkv sparse", qkv + cfg.index_n_heads * cfg.index_head_dim + cfg.index_head_dim, h),
            ("o_proj", h, cfg.num_attention_heads * d), ("dense gate_up", 2 * cfg.dense_intermediate_size, h),
            ("dense down", h, cfg.dense_intermediate_size), ("shared gate_up", 2 * cfg.shared_intermediate_size, h),
            ("shared down", h, cfg.shared_intermediate_size)]


def all_shapes(models: list[str]) -> list[dict[str, Any]]:
    seen: dict[tuple[int, int], dict[str, Any]] = {}
    for m in models:
        for what, n, k in (M3_SHAPES if m == "m3" else geometry_shapes(m)):
            seen.setdefault((n, k), {"n": n, "k": k, "uses": []})["uses"].append(f"{m} {what}")
    return list(seen.values())


# ---- timing -------------------------------------------------------------------------------------------


def copies(nbytes: int, rotate_mb: float, limit: int = 64) -> int:
    return 1 if rotate_mb <= 0 else max(2, min(limit, math.ceil(rotate_mb * 2**20 / nbytes)))


# ---- linear -------------------------------------------------------------------------------------------


def bench_linear(shape: dict[str, Any], ts: list[int], args: argparse.Namespace, copy_bw: float) -> list[dict]:
    from m3eagle.kernels.fused import gemv
    from m3eagle.kernels.quant.mxfp8 import dequantize_mx, quantize_mx
    from m3eagle.kernels.quant.w8a16 import DEQUANT_MIN_T, mx_dequantize, mx_linear, pick_config

    dev = torch.device("cuda")
    n, k = shape["n"], shape["k"]
    w = torch.randn(n, k, device=dev).mul_(k ** -0.5)
    q0, s0 = quantize_mx(w)
    wb0 = w.to(torch.bfloat16)
    wref = dequantize_mx(q0, s0)  # fp32 [N, K]
    del w
    fp8_bytes = n * k + n * k // 32
    mx = [(q0, s0)] + [(q0.clone(), s0.clone()) for _ in range(copies(fp8_bytes, args.rotate_mb) - 1)]
    bf = [wb0] + [wb0.clone() for _ in range(copies(2 * n * k, args.rotate_mb, 16) - 1)]
    counters = gemv.SplitCounters()
    rows = []
    for t in ts:
        x = torch.randn(t, k, device=dev).to(torch.bfloat16)
        y = mx_linear(x, q0, s0)
        ref = x.float() @ wref.T
        err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
        cfg = pick_config(t, n, k)
        row: dict[str, Any] = {"n": n, "k": k, "t": t, "uses": shape["uses"], "err": err, "config": vars(cfg).copy()}
        out = torch.empty(t, n, dtype=torch.bfloat16, device=dev)
        us = graph_time(lambda x, a, out=out: mx_linear(x, a[0], a[1], out=out), x, mx, args.replays, args.min_calls)
        act_bytes = 2 * t * k
        row["mx_us"] = us
        row["mx_gbs"] = (fp8_bytes + act_bytes) / us / 1e3
        row["mx_pct_copy"] = 100 * row["mx_gbs"] / copy_bw
        row["bf16_cublas_us"] = graph_time(F.linear, x, bf, args.replays, args.min_calls)
        row["bf16_cublas_gbs"] = (2 * n * k + act_bytes) / row["bf16_cublas_us"] / 1e3
        if t <= gemv.MAX_T:
            row["bf16_gemv_us"] = graph_time(lambda x, b: gemv.linear(x, b, counters=counters), x, bf, args.replays,
                                             args.min_calls)
        if t >= 64:  # the other prompt-size path: from DEQUANT_MIN_T rows mx_us is the dequantizing launch + cuBLAS,
            # below it the tiled kernel; each row times the one mx_linear does not take
            alt = None if t >= DEQUANT_MIN_T else "dequant"
            row["mx_path"] = "dequant+cublas" if alt is None else "tiled"
            row["alt_path"] = "tiled" if alt is None else "dequant+cublas"
            tiled_cfg = pick_config(t, n, k)
            row["alt_us"] = graph_time(
                (lambda x, a, out=out, c=tiled_cfg: mx_linear(x, a[0], a[1], out=out, config=c)) if alt is None else
                (lambda x, a, out=out: torch.mm(x, mx_dequantize(a[0], a[1]).t(), out=out)), x, mx, args.replays,
                args.min_calls)
            row["mx_tflops"] = 2 * t * n * k / us / 1e6
            row["bf16_cublas_tflops"] = 2 * t * n * k / row["bf16_cublas_us"] / 1e6
        rows.append(row)
        g = row.get("bf16_gemv_us")
        gemv_s = f"{g:8.1f} us" if g is not None else "      -    "
        flops = (f" (mx {row['mx_path']} {row['mx_tflops']:.0f} / bf16 {row['bf16_cublas_tflops']:.0f} TFLOP/s; "
                 f"{row['alt_path']} {row['alt_us']:.0f} us)" if t >= 64 else "")
        print(f"{n:>6} x {k:<6} T={t:<5} mx {us:8.1f} us {row['mx_gbs']:7.0f} GB/s ({row['mx_pct_copy']:4.0f}% copy)"
              f" | cuBLAS bf16 {row['bf16_cublas_us']:8.1f} us | gemv bf16 {gemv_s}"
              f" | x{row['bf16_cublas_us'] / us:4.2f} vs cuBLAS{flops} | err {err:.1e}", flush=True)
    del mx, bf, wref
    torch.cuda.empty_cache()
    return rows


# ---- tuning -------------------------------------------------------------------------------------------


# (block_n, block_k, num_stages, num_warps) of the tiled kernel's split-K candidates, and the split counts. Shared
# memory (num_stages - 1 buffers of the fp8 tile + the 16-row x tile) sets how many programs an SM holds (sm_90,
# Triton 3.9): 64 x 256 at 4 / 3 / 2 stages 74 / 49 / 25 KB (3 / 4 / 5 programs, 5 by registers), 64 x 128 at
# 4 / 3 stages 36 / 24 KB (6), 128 x 128 at 3 stages 41 KB (5), 128 x 256 at 3 stages and 8 warps 82 KB (2)
DOT_SPLIT = ((64, 256, 4, 4), (64, 256, 3, 4), (64, 256, 2, 4), (64, 128, 4, 4), (64, 128, 3, 4), (128, 128, 3, 4),
             (128, 256, 3, 8))
SPLITS = (2, 3, 4, 6, 8)
# (block_n, block_k, num_warps) of the lean GEMV's candidates at T = 1 (64 fp8 weights per thread and step, or
# 32 with 8 warps), and the few also timed at T = 2 (each row adds ~1.5 instructions per weight: the tiled
# kernel wins above)
LEAN_T1 = ((16, 512, 4), (32, 256, 4), (8, 1024, 4), (32, 512, 8), (16, 1024, 8), (16, 512, 8))
LEAN_T2 = ((16, 512, 4), (32, 256, 4), (16, 512, 8))


def tune_candidates(t: int, n: int, k: int) -> list[Any]:
    """The configs the sweep times for T rows (a T bucket) on an [N, K] weight, beside pick_config's:
    the tiled (tl.dot) kernel unsplit -- one 16-row block (rows past T padded), BN 64 / 128 x BK 128 / 256,
    3 / 4 stages -- and split along K into S in SPLITS programs per output tile (one launch: the last program
    sums the partials), where each split keeps >= 2 K steps; the lean GEMV (T <= 2) unsplit and split 2 / 4."""
    from m3eagle.kernels.quant.w8a16 import MxConfig, t_bucket

    out = [MxConfig(True, 16, bn, bk, num_warps=4, num_stages=st) for bn in (64, 128) for bk in (128, 256)
           for st in (3, 4)]
    out += [MxConfig(True, 16, bn, bk, num_warps=w, num_stages=st, split_k=s, one_launch=True)
            for bn, bk, st, w in DOT_SPLIT for s in SPLITS if k >= 2 * s * bk]
    lean = LEAN_T1 if t == 1 else LEAN_T2 if t == 2 else ()
    out += [MxConfig(False, t_bucket(t), bn, bk, num_warps=w, split_k=s, lean=True, one_launch=s > 1)
            for bn, bk, w in lean for s in (1, 2, 4) if s == 1 or k >= 2 * s * bk]
    return out


def compile_key(cfg: Any, t: int, n: int, k: int) -> tuple:
    """What makes mx_linear compile anew for cfg at [t, k] x [n, k]^T (as mx_linear derives its constexprs)."""
    import triton

    split = max(1, min(cfg.split_k, triton.cdiv(k, cfg.block_k)))
    split = triton.cdiv(k, triton.cdiv(triton.cdiv(k, split), cfg.block_k) * cfg.block_k)
    rows = cfg.block_m if cfg.use_dot else triton.next_power_of_2(t)
    return (cfg.use_dot, cfg.lean, rows, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages, split > 1,
            split > 1 and cfg.one_launch, k % cfg.block_k == 0)


def _compile_worker(launches: list[tuple[int, int, int, dict[str, Any]]]) -> int:
    """Compile (not time) the listed launches in a spawned process: they land in Triton's disk cache."""
    from m3eagle.kernels.quant.w8a16 import MxConfig, mx_linear

    for n, k, t, cfg in launches:
        q = torch.zeros(n, k, dtype=torch.float8_e4m3fn, device="cuda")
        s = torch.full((n, k // 32), 127, dtype=torch.uint8, device="cuda")
        try:
            mx_linear(torch.zeros(t, k, dtype=torch.bfloat16, device="cuda"), q, s, config=MxConfig(**cfg))
        except Exception:  # the timing loop reports it (e.g. a config out of shared memory)
            pass
    torch.cuda.synchronize()
    return len(launches)


def precompile(todo: list[tuple[int, int, int, Any]], jobs: int) -> None:
    """Compile every distinct launch of the sweep on `jobs` processes first (Triton compiles one kernel at a time
    per process); the timing process then loads them from the disk cache."""
    import multiprocessing as mp
    import time
    from dataclasses import asdict

    first: dict[tuple, tuple[int, int, int, dict[str, Any]]] = {}
    for n, k, t, cfg in todo:
        first.setdefault(compile_key(cfg, t, n, k), (n, k, t, asdict(cfg)))
    if jobs <= 1 or not first:
        return
    groups = [list(first.values())[i::jobs] for i in range(jobs)]
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(jobs) as pool:
        done = sum(pool.map(_compile_worker, [g for g in groups if g]))
    print(f"precompiled {done} launches on {jobs} processes in {time.perf_counter() - t0:.0f} s", flush=True)


def eager_us(fn: Any, x: torch.Tensor, ws: list[Any], calls: int = 4) -> float:
    """us per call of a few back-to-back eager calls (launch overhead included): only to skip a config that is
    far slower than the best so far before it costs a graph capture of dozens of calls."""
    fn(x, ws[0])
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for i in range(calls):
        fn(x, ws[i % len(ws)])
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1) * 1e3 / calls


def family(cfg: Any) -> str:
    return ("lean" if cfg.lean else "gemv") if not cfg.use_dot else "split" if cfg.split_k > 1 else "dot"


def tune_gemv(shapes: list[dict[str, Any]], args: argparse.Namespace, copy_bw: float,
              rows: list[dict[str, Any]]) -> dict[tuple[int, int, int], Any]:
    """Per shape and T bucket (--tune-t): pick_config's config (the table's entry) and `tune_candidates`, each
    timed as bench_linear times mx_linear; the fastest wins (every timing is appended to rows). A config whose
    eager probe is > 4x the best time so far (+ 200 us) is skipped untimed (a pathological compile must not eat
    the sweep's minutes); one whose graph-replayed output misses x.float() @ dequantize_mx(q, s).T by more than
    bf16 rounding (err > 2e-2), or that leaves a split-K counter non-zero, is reported and never wins."""
    from m3eagle.kernels.quant.mxfp8 import dequantize_mx, quantize_mx
    from m3eagle.kernels.quant.w8a16 import mx_linear, pick_config, split_counters

    dev = torch.device("cuda")
    precompile([(sh["n"], sh["k"], t, c) for sh in shapes for t in args.tune_t
                for c in [pick_config(t, sh["n"], sh["k"])] + tune_candidates(t, sh["n"], sh["k"])], args.jobs)
    best: dict[tuple[int, int, int], Any] = {}
    for shape in shapes:
        n, k = shape["n"], shape["k"]
        q0, s0 = quantize_mx(torch.randn(n, k, device=dev).mul_(k ** -0.5))
        fp8_bytes = n * k + n * k // 32
        mx = [(q0, s0)] + [(q0.clone(), s0.clone()) for _ in range(copies(fp8_bytes, args.rotate_mb) - 1)]
        wref = dequantize_mx(q0, s0)  # fp32 [N, K]
        for t in args.tune_t:
            x = torch.randn(t, k, device=dev).to(torch.bfloat16)
            ref = x.float() @ wref.T
            out = torch.empty(t, n, dtype=torch.bfloat16, device=dev)
            timed: list[tuple[float, Any]] = []
            base = pick_config(t, n, k)
            for cfg in [base] + tune_candidates(t, n, k):
                def fn(x, a, cfg=cfg, out=out):
                    return mx_linear(x, a[0], a[1], out=out, config=cfg)
                try:
                    fastest = min(us for us, _ in timed) if timed else math.inf
                    if timed and eager_us(fn, x, mx) > max(4 * fastest, fastest + 200):
                        print(f"  {cfg}: skipped (eager probe far above the best)")
                        continue
                    out.fill_(float("nan"))
                    us = graph_time(fn, x, mx, max(5, args.replays // 2), args.min_calls)
                except Exception as e:  # a config the compiler rejects (registers, shared memory): skip it
                    print(f"  {cfg}: {type(e).__name__}")
                    continue
                err = ((out.float() - ref).abs().max() / ref.abs().max()).item()  # the last replayed call's y
                cnt = split_counters(x.device)
                left = cnt is not None and bool(cnt.any())
                if not err <= 2e-2 or left:
                    print(f"  {cfg}: WRONG (err {err:.1e}, split-K counters left non-zero: {left})")
                    if left:
                        cnt.zero_()
                    continue
                timed.append((us, cfg))
                rows.append({"t": t, "n": n, "k": k, "us": us, "family": family(cfg), "config": vars(cfg).copy(),
                             "pct_copy": 100 * (fp8_bytes + 2 * t * k) / us / 1e3 / copy_bw})
            if not timed:
                print(f"tune {n:>6} x {k:<6} T={t}: no config ran correctly; the table keeps its entry", flush=True)
                continue
            us0 = next((u for u, c in timed if c is base), math.nan)
            us, cfg = min(timed, key=lambda p: p[0])
            best[(t, n, k)] = cfg
            gbs = (fp8_bytes + 2 * t * k) / us / 1e3
            fams: dict[str, float] = {}
            for u, c in timed:
                fams[family(c)] = min(u, fams.get(family(c), math.inf))
            print(f"tune {n:>6} x {k:<6} T={t}: table/rule {us0:7.1f} us -> best {us:7.1f} us "
                  f"({100 * gbs / copy_bw:4.0f}% copy, {len(timed)} timed; best of "
                  f"{', '.join(f'{f} {u:.1f}' for f, u in sorted(fams.items()))}) {cfg}", flush=True)
        del mx, wref
        torch.cuda.empty_cache()
    return best


def dry_run(shapes: list[dict[str, Any]], ts: list[int]) -> None:
    """The sweep's size without a GPU: configs timed per shape and T, and the distinct kernels it compiles."""
    from m3eagle.kernels.quant.w8a16 import pick_config

    keys, timings = set(), 0
    for sh in shapes:
        n, k = sh["n"], sh["k"]
        counts = []
        for t in ts:
            cfgs = [pick_config(t, n, k)] + tune_candidates(t, n, k)
            keys |= {compile_key(c, t, n, k) for c in cfgs}
            counts.append(len(cfgs))
            timings += len(cfgs)
        print(f"{n:>6} x {k:<6} configs per T {dict(zip(ts, counts))}")
    print(f"{timings} timings, {len(keys)} distinct compiles")


def tune_moe(args: argparse.Namespace, copy_bw: float) -> list[dict[str, Any]]:
    """mx_moe_experts' blocks, warps and GEMV body (plain / lean) at T = 1 on M3's experts: every combination, timed."""
    from m3eagle.kernels.quant.mxfp8 import quantize_mx
    from m3eagle.kernels.quant.w8a16 import mx_moe_experts

    dev = torch.device("cuda")
    e, k, h, inter = args.experts, args.top_k, args.hidden, args.inter
    q13 = torch.empty(e, 2 * inter, h, dtype=torch.float8_e4m3fn, device=dev)
    s13 = torch.empty(e, 2 * inter, h // 32, dtype=torch.uint8, device=dev)
    q2 = torch.empty(e, h, inter, dtype=torch.float8_e4m3fn, device=dev)
    s2 = torch.empty(e, h, inter // 32, dtype=torch.uint8, device=dev)
    for i in range(e):  # one expert at a time: quantize_mx's fp32 temporaries of the whole stack would not fit
        q13[i], s13[i] = quantize_mx(torch.randn(2 * inter, h, device=dev) * h ** -0.5)
        q2[i], s2[i] = quantize_mx(torch.randn(h, inter, device=dev) * inter ** -0.5)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(1, h, device=dev, generator=g).to(torch.bfloat16)
    args_list = [(torch.rand(1, k, device=dev, generator=g), torch.randperm(e, device=dev, generator=g)[:k][None])
                 for _ in range(16)]  # 16 routings: each call reads other experts
    nbytes = k * 3 * h * inter * (1 + 1 / 32) + 2 * h
    rows = []
    for bn, bk, warps, lean in itertools.product((8, 16, 32), (256, 512), (4, 8), (False, True)):
        try:
            us = graph_time(lambda x, a, bn=bn, bk=bk, w=warps, lean=lean: mx_moe_experts(
                x, a[0], a[1], q13, s13, q2, s2, 1.702, 7.0, block_n=bn, block_k=bk, num_warps=w, lean=lean),
                x, args_list, max(5, args.replays // 2), args.min_calls)
        except Exception as ex:
            print(f"  moe bn={bn} bk={bk} warps={warps} lean={lean}: {type(ex).__name__}")
            continue
        rows.append({"block_n": bn, "block_k": bk, "num_warps": warps, "lean": lean, "us": us,
                     "pct_copy": 100 * nbytes / us / 1e3 / copy_bw})
    rows.sort(key=lambda r: r["us"])
    for r in rows[:5]:
        print(f"tune MoE T=1: {r}", flush=True)
    return rows


# ---- MoE ----------------------------------------------------------------------------------------------


def shared_moe(impl: Any, fused: Any, x: torch.Tensor, wts: torch.Tensor, ids: torch.Tensor, mx13: Any, mx2: Any,
               sh13: Any, sh2: Any, alpha: float, limit: float, reps: int, calls: int) -> dict[str, Any]:
    """A decode MoE layer with its shared expert, as the engine runs it (`experts_and_shared`: one more gate_up pair
    per token and one more down term in the MoE's two launches) and as it ran before (the routed MoE, then the
    shared expert's gate_up + activation and down GEMMs, summed as the next add + norm would): us per call, and
    the two outputs' relative difference (bf16 roundings only)."""
    def fused_fn(x, a):
        return impl.experts_and_shared(x, *a, mx13, mx2, sh13, sh2, alpha, limit, 2.0)

    def apart_fn(x, a):
        shared = fused.linear(fused.linear_swiglu_oai(x, sh13, alpha, limit), sh2)
        return impl.experts(x, *a, mx13, mx2, alpha, limit) * 2.0 + shared

    one, two = fused_fn(x, (wts, ids)), apart_fn(x, (wts, ids))
    return {"mx_shared_fused_us": graph_time(fused_fn, x, [(wts, ids)], reps, calls),
            "mx_shared_apart_us": graph_time(apart_fn, x, [(wts, ids)], reps, calls),
            "shared_fused_vs_apart_err": ((one.float() - two.float()).abs().max() / two.float().abs().max()).item()}


def bench_moe(ts: list[int], args: argparse.Namespace, copy_bw: float) -> list[dict]:
    """The MXFP8 MoE as `TritonMoE.experts` runs it (path by T) against the bf16 Triton MoE through the same backend;
    with --moe-pair-gemv also the per-pair GEMVs at T > 8."""
    from m3eagle.kernels.fused.triton_backend import TritonFused
    from m3eagle.kernels.moe.backend import TritonMoE
    from m3eagle.kernels.quant import w8a16
    from m3eagle.kernels.quant.mxfp8 import MxWeight, dequantize_mx, quantize_mx
    from m3eagle.kernels.quant.w8a16 import mx_moe_experts

    dev = torch.device("cuda")
    e, k, h, inter = args.experts, args.top_k, args.hidden, args.inter
    alpha, limit = 1.702, 7.0
    q13 = torch.empty(e, 2 * inter, h, dtype=torch.float8_e4m3fn, device=dev)
    s13 = torch.empty(e, 2 * inter, h // 32, dtype=torch.uint8, device=dev)
    q2 = torch.empty(e, h, inter, dtype=torch.float8_e4m3fn, device=dev)
    s2 = torch.empty(e, h, inter // 32, dtype=torch.uint8, device=dev)
    for i in range(e):
        q13[i], s13[i] = quantize_mx(torch.randn(2 * inter, h, device=dev) * h ** -0.5)
        q2[i], s2[i] = quantize_mx(torch.randn(h, inter, device=dev) * inter ** -0.5)
    bf = None
    if not args.no_bf16_moe:
        try:
            bf = (torch.stack([dequantize_mx(q13[i], s13[i], torch.bfloat16) for i in range(e)]),
                  torch.stack([dequantize_mx(q2[i], s2[i], torch.bfloat16) for i in range(e)]))
        except torch.OutOfMemoryError:
            print("bf16 MoE weights do not fit: no bf16 comparison")
    impl = TritonMoE()
    fused = TritonFused()
    mx13, mx2 = MxWeight(q13, s13), MxWeight(q2, s2)
    sh13 = MxWeight(*quantize_mx(torch.randn(2 * inter, h, device=dev) * h ** -0.5))  # a shared expert of width I
    sh2 = MxWeight(*quantize_mx(torch.randn(h, inter, device=dev) * inter ** -0.5))
    rows = []
    for t in ts:
        g = torch.Generator(device=dev).manual_seed(t)
        x = torch.randn(t, h, device=dev, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(e, device=dev, generator=g)[:k] for _ in range(t)])
        wts = torch.rand(t, k, device=dev, generator=g)
        out = impl.experts(x, wts, ids, mx13, mx2, alpha, limit)
        path = "pair_gemv" if t <= w8a16.GEMV_MAX_T else "sorted"
        row: dict[str, Any] = {"t": t, "E": e, "k": k, "H": h, "I": inter, "mx_path": path}
        used = torch.unique(ids).numel()
        nbytes = used * (3 * h * inter) * (1 + 1 / 32) + 2 * t * h
        if bf is not None:
            ref = impl.experts(x, wts, ids, bf[0], bf[1], alpha, limit)
            row["err_vs_bf16_moe"] = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        calls = args.min_calls if t <= 8 else 2
        reps = args.replays if t <= 8 else 3
        us = graph_time(lambda x, a: impl.experts(x, *a, mx13, mx2, alpha, limit), x, [(wts, ids)], reps, calls)
        row.update(mx_us=us, experts_read=used, mx_gbs=nbytes / us / 1e3)
        row["mx_pct_copy"] = 100 * row["mx_gbs"] / copy_bw
        if args.moe_pair_gemv and path != "pair_gemv":
            row["mx_pair_gemv_us"] = graph_time(lambda x, a: mx_moe_experts(x, *a, q13, s13, q2, s2, alpha, limit), x,
                                                [(wts, ids)], reps, calls)
        if bf is not None:
            row["bf16_moe_us"] = graph_time(lambda x, a: impl.experts(x, *a, bf[0], bf[1], alpha, limit),
                                            x, [(wts, ids)], reps, calls)
        if t <= w8a16.GEMV_MAX_T:  # the layer's shared expert inside the MoE's two launches vs its own two GEMMs
            row.update(shared_moe(impl, fused, x, wts, ids, mx13, mx2, sh13, sh2, alpha, limit, reps, calls))
        rows.append(row)
        print(f"MoE E={e} k={k} H={h} I={inter} T={t:<5} mx ({path}) {us:10.1f} us {row['mx_gbs']:7.0f} GB/s "
              f"({row['mx_pct_copy']:4.0f}% copy; {used} experts read) | bf16 triton MoE "
              f"{row.get('bf16_moe_us', math.nan):10.1f} us | err vs bf16 MoE {row.get('err_vs_bf16_moe', math.nan):.1e}"
              + (f" | with its shared expert: inside {row['mx_shared_fused_us']:.1f} us, apart "
                 f"{row['mx_shared_apart_us']:.1f} us" if "mx_shared_fused_us" in row else ""), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="m3,m3-8b,m3-mini", help="comma list of m3, m3-8b, m3-mini")
    p.add_argument("--t", default="1,2,4,8,2048", help="rows per call")
    p.add_argument("--moe-t", default="1,2048", help="tokens per MoE call")
    p.add_argument("--no-moe", action="store_true")
    p.add_argument("--no-bf16-moe", action="store_true", help="skip the bf16 MoE comparison (14.5 GB of weights)")
    p.add_argument("--moe-pair-gemv", action="store_true",
                   help="also time the per-pair GEMV MoE (mx_moe_experts) at T > 8, where TritonMoE runs the sorted path")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--hidden", type=int, default=6144)
    p.add_argument("--inter", type=int, default=3072)
    p.add_argument("--rotate-mb", type=float, default=256, help="weight copies cycled through per graph, in MB")
    p.add_argument("--min-calls", type=int, default=32, help="calls per captured graph, at least")
    p.add_argument("--replays", type=int, default=20, help="timed graph replays (median)")
    p.add_argument("--json", type=Path, default=None, help="write every number to this file")
    p.add_argument("--tune", action="store_true",
                   help="first sweep mx_linear's configs at T <= 8 (tune_candidates) and the MoE's blocks")
    p.add_argument("--write", action="store_true", help="with --tune: write the winners to the package's table")
    p.add_argument("--tune-t", default="1,2,4,8", help="with --tune: the T buckets to tune")
    p.add_argument("--no-tune-moe", action="store_true", help="with --tune: keep the table's MoE blocks")
    p.add_argument("--tune-only", action="store_true", help="with --tune: stop after the sweep (no benchmark pass)")
    p.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1),
                   help="with --tune: processes that compile the sweep's kernels first (1: compile while timing)")
    p.add_argument("--dry-run", action="store_true",
                   help="with --tune: list the sweep's size (timings, distinct compiles) and stop; needs no GPU")
    args = p.parse_args()
    args.tune_t = [int(v) for v in args.tune_t.split(",")]
    if args.tune and args.dry_run:
        dry_run(all_shapes(args.models.split(",")), args.tune_t)
        return
    if not torch.cuda.is_available():
        print("benchmarks/w8a16.py needs a CUDA GPU (the MXFP8 kernels' correctness runs on CPU in "
              "tests/kernels/test_w8a16.py)")
        sys.exit(1)
    dev = torch.device("cuda")
    copy_bw = measure_copy_bandwidth(dev, 1 << 30)["bytes_per_s"] / 1e9
    name = torch.cuda.get_device_name(dev)
    print(f"{name}: device-to-device copy {copy_bw:.0f} GB/s (read + write)")
    ts = [int(v) for v in args.t.split(",")]
    doc: dict[str, Any] = {"device": name, "copy_gbs": copy_bw, "linear": [], "moe": []}
    if args.tune:
        from m3eagle.kernels.quant.w8a16 import write_tuned

        doc["tune_linear"] = []
        best = tune_gemv(all_shapes(args.models.split(",")), args, copy_bw, doc["tune_linear"])
        doc["tuned_gemv"] = [{"t": t, "n": n, "k": k, "config": vars(c).copy()} for (t, n, k), c in best.items()]
        doc["tune_moe"] = [] if args.no_tune_moe else tune_moe(args, copy_bw)
        if args.write:
            top = doc["tune_moe"][0] if doc["tune_moe"] else None
            moe = {k: top[k] for k in ("block_n", "block_k", "num_warps", "lean")} if top else None
            write_tuned(best, f"benchmarks/w8a16.py --tune --write on {name}", moe, name)
            print(f"wrote {name}'s section of m3eagle/kernels/quant/w8a16_configs.json")
        if args.tune_only:
            if args.json:
                args.json.write_text(json.dumps(doc, indent=1) + "\n")
            return
    for shape in all_shapes(args.models.split(",")):
        doc["linear"] += bench_linear(shape, ts, args, copy_bw)
    if not args.no_moe:
        doc["moe"] = bench_moe([int(v) for v in args.moe_t.split(",")], args, copy_bw)
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
