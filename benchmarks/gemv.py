"""Skinny GEMMs of decode (y [T, N] = x [T, K] @ w[N, K]^T, T = 1..32): cuBLAS (F.linear) vs the Triton kernel of
m3eagle/kernels/fused/gemv.py, on a CUDA GPU.

    python benchmarks/gemv.py                              # every shape x T in (1, 2, 4, 8, 16, 32)
    python benchmarks/gemv.py --json gemv.json             # also write every number to a file
    python benchmarks/gemv.py --tune --json gemv_tune.json # sweep block sizes / warps / stages / split-K per
                                                           # shape and T (compiles on --jobs processes)
    python benchmarks/gemv.py --geometry m3-mini --t 1,8 --shapes 2048x2048,8192x2048
    python benchmarks/gemv.py --device cpu --shapes 256x256 --t 1,3   # smoke test (TRITON_INTERPRET=1;
                                                                       # eager wall-clock, meaningless times)

Shapes are derived from the model configs, as the models build their weights (one row per distinct N x K):
the packed q/k/v projection of full-attention layers ([(Hq + 2 Hkv) * D, H]) and of sparse layers (plus the
indexer's q and k: + Hi * Di + Di rows; `pack_projections` packs them into one weight), o_proj, the dense
MLP (gate_up [2 I, H], down [H, I]), the shared expert's MLP (same form; it runs as a plain linear unless the
MoE backend fuses it), lm_head, and the geometry's Eagle3 head (fc [H, 3 H], qkv [.., 2 H], o_proj, MLP,
lm_head [draft vocab, H]; --no-head leaves those out). Geometries: m3eagle/bench/geometries.py (m3-mini,
m3-8b) and m3eagle/assets/default (embedded).

Timing: each implementation is captured in a CUDA graph of many back-to-back calls and the graph is replayed
(median of --replays replays, per call). The calls cycle through copies of the weight that together span
--rotate-mb (default 256 MB, ~4x the H200's L2) so every call reads its weight from HBM, as decode does
(a model's weights are far larger than L2); --rotate-mb 0 times one L2-resident weight. At most --max-copies
(512) copies: the embedded model's smallest weights (64-128 KB) then span 32-64 MB and stay partly in L2, as
that whole 9M-parameter model (~18 MB) does in a real decode. GB/s counts the
weight's bytes only (x and y are < 1%). Each result is checked against an fp32 reference: err is
max |y - ref| / max |ref|; bf16 rounding of y alone gives ~4e-3.

Also measured: the HBM copy bandwidth (1 GiB device-to-device copy, bytes read + written), the ceiling.

A readable table goes to stdout; --json PATH writes all results (and with --tune every config's time).
"""

from __future__ import annotations

import sys

from _interpreter import use_interpreter_for_cpu  # noqa: E402  (the script's own folder)

use_interpreter_for_cpu(sys.argv)  # before anything imports triton

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import asdict  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
GEOMETRIES = ("embedded", "m3-mini", "m3-8b")


# ---- shapes -------------------------------------------------------------------------------------------


