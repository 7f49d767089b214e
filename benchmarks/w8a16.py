"""W8A16 MXFP8 kernels (m3eagle/kernels/quant/w8a16.py) vs bf16 on a CUDA GPU: `mx_linear` against bf16
F.linear (cuBLAS) and the bf16 decode GEMV (m3eagle/kernels/fused/gemv.py), and the MXFP8 routed MoE as the
Triton backend runs it (`TritonMoE.experts`: `mx_moe_experts`' per-pair GEMVs at T <= 8, the sorted grouped GEMMs
`triton_moe.mx_fused_experts` above) against the bf16 Triton MoE (m3eagle/kernels/moe/triton_moe.py).

    python benchmarks/w8a16.py                         # M3 + m3-8b + m3-mini shapes, T in 1, 2, 4, 8, 2048, + MoE
    python benchmarks/w8a16.py --json w8a16.json       # also write every number to one JSON document
    python benchmarks/w8a16.py --models m3 --t 1,2048 --no-moe
    python benchmarks/w8a16.py --tune --write          # sweep GEMV / tiled configs at T <= 8 (and the MoE's); write
                                                       # the winners to m3eagle/kernels/quant/w8a16_configs.json

Shapes (one row per distinct N x K, the projections that have it listed): MiniMax-M3 (hidden 6144): packed q/k/v
[64*128 + 2*4*128, 6144] = [9216, 6144], o_proj [6144, 8192], dense MLP gate_up [24576, 6144] / down [6144, 12288],
shared expert gate_up [6144, 6144] / down [6144, 3072] (lm_head stays bf16: not here); m3-8b and m3-mini from
m3eagle/bench/geometries.py (q/k/v of full and sparse layers -- the latter with the indexer's rows -- o_proj,
dense MLP, shared expert). MoE: M3's experts, E = 128, k = 4, H = 6144, I = 3072, at T = 1 and 2048.

Timing: each implementation is captured in a CUDA graph of back-to-back calls cycling through weight copies that
span --rotate-mb (so each call reads its weight from HBM, as decode does); median over --replays replays, per
call. GB/s counts the bytes read: weights (fp8 + ue8m0 scales, or bf16) and activations; "%copy" is that over a
measured 1 GiB device-to-device copy's bandwidth (bytes read + written). err: max |y - ref| / max |ref| against
x.float() @ dequantize_mx(q, s).T (bf16 rounding of y alone gives ~4e-3). On a CPU the script exits with a message.
"""

from __future__ import annotations

import argparse
import json
import math
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
    from m3eagle.kernels.quant.w8a16 import mx_linear, pick_config

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
        if t >= 64:  # the alternative at prompt sizes: dequantize into a bf16 scratch weight, then cuBLAS
            row["dequant_cublas_us"] = graph_time(
                lambda x, a: F.linear(x, dequantize_mx(a[0], a[1], torch.bfloat16)), x, mx, args.replays, 2)
            row["mx_tflops"] = 2 * t * n * k / us / 1e6
            row["bf16_cublas_tflops"] = 2 * t * n * k / row["bf16_cublas_us"] / 1e6
        rows.append(row)
        g = row.get("bf16_gemv_us")
        gemv_s = f"{g:8.1f} us" if g is not None else "      -    "
        flops = (f" (mx {row['mx_tflops']:.0f} / bf16 {row['bf16_cublas_tflops']:.0f} TFLOP/s; dequant+cuBLAS "
                 f"{row['dequant_cublas_us']:.0f} us)" if t >= 64 else "")
        print(f"{n:>6} x {k:<6} T={t:<5} mx {us:8.1f} us {row['mx_gbs']:7.0f} GB/s ({row['mx_pct_copy']:4.0f}% copy)"
              f" | cuBLAS bf16 {row['bf16_cublas_us']:8.1f} us | gemv bf16 {gemv_s}"
              f" | x{row['bf16_cublas_us'] / us:4.2f} vs cuBLAS{flops} | err {err:.1e}", flush=True)
    del mx, bf, wref
    torch.cuda.empty_cache()
    return rows


# ---- tuning -------------------------------------------------------------------------------------------


