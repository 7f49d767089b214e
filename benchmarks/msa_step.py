"""One m3-mini (or m3-8b) target step at long context: MiniMax Sparse Attention (MSA) vs dense attention.

    python benchmarks/msa_step.py                        # H200: about 2 minutes
    python benchmarks/msa_step.py --json msa_step.json   # also write the JSON document to a file
    python benchmarks/msa_step.py --geometry m3-8b --no-sweep   # the m3-8b geometry (~110 GB of HBM)
    python benchmarks/msa_step.py --device cpu --tiny    # smoke test on CPU (sets TRITON_INTERPRET=1)

What it runs, in one process:

1. The m3-mini geometry with random bf16 weights (vocab 32000, hidden 2048, 12 layers: 2 dense MLP /
   full attention, then 10 MoE / MSA; 16 heads, 2 KV heads, head_dim 128, half-rotary; 32 experts top-4;
   indexer 2 heads x 128, block 128, top-16, local 1), and the same model with every attention layer full
   ("dense"), sharing weights and K/V pools. Pools are filled with random K/V/index-K for 8 rows of 128k.
2. One target step (forward + logits) captured by hand in a CUDA graph and replayed, for contexts 1k,
   16k, 64k, 128k and two shapes: b1 (1 row x 1 token, decode) and 8x4 (8 rows x 4 tokens, spec verify).
   Times are medians over replays. By default every step carries the graph-style KV bound that the
   engine's graph runner fixes (max_kv = the table width in slots, past 128k), so kernel grids never
   depend on the context; `--max-kv ctx` uses each context as its own bound instead (eager-engine style).
3. One sparse layer alone at 64k (b1 and 8x4), each call graph-captured 10 times back to back: the
   indexer (GB/s of index-K read vs the measured HBM copy bandwidth), the attention over the selection,
   both, the dense kernel on the same pools, and the model-side indexer prologue (its q/k norms, RoPE and
   the index-K cache write ride in the layer's fused q/k/v launch, as its projections ride in the packed
   GEMM: the prologue is that launch with the index heads minus without) that runs before the backend. Plus
   a sweep of the indexer's split size, keys per loop iteration and warps, and of the split merge's
   warps, at 16k / 64k / 128k.
4. Checks at 128k, for the b1 and 8x4 rows: the Triton selection equals `reference.select_blocks`
   (mismatches are reported with the score gap that explains them: fp32 sums in another order can only
   flip exact near-ties), and sparse attention matches `reference.paged_attention` within bf16 tolerance.

A readable table goes to stderr, one JSON line to stdout (and to --json FILE). Targets (issue 16):
MSA/dense <= 1.05 at 1k b1; <= 0.8 / 0.6 / 0.5 at 16k / 64k / 128k (b1 and 8x4); MSA 128k / 1k (8x4)
<= 1.25. The roofline columns give the floor of each step (bytes an ideal engine reads / copy bandwidth,
`m3eagle.bench.roofline`): a target below the floors' ratio cannot be met by attention kernels alone.
"""

from __future__ import annotations

import sys

from _interpreter import use_interpreter_for_cpu  # noqa: E402  (the script's own folder)

use_interpreter_for_cpu(sys.argv)  # before anything imports triton

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass, replace  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from m3eagle.bench import roofline  # noqa: E402
from m3eagle.config import M3Config  # noqa: E402
from m3eagle.kernels.attention import reference  # noqa: E402
from m3eagle.kernels.attention.metadata import TRASH_PAGE, AttnMetadata, build_metadata, gather_slots  # noqa: E402
from m3eagle.kernels.attention.triton_backend import TritonBackend  # noqa: E402
from m3eagle.kernels.fused.reference import rope_cos_sin  # noqa: E402
from m3eagle.loader.dummy import dummy_target  # noqa: E402
from m3eagle.models.layers import pack_projections  # noqa: E402
from m3eagle.models.minimax_m3 import LayerCache, MiniMaxM3  # noqa: E402