def geometry_shapes(name: str, head: bool = True) -> list[tuple[str, int, int]]:
    """(what, N, K) of every dense projection a decode step of geometry `name` runs."""
    from m3eagle.bench import geometries as geo
    from m3eagle.config import M3Config
    from m3eagle.models.eagle3 import Eagle3Config

    if name == "embedded":
        c = M3Config.from_dict(json.loads((geo.ASSETS / "target" / "config.json").read_text()))
        d_path = geo.ASSETS / "draft" / "config.json"
        draft = Eagle3Config.from_dict(json.loads(d_path.read_text())) if d_path.is_file() else None
    else:
        c, draft = geo.NAMED[name]()
    h, d = c.hidden_size, c.head_dim
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * d
    out = []
    if geo.FULL in c.layer_types:
        out.append(("qkv", qkv, h))
    if geo.SPARSE in c.layer_types:
        out.append(("qkv+index", qkv + c.index_n_heads * c.index_head_dim + c.index_head_dim, h))
    out.append(("o_proj", h, c.num_attention_heads * d))
    if geo.DENSE in c.mlp_layer_types:
        out += [("dense gate_up", 2 * c.dense_intermediate_size, h), ("dense down", h, c.dense_intermediate_size)]
    if geo.MOE in c.mlp_layer_types:
        s = c.shared_intermediate_size
        out += [("shared gate_up", 2 * s, h), ("shared down", h, s)]
    out.append(("lm_head", c.vocab_size, h))
    if head and draft is not None:
        hh, hd = draft.hidden_size, draft.head_dim
        out += [("head fc", hh, draft.aux_hidden_size),
                ("head qkv", (draft.num_attention_heads + 2 * draft.num_key_value_heads) * hd, 2 * hh),
                ("head o_proj", hh, draft.num_attention_heads * hd),
                ("head gate_up", 2 * draft.intermediate_size, hh), ("head down", hh, draft.intermediate_size),
                ("head lm_head", draft.draft_vocab_size, hh)]
    return out


def all_shapes(names: list[str], head: bool) -> list[dict[str, Any]]:
    """Distinct (N, K) in first-seen order, each with the projections that have it."""
    seen: dict[tuple[int, int], dict[str, Any]] = {}
    for g in names:
        for what, n, k in geometry_shapes(g, head):
            seen.setdefault((n, k), {"n": n, "k": k, "uses": []})["uses"].append(f"{g} {what}")
    return list(seen.values())


# ---- timing -------------------------------------------------------------------------------------------


def copy_bandwidth(dev: torch.device) -> float:
    """GB/s of a 1 GiB device-to-device copy, bytes read + written (median of 10)."""
    if dev.type != "cuda":
        return float("nan")
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=dev).random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        dst.copy_(src)
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1e-3)
    del src, dst
    return 2 * n / statistics.median(times) / 1e9


def weight_copies(n: int, k: int, dtype: torch.dtype, dev: torch.device, rotate_mb: float, max_copies: int,
                  ) -> list[torch.Tensor]:
    """Weights [N, K] with values ~ 1/sqrt(K) (so y ~ x): enough copies to span rotate_mb (>= 2 when rotating)."""
    nbytes = n * k * torch.finfo(dtype).bits // 8
    copies = 1 if rotate_mb <= 0 else max(2, min(max_copies, math.ceil(rotate_mb * 2**20 / nbytes)))
    w0 = torch.randn(n, k, device=dev, dtype=torch.float32).mul_(k ** -0.5).to(dtype)
    return [w0] + [w0.clone() for _ in range(copies - 1)]


def graph_time(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, ws: list[torch.Tensor],
               replays: int, min_calls: int) -> float:
    """us per call: fn(x, ws[i % len(ws)]) captured back to back in one CUDA graph, median over replays."""
    for w in ws[:2]:  # compile, cuBLAS handles, split-K counters: before capture
        fn(x, w)
    if x.device.type != "cuda":  # --device cpu smoke test: eager wall clock
        t0 = time.perf_counter()
        for w in ws:
            fn(x, w)
        return (time.perf_counter() - t0) * 1e6 / len(ws)
    torch.cuda.synchronize()
    calls = len(ws) * max(1, math.ceil(min_calls / len(ws)))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(x, ws[i % len(ws)])
    for _ in range(2):
        g.replay()
    times = []
    for _ in range(replays):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3 / calls)
    del g
    return statistics.median(times)


_COUNTERS: list[Any] = []


def split_counters() -> Any:
    """The script's one gemv.SplitCounters (split-K configs split only with counters)."""
    if not _COUNTERS:
        from m3eagle.kernels.fused import gemv

        _COUNTERS.append(gemv.SplitCounters())
    return _COUNTERS[0]


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


