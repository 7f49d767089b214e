"""Fused routed-experts kernels (m3eagle/kernels/moe/triton_moe.py) on a CUDA GPU in bf16: correctness, CUDA-graph
capture, timing against the roofline, and block-size tuning.

    python benchmarks/moe_kernel.py --json moe.json                # check + time both shapes, ~1-2 min on an H200
    python benchmarks/moe_kernel.py --tune --write --json moe.json # sweep configs first, rewrite the table, < 4 min
    python benchmarks/moe_kernel.py --tune --buckets 1,4 --write   # some buckets only (the rest of the table kept)
    python benchmarks/moe_kernel.py --shapes m3-mini --profile 1,4,2048   # + per-kernel GPU time at those T
    TRITON_INTERPRET=1 python benchmarks/moe_kernel.py --device cpu --tune   # tiny shape: a smoke test

Shapes: m3-mini (hidden 2048, 32 experts, top-4, intermediate 1024, shared 1024), m3-8b (hidden 4096,
16 experts, top-4, intermediate 1536, shared 1536) and embedded (the default pair's target: hidden 256, 4
experts, top-2, intermediate 160, shared 128), with random weights and a random fp32 router.

1. Correctness: the routed output of TritonMoE and of the dense bf16 reference, both against an fp32 oracle
   (the reference on fp32 copies of the weights) with the same routing; the whole SparseMoE layer, triton
   vs reference; two expert subsets summing to the full result.
2. CUDA graphs: a layer captured with the triton impl, replayed on new inputs (new routing), equals eager
   bit for bit; one eager call under `torch.cuda.set_sync_debug_mode("error")` shows no host sync.
3. Timing: medians of CUDA-graph replays, timed with CUDA events. Each timed call runs LAYERS layers with
   their own weights and routing, so the chosen experts stream from HBM rather than from the 50 MB L2 (as
   consecutive layers of a model do); times are per layer. Bandwidth counts the weights of the distinct
   experts the routing actually chose, plus the shared expert (and router) for the whole layer. TFLOP/s
   counts routed FLOPs (2 * T * k * 3 * I * H) over the routed kernels' time; engine TFLOP/s the FLOPs of
   the experts the engine layer computes (the routed pairs plus the shared expert fused into the same
   GEMMs: k + 1 per token) over the whole engine layer's time, router included. For scale, the same run
   measures a dense bf16 torch.mm of the same FLOPs ([T*k, H] @ [H, 3I] and [T*(k+1), H] @ [H, 3I], its own
   LAYERS weights) and the HBM copy bandwidth of a 4 GiB device-to-device copy. Decode-sized steps
   (T <= 16) are timed once more with programmatic dependent launch ("PDL us"), as the engine captures the
   graphs of batches of up to 4 rows under M3EAGLE_PDL=auto (m3eagle/kernels/pdl.py); the column is empty where
   the GPU cannot (before sm_90) or M3EAGLE_PDL=0. A line under each shape's table states the issue's
   bars: decode-sized layers as % of the copy bandwidth (with and without PDL), T >= 256 as % of torch.mm.
4. --tune: per T bucket of the table, time the whole layer as the engine runs it (fused router, then the
   experts with the shared expert fused in when its width allows; buckets of up to 4 tokens with PDL, as
   the engine's small-batch graphs launch them) for each candidate config (the sort-free
   direct path's tiles up to T = 4, decode candidates with small row blocks up to T = 256, prefill
   candidates from 256 up), keep the fastest that matches the reference, print the table, and with --write
   merge it into m3eagle/kernels/moe/tuned_configs.json under this GPU's name. The timing pass then uses the tuned
   configs.

A readable table goes to stderr; one JSON line to stdout (and to --json FILE).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYERS = 4
PDL_MAX_T = 16  # steps of up to this many tokens are also timed with PDL (decode graphs of <= 4 rows, K <= 3)
ALPHA, LIMIT, SCALING = 1.702, 7.0, 2.0


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    experts: int
    top_k: int
    inter: int
    shared: int
    tokens: tuple[int, ...]  # step sizes to check and time

    def expert_bytes(self, itemsize: int) -> int:
        return 3 * self.inter * self.hidden * itemsize  # gate, up and down rows of one expert


SHAPES = [Shape("m3-mini", 2048, 32, 4, 1024, 1024, (1, 4, 32, 256, 2048)),
          Shape("m3-8b", 4096, 16, 4, 1536, 1536, (1, 32, 2048)),
          # the embedded pair's target: a shared expert narrower than the routed ones (fused on direct steps)
          Shape("embedded", 256, 4, 2, 160, 128, (1, 4, 32))]
TINY = Shape("tiny", 64, 8, 2, 32, 32, (1, 5, 40))


def log(msg: str = "") -> None:
    print(msg, file=sys.stderr, flush=True)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-12)).item()


# ---- model pieces ---------------------------------------------------------------------------------------


def make_layer(shape: Shape, dev: torch.device, dtype: torch.dtype, seed: int):
    """A SparseMoE with random weights made on the device: experts and shared expert in `dtype`, router
    fp32 (as the checkpoint keeps it). Gate/up weights are scaled so SwiGLU's clamps are sometimes live."""
    from m3eagle.models.layers import SparseMoE

    g = torch.Generator(device=dev).manual_seed(seed)
    h, i = shape.hidden, shape.inter
    with torch.device(dev):
        moe = SparseMoE(h, i, shape.shared, shape.experts, shape.top_k, SCALING, ALPHA, LIMIT)
    with torch.no_grad():
        moe.gate.weight.normal_(0.0, h ** -0.5, generator=g)
        moe.gate.e_score_correction_bias.normal_(0.0, 0.1, generator=g)
        moe.experts.gate_up_proj.normal_(0.0, 2.0 * h ** -0.5, generator=g)
        moe.experts.down_proj.normal_(0.0, i ** -0.5, generator=g)
        for p in moe.shared_experts.parameters():
            p.normal_(0.0, p.shape[1] ** -0.5, generator=g)
    moe.experts.to(dtype)
    moe.shared_experts.to(dtype)
    return moe.eval()