FULL, SPARSE, DENSE_MLP, MOE_MLP = "full_attention", "minimax_m3_sparse", "dense", "sparse"
TARGETS = {1024: 1.05, 16384: 0.8, 65536: 0.6, 131072: 0.5}  # MSA / dense step time, per context
FLAT_LIMIT = 1.25  # MSA 128k / MSA 1k, 8x4


def log(*args: object) -> None:
    print(*args, file=sys.stderr, flush=True)


# ---- the geometry ---------------------------------------------------------------------------------------


def m3_config(tiny: bool, geometry: str = "m3-mini") -> M3Config:
    """m3-mini or m3-8b (`m3eagle bench`'s geometries, m3eagle/bench/geometries.py), or a tiny one for the
    CPU smoke test. Full attention first."""
    if not tiny and geometry != "m3-mini":
        from m3eagle.bench import geometries

        return geometries.NAMED[geometry]()[0]
    if tiny:
        sizes = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, dense_intermediate_size=64, num_local_experts=4,
                     num_experts_per_tok=2, intermediate_size=32, shared_intermediate_size=32, index_n_heads=2,
                     index_head_dim=32, index_block_size=16, index_topk_blocks=2)
        n_full = 1
    else:
        sizes = dict(vocab_size=32000, hidden_size=2048, num_hidden_layers=12, num_attention_heads=16,
                     num_key_value_heads=2, head_dim=128, dense_intermediate_size=4096, num_local_experts=32,
                     num_experts_per_tok=4, intermediate_size=1024, shared_intermediate_size=1024,
                     index_n_heads=2, index_head_dim=128, index_block_size=128, index_topk_blocks=16)
        n_full = 2
    n = sizes["num_hidden_layers"]
    return M3Config.from_dict(dict(
        sizes, partial_rotary_factor=0.5, index_local_blocks=1, bos_token_id=1, eos_token_id=0,
        layer_types=[FULL] * n_full + [SPARSE] * (n - n_full),
        mlp_layer_types=[DENSE_MLP] * n_full + [MOE_MLP] * (n - n_full)))


def dense_config(cfg: M3Config) -> M3Config:
    """The same model with every attention layer full (no indexer)."""
    return replace(cfg, layer_types=(FULL,) * cfg.num_hidden_layers)


def make_ops(device: torch.device):
    """How the models get their fast paths (attention backend, MoE, fused elementwise ops) -- the one
    place that knows. The engine hands an `m3eagle.kernels.ops.Ops` to the models with each step's metadata
    (`meta.ops`). Triton attention always (the interpreter on CPU); the rest as the engine picks them."""
    from m3eagle.kernels.ops import make_ops as engine_ops

    return engine_ops("triton", "auto", device)


def with_ops(meta: AttnMetadata, ops) -> AttnMetadata:
    return replace(meta, ops=ops)


# ---- pools and steps ------------------------------------------------------------------------------------


@dataclass
class Pools:
    """K/V (every layer) and index-K (sparse layers) for `rows` rows of up to `row_slots` tokens each.
    Row r owns the pages of slots [1 + r * row_pages, 1 + (r + 1) * row_pages) in a shuffled order."""

    msa: list[LayerCache]
    dense: list[LayerCache]  # the same K/V tensors, no index-K
    page_size: int
    row_pages: int
    perm: torch.Tensor  # [rows, row_pages] page ids (page 0 is the trash page)