# ---- tuning -------------------------------------------------------------------------------------------


def candidates(t: int, n: int, k: int) -> list[Any]:
    """The tuning grid for one shape and T (split-K is swept afterwards on the best few, see tune_one)."""
    from m3eagle.kernels.fused.gemv import GemvConfig

    out = []
    kp = triton_next_pow2(k)
    if t <= 4:  # elementwise GEMV: T accumulators [BN, BK] fp32 in registers
        bt = triton_next_pow2(t)
        for bn in (1, 2, 4, 8, 16):
            for bk in (256, 512, 1024, 2048):
                for warps in (4, 8):
                    per_thread = bn * bk // (32 * warps)  # weight elements per thread per K step
                    if bk > max(256, kp) or per_thread < 8 or bt * per_thread > 64:
                        continue
                    for stages in ((1, 2) if k > bk else (1,)):  # 2: prefetch the next K tile
                        out.append(GemvConfig(bn, bk, warps, stages))
    bt = max(16, triton_next_pow2(t))
    for bn in (16, 32, 64, 128):  # tl.dot, T padded to 16 / 32
        for bk in (64, 128, 256):
            if bk > max(64, kp):
                continue
            for warps in ((4, 8) if bn >= 128 else (4,)):
                for stages in (3, 4):
                    if (bn + bt) * bk * 2 * stages <= 200 * 1024:  # shared memory per program
                        out.append(GemvConfig(bn, bk, warps, stages, use_dot=True))
    return out


def triton_next_pow2(v: int) -> int:
    return 1 << (max(v, 1) - 1).bit_length()


