"""Fused elementwise ops (m3eagle/kernels/fused/, m3eagle/kernels/moe/router.py) on a CUDA GPU in bf16:
exactness against the PyTorch reference, time per op, and kernel launches per decode step.

    python benchmarks/fused_ops.py                       # H200: < 2 minutes
    python benchmarks/fused_ops.py --json fused.json     # also write the JSON document to a file
    python benchmarks/fused_ops.py --device cpu          # smoke test on CPU (sets TRITON_INTERPRET=1)

1. Exactness, per op and shape (the embedded 9M model's and m3-mini's): the triton op against the reference
   chain on the same bf16 inputs. Reported: the fraction of output elements that are bit-equal and the
   max difference in units of the reference's bf16 ulp. Elementwise chains (SwiGLU-OAI, SiLU-mul, the RoPE
   tables, RoPE without a norm, the residual sums) should be 100% equal; norms may differ by an ulp where
   the fp32 mean square is summed in another order. The router: identical expert sets, and ties (a zero
   router) checked against CUDA's torch.topk, which takes the lowest ids.
2. Time per op: reference chain vs fused kernel, each captured in a CUDA graph (REPEAT calls back to back)
   and replayed; medians of replays, per call.
3. Launches per plain decode step of the embedded model (and per decoder layer: a dense one and a MoE +
   sparse-attention one), counted with torch.profiler (CUDA kernels + memsets/memcpys) on one eager
   MiniMaxM3.forward + compute_logits of B decode rows at a 200-token context, with attention + MoE on
   triton in both and the fused ops on 'reference' vs 'triton' (a CUDA graph replays the same kernels).
   The step is also captured in a CUDA graph with the triton fused ops: replay == eager, no host sync.
   On CPU the count is of aten ops that are not views plus Triton launches (an estimate of CUDA kernels).

A readable table goes to stderr, one JSON line to stdout (and to --json FILE).
"""

from __future__ import annotations

import sys

from _interpreter import use_interpreter_for_cpu  # noqa: E402  (the script's own folder)

use_interpreter_for_cpu(sys.argv)  # before anything imports triton

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from m3eagle.kernels.attention.metadata import build_metadata  # noqa: E402
from m3eagle.kernels.fused import registry as backend  # noqa: E402
from m3eagle.kernels.ops import make_ops  # noqa: E402

REPEAT = 10  # calls per captured graph in the op timings
EPS, ALPHA, LIMIT = 1e-6, 1.702, 7.0
# (name, hidden, heads, kv_heads, head_dim, rotary_dim, index_heads, index_dim, inter (shared), experts, top_k)
SHAPES = [("embedded", 256, 4, 2, 64, 32, 2, 32, 128, 4, 2), ("m3-mini", 2048, 16, 2, 128, 64, 2, 128, 1024, 32, 4)]


def log(msg: str = "") -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- exactness ----------------------------------------------------------------------------------------