def make_pools(model: MiniMaxM3, rows: int, max_ctx: int, page_size: int, device: torch.device) -> Pools:
    row_pages = -(-(max_ctx + 64) // page_size)
    num_slots = (1 + rows * row_pages) * page_size
    g = torch.Generator(device=device).manual_seed(1)
    caches = model.new_caches(num_slots, model.embed_tokens.weight.dtype, device)
    for c in caches:  # post-norm K, V and index keys are O(1): unit normals
        for t in (c.k, c.v, c.idx_k):
            if t is not None:
                t.normal_(generator=g)
    dense = [LayerCache(c.k, c.v, None) for c in caches]
    perm = 1 + torch.randperm(rows * row_pages, generator=torch.Generator().manual_seed(2)).view(rows, row_pages)
    return Pools(caches, dense, page_size, row_pages, perm)


def step_metadata(pools: Pools, rows: int, q_len: int, ctx: int, max_kv: int, device: torch.device) -> AttnMetadata:
    """rows x q_len new tokens, each row ending at position ctx - 1 (its last q_len tokens are this step's)."""
    width = -(-max_kv // pools.page_size)
    table = torch.full((rows, width), TRASH_PAGE, dtype=torch.int64)
    held = -(-ctx // pools.page_size)
    table[:, :held] = pools.perm[:rows, :held]
    return build_metadata([q_len] * rows, torch.full((rows,), ctx), table, pools.page_size, device, max_kv)


class Timer:
    """Median GPU milliseconds of one call, CUDA-graph captured by hand (eager wall time on the CPU)."""

    def __init__(self, device: torch.device, reps: int, warmup: bool = True) -> None:
        self.device, self.reps, self.warmup = device, reps, warmup

    def __call__(self, fn: Callable[[], object], calls: int = 1) -> float:
        if self.device.type != "cuda":
            if self.warmup:  # (the --smoke run skips it: the interpreter has nothing to warm, only time to spend)
                fn()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            return (time.perf_counter() - t0) * 1e3 / calls
        graph = self._capture(fn, calls)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(self.reps)]
        for start, end in events:
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize()
        ms = statistics.median(s.elapsed_time(e) for s, e in events) / calls
        del graph
        return ms

    def kernels(self, fn: Callable[[], object], reps: int = 10) -> list[dict]:
        """GPU time per call by kernel name (torch.profiler over `reps` replays of a graph of one call):
        where a step's device time goes. CUDA only."""
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        from m3eagle.bench.offline import top_kernels

        graph = self._capture(fn, 1)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                graph.replay()
            torch.cuda.synchronize()
        spans = [(e.name, e.time_range.end - e.time_range.start) for e in prof.events()
                 if e.device_type == DeviceType.CUDA]
        del graph
        return top_kernels(spans, reps, n=25)

    @staticmethod
    def _capture(fn: Callable[[], object], calls: int) -> torch.cuda.CUDAGraph:
        """`calls` back-to-back calls of fn in one CUDA graph, warmed up and replayed once."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture stream: Triton compiles, allocator settles
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # a private pool per capture: a pool shared with graphs already deleted trips an allocator assert
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        return graph


# ---- 1. whole steps -------------------------------------------------------------------------------------


def time_steps(args, cfg: M3Config, msa: MiniMaxM3, dense: MiniMaxM3, pools: Pools, ops, timer: Timer,
               bw: float) -> list[dict]:
    dev = timer.device
    dcfg = dense_config(cfg)
    rows_out = []
    log(f"{'context':>8} {'shape':>5} {'MSA ms':>8} {'dense ms':>9} {'MSA/dense':>9} {'target':>7} "
        f"{'floor MSA':>9} {'floor dense':>11} {'floor ratio':>11}")
    for ctx in args.contexts:
        for rows, q_len in args.shapes:
            max_kv = args.fixed_max_kv if args.max_kv == "fixed" else ctx
            meta = with_ops(step_metadata(pools, rows, q_len, ctx, max_kv, dev), ops)
            ids = torch.randint(0, cfg.vocab_size, (rows * q_len,), device=dev)
            res = {}
            for name, model, caches in (("msa", msa, pools.msa), ("dense", dense, pools.dense)):
                def step(model=model, caches=caches, ids=ids, meta=meta):
                    return model.compute_logits(model(ids, meta.positions, meta, caches))
                res[name] = timer(step)
            floors = {n: roofline.decode_step_bytes(c, rows, ctx, 2, tokens=rows * q_len)["total"] / bw * 1e3
                      for n, c in (("msa", cfg), ("dense", dcfg))}
            ratio = res["msa"] / res["dense"]
            limit = TARGETS.get(ctx)
            row = {"context": ctx, "rows": rows, "q_len": q_len, "msa_ms": res["msa"], "dense_ms": res["dense"],
                   "ratio": ratio, "target": limit, "floor_msa_ms": floors["msa"], "floor_dense_ms": floors["dense"]}
            rows_out.append(row)
            shape = f"{rows}x{q_len}"
            log(f"{ctx:>8} {shape:>5} {res['msa']:>8.3f} {res['dense']:>9.3f} {ratio:>9.3f} "
                f"{'<=' + str(limit) if limit else '-':>7} {floors['msa']:>9.3f} {floors['dense']:>11.3f} "
                f"{floors['msa'] / floors['dense']:>11.3f}")
    return rows_out


def _ctx(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def targets(steps: list[dict], shapes: list[tuple[int, int]]) -> dict:
    out = {}
    for s in steps:
        lim = s["target"]
        if lim is None or (s["context"] == 1024 and (s["rows"], s["q_len"]) != (1, 1)):
            continue  # the 1k target is for b1 only
        key = f"ratio_{_ctx(s['context'])}_{s['rows']}x{s['q_len']}"
        out[key] = {"value": s["ratio"], "limit": lim, "met": s["ratio"] <= lim}
    verify = max(shapes, key=lambda s: s[0] * s[1])
    by_ctx = {s["context"]: s["msa_ms"] for s in steps if (s["rows"], s["q_len"]) == verify}
    if by_ctx:
        lo, hi = min(by_ctx), max(by_ctx)
        value = by_ctx[hi] / by_ctx[lo]
        out[f"msa_{_ctx(hi)}_over_{_ctx(lo)}_{verify[0]}x{verify[1]}"] = {
            "value": value, "limit": FLAT_LIMIT, "met": value <= FLAT_LIMIT}
    return out


def profile_steps(args, cfg: M3Config, msa: MiniMaxM3, dense: MiniMaxM3, pools: Pools, ops, timer: Timer,
                  ) -> list[dict]:
    """Kernel tables of the MSA and the dense step at each --profile context (b1 and 8x4): where the
    MSA step's extra time goes."""
    out = []
    for ctx in args.profile:
        for rows, q_len in args.shapes:
            max_kv = args.fixed_max_kv if args.max_kv == "fixed" else ctx
            meta = with_ops(step_metadata(pools, rows, q_len, ctx, max_kv, timer.device), ops)
            ids = torch.randint(0, cfg.vocab_size, (rows * q_len,), device=timer.device)
            for name, model, caches in (("msa", msa, pools.msa), ("dense", dense, pools.dense)):
                def step(model=model, caches=caches, ids=ids, meta=meta):
                    return model.compute_logits(model(ids, meta.positions, meta, caches))
                top = timer.kernels(step)
                out.append({"context": ctx, "rows": rows, "q_len": q_len, "model": name, "top_kernels": top})
                log(f"-- {name} {ctx} ctx {rows}x{q_len}: GPU us per step by kernel "
                    f"(total {sum(k['us_per_step'] for k in top):.1f} in the top {len(top)})")
                for k in top[:18]:
                    log(f"   {k['us_per_step']:8.1f} us {k['calls_per_step']:5.1f}x  {k['name']}")
    return out


# ---- 2. one sparse layer ---------------------------------------------------------------------------------


def layer_inputs(cfg: M3Config, meta: AttnMetadata, dtype: torch.dtype, device: torch.device, seed: int):
    """Random q [T, Hq, D] and iq [T, Hi, Di] for one layer of this step."""
    g = torch.Generator(device=device).manual_seed(seed)
    t = meta.num_tokens

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=device).to(dtype)

    return rnd(t, cfg.num_attention_heads, cfg.head_dim), rnd(t, cfg.index_n_heads, cfg.index_head_dim)


def time_layer(args, cfg: M3Config, msa: MiniMaxM3, pools: Pools, timer: Timer, bw: float, ctx: int,
               shape: tuple[int, int], tri: TritonBackend, ops) -> dict:
    dev = timer.device
    layer = next(i for i in range(cfg.num_hidden_layers) if cfg.is_sparse(i))
    cache, attn = pools.msa[layer], msa.layers[layer].self_attn
    rows, q_len = shape
    max_kv = args.fixed_max_kv if args.max_kv == "fixed" else ctx
    meta = step_metadata(pools, rows, q_len, ctx, max_kv, dev)
    q, iq = layer_inputs(cfg, meta, cache.k.dtype, dev, 3)
    bs, topk, local, scale = cfg.index_block_size, cfg.index_topk_blocks, cfg.index_local_blocks, attn.scale
    sel = tri.select_blocks(iq, cache.idx_k, meta, bs, topk, local)
    x = torch.randn(meta.num_tokens, cfg.hidden_size, device=dev).to(cache.k.dtype)
    cos, sin = rope_cos_sin(meta.positions, cfg.rotary_dim, cfg.rope_theta, x.dtype, cfg.rope_scaling)

    pmeta = with_ops(meta, ops)

    pq, pk, pv, qi_raw, ki_raw = attn.proj(x)  # the index projections ride in the layer's packed GEMM
    t, d = meta.num_tokens, cfg.head_dim
    qkv = (pq.view(t, -1, d), pk.view(t, -1, d), pv.view(t, -1, d), attn.q_norm.weight, attn.k_norm.weight,
           attn.q_norm.eps, cos, sin, cache.k, cache.v, pmeta.slot_mapping)

    def with_index():  # what models.minimax_m3.Attention runs after that GEMM on a sparse layer
        return ops.fused.qkv_index_rope_store(*qkv, *attn.indexer.paged_inputs(qi_raw, ki_raw, cache.idx_k))

    def without_index():  # ... and on a full-attention layer
        return ops.fused.qkv_rope_store(*qkv)

    calls = args.layer_calls  # back to back, as the layers of a step launch them (10; 1 in the --smoke run)
    us = {
        "indexer": timer(lambda: tri.select_blocks(iq, cache.idx_k, meta, bs, topk, local), calls),
        "attend_selected": timer(lambda: tri.attend_selected(q, cache.k, cache.v, meta, scale, sel, bs), calls),
        "sparse_attention": timer(lambda: tri.sparse_attention(q, cache.k, cache.v, meta, scale, iq, cache.idx_k,
                                                               bs, topk, local), calls),
        "dense_attention": timer(lambda: tri.attention(q, cache.k, cache.v, meta, scale), calls),
        "qkv_rope_with_index": timer(with_index, calls),
        "qkv_rope_without_index": timer(without_index, calls),
    }
    us = {k: v * 1e3 for k, v in us.items()}
    us["indexer_prologue"] = us["qkv_rope_with_index"] - us["qkv_rope_without_index"]  # the index heads' share
    index_bytes = rows * ctx * cfg.index_head_dim * 2  # index-K read once per row
    gbps = index_bytes / (us["indexer"] * 1e-6) / 1e9
    return {"context": ctx, "rows": rows, "q_len": q_len, **{f"{k}_us": v for k, v in us.items()},
            "index_bytes": index_bytes, "indexer_GBps": gbps, "indexer_frac_of_copy_bw": gbps * 1e9 / bw}


def sweep_indexer(args, cfg: M3Config, pools: Pools, timer: Timer, bw: float) -> list[dict]:
    """Indexer alone under a few split sizes, keys per loop iteration and warp counts."""
    dev = timer.device
    out = []
    layer = next(i for i in range(cfg.num_hidden_layers) if cfg.is_sparse(i))
    for ctx in args.sweep_contexts:
        for rows, q_len in args.shapes:
            max_kv = args.fixed_max_kv if args.max_kv == "fixed" else ctx
            meta = step_metadata(pools, rows, q_len, ctx, max_kv, dev)
            _, iq = layer_inputs(cfg, meta, pools.msa[layer].k.dtype, dev, 4)
            grid = [(keys, per_iter, warps, None) for keys, per_iter, warps in
                    itertools.product((256, 512), (128, 256, 512), (4, 8))]
            grid += [(None, 256, None, merge) for merge in (1, 2, 4, 8)]  # the split merge's warps
            for keys, per_iter, warps, merge in grid:
                tri = TritonBackend(min_index_keys_per_split=keys, index_num_warps=warps,
                                    index_keys_per_iter=per_iter, index_merge_warps=merge)

                def index(tri=tri, iq=iq, meta=meta):
                    return tri.select_blocks(iq, pools.msa[layer].idx_k, meta, cfg.index_block_size,
                                             cfg.index_topk_blocks, cfg.index_local_blocks)
                us = timer(index, 10) * 1e3
                gbps = rows * ctx * cfg.index_head_dim * 2 / (us * 1e-6) / 1e9
                out.append({"context": ctx, "rows": rows, "q_len": q_len, "min_index_keys_per_split": keys,
                            "index_keys_per_iter": per_iter, "index_num_warps": warps, "index_merge_warps": merge,
                            "us": us, "GBps": gbps, "frac_of_copy_bw": gbps * 1e9 / bw})
    return out


# ---- 3. checks against the reference ---------------------------------------------------------------------


def check(args, cfg: M3Config, msa: MiniMaxM3, pools: Pools, ctx: int, tri: TritonBackend,
          device: torch.device) -> dict:
    layer = next(i for i in range(cfg.num_hidden_layers) if cfg.is_sparse(i))
    cache, scale = pools.msa[layer], msa.layers[layer].self_attn.scale
    bs, topk, local = cfg.index_block_size, cfg.index_topk_blocks, cfg.index_local_blocks
    out = []
    for rows, q_len in args.shapes:
        max_kv = args.fixed_max_kv if args.max_kv == "fixed" else ctx
        meta = step_metadata(pools, rows, q_len, ctx, max_kv, device)
        q, iq = layer_inputs(cfg, meta, cache.k.dtype, device, 5)
        ik_rows = cache.idx_k[gather_slots(meta, meta.max_kv)]  # [B, L, Di]
        pos = reference.padded_positions(meta)
        ref = reference.select_blocks(reference.pad_queries(iq, meta), ik_rows, pos, bs, topk, local)
        ref = ref[meta.tok_row, :, meta.tok_col]  # [T, Hi, k]
        worst_gap, mismatched, unexplained = 0.0, 0, 0
        for splits in (1, None):  # one launch, and the backend's split policy
            sel = (tri.select_blocks(iq, cache.idx_k, meta, bs, topk, local) if splits is None else
                   tri_kernels().select_blocks(iq, cache.idx_k, meta, bs, topk, local, num_splits=1))
            bad = (sel != ref).any(-1).nonzero().tolist()  # [(t, h)]
            mismatched += len(bad)
            for t, h in bad:
                gap = _tie_gap(iq, ik_rows, meta, t, h, sel[t, h], ref[t, h], bs, local)
                worst_gap = max(worst_gap, gap)
                unexplained += gap > 1e-5
        args_ = (q, cache.k, cache.v, meta, scale, iq, cache.idx_k, bs, topk, local)
        o_ref = reference.paged_attention(*args_).float()
        o_tri = tri.sparse_attention(*args_).float()
        err = ((o_tri - o_ref).abs().max() / o_ref.abs().max()).item()
        out.append({"context": ctx, "rows": rows, "q_len": q_len, "selections": 2 * ref.shape[0] * ref.shape[1],
                    "mismatched": mismatched, "mismatched_not_near_tie": unexplained, "worst_tie_gap": worst_gap,
                    "attention_max_rel_err": err, "ok": unexplained == 0 and err < 2e-2 and
                    bool(torch.isfinite(o_tri).all())})
        log(f"check {ctx} ctx {rows}x{q_len}: {ref.numel()} selected blocks x 2 paths, {mismatched} rows differ "
            f"({unexplained} beyond fp32 near-ties, worst gap {worst_gap:.1e}); attention max rel err {err:.2e}")
    return {"cases": out, "ok": all(c["ok"] for c in out)}


def tri_kernels():
    from m3eagle.kernels.attention import triton_kernels

    return triton_kernels


def _tie_gap(iq, ik_rows, meta, t: int, h: int, sel: torch.Tensor, ref: torch.Tensor, bs: int, local: int) -> float:
    """Relative score gap between the blocks only one side picked and the oracle's last pick: ~1e-7 means
    the two fp32 sums (different orders) straddle an exact tie; anything large is a real bug (so is any
    disagreement about a forced local block, whose +inf ties must resolve identically)."""
    b, pos = int(meta.tok_row[t]), int(meta.positions[t])
    s = ik_rows[b, : pos + 1].float() @ iq[t, h].float()  # [pos + 1] fp32, as the oracle scores
    nb = -(-s.numel() // bs)
    s = torch.nn.functional.pad(s, (0, nb * bs - s.numel()), value=float("-inf")).view(nb, bs).amax(-1)
    own = pos // bs
    s[max(0, own - local + 1): own + 1] = float("inf")
    only = (set(sel.tolist()) ^ set(ref.tolist())) - {-1}
    if not only:
        return 0.0  # the same blocks in another order: a tie between two selected ones
    picks = [int(i) for i in ref.tolist() if i >= 0]
    last = s[picks[-1]].item() if picks else float("-inf")
    vals = [s[i].item() if i < nb else float("-inf") for i in only]
    if not all(math.isfinite(v) for v in (last, *vals)):
        return float("inf")
    return max(abs(v - last) / max(1.0, abs(last)) for v in vals)


# ---- main ------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (Triton interpreter, with --tiny)")
    ap.add_argument("--tiny", action="store_true", help="tiny geometry and contexts: a CPU smoke test")
    ap.add_argument("--smoke", action="store_true", help="with --tiny: one context and shape (a CI smoke test)")
    ap.add_argument("--geometry", choices=["m3-mini", "m3-8b"], default="m3-mini",
                    help="the bench geometry to time (default m3-mini; m3-8b needs ~110 GB of GPU memory)")
    ap.add_argument("--max-kv", choices=["fixed", "ctx"], default="fixed",
                    help="KV bound of each step: 'fixed' past the largest context, as CUDA graphs of the engine "
                         "(default), or 'ctx': the context itself")
    ap.add_argument("--reps", type=int, default=30, help="graph replays per timing (median)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--no-sweep", action="store_true", help="skip the indexer sweep")
    ap.add_argument("--profile", type=int, nargs="*", default=[], metavar="CTX",
                    help="also print kernel tables of the MSA and dense steps at these contexts (CUDA)")
    ap.add_argument("--json", type=Path, help="also write the JSON document here")
    args = ap.parse_args()
    t_start = time.time()
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks/msa_step.py: no CUDA device; run with --device cpu --tiny for a smoke test")
    if dev.type == "cpu" and not args.tiny:
        raise SystemExit("--device cpu runs the Triton interpreter: add --tiny")
    torch.manual_seed(0)
    cfg = m3_config(args.tiny, args.geometry)
    if args.tiny:
        args.contexts, args.shapes, args.sweep_contexts, layer_ctx = [64, 256], [(1, 1), (2, 3)], [], 256
        if args.smoke:  # one context and shape: the CI test that keeps this script running
            args.contexts, args.shapes, layer_ctx = [80], [(2, 3)], 80
        args.reps = 1
    else:
        args.contexts, args.shapes = [1024, 16384, 65536, 131072], [(1, 1), (8, 4)]
        args.sweep_contexts, layer_ctx = ([] if args.no_sweep else [16384, 65536, 131072]), 65536
    # --smoke (the CI test, under the interpreter): every timed call runs once, without a warm-up: what it keeps
    # running is the code, not the numbers (10 back-to-back calls of each layer op took most of its ~45 s)
    args.layer_calls = 1 if args.smoke else 10
    max_ctx = max(args.contexts)
    # As the graph runner: max_kv = the page table's width in slots (max_model_len + reserve, +1 page).
    args.fixed_max_kv = (-(-(max_ctx + 2 * 4) // args.page_size) + 1) * args.page_size
    ops = make_ops(dev)
    tri = ops.attention if isinstance(ops.attention, TritonBackend) else TritonBackend()

    # NOTE: fp32 on the CPU: the Triton 3.9 interpreter computes bf16 x bf16 tl.dot wrongly.
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    log(f"building {'tiny' if args.tiny else args.geometry} (random {dtype}) and its dense twin on {dev} ...")
    msa = dummy_target(cfg, dtype, dev)
    dense = dummy_target(dense_config(cfg), dtype, dev)
    # The same weights, shared rather than copied (m3-8b's twin would need another 20 GB); the indexer
    # has no twin.
    own = dict(msa.named_parameters())
    for name, p in dense.named_parameters():
        p.data = own[name].data
    torch.cuda.empty_cache() if dev.type == "cuda" else None
    for m in (msa, dense):  # one q/k/v(/index q/k) GEMM per layer, as the engine runs them
        pack_projections(m)
    rows_max = max(r for r, _ in [(1, 1), *args.shapes])
    pools = make_pools(msa, rows_max, max_ctx, args.page_size, dev)
    bw = roofline.measure_copy_bandwidth(dev, (4 << 30) if dev.type == "cuda" else (64 << 20))["bytes_per_s"]
    timer = Timer(dev, args.reps, warmup=not args.smoke)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (Triton interpreter)"
    log(f"{name}: copy bandwidth {bw / 1e9:.0f} GB/s; max_kv {args.max_kv}"
        f"{' = ' + str(args.fixed_max_kv) if args.max_kv == 'fixed' else ''}; page size {args.page_size}")

    with torch.no_grad():
        log("\n== one target step (forward + logits), CUDA graph replay, median ms ==")
        steps = time_steps(args, cfg, msa, dense, pools, ops, timer, bw)
        goals = targets(steps, args.shapes)
        for k, v in goals.items():
            log(f"target {k}: {v['value']:.3f} (<= {v['limit']}) {'met' if v['met'] else 'NOT met'}")

        log(f"\n== one sparse layer at {layer_ctx} ctx, us per call (10 calls per graph) ==")
        layer = [time_layer(args, cfg, msa, pools, timer, bw, layer_ctx, s, tri, ops) for s in args.shapes]
        for r in layer:
            log(f"{r['rows']}x{r['q_len']}: indexer {r['indexer_us']:.1f} ({r['indexer_GBps']:.0f} GB/s, "
                f"{100 * r['indexer_frac_of_copy_bw']:.0f}% of copy), attend selected {r['attend_selected_us']:.1f}, "
                f"sparse total {r['sparse_attention_us']:.1f}, dense kernel {r['dense_attention_us']:.1f}, "
                f"model-side indexer prologue {r['indexer_prologue_us']:.1f} (fused q/k/v launch "
                f"{r['qkv_rope_with_index_us']:.1f} with the index heads, {r['qkv_rope_without_index_us']:.1f} without)")

        profiles = []
        if args.profile and dev.type == "cuda":
            log("\n== kernel tables (torch.profiler over graph replays) ==")
            profiles = profile_steps(args, cfg, msa, dense, pools, ops, timer)

        sweep = sweep_indexer(args, cfg, pools, timer, bw) if args.sweep_contexts else []
        if sweep:
            log("\n== indexer sweep: min_index_keys_per_split x index_keys_per_iter x index_num_warps, then the "
                "merge's warps (None: default), us (GB/s) ==")
            for r in sweep:
                log(f"{r['context']:>7} {r['rows']}x{r['q_len']} keys {r['min_index_keys_per_split']!s:>5} "
                    f"per iter {r['index_keys_per_iter']:>4} warps {r['index_num_warps']!s:>4} merge warps "
                    f"{r['index_merge_warps']!s:>4}: {r['us']:7.1f} us ({r['GBps']:5.0f} GB/s)")

        log(f"\n== checks at {max_ctx} ctx against the reference ==")
        checks = check(args, cfg, msa, pools, max_ctx, tri, dev)

    doc = {"bench": "msa_step", "device": name, "geometry": "tiny" if args.tiny else args.geometry, "dtype": str(dtype),
           "max_kv_mode": args.max_kv, "max_kv": args.fixed_max_kv if args.max_kv == "fixed" else None,
           "page_size": args.page_size, "copy_GBps": bw / 1e9, "steps": steps, "targets": goals,
           "layer": layer, "profiles": profiles, "indexer_sweep": sweep, "check": checks, "wall_s": time.time() - t_start}
    line = json.dumps(doc, default=float)
    print(line)
    if args.json:
        args.json.write_text(line + "\n")
    log(f"\nwall {doc['wall_s']:.0f} s; checks {'ok' if checks['ok'] else 'FAILED'}")
    if not checks["ok"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