def split_variants(cfg: Any, n: int, k: int) -> list[Any]:
    """cfg with SPLIT_K 2, 4, 8 where the split leaves each program at least two K steps."""
    from dataclasses import replace

    tiles = -(-n // cfg.block_n)
    return [replace(cfg, split_k=s) for s in (2, 4, 8) if k >= 2 * s * cfg.block_k and tiles * s <= 8 * 132]


def _compile_worker(job: tuple[str, list[tuple[int, int, int, dict[str, Any]]]]) -> int:
    """Compile (not time) the listed launches in a spawned process; they land in Triton's disk cache."""
    from m3eagle.kernels.fused import gemv

    dtype_name, launches = job
    dtype = DTYPES[dtype_name]
    ws: dict[tuple[int, int], torch.Tensor] = {}
    for n, k, t, cfg in launches:
        if (n, k) not in ws:
            ws[(n, k)] = torch.zeros(n, k, dtype=dtype, device="cuda")
        try:
            gemv.linear(torch.zeros(t, k, dtype=dtype, device="cuda"), ws[(n, k)], gemv.GemvConfig(**cfg), split_counters())
        except Exception:  # the timing loop reports it (e.g. a config out of shared memory)
            pass
    torch.cuda.synchronize()
    return len(launches)


def precompile(launches: list[tuple[int, int, int, Any]], dtype_name: str, jobs: int) -> None:
    """Compile every config of the sweep on `jobs` processes first: Triton compiles one kernel at a time per
    process, and a sweep has hundreds; the timing process then loads them from the disk cache."""
    if jobs <= 1 or not launches:
        return
    import multiprocessing as mp

    by_cfg: dict[Any, list[tuple[int, int, int, dict[str, Any]]]] = {}
    for n, k, t, cfg in launches:
        by_cfg.setdefault(cfg, []).append((n, k, t, asdict(cfg)))
    groups: list[list[tuple[int, int, int, dict[str, Any]]]] = [[] for _ in range(jobs)]
    for i, items in enumerate(by_cfg.values()):  # one config's variants in one process: no duplicate compiles
        groups[i % jobs] += items
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(jobs) as pool:
        done = sum(pool.map(_compile_worker, [(dtype_name, g) for g in groups if g]))
    print(f"precompiled {len(by_cfg)} configs ({done} launches) on {jobs} processes in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)


def tune_one(x: torch.Tensor, ws: list[torch.Tensor], ref: torch.Tensor, args: argparse.Namespace,
             ) -> list[dict[str, Any]]:
    """Time every candidate, then split-K variants of the 4 best; rows sorted by time."""
    from m3eagle.kernels.fused import gemv

    t, k = x.shape
    n = ws[0].shape[0]
    rows = []

    def run(cfg: Any) -> None:
        try:
            err = rel_err(gemv.linear(x, ws[0], cfg, split_counters()), ref)
            us = graph_time(lambda a, b: gemv.linear(a, b, cfg, split_counters()), x, ws, args.tune_replays, args.min_calls)
        except Exception as e:  # e.g. triton's OutOfResources (shared memory) for a config: skip it
            print(f"{'':>17} skipped {cfg_str(asdict(cfg))}: {type(e).__name__}: {str(e)[:100]}", flush=True)
            return
        if not err <= 2e-2:  # a wrong result never wins
            print(f"{'':>17} WRONG {cfg_str(asdict(cfg))}: err {err:.1e}", flush=True)
            us = float("inf")
        rows.append({**asdict(cfg), "us": us, "err": err})

    for cfg in candidates(t, n, k):
        run(cfg)
    rows.sort(key=lambda r: r["us"])
    for r in rows[:4]:
        for cfg in split_variants(gemv.GemvConfig(**{f: r[f] for f in GEMV_FIELDS}), n, k):
            run(cfg)
    rows.sort(key=lambda r: r["us"])
    return rows


GEMV_FIELDS = ("block_n", "block_k", "num_warps", "num_stages", "split_k", "use_dot")


def cfg_str(c: dict[str, Any]) -> str:
    kind = "dot " if c["use_dot"] else "gemv"
    return f"{kind} n{c['block_n']} k{c['block_k']} w{c['num_warps']} s{c['num_stages']} split{c['split_k']}"


def summarise_tune(tuned: list[dict[str, Any]]) -> None:
    """Per T: the single config with the best geometric-mean slowdown against each shape's best."""
    print("\nbest single config per T (geomean time / per-shape best over the shapes tuned):")
    for t in sorted({r["t"] for r in tuned}):
        rs = [r for r in tuned if r["t"] == t]
        scores: dict[str, list[float]] = {}
        for r in rs:
            best = r["configs"][0]["us"]
            for c in r["configs"]:
                scores.setdefault(cfg_str(c), []).append(c["us"] / best)
        full = {s: math.exp(sum(map(math.log, v)) / len(v)) for s, v in scores.items() if len(v) == len(rs)}
        top = sorted(full.items(), key=lambda kv: kv[1])[:3]
        print(f"  T={t:<3d} " + "   ".join(f"{s} x{v:.3f}" for s, v in top))


def emit_table(tuned: list[dict[str, Any]], write: bool = False) -> None:
    """The best config per (N, K, T) as entries of m3eagle/kernels/fused/gemv_configs.json (keyed by next_pow2(T)):
    printed, and with `write` merged into the table the engine loads."""
    entries = []
    for r in tuned:
        c = r["configs"][0]
        entries.append({"n": r["n"], "k": r["k"], "t": triton_next_pow2(r["t"]), "model": r.get("geometry"),
                        "config": {f: c[f] for f in GEMV_FIELDS}, "us": round(c["us"], 2),
                        "vs_cublas": round(r["cublas_us"] / c["us"], 2),
                        "vs_pick_config": round(r["default_us"] / c["us"], 2)})
    print("\n# best of the sweep, as gemv_configs.json entries (us; x vs cuBLAS; x vs pick_config's rules):")
    for e in entries:
        print(f"  {json.dumps(e)}")
    if write:
        from m3eagle.kernels.fused import gemv

        gemv.write_configs(entries)
        print(f"wrote {len(entries)} entries into {gemv.CONFIGS_PATH}")


# ---- main ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test under the Triton interpreter")
    p.add_argument("--geometry", default=",".join(GEOMETRIES), help="comma list of " + ", ".join(GEOMETRIES))
    p.add_argument("--no-head", action="store_true", help="leave out the Eagle3 head's projections")
    p.add_argument("--shapes", default="", help="only these NxK (comma list), e.g. 2048x2048,32000x2048")
    p.add_argument("--t", default="1,2,4,8,16,32", help="rows per call (comma list, 1..32)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--rotate-mb", type=float, default=256.0,
                   help="weight copies cycled through per graph, in MB (0: one L2-resident weight)")
    p.add_argument("--max-copies", type=int, default=512)
    p.add_argument("--min-calls", type=int, default=32, help="calls per captured graph, at least")
    p.add_argument("--replays", type=int, default=20, help="timed graph replays (median)")
    p.add_argument("--tune", action="store_true", help="sweep the kernel's configs per shape and T")
    p.add_argument("--tune-replays", type=int, default=7)
    p.add_argument("--write", action="store_true", help="with --tune: merge the winners into gemv_configs.json")
    p.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1),
                   help="processes compiling the sweep's kernels up front (1: compile while timing)")
    p.add_argument("--time-limit", type=float, default=0.0,
                   help="seconds: stop tuning (not the plain timings) past this wall time; 0 = no limit")
    p.add_argument("--json", type=Path, default=None, help="write every result to this file (after each shape)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    if args.device == "cpu":
        args.rotate_mb, args.jobs = 0.0, 1
    elif not torch.cuda.is_available():
        print("benchmarks/gemv.py times CUDA kernels and needs a CUDA GPU; none is visible (the CPU tests are "
              "tests/kernels/test_gemv.py)", file=sys.stderr)
        return 2
    from m3eagle.kernels.fused import gemv

    dev = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    ts = [int(v) for v in args.t.split(",") if v]
    if not all(1 <= t <= gemv.MAX_T for t in ts):
        print(f"--t values must be in 1..{gemv.MAX_T}", file=sys.stderr)
        return 2
    shapes = all_shapes([g for g in args.geometry.split(",") if g], not args.no_head)
    if args.shapes:
        keep = {tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",") if s}
        shapes = [s for s in shapes if (s["n"], s["k"]) in keep]
    copy_gbps = copy_bandwidth(dev)
    import triton

    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        name = props.name
        print(f"{name}: {props.multi_processor_count} SMs, L2 {props.L2_cache_size / 2**20:.0f} MB; torch "
              f"{torch.__version__}, triton {triton.__version__}; HBM copy bandwidth {copy_gbps:.0f} GB/s "
              f"(1 GiB device-to-device, read + write)", flush=True)
    else:
        name = "cpu (Triton interpreter)"
        print("CPU smoke test under the Triton interpreter: the times mean nothing", flush=True)
    doc: dict[str, Any] = {"device": name, "torch": torch.__version__, "triton": triton.__version__,
                           "dtype": args.dtype, "copy_gbps": copy_gbps, "rotate_mb": args.rotate_mb,
                           "results": [], "tune": []}
    if args.tune:
        # each candidate as timed, and once with split-K (one compile serves every split count)
        launches = [(s["n"], s["k"], t, v) for s in shapes for t in ts for c in candidates(t, s["n"], s["k"])
                    for v in (c, *split_variants(c, s["n"], s["k"])[:1])]
        precompile(launches, args.dtype, args.jobs)

    print(f"\n{'N':>6} {'K':>6} {'T':>3} | {'cuBLAS us':>9} {'GB/s':>6} | {'triton us':>9} {'GB/s':>6} "
          f"{'speedup':>7} | {'err cuBLAS':>10} {'err triton':>10} | config; uses", flush=True)
    g = torch.Generator(device=dev).manual_seed(0)
    for s in shapes:
        n, k = s["n"], s["k"]
        ws = weight_copies(n, k, dtype, dev, args.rotate_mb, args.max_copies)
        wbytes = n * k * ws[0].element_size()
        for t in ts:
            # x as a column slice of a wider buffer (row stride > K), as a packed projection's output is
            x = torch.randn(t, k + 64, device=dev, generator=g).to(dtype)[:, 32:32 + k]
            ref = x.float() @ ws[0].float().T  # [T, N] fp32
            cfg = gemv.pick_config(t, n, k, dtype, dev)
            row: dict[str, Any] = {"n": n, "k": k, "t": t, "uses": s["uses"], "weight_bytes": wbytes,
                                   "config": asdict(cfg)}
            row["err_cublas"] = rel_err(F.linear(x, ws[0]), ref)
            row["err_triton"] = rel_err(gemv.linear(x, ws[0], counters=split_counters()), ref)
            row["cublas_us"] = graph_time(F.linear, x, ws, args.replays, args.min_calls)
            row["triton_us"] = graph_time(lambda a, b: gemv.linear(a, b, counters=split_counters()), x, ws, args.replays,
                                          args.min_calls)
            for impl in ("cublas", "triton"):
                row[f"{impl}_gbps"] = wbytes / row[f"{impl}_us"] / 1e3
            row["floor_us"] = wbytes / copy_gbps / 1e3
            doc["results"].append(row)
            print(f"{n:>6} {k:>6} {t:>3} | {row['cublas_us']:9.2f} {row['cublas_gbps']:6.0f} | "
                  f"{row['triton_us']:9.2f} {row['triton_gbps']:6.0f} {row['cublas_us'] / row['triton_us']:6.2f}x | "
                  f"{row['err_cublas']:10.1e} {row['err_triton']:10.1e} | {cfg_str(asdict(cfg))}; "
                  f"{', '.join(s['uses'])}", flush=True)
            if args.tune and args.time_limit and time.perf_counter() - start > args.time_limit:
                if not doc.get("tune_cut"):
                    print(f"--time-limit {args.time_limit:.0f} s reached: no more tuning", flush=True)
                doc["tune_cut"] = True
            elif args.tune:
                rows = tune_one(x, ws, ref, args)
                bad = [r for r in rows if not r["err"] <= 2e-2]
                doc["tune"].append({"n": n, "k": k, "t": t, "cublas_us": row["cublas_us"],
                                    "default_us": row["triton_us"], "configs": rows})
                best = rows[0]
                print(f"{'':>17} tuned: {best['us']:9.2f} {wbytes / best['us'] / 1e3:6.0f} "
                      f"{row['cublas_us'] / best['us']:6.2f}x vs cuBLAS, default {row['triton_us'] / best['us']:.2f}x "
                      f"the best | {cfg_str(best)}; next: "
                      + "; ".join(f"{cfg_str(r)} {r['us']:.2f}" for r in rows[1:3])
                      + (f"; {len(bad)} configs WRONG (err > 2e-2)" if bad else ""), flush=True)
        del ws
        torch.cuda.empty_cache()
        if args.json is not None:  # after each shape: a run cut short still leaves its numbers
            args.json.write_text(json.dumps(doc, indent=1))
    res = doc["results"]
    if res:
        geo_speedup = math.exp(sum(math.log(r["cublas_us"] / r["triton_us"]) for r in res) / len(res))
        worst = max(r["err_triton"] for r in res)
        print(f"\ngeomean speedup over cuBLAS {geo_speedup:.2f}x over {len(res)} (shape, T); worst triton err "
              f"{worst:.1e}; HBM copy {copy_gbps:.0f} GB/s")
    if args.tune and doc["tune"]:
        summarise_tune(doc["tune"])
        emit_table(doc["tune"], args.write)
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