def compare(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Bit-equal fraction and the max difference in ulps of the reference (bf16: 2^-7 relative)."""
    out, ref = out.float(), ref.float()
    equal = (out == ref) | (out.isnan() & ref.isnan())
    ulp = torch.where(ref == 0, torch.full_like(ref, 2.0 ** -133), 2.0 ** (torch.floor(torch.log2(ref.abs())) - 7))
    return {"equal": equal.float().mean().item(), "max_ulp": ((out - ref).abs() / ulp).max().item()}


def op_cases(shape: tuple, t: int, dev: torch.device, dtype: torch.dtype, timing: bool = False,
             ) -> dict[str, Callable[[Any], Any]]:
    """name -> fn(fused) running one op on fixed random inputs; fn returns the tensors to compare. With
    `timing` the KV pools are allocated once (not inside the timed call) and shared by every call."""
    _, hid, hq, hk, d, rdim, hi, di, inter, n_exp, top_k = shape
    g = torch.Generator(device=dev).manual_seed(t * 7 + hid)

    def rnd(*s, scale=1.0, dt=dtype):
        return (torch.randn(*s, generator=g, device=dev) * scale).to(dt)

    x, res, x2 = rnd(t, hid), rnd(t, hid, scale=4.0), rnd(t, hid)
    w_norm = rnd(hid, scale=0.2)
    qkv = rnd(t, (hq + 2 * hk) * d, scale=2.0)  # q, k, v as views of one projection output
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=1)
    q, k, v = q.view(t, hq, d), k.view(t, hk, d), v.view(t, hk, d)
    qw, kw = rnd(d, scale=0.2), rnd(d, scale=0.2)
    iq, ik = rnd(t, hi, di), rnd(t, 1, di)
    n_slots = 4 * t + 16
    slots = torch.randperm(n_slots, generator=g, device=dev)[:t]
    pos = torch.randint(0, 131072, (t,), generator=g, device=dev)
    gate_up = rnd(t, 2 * inter, scale=5.0)  # |gate|, |up| > limit often: the clamps are live
    gate, up = rnd(t, inter, scale=3.0), rnd(t, inter)
    logits = rnd(t, n_exp, scale=2.0, dt=torch.float32)
    bias = rnd(n_exp, scale=0.1, dt=torch.float32)
    w_router = rnd(n_exp, hid, scale=hid ** -0.5, dt=torch.float32)
    cos, sin = backend.create("reference").rope_cos_sin(pos, rdim, 10000.0, dtype)  # [T, R] each
    r = min(di, rdim)
    shared = [torch.zeros(n_slots, hk, d, dtype=dtype, device=dev) for _ in range(2)]
    shared.append(torch.zeros(n_slots, di, dtype=dtype, device=dev))

    def pools() -> list[torch.Tensor]:
        return shared if timing else [torch.zeros_like(p) for p in shared]

    def attn_prep(f):
        kp, vp, _ = pools()
        return f.qkv_rope_store(q, k, v, qw, kw, EPS, cos, sin, kp, vp, slots), kp, vp

    def index_prep(f):
        ip = pools()[2]
        return f.qkv_rope_store(iq, ik, None, qw[:di], kw[:di], EPS, cos[:, :r], sin[:, :r], ip, None, slots), ip

    return {
        "add_rms_norm": lambda f: f.add_rms_norm(x, res, w_norm, EPS),
        "add_rms_norm_moe": lambda f: f.add_rms_norm(x, res, w_norm, EPS, x2, 2.5),
        "rms_norm_llama": lambda f: (f.rms_norm(x, w_norm + 1, EPS, gemma=False),),
        "rope_cos_sin": lambda f: f.rope_cos_sin(pos, rdim, 10000.0, dtype),
        "qk_norm_rope+kv_store": attn_prep,
        "indexer_norm_rope+store": index_prep,
        "rope_only(eagle)": lambda f: (f.qk_norm_rope(q, None, 0.0, cos, sin),),
        "swiglu_oai": lambda f: (f.swiglu_oai(gate_up, ALPHA, LIMIT),),
        "silu_mul": lambda f: (f.silu_mul(gate, up),),
        "route": lambda f: f.route(logits, bias, top_k),
        "router_logits": lambda f: (f.router_logits(x, w_router),),
        "route_tokens": lambda f: f.route_tokens(x, w_router, bias, top_k),  # the router in one launch
    }


def check_ops(dev: torch.device, dtype: torch.dtype, tokens: list[int]) -> list[dict]:
    ref, tri = backend.create("reference"), backend.create("triton")
    rows = []
    for shape in SHAPES:
        for t in tokens:
            for name, fn in op_cases(shape, t, dev, dtype).items():
                a, b = fn(tri), fn(ref)
                row: dict[str, Any] = {"shape": shape[0], "T": t, "op": name}
                if name in ("route", "route_tokens"):
                    row["same_experts"] = bool(torch.equal(a[1].sort(-1).values, b[1].sort(-1).values))
                    row["same_order"] = bool(torch.equal(a[1], b[1]))
                    row["weights_max_abs"] = (a[0] - b[0]).abs().max().item()
                elif name == "router_logits":  # a GEMV: another summation order than cuBLAS, by design
                    row["rel_err"] = ((a[0] - b[0]).abs().max() / b[0].abs().max()).item()
                else:
                    cmp = [compare(o, r) for o, r in zip(a, b)]
                    row["equal"] = min(c["equal"] for c in cmp)
                    row["max_ulp"] = max(c["max_ulp"] for c in cmp)
                rows.append(row)
    return rows


def check_router_ties(dev: torch.device) -> dict[str, bool]:
    """Equal biased scores: ours take the lowest ids; so does CUDA's torch.topk (CPU's does not)."""
    tri = backend.create("triton")
    out = {}
    for e, k in ((4, 2), (32, 4), (256, 8)):
        g = torch.Generator(device=dev).manual_seed(e)
        for levels in (1, 3):
            logits = torch.randint(0, levels, (64, e), generator=g, device=dev).float()
            bias = torch.zeros(e, device=dev)
            _, idx = tri.route(logits, bias, k)
            stable = torch.sort(torch.sigmoid(logits), dim=-1, descending=True, stable=True).indices[:, :k]
            topk = torch.topk(torch.sigmoid(logits) + bias, k, dim=-1, sorted=False).indices
            out[f"E{e}k{k}_levels{levels}_vs_stable_sort"] = bool(torch.equal(idx, stable))
            out[f"E{e}k{k}_levels{levels}_vs_torch_topk_set"] = bool(
                torch.equal(idx.sort(-1).values, topk.sort(-1).values))
    return out


# ---- timing -------------------------------------------------------------------------------------------


def time_fn(fn: Callable[[], object], dev: torch.device, reps: int) -> float:
    """Median seconds per call: REPEAT calls captured in one CUDA graph, replays timed with events. CPU:
    wall clock of eager calls."""
    if dev.type != "cuda":
        fn()
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # compile + warm caches outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEAT):
            fn()
    graph.replay()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e-3 / REPEAT)
    del graph
    return statistics.median(ts)


def time_ops(dev: torch.device, dtype: torch.dtype, tokens: list[int], reps: int) -> list[dict]:
    ref, tri = backend.create("reference"), backend.create("triton")
    rows = []
    for shape in SHAPES:
        for t in tokens:
            for name, fn in op_cases(shape, t, dev, dtype, timing=True).items():
                t_ref = time_fn(lambda fn=fn: fn(ref), dev, reps)
                t_tri = time_fn(lambda fn=fn: fn(tri), dev, reps)
                rows.append({"shape": shape[0], "T": t, "op": name, "reference_us": t_ref * 1e6,
                             "triton_us": t_tri * 1e6, "speedup": t_ref / t_tri})
    return rows


# (name, experts, hidden): the MoE routers of the geometries, and MiniMax-M3's own
ROUTERS = [("m3-mini", 32, 2048), ("m3-8b", 16, 4096), ("minimax-m3", 128, 6144)]


ROUTER_TILES = [(bm, bh, w, st) for bm in (16, 32, 64) for bh in (64, 128, 256) for w, st in ((4, 3), (8, 3))]


def router_sweep(dev: torch.device, tokens: list[int], reps: int) -> list[dict]:
    """Prompt-sized routers: the cast + cuBLAS fp32 GEMM + route path (what steps past ROUTER_GEMV_MAX_T
    took before the tiled router) against `route_tiles` per (block_m, block_h, warps, stages), same inputs."""
    from m3eagle.kernels.fused import reference as fref
    from m3eagle.kernels.moe import router

    tri = backend.create("triton")
    rows = []
    for name, n_exp, hid in ROUTERS:
        g = torch.Generator(device=dev).manual_seed(n_exp)
        w = (torch.randn(n_exp, hid, generator=g, device=dev) * hid ** -0.5).float()
        w3 = router.router_split(w)
        bias = (torch.randn(n_exp, generator=g, device=dev) * 0.1).float()
        for t in tokens:
            x = torch.randn(t, hid, generator=g, device=dev).to(torch.bfloat16)
            base = lambda x=x, w=w, bias=bias: tri.route(fref.router_logits(x, w), bias, 4)  # noqa: E731
            bw, bi = base()
            row: dict[str, Any] = {"router": name, "E": n_exp, "H": hid, "T": t,
                                   "cublas_us": time_fn(base, dev, reps) * 1e6, "tiles": {}}
            for bm, bh, nw, st in ROUTER_TILES if not dev.type == "cpu" else ROUTER_TILES[:1]:
                fn = lambda x=x, w3=w3, bias=bias, c=(bm, bh, nw, st): router.route_tiles(  # noqa: E731
                    x, w3, bias, 4, *c)
                try:
                    tw, ti = fn()
                    us = time_fn(fn, dev, reps) * 1e6
                except Exception as exc:  # past the GPU's shared memory or registers
                    log(f"  {name} T={t} tile {(bm, bh, nw, st)}: skipped ({type(exc).__name__})")
                    continue
                row["tiles"][f"{bm},{bh},{nw},{st}"] = {
                    "us": us, "same_order": (ti == bi).all(1).float().mean().item(),
                    "w_max_abs": (tw - bw).abs().max().item()}
            rows.append(row)
    return rows


# ---- launches per step --------------------------------------------------------------------------------


class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    """CPU estimate of kernel launches: aten ops that compute (not views, not bare allocations)."""

    SKIP = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "detach",
            "_local_scalar_dense", "set_", "resize_"}

    def __init__(self) -> None:
        super().__init__()
        self.count, self.names, self.paused = 0, {}, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.paused and not func.is_view and name not in self.SKIP:
            self.count += 1
            self.names[name] = self.names.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def count_launches(fn: Callable[[], object], dev: torch.device) -> tuple[int, dict[str, int]]:
    fn()  # compile, fill caches
    if dev.type == "cuda":
        torch.cuda.synchronize()
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        names: dict[str, int] = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                names[e.name] = names.get(e.name, 0) + 1
        return sum(names.values()), names
    import triton.runtime.interpreter as interp

    counter = _CountOps()
    run = interp.InterpretedFunction.run

    def counted(self, *a, **k):
        counter.count += 1
        counter.names[self.fn.__name__] = counter.names.get(self.fn.__name__, 0) + 1
        counter.paused = True  # the interpreter's own host copies are not launches
        try:
            return run(self, *a, **k)
        finally:
            counter.paused = False

    interp.InterpretedFunction.run = counted
    try:
        with counter:
            fn()
    finally:
        interp.InterpretedFunction.run = run
    return counter.count, counter.names


def embedded_model(dev: torch.device, dtype: torch.dtype):
    """The embedded model's geometry (m3eagle/assets/default/target) with random weights."""
    import m3eagle
    from m3eagle.loader.dummy import dummy_target, target_config

    return dummy_target(target_config(Path(m3eagle.__file__).parent / "assets" / "default" / "target"), dtype, dev)