def profile_step(shape: Shape, layers: list, t: int, tri, dev: torch.device, dtype: torch.dtype,
                 reps: int = 20) -> dict:
    """Per-kernel GPU time (us per layer) of the routed path (align, GEMMs, combine) and of the engine's whole
    layer (fused router, shared expert fused) at T tokens, from torch.profiler over `reps` graph replays of
    all `layers` (graphs, so no launch gaps of eager mode are counted); logged as a table."""
    from torch.profiler import ProfilerActivity, profile

    from m3eagle.kernels.fused import registry as fused_backend
    from m3eagle.kernels.ops import Ops

    x = make_x(shape, t, dev, dtype, seed=t)
    fused_ops = Ops(attention=None, moe=tri, fused=fused_backend.create("triton"))
    out: dict = {"T": t}
    with torch.no_grad():
        routes = [tuple(r.contiguous() for r in layer.gate(x)) for layer in layers]  # as in time_step
        fns = {"routed": lambda: [routed(tri, la, x, w, idx) for la, (w, idx) in zip(layers, routes)],
               "engine_layer": lambda: [la.forward_parts(x, fused_ops) for la in layers]}
        for name, fn in fns.items():
            graph = capture(fn)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(reps):
                    graph.replay()
                torch.cuda.synchronize()
            per: dict[str, float] = {}
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    per[e.name] = per.get(e.name, 0.0) + e.device_time / (reps * len(layers))
            out[name] = dict(sorted(per.items(), key=lambda kv: -kv[1]))
            log(f"  profile T={t} {name}: {sum(per.values()):.1f} us of kernels per layer")
            for k, v in out[name].items():
                log(f"      {v:8.1f} us  {k[:90]}")
            del graph
    return out


def make_x(shape: Shape, t: int, dev: torch.device, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device=dev).manual_seed(seed)
    return torch.randn(t, shape.hidden, device=dev, generator=g).to(dtype)  # [T, H], like a normed hidden


def routed(impl, layer, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, expert_range=None) -> torch.Tensor:
    e = layer.experts
    return impl.experts(x, w, idx, e.gate_up_proj, e.down_proj, ALPHA, LIMIT, expert_range)


def layer_as_engine(ops, layer, x: torch.Tensor) -> torch.Tensor:
    """The whole layer as the engine's paged path runs it (SparseMoE.forward_parts with `ops`): the fused
    router, then the experts with the shared expert fused."""
    a, b, scale = layer.forward_parts(x, ops)
    return a if b is None else a * scale + b