def gemv_candidates(n: int, k: int) -> list[Any]:
    """The GEMV configs the sweep times at T = 1: BLOCK_N 8 / 16, stages 1 / 3, and split-K by the rule
    (pick_config's: enough programs for the SMs) and at twice the rule."""
    import triton

    from m3eagle.kernels.quant.w8a16 import MAX_SPLIT, SMS, MxConfig

    out = []
    bk = min(512, triton.next_power_of_2(k))
    for bn in (8, 16):
        for stages in (1, 3):
            tiles = triton.cdiv(n, bn)
            rule = max(1, min(MAX_SPLIT, triton.cdiv(4 * SMS, tiles), k // (2 * bk))) if tiles < 2 * SMS else 1
            for split in sorted({rule, min(MAX_SPLIT, 2 * rule, max(1, k // bk))}):
                out.append(MxConfig(False, 1, bn, bk, num_warps=4, num_stages=stages, split_k=split))
    return out


def gemm_candidates() -> list[Any]:
    """The tiled (tl.dot) configs the sweep times at T = 1..8 against the GEMV: one 16-row block (rows past T
    padded), whole tiles of the weight read once for every row."""
    from m3eagle.kernels.quant.w8a16 import MxConfig

    return [MxConfig(True, 16, bn, bk, num_warps=4, num_stages=st) for bn in (64, 128) for bk in (128, 256)
            for st in (3, 4)]


def tune_gemv(shapes: list[dict[str, Any]], args: argparse.Namespace, copy_bw: float) -> dict[tuple[int, int, int], Any]:
    from m3eagle.kernels.quant.mxfp8 import quantize_mx
    from m3eagle.kernels.quant.w8a16 import mx_linear, pick_config

    dev = torch.device("cuda")
    best: dict[tuple[int, int, int], Any] = {}
    for shape, t in [(sh, t) for sh in shapes for t in (1, 2, 4, 8)]:
        n, k = shape["n"], shape["k"]
        q0, s0 = quantize_mx(torch.randn(n, k, device=dev).mul_(k ** -0.5))
        fp8_bytes = n * k + n * k // 32
        mx = [(q0, s0)] + [(q0.clone(), s0.clone()) for _ in range(copies(fp8_bytes, args.rotate_mb) - 1)]
        x = torch.randn(t, k, device=dev).to(torch.bfloat16)
        out = torch.empty(t, n, dtype=torch.bfloat16, device=dev)
        base = pick_config(t, n, k)
        timed = []
        for cfg in [base] + (gemv_candidates(n, k) if t == 1 else []) + gemm_candidates():
            try:
                us = graph_time(lambda x, a, cfg=cfg, out=out: mx_linear(x, a[0], a[1], out=out, config=cfg), x, mx,
                                max(5, args.replays // 2), args.min_calls)
            except Exception as e:  # a config the compiler rejects (registers, shared memory): skip it
                print(f"  {cfg}: {type(e).__name__}")
                continue
            timed.append((us, cfg))
        us0 = timed[0][0]
        us, cfg = min(timed, key=lambda p: p[0])
        best[(t, n, k)] = cfg
        gbs = (fp8_bytes + 2 * t * k) / us / 1e3
        print(f"tune {n:>6} x {k:<6} T={t}: rule {us0:7.1f} us -> best {us:7.1f} us ({100 * gbs / copy_bw:4.0f}% copy) "
              f"{cfg}", flush=True)
        del mx
        torch.cuda.empty_cache()
    return best


def tune_moe(args: argparse.Namespace, copy_bw: float) -> list[dict[str, Any]]:
    """mx_moe_experts' blocks and warps at T = 1 on M3's experts: every combination, timed."""
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
    for bn in (8, 16, 32):
        for bk in (256, 512):
            for warps in (4, 8):
                try:
                    us = graph_time(lambda x, a, bn=bn, bk=bk, w=warps: mx_moe_experts(
                        x, a[0], a[1], q13, s13, q2, s2, 1.702, 7.0, block_n=bn, block_k=bk, num_warps=w),
                        x, args_list, max(5, args.replays // 2), args.min_calls)
                except Exception as ex:
                    print(f"  moe bn={bn} bk={bk} warps={warps}: {type(ex).__name__}")
                    continue
                rows.append({"block_n": bn, "block_k": bk, "num_warps": warps, "us": us,
                             "pct_copy": 100 * nbytes / us / 1e3 / copy_bw})
    rows.sort(key=lambda r: r["us"])
    for r in rows[:5]:
        print(f"tune MoE T=1: {r}", flush=True)
    return rows


# ---- MoE ----------------------------------------------------------------------------------------------


def bench_moe(ts: list[int], args: argparse.Namespace, copy_bw: float) -> list[dict]:
    """The MXFP8 MoE as `TritonMoE.experts` runs it (path by T) against the bf16 Triton MoE through the same backend;
    with --moe-pair-gemv also the per-pair GEMVs at T > 8."""
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
    mx13, mx2 = MxWeight(q13, s13), MxWeight(q2, s2)
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
        rows.append(row)
        print(f"MoE E={e} k={k} H={h} I={inter} T={t:<5} mx ({path}) {us:10.1f} us {row['mx_gbs']:7.0f} GB/s "
              f"({row['mx_pct_copy']:4.0f}% copy; {used} experts read) | bf16 triton MoE "
              f"{row.get('bf16_moe_us', math.nan):10.1f} us | err vs bf16 MoE {row.get('err_vs_bf16_moe', math.nan):.1e}",
              flush=True)
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
    p.add_argument("--tune", action="store_true", help="first sweep the GEMV configs at T = 1 and the MoE's blocks")
    p.add_argument("--write", action="store_true", help="with --tune: write the GEMV winners to the package's table")
    args = p.parse_args()
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

        best = tune_gemv(all_shapes(args.models.split(",")), args, copy_bw)
        doc["tuned_gemv"] = [{"t": t, "n": n, "k": k, "config": vars(c).copy()} for (t, n, k), c in best.items()]
        doc["tune_moe"] = tune_moe(args, copy_bw)
        if args.write:
            top = doc["tune_moe"][0] if doc["tune_moe"] else None
            moe = {k: top[k] for k in ("block_n", "block_k", "num_warps")} if top else None
            write_tuned(best, f"benchmarks/w8a16.py --tune --write on {name}", moe)
            print("wrote m3eagle/kernels/quant/w8a16_configs.json")
    for shape in all_shapes(args.models.split(",")):
        doc["linear"] += bench_linear(shape, ts, args, copy_bw)
    if not args.no_moe:
        doc["moe"] = bench_moe([int(v) for v in args.moe_t.split(",")], args, copy_bw)
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