def decode_step(model, dev: torch.device, dtype: torch.dtype, rows: int, ctx: int):
    """Caches and metadata for one decode step: `rows` rows of 1 token at context `ctx`."""
    page = 16
    width = -(-(ctx + 1) // page) + 1
    table = (torch.arange(rows * width, device=dev).view(rows, width) + 1)  # page 0 is the trash page
    caches = model.new_caches((rows * width + 1) * page, dtype, dev)
    meta = build_metadata([1] * rows, torch.full((rows,), ctx + 1), table, page, dev, max_kv=width * page)
    ids = torch.randint(0, model.cfg.vocab_size, (rows,), device=dev)
    return caches, meta, ids


def layer_counts(model, m, caches, ids: torch.Tensor, dev: torch.device, dtype: torch.dtype) -> dict[str, int]:
    """Launches of one decoder layer of each kind (0: dense MLP + full attention, 1: MoE + sparse attention),
    fed the embedding as both residual and update."""
    f = m.ops.fused
    x = model.embed_tokens(ids)
    cos, sin = f.rope_cos_sin(m.positions, model.cfg.rotary_dim, model.cfg.rope_theta, dtype, model.cfg.rope_scaling)
    out = {}
    for i, kind in ((0, "dense+full"), (1, "moe+sparse")):
        layer = model.layers[i]
        out[kind] = count_launches(lambda: layer(x, (x, None, 1.0), cos, sin, m, caches[i]), dev)[0]  # noqa: B023
    return out


def step_counts(dev: torch.device, dtype: torch.dtype, rows: int, ctx: int) -> dict[str, Any]:
    model = embedded_model(dev, dtype)
    caches, meta, ids = decode_step(model, dev, dtype, rows, ctx)
    out: dict[str, Any] = {"rows": rows, "ctx": ctx}
    logits = {}
    for fused in ("reference", "triton"):
        ops = make_ops("triton", "triton", dev, fused=fused)  # CPU: the interpreter, for the count
        m = replace(meta, ops=ops)

        def forward(m=m):
            return model.compute_logits(model(ids, m.positions, m, caches))

        with torch.no_grad():
            n, names = count_launches(forward, dev)
            logits[fused] = forward()
            per_layer = layer_counts(model, m, caches, ids, dev, dtype)
        out[fused] = {"step": n, "layers": per_layer, "top": sorted(names.items(), key=lambda kv: -kv[1])[:12]}
    out["logits_max_abs_diff"] = (logits["triton"] - logits["reference"]).abs().max().item()
    out["same_argmax"] = bool(torch.equal(logits["triton"].argmax(-1), logits["reference"].argmax(-1)))
    if dev.type == "cuda":
        out["graph"] = graph_check(model, dev, dtype, rows, ctx)
    return out


def graph_check(model, dev: torch.device, dtype: torch.dtype, rows: int, ctx: int) -> dict[str, Any]:
    """The decode step with the triton fused ops, captured in a CUDA graph: replay == eager, no host sync."""
    caches, meta, ids = decode_step(model, dev, dtype, rows, ctx)
    m = replace(meta, ops=make_ops("triton", "triton", dev, fused="triton"))
    snapshot = [(c.k.clone(), c.v.clone()) for c in caches]

    def forward():
        return model.compute_logits(model(ids, m.positions, m, caches))

    with torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            eager = forward()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.set_sync_debug_mode("error")
        try:
            forward()
            no_sync = True
        except RuntimeError:
            no_sync = False
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = forward()
        for c, (k, v) in zip(caches, snapshot):
            c.k.copy_(k), c.v.copy_(v)
        graph.replay()
        torch.cuda.synchronize()
    return {"replay_equal_eager": bool(torch.equal(static, eager)), "no_sync": no_sync}


# ---- main ---------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=50, help="timed graph replays per measurement")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--router-sweep", action="store_true",
                    help="only the prompt-sized router sweep (cuBLAS path vs route_tiles), T = 256, 2048, 8192")
    args = ap.parse_args()
    dev = torch.device(args.device)
    cpu = dev.type != "cuda"
    if not cpu and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --device cpu (interpreter smoke test)")
    dtype = torch.float32 if cpu else torch.bfloat16  # the interpreter truncates fp32 -> bf16
    tokens = [3] if cpu else [1, 8, 256]
    t0 = time.time()
    doc: dict[str, Any] = {"device": torch.cuda.get_device_name() if not cpu else "cpu", "dtype": str(dtype)}
    if args.router_sweep:
        from m3eagle.kernels.moe import router

        doc["router_sweep"] = router_sweep(dev, [65] if cpu else [256, 2048, 8192], args.reps)
        for r in doc["router_sweep"]:
            tiles = sorted(r["tiles"].items(), key=lambda kv: kv[1]["us"])
            default = dict(tiles).get("{},{},4,3".format(*router.router_tile_blocks(r["T"], max(16, r["E"]))), {})
            log(f"  {r['router']:10s} T={r['T']:<5d} cuBLAS path {r['cublas_us']:7.1f} us | tiles (block_m, block_h,"
                f" warps, stages), best first: " + "  ".join(f"{c} {v['us']:.1f}" for c, v in tiles[:6])
                + f" | default {default.get('us', float('nan')):.1f}"
                + (f" | best: same order {tiles[0][1]['same_order']:.4f}, w max |diff| {tiles[0][1]['w_max_abs']:.1e}"
                   if tiles else ""))
        print(json.dumps(doc))
        if args.json:
            args.json.write_text(json.dumps(doc) + "\n")
        return

    log(f"== exactness ({dtype}; equal = bit-equal fraction, ulp = max |diff| in reference bf16 ulps)")
    doc["exactness"] = check_ops(dev, dtype, tokens)
    for r in doc["exactness"]:
        if r["op"] in ("route", "route_tokens"):
            log(f"  {r['shape']:9s} T={r['T']:<4d} {r['op']:24s} same experts {r['same_experts']}, same order "
                f"{r['same_order']}, weights max |diff| {r['weights_max_abs']:.1e}")
        elif r["op"] == "router_logits":
            log(f"  {r['shape']:9s} T={r['T']:<4d} {r['op']:24s} max relative error {r['rel_err']:.1e} (fp32 GEMV)")
        else:
            log(f"  {r['shape']:9s} T={r['T']:<4d} {r['op']:24s} equal {r['equal']:7.2%}  max ulp {r['max_ulp']:.1f}")
    doc["router_ties"] = check_router_ties(dev)
    log(f"  router ties, all equal the stable-sort rule: {all(v for k, v in doc['router_ties'].items() if 'stable' in k)}"
        f"; same sets as torch.topk: {all(v for k, v in doc['router_ties'].items() if 'topk' in k)}"
        + (" (CPU topk ties are arbitrary)" if cpu else ""))

    log("== time per op (CUDA graph replay, median per call)" if not cpu else "== time per op (CPU wall clock)")
    doc["timing"] = time_ops(dev, dtype, tokens, args.reps)
    for r in doc["timing"]:
        log(f"  {r['shape']:9s} T={r['T']:<4d} {r['op']:24s} reference {r['reference_us']:8.2f} us  triton "
            f"{r['triton_us']:8.2f} us  x{r['speedup']:.1f}")

    log("== launches per plain decode step of the embedded model (attention + MoE on triton in both)")
    doc["launches"] = []
    for rows in ([1] if cpu else [1, 8]):
        c = step_counts(dev, dtype, rows, ctx=200)
        doc["launches"].append(c)
        log(f"  rows={rows} ctx={c['ctx']}: step {c['reference']['step']} -> {c['triton']['step']} launches; "
            f"per layer {c['reference']['layers']} -> {c['triton']['layers']}; logits max |diff| "
            f"{c['logits_max_abs_diff']:.2e}, same argmax {c['same_argmax']}; graph {c.get('graph')}")
        for fused in ("reference", "triton"):
            log(f"    {fused:9s} most launched: {c[fused]['top'][:8]}")
    doc["seconds"] = time.time() - t0
    line = json.dumps(doc)
    print(line)
    if args.json:
        args.json.write_text(line + "\n")


if __name__ == "__main__":
    main()