def experts_as_engine(impl, layer, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """routed * scale + shared with the routing given, as the engine runs it (SparseMoE.expert_parts): one
    fused pass when the impl and the layer allow it (what the tuning should time), else the two parts."""
    a, b, scale = layer.expert_parts(x, w, idx, impl)
    return a if b is None else a * scale + b  # fused: a is the whole sum (scale 1)


# ---- timing ---------------------------------------------------------------------------------------------


def capture(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """fn captured in a CUDA graph after a warm-up on a side stream (Triton compiles, cuBLAS picks its
    kernels), then replayed once."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    return graph


class Timer:
    """Median seconds per call of fn. CUDA: fn captured in a CUDA graph (after a warm-up that compiles the
    kernels), replays timed with events. CPU: wall clock."""

    def __init__(self, dev: torch.device, reps: int) -> None:
        self.dev, self.reps = dev, reps

    def __call__(self, fn: Callable[[], object], calls_per_fn: int = 1) -> float:
        if self.dev.type != "cuda":
            fn()
            ts = []
            for _ in range(max(1, self.reps // 5)):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts) / calls_per_fn
        graph = capture(fn)
        ts = []
        for _ in range(self.reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) * 1e-3)
        del graph
        return statistics.median(ts) / calls_per_fn

    def eager(self, fn: Callable[[], object], calls_per_fn: int = 1) -> float:
        """Plain launches, host overhead included (what a step outside a graph pays)."""
        fn()
        if self.dev.type != "cuda":
            return self(fn, calls_per_fn)
        ts = []
        for _ in range(max(3, self.reps // 4)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) / calls_per_fn


def copy_bandwidth(dev: torch.device) -> float:
    """GB/s of a 4 GiB device-to-device copy, counting read and write: the bench's own measure
    (`m3eagle.bench.roofline`), eager. Not through Timer: a D2D copy captured in a CUDA graph becomes a
    memcpy node, which ran at 2.77 TB/s on an H200 against 4.3 TB/s for the copy kernel eager launches use
    (the first table of this script used the graph figure and so overstated every bandwidth share)."""
    if dev.type != "cuda":
        return float("nan")
    from m3eagle.bench.roofline import measure_copy_bandwidth

    return measure_copy_bandwidth(dev, 4 << 30)["bytes_per_s"] / 1e9


# ---- checks ---------------------------------------------------------------------------------------------


def check(shape: Shape, layer, t: int, tri, dev: torch.device, dtype: torch.dtype) -> dict:
    """Errors of one step: routed triton and routed bf16 reference vs the fp32 oracle, layer vs layer, and
    two expert subsets vs the full routed output; the engine's layer (shared expert fused) vs fp32."""
    from m3eagle.kernels.fused import registry as fused_backend
    from m3eagle.kernels.moe import backend, reference
    from m3eagle.kernels.ops import Ops

    ref_impl = backend.reference()
    x = make_x(shape, t, dev, dtype, seed=100 + t)
    with torch.no_grad():
        w, idx = layer.gate(x)
        out = routed(tri, layer, x, w, idx)
        ref = routed(ref_impl, layer, x, w, idx)
        e = layer.experts
        oracle = reference.experts(x.float(), w, idx, e.gate_up_proj.float(), e.down_proj.float(), ALPHA, LIMIT)
        half = shape.experts // 2
        parts = routed(tri, layer, x, w, idx, (0, half)).float() + routed(tri, layer, x, w, idx, (half, shape.experts))
        layer_err = rel_err(layer(x, impl=tri), layer(x))
        # the engine's path: the shared expert inside the routed kernels (when its width allows), vs the
        # reference layer in fp32 (weights upcast) and in bf16
        engine = layer_as_engine(Ops(attention=None, moe=tri, fused=fused_backend.create("triton")), layer, x).float()
        layer32 = copy.deepcopy(layer).float()
        layer_oracle = layer32(x.float())
        engine_err, layer_ref_err = rel_err(engine, layer_oracle), rel_err(layer(x), layer_oracle)
    r = {"err_engine_layer_vs_fp32": engine_err, "err_ref_layer_vs_fp32": layer_ref_err,
         "err_triton_vs_fp32": rel_err(out, oracle), "err_ref_bf16_vs_fp32": rel_err(ref, oracle),
         "err_triton_vs_ref": rel_err(out, ref), "err_layer_vs_ref": layer_err,
         "err_subsets_vs_full": rel_err(parts, out), "finite": bool(torch.isfinite(out).all())}
    # bf16 rounds each expert output and the sum once; allow the kernel twice the reference's own error
    bound = 2 * r["err_ref_bf16_vs_fp32"] + (1e-5 if dtype == torch.float32 else 2e-3)
    layer_bound = 2 * layer_ref_err + (1e-5 if dtype == torch.float32 else 2e-3)
    r["ok"] = (r["finite"] and r["err_triton_vs_fp32"] <= bound and r["err_subsets_vs_full"] <= max(bound, 1e-2)
               and engine_err <= layer_bound)
    return r


def check_graph(shape: Shape, layer, impl_of: Callable[[int], object], dev: torch.device,
                dtype: torch.dtype) -> dict:
    """Capture the layer with the triton impl; replay on other inputs (other routing) == eager, bit for bit.
    Also one eager call with sync debug mode "error": any host sync would raise."""
    from m3eagle.kernels.fused import registry as fused_backend
    from m3eagle.kernels.ops import Ops

    if dev.type != "cuda":
        return {"graph_equal": None, "no_sync": None}
    res = {}
    fused = fused_backend.create("triton")
    with torch.no_grad():
        for t in (1, 4, 37):  # each with its own bucket's config, as the engine picks it
            tri = impl_of(t)
            ops = Ops(attention=None, moe=tri, fused=fused)
            xs = make_x(shape, t, dev, dtype, seed=7)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                layer(xs, impl=tri)
                layer_as_engine(ops, layer, xs)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                ys = layer(xs, impl=tri)  # reference router + the experts
                zs = layer_as_engine(ops, layer, xs)  # the engine's path (fused router, shared expert fused)
            equal = True
            for seed in (8, 9):
                x2 = make_x(shape, t, dev, dtype, seed=seed)
                xs.copy_(x2)
                g.replay()
                equal &= bool(torch.equal(ys, layer(x2, impl=tri)))
                equal &= bool(torch.equal(zs, layer_as_engine(ops, layer, x2)))
            res[f"graph_equal_T{t}"] = equal
            del g
        x = make_x(shape, 5, dev, dtype, seed=10)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            layer(x, impl=impl_of(1))
            layer(x, impl=impl_of(5))
            layer_as_engine(Ops(attention=None, moe=impl_of(1), fused=fused), layer, x[:1])
            res["no_sync"] = True
        except RuntimeError as err:
            res["no_sync"] = False
            log(f"  host sync in the triton MoE path: {err}")
        finally:
            torch.cuda.set_sync_debug_mode("default")
    res["graph_equal"] = all(v for k, v in res.items() if k.startswith("graph_equal_T"))
    return res


# ---- timing of one step size ----------------------------------------------------------------------------


def time_step(shape: Shape, layers: list, t: int, tri, timer: Timer, dev: torch.device, dtype: torch.dtype,
              with_reference: bool = True) -> dict:
    from m3eagle.kernels import pdl
    from m3eagle.kernels.fused import registry as fused_backend
    from m3eagle.kernels.moe import backend
    from m3eagle.kernels.ops import Ops

    ref_impl = backend.reference()
    itemsize = torch.finfo(dtype).bits // 8
    x = make_x(shape, t, dev, dtype, seed=t)
    with torch.no_grad():
        # contiguous, as the engine's fused routers write them (the reference router's idx is a strided slice
        # of its sort, which align and combine would copy: an elementwise launch the engine never runs)
        routes = [tuple(r.contiguous() for r in layer.gate(x)) for layer in layers]
        distinct = statistics.mean(int(idx.unique().numel()) for _, idx in routes)

        def routed_all(impl=tri):
            for layer, (w, idx) in zip(layers, routes):
                routed(impl, layer, x, w, idx)

        def layer_all(impl=tri):
            for layer in layers:
                layer(x, impl=impl)

        fused_ops = Ops(attention=None, moe=tri, fused=fused_backend.create("triton"))

        def engine_layer_all():  # as the engine runs it: fused router, shared expert inside the routed kernels
            for layer in layers:
                layer.forward_parts(x, fused_ops)

        n, k3 = t * shape.top_k, 3 * shape.inter
        mats = [torch.randn(shape.hidden, k3, device=dev).to(dtype) for _ in layers]  # [H, 3I] each
        a = torch.randn(n, shape.hidden, device=dev).to(dtype)  # [T*k, H]

        def mm_all():
            for b in mats:
                torch.mm(a, b)

        # the engine layer's expert FLOPs: the routed pairs and, fused into the same GEMMs, the shared expert
        n_eng = t * (shape.top_k + (1 if layers[0].shared_joinable() else 0))
        a_eng = torch.randn(n_eng, shape.hidden, device=dev).to(dtype)  # [T*(k+1), H]

        def mm_engine_all():
            for b in mats:
                torch.mm(a_eng, b)

        r = {"T": t, "distinct_experts": distinct}
        r["routed_us"] = timer(routed_all, len(layers)) * 1e6
        r["routed_eager_us"] = timer.eager(routed_all, len(layers)) * 1e6
        r["layer_us"] = timer(layer_all, len(layers)) * 1e6
        r["engine_layer_us"] = timer(engine_layer_all, len(layers)) * 1e6
        with pdl.scope(True):
            pdl_on = pdl.enabled(dev)  # sm_90+ and not M3EAGLE_PDL=0
        if t <= PDL_MAX_T and pdl_on:
            # as the engine runs decode-sized layers: its graphs of <= pdl.AUTO_MAX_BUCKET rows (T <= 16 at
            # K <= 3) are captured with programmatic dependent launch (m3eagle/kernels/pdl.py, M3EAGLE_PDL=auto)
            with pdl.scope(True):
                r["engine_layer_pdl_us"] = timer(engine_layer_all, len(layers)) * 1e6
        r["shared_fused"] = bool(layers[0].shared_joinable())
        if with_reference:
            r["ref_layer_us"] = timer(lambda: layer_all(ref_impl), len(layers)) * 1e6
        r["mm_us"] = timer(mm_all, len(layers)) * 1e6
        r["mm_engine_us"] = timer(mm_engine_all, len(layers)) * 1e6
    flops = 2 * n * k3 * shape.hidden
    engine_flops = 2 * n_eng * k3 * shape.hidden
    routed_bytes = distinct * shape.expert_bytes(itemsize)
    layer_bytes = (routed_bytes + 3 * shape.shared * shape.hidden * itemsize + shape.experts * shape.hidden * 4
                   + 2 * t * shape.hidden * itemsize)
    r["routed_GBps"] = routed_bytes / (r["routed_us"] * 1e-6) / 1e9
    r["layer_GBps"] = layer_bytes / (r["layer_us"] * 1e-6) / 1e9
    r["engine_layer_GBps"] = layer_bytes / (r["engine_layer_us"] * 1e-6) / 1e9
    if "engine_layer_pdl_us" in r:
        r["engine_layer_pdl_GBps"] = layer_bytes / (r["engine_layer_pdl_us"] * 1e-6) / 1e9
    r["routed_TFLOPs"] = flops / (r["routed_us"] * 1e-6) / 1e12
    r["mm_TFLOPs"] = flops / (r["mm_us"] * 1e-6) / 1e12
    # the whole layer as the engine runs it (router, align, combine included) on its expert FLOPs
    r["engine_TFLOPs"] = engine_flops / (r["engine_layer_us"] * 1e-6) / 1e12
    r["mm_engine_TFLOPs"] = engine_flops / (r["mm_engine_us"] * 1e-6) / 1e12
    if "ref_layer_us" in r:
        r["speedup_vs_ref"] = r["ref_layer_us"] / r["layer_us"]
    return r


# ---- tuning ---------------------------------------------------------------------------------------------


def candidates(bucket: int, dev: torch.device):
    from m3eagle.kernels.moe.tuning import MoEConfig as C

    # the sort-free decode path (m3eagle/kernels/moe/direct.py): gate_up tile x down tile, for up to 4 tokens
    # (few compiles: each kernel's tiles compile once and every pairing reuses them). Narrow, K-deep tiles put
    # a whole row segment's loads in flight at once, as fused/gemv.py's tuned configs do.
    # (num_stages 1: no software pipelining of the K loop; 2-3: the next tiles' loads in flight meanwhile)
    direct = [C(16, bn, bk, num_stages=1, direct=1, down_block_n=dbn, down_block_k=dbk, num_warps=4)
              for bn, bk in ((16, 256), (8, 512), (4, 1024), (2, 1024), (8, 1024), (4, 512))
              for dbn, dbk in ((8, 256), (16, 128), (2, 1024), (4, 512), (1, 1024), (2, 512))]
    direct += [C(16, 32, 256, num_stages=1, direct=1, down_block_n=16, down_block_k=128, num_warps=8),
               C(16, 8, 1024, num_stages=1, direct=1, down_block_n=4, down_block_k=1024, num_warps=8)]
    direct += [C(16, bn, bk, num_stages=st, direct=1, down_block_n=dbn, down_block_k=dbk, num_warps=4)
               for bn, bk in ((2, 1024), (8, 256)) for dbn, dbk in ((8, 256), (4, 512)) for st in (2, 3)]
    # down's weights loaded before its PDL wait (one K tile over all of I: 1024 for m3-mini, 2048 covers
    # m3-8b's 1536), and the router sharing its launch with the shared expert's gate_up -- each alone and
    # together, on the gate_up tiles that won before
    direct += [C(16, bn, bk, num_stages=1, direct=1, down_block_n=dbn, down_block_k=dbk, num_warps=4,
                 down_preload=pre, route_shared=rs)
               for bn, bk in ((4, 512), (2, 1024), (4, 1024)) for dbn, dbk in ((1, 1024), (2, 1024), (1, 2048), (2, 2048))
               for pre, rs in ((1, 0), (1, 1), (0, 1))]
    # m3-8b's router (H 4096) runs 8 warps: the route + shared launch needs gate_up at the same count
    direct += [C(16, bn, bk, num_stages=1, direct=1, down_block_n=dbn, down_block_k=2048, num_warps=8,
                 down_preload=1, route_shared=1) for bn, bk in ((2, 1024), (4, 1024)) for dbn in (1, 2)]
    # several down column tiles per program, the next tile's weights loaded during this one's sums
    # (MoEConfig.down_rows; one K tile over I), on the gate_up tiles that won before
    direct += [C(16, bn, bk, num_stages=1, direct=1, down_block_n=dbn, down_block_k=dbk, num_warps=w,
                 down_preload=1, route_shared=1, down_rows=r)
               for bn, bk in ((4, 1024), (2, 1024)) for dbn, dbk in ((1, 1024), (2, 1024), (1, 2048))
               for r in (2, 4, 8) for w in (4, 8)]
    # several gate_up column tiles per program (MoEConfig.gate_rows) with the best down tiles
    direct += [C(16, bn, bk, num_stages=1, direct=1, down_block_n=dbn, down_block_k=1024, down_preload=1,
                 route_shared=1, down_rows=dr, gate_rows=gr)
               for bn, bk in ((1, 1024), (2, 1024), (4, 1024), (2, 512)) for gr in (2, 4, 8)
               for dbn, dr in ((2, 2), (1, 4))]
    # (gate_up over all of H in one 2048-wide K tile lost to these: 25.1 vs 23.5 us)
    # the shared expert's down in the gate_up launch (shared_down tiles a program), on the rows
    # configs that won; 8 warps for m3-8b's router (H 4096), so that its router shares a launch at all
    direct += [C(16, bn, bk, num_stages=1, direct=1, down_block_n=dbn, down_block_k=dbk, down_preload=1,
                 route_shared=1, down_rows=dr, gate_rows=gr, shared_down=sd, num_warps=w)
               for bn, bk, gr, dbn, dbk, dr, w in ((2, 512, 2, 2, 1024, 2, 4), (2, 1024, 2, 2, 1024, 2, 4),
                                                   (2, 1024, 1, 1, 2048, 2, 8), (2, 512, 2, 1, 2048, 4, 8))
               for sd in (0, 1, 2, 4)]
    # (the routed gate_up starting on per-token routing flags instead of its PDL wait lost)
    if dev.type != "cuda":  # interpreter smoke test: cheap configs
        return [C(16, 32, 32, 1, 4, 3), C(32, 16, 64, 4, 4, 3)] + (
            [C(16, 16, 32, num_stages=1, direct=1, down_block_n=8, down_block_k=32)] if bucket <= 4 else [])
    decode = [C(16, 16, 128, 1, 2, 4), C(16, 16, 256, 1, 4, 3), C(16, 32, 128, 1, 2, 4),
              C(16, 32, 64, 1, 4, 4), C(16, 32, 128, 1, 4, 4), C(16, 32, 256, 1, 4, 3), C(16, 64, 64, 1, 4, 4),
              C(16, 64, 128, 1, 4, 3), C(16, 64, 256, 1, 4, 2), C(16, 128, 128, 1, 8, 3),
              C(32, 64, 128, 8, 4, 3), C(32, 128, 64, 8, 4, 3)]
    # the down GEMM with its own tiles on the decode rows that win (at T = 4 down streams its experts at ~80%
    # of copy bandwidth where gate_up reaches ~88%)
    decode += [C(bm, bn, bk, g, w, st, down_block_n=dbn, down_block_k=dbk)
               for bm, bn, bk, g, w, st in ((32, 64, 128, 8, 4, 3), (16, 32, 256, 1, 4, 3), (16, 64, 128, 1, 4, 3))
               for dbn, dbk in ((16, 256), (32, 128), (32, 256), (64, 64), (128, 64), (16, 512))]
    prefill = [C(32, 64, 128, 8, 4, 3), C(32, 128, 64, 8, 4, 3), C(64, 64, 64, 8, 4, 3), C(64, 128, 64, 8, 4, 3),
               C(64, 128, 64, 8, 8, 3), C(64, 64, 128, 8, 4, 3), C(128, 64, 64, 8, 4, 3),
               C(128, 128, 64, 8, 8, 3), C(128, 128, 32, 8, 8, 4), C(128, 256, 64, 8, 8, 3), C(128, 128, 64, 4, 8, 4),
               C(64, 256, 64, 8, 8, 3), C(128, 128, 128, 8, 8, 3), C(256, 128, 64, 8, 8, 3), C(128, 64, 128, 8, 4, 3),
               # deeper pipelines and other L2 groupings of the 128 x 128 tile (the T = 2048 winner)
               C(128, 128, 64, 8, 8, 4), C(128, 128, 64, 16, 8, 3), C(128, 128, 64, 4, 8, 3), C(128, 64, 64, 8, 4, 4),
               C(64, 128, 64, 8, 4, 4), C(128, 128, 32, 8, 8, 5)]
    # the down GEMM with its own tiles (N = H, K = I; gate_up's tile is 2 * block_n wide) on the best rows
    prefill += [C(bm, bn, bk, g, w, st, down_block_n=dbn, down_block_k=dbk)
                for bm, bn, bk, g, w, st in ((128, 128, 64, 16, 8, 3), (128, 128, 64, 8, 8, 3), (64, 256, 64, 8, 8, 3))
                for dbn, dbk in ((64, 64), (256, 64), (128, 128), (64, 128), (256, 32)) if (dbn, dbk) != (bn, bk)]
    # half-height tiles for the experts' padded last blocks (MoEConfig.split_tail)
    prefill += [replace(c, split_tail=1) for c in prefill if c.block_m >= 64]
    if bucket <= 4:
        return decode + direct
    if bucket < 256:
        return decode
    if bucket == 256:
        return decode + [c for c in prefill if c not in decode]
    return prefill


def align_sweep(dev: torch.device, timer: Timer) -> list[dict]:
    """The alignment alone (count + place, graph replay) at prompt sizes per chunk (pairs per program;
    m3eagle.kernels.moe.align.chunk_size picks one), routed only and with a shared expert, on m3-mini's routing
    shape (32 experts, top-4, block_m 128)."""
    from m3eagle.kernels.moe import align as al

    rows = []
    for t in (512, 2048, 8192):
        g = torch.Generator(device=dev).manual_seed(t)
        idx = torch.rand(t, 32, generator=g, device=dev).argsort(1)[:, :4].contiguous()
        for shared in (False, True):
            pick = al.chunk_size(t * 4, 32)  # routed pairs over the routed experts (the shared ones are arithmetic)
            row = {"T": t, "shared": shared, "chunk_size": pick}
            for chunk in (32, 64, 128, 256, 512):
                row[chunk] = timer(lambda idx=idx, s=shared, c=chunk: al.align(idx, 0, 32, 128, chunk=c, shared=s)) * 1e6
            rows.append(row)
            log(f"  align T={t:<5} shared={shared!s:5} (chunk_size picks {pick}): " + "  ".join(
                f"chunk {k} {v:.1f} us" for k, v in row.items() if isinstance(k, int)))
    return rows


def tune_shape(shape: Shape, layers: list, dev: torch.device, dtype: torch.dtype, timer: Timer,
               buckets: tuple[int, ...]) -> tuple[dict, list]:
    """{bucket: best config dict} and the rows of every measurement."""
    from m3eagle.kernels import pdl
    from m3eagle.kernels.fused import registry as fused_backend
    from m3eagle.kernels.moe import backend
    from m3eagle.kernels.ops import Ops

    fused = fused_backend.create("triton")
    best, rows = {}, []
    for b in buckets:
        x = make_x(shape, b, dev, dtype, seed=1000 + b)
        with torch.no_grad():
            # the fused router's routing: every candidate routes with it
            w0, idx0 = layers[0].gate(x, fused)
            ref = experts_as_engine(backend.reference(), layers[0], x, w0, idx0)
        results = []
        for cfg in candidates(b, dev):
            ops = Ops(attention=None, moe=backend.create("triton", config=cfg), fused=fused)
            try:
                with torch.no_grad():
                    err = rel_err(layer_as_engine(ops, layers[0], x), ref)

                    def run(ops=ops, x=x):  # the whole layer, router included, as the engine runs it
                        for layer in layers:
                            layer.forward_parts(x, ops)

                    # buckets of up to pdl.AUTO_MAX_BUCKET tokens run in the engine's PDL graphs (M3EAGLE_PDL
                    # auto): time their candidates that way too (a layout can win or lose by it)
                    with pdl.scope(b <= pdl.AUTO_MAX_BUCKET):
                        us = timer(run, len(layers)) * 1e6
            except Exception as exc:  # a config past the GPU's shared memory or registers: skip it
                log(f"  {shape.name} T={b} {cfg}: skipped ({type(exc).__name__})")
                continue
            ok = err <= (1e-5 if dtype == torch.float32 else 3e-2)
            results.append((us if ok else math.inf, cfg))
            rows.append({"shape": shape.name, "T": b, "config": cfg.to_dict(), "us": us, "rel_err": err, "ok": ok})
        results.sort(key=lambda r: r[0])
        if results and results[0][0] < math.inf:
            best[b] = results[0][1]
            log(f"  {shape.name:<8} T={b:<5} best {results[0][0]:8.1f} us  {results[0][1]}  "
                f"(of {len(results)}; worst {max(r[0] for r in results):.1f} us)")
    return best, rows


def write_table(dev_name: str, tuned: dict[str, dict[int, object]]) -> Path:
    from m3eagle.kernels.moe import tuning

    raw = json.loads(tuning.TABLE_PATH.read_text()) if tuning.TABLE_PATH.exists() else {}
    per_dev = raw.setdefault(dev_name, {})
    for key, per in tuned.items():  # merged per bucket: a tune of some buckets keeps the others
        merged = {int(b): c for b, c in per_dev.get(key, {}).items()}
        merged.update({b: cfg.to_dict() for b, cfg in per.items()})
        per_dev[key] = {str(b): c for b, c in sorted(merged.items())}
    tuning.TABLE_PATH.write_text(tuning.dump_table(raw))
    tuning.load_table.cache_clear()
    return tuning.TABLE_PATH


# ---- main -----------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (bf16, the real run) or cpu (tiny fp32 smoke test)")
    ap.add_argument("--tune", action="store_true", help="sweep block configs per T bucket first")
    ap.add_argument("--write", action="store_true", help="with --tune: merge the winners into tuned_configs.json")
    ap.add_argument("--shapes", default=None, help="comma list of shape names (default: all)")
    ap.add_argument("--buckets", default=None, help="with --tune: comma list of T buckets (default: all)")
    ap.add_argument("--reps", type=int, default=None, help="timed graph replays per measurement (30; CPU 5)")
    ap.add_argument("--json", default=None, help="also write the JSON summary to this file")
    ap.add_argument("--profile", default=None, metavar="T,T",
                    help="CUDA: per-kernel GPU time of the routed path and of the engine's layer at these T")
    ap.add_argument("--align-sweep", action="store_true",
                    help="only time the alignment per chunk size (pairs per program) at prompt sizes")
    args = ap.parse_args()

    dev = torch.device(args.device)
    if dev.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first `import triton`
    elif not torch.cuda.is_available():
        raise SystemExit("benchmarks/moe_kernel.py needs a CUDA device, or --device cpu for the smoke test")
    from m3eagle.kernels.moe import backend, tuning

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    shapes = SHAPES if dev.type == "cuda" else [TINY]
    if args.shapes:
        want = set(args.shapes.split(","))
        shapes = [s for s in shapes if s.name in want]
    dev_name = tuning.device_name(dev)
    timer = Timer(dev, args.reps or (30 if dev.type == "cuda" else 5))
    started = time.perf_counter()
    summary: dict = {"bench": "moe_kernel", "device": dev_name, "dtype": str(dtype).removeprefix("torch."),
                     "layers_per_timed_call": LAYERS}
    if dev.type == "cuda":
        summary["hbm_copy_GBps"] = copy_bandwidth(dev)
        log(f"HBM copy bandwidth (4 GiB device-to-device): {summary['hbm_copy_GBps']:.0f} GB/s")

    if args.align_sweep:
        summary["align_sweep"] = align_sweep(dev, timer)
        print(json.dumps(summary, default=float))
        if args.json:
            Path(args.json).write_text(json.dumps(summary, default=float) + "\n")
        return

    layers_of = {s.name: [make_layer(s, dev, dtype, seed=j) for j in range(LAYERS)] for s in shapes}

    tuned: dict[str, dict[int, object]] = {}
    if args.tune:
        buckets = tuning.BUCKETS if dev.type == "cuda" else (1, 16)
        if args.buckets:
            buckets = tuple(int(b) for b in args.buckets.split(","))
        log(f"tuning over buckets {buckets} ...")
        tune_rows = []
        for s in shapes:
            best, rows = tune_shape(s, layers_of[s.name], dev, dtype, timer, buckets)
            tuned[tuning.shape_key(s.experts, s.hidden, s.inter, s.top_k, dtype)] = best
            tune_rows += rows
        summary["tuned_table"] = {key: {str(b): c.to_dict() for b, c in per.items()} for key, per in tuned.items()}
        summary["tune_measurements"] = tune_rows
        log(json.dumps({dev_name: summary["tuned_table"]}))
        if args.write and dev.type == "cuda":
            log(f"wrote {write_table(dev_name, tuned)}")
        elif args.write:
            log("--write ignored off the GPU: the table holds measured GPU configs only")
        log(f"tuning took {time.perf_counter() - started:.0f} s")

    def impl_for(s: Shape, t: int):
        """The tuned config of this run if there is one, else the table's (TritonMoE's own lookup)."""
        per = tuned.get(tuning.shape_key(s.experts, s.hidden, s.inter, s.top_k, dtype), {})
        b = tuning.bucket(t)  # a bucket this run did not tune (--buckets) keeps the table's config
        return backend.create("triton", config=per.get(b))

    ok = True
    summary["shapes"] = []
    for s in shapes:
        layers = layers_of[s.name]
        log(f"\n{s.name}: hidden {s.hidden}, {s.experts} experts, top-{s.top_k}, intermediate {s.inter}, "
            f"shared {s.shared}, {dtype}")
        checks = [{"T": t, **check(s, layers[0], t, impl_for(s, t), dev, dtype)} for t in s.tokens]
        graph = check_graph(s, layers[0], lambda t, s=s: impl_for(s, t), dev, dtype)
        for c in checks:
            log(f"  check T={c['T']:<5} triton vs fp32 {c['err_triton_vs_fp32']:.2e} "
                f"(bf16 ref {c['err_ref_bf16_vs_fp32']:.2e})  layer vs ref {c['err_layer_vs_ref']:.2e}  "
                f"engine layer vs fp32 {c['err_engine_layer_vs_fp32']:.2e} (ref {c['err_ref_layer_vs_fp32']:.2e})  "
                f"subsets {c['err_subsets_vs_full']:.2e}  {'ok' if c['ok'] else 'FAILED'}")
        log(f"  CUDA graph replay == eager: {graph['graph_equal']}; no host sync: {graph['no_sync']}")
        ok &= all(c["ok"] for c in checks) and graph["graph_equal"] is not False and graph["no_sync"] is not False
        log(f"  {'T':>5} {'experts':>7} {'routed us':>10} {'eager us':>9} {'layer us':>9} {'ref us':>9} "
            f"{'speedup':>8} {'routed GB/s':>11} {'layer GB/s':>10} {'engine us':>9} {'engine GB/s':>11} "
            f"{'PDL us':>7} {'PDL GB/s':>8} "
            f"{'TFLOP/s':>8} {'mm TFLOP/s':>10} {'engine TFLOP/s':>14} {'mm (same) TFLOP/s':>17}")
        timings = []
        for t in s.tokens:
            r = time_step(s, layers, t, impl_for(s, t), timer, dev, dtype)
            timings.append(r)
            log(f"  {t:>5} {r['distinct_experts']:>7.1f} {r['routed_us']:>10.1f} {r['routed_eager_us']:>9.1f} "
                f"{r['layer_us']:>9.1f} {r.get('ref_layer_us', math.nan):>9.1f} {r.get('speedup_vs_ref', math.nan):>7.2f}x "
                f"{r['routed_GBps']:>11.0f} {r['layer_GBps']:>10.0f} {r['engine_layer_us']:>9.1f} "
                f"{r['engine_layer_GBps']:>11.0f} {r.get('engine_layer_pdl_us', math.nan):>7.1f} "
                f"{r.get('engine_layer_pdl_GBps', math.nan):>8.0f} {r['routed_TFLOPs']:>8.1f} {r['mm_TFLOPs']:>10.1f} "
                f"{r['engine_TFLOPs']:>14.1f} {r['mm_engine_TFLOPs']:>17.1f}")
        # the bars, spelled out: decode-sized layers on copy bandwidth, prompt-sized ones on torch.mm
        copy = summary.get("hbm_copy_GBps")
        bars = []
        for r in timings:
            if copy and r["T"] <= PDL_MAX_T:
                r["engine_pct_of_copy"] = 100 * r["engine_layer_GBps"] / copy
                text = f"T={r['T']}: engine layer {r['engine_pct_of_copy']:.1f}% of copy"
                if "engine_layer_pdl_GBps" in r:
                    r["engine_pdl_pct_of_copy"] = 100 * r["engine_layer_pdl_GBps"] / copy
                    text += f", {r['engine_pdl_pct_of_copy']:.1f}% with PDL"
                bars.append(text)
            elif r["T"] >= 256:
                r["routed_pct_of_mm"] = 100 * r["routed_TFLOPs"] / r["mm_TFLOPs"]
                r["engine_pct_of_mm"] = 100 * r["engine_TFLOPs"] / r["mm_engine_TFLOPs"]
                bars.append(f"T={r['T']}: routed {r['routed_pct_of_mm']:.1f}% of torch.mm, engine layer "
                            f"{r['engine_pct_of_mm']:.1f}% of torch.mm on its FLOPs")
        if bars:
            log("  " + "; ".join(bars))
        entry = {"shape": s.name, "hidden": s.hidden, "experts": s.experts, "top_k": s.top_k,
                 "inter": s.inter, "shared": s.shared, "checks": checks, "graph": graph, "timings": timings}
        if args.profile and dev.type == "cuda":
            entry["profile"] = [profile_step(s, layers, int(t), impl_for(s, int(t)), dev, dtype)
                                for t in args.profile.split(",")]
        summary["shapes"].append(entry)
    summary["ok"] = ok
    summary["wall_s"] = time.perf_counter() - started
    log(f"\n{'all checks passed' if ok else 'SOME CHECKS FAILED'} in {summary['wall_s']:.0f} s")
    line = json.dumps(summary, default=float)
    print(line)
    if args.json:
        Path(args.json).write_text(line + "\n")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
