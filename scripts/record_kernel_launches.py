"""Record every Triton kernel launch of interpreted engine runs, for tests/kernels/test_kernels_compile.py.

    python scripts/record_kernel_launches.py [--out tests/data/kernel_launches.json] [--passes bf16,fp8,...]
    (CPU only; the passes run in 2 processes at once: ~10 min on 2 cores)

Why: the CPU suite runs the kernels under the Triton interpreter, which accepts code that the GPU compiler
rejects (tl.dot tiles under 16, layouts and types only the compiler checks). The test compiles every launch
recorded here for sm_90 without a GPU, so a kernel is compiled off the GPU only if some launch of it is recorded;
tests/kernels/test_kernel_launch_coverage.py fails when a kernel of the package has none. Hence one run of this
script launches every kernel of the package, in four passes (each an engine run on the embedded pair under the
interpreter, plus direct calls for the launch shapes no engine run takes):

  bf16           every fast path on (triton attention, MoE and fused ops; bf16, as on the GPU; K=3 speculation;
                 a prompt past the indexer's top-k blocks so the sparse kernels run; the same again with splits of
                 16 keys asked for, so the split-KV dense, sparse and indexer launches and their combines run as on a
                 GPU), then a 24-token prompt with the tiled sparse prefill kernel on (`sparse_prefill_min_q`, off
                 by default) -- which fits the top-k, takes the dense shortcut and so launches no tiled kernel:
                 `_sparse_prefill_kernel`'s records and a head_dim-512 split `_combine_kernel` are kept by hand in
                 the file; direct calls: split-K
                 and tl.dot GEMV, an expert subset, the MoE's split-tail tiles, the
                 decode MoE's route + shared launches, the tiled router's other block shapes, the separate router
                 GEMV + route launches.
  deterministic  LLM(deterministic=True) with the batch-invariant backends forced (CPU would pick the reference):
                 batch_invariant/matmul.py's GEMM for every projection, the batch-invariant attention shapes, the
                 route launch; direct GEMMs: split with the in-launch sum, the two-launch fallback
                 (`linear_two_launch`, `_split_sum_kernel`), unsplit, bf16 and fp32.
  fp8            quantization="fp8" (MXFP8 weights, quant/w8a16.py): mx_linear's GEMV / tiled GEMM, the per-pair
                 MoE GEMVs at decode, the sorted MXFP8 MoE for prompts; direct mx_linear calls with each distinct
                 config of the tuned table (w8a16_configs.json) and the variants it holds none of (fp16 / fp32
                 activations, ragged K, LEAN split with either sum).
  tree           a 3,4,16 draft tree with the triton tree ops: the tree layout, walk, compaction, rerank and
                 top-k kernels.

Each distinct launch -- module, kernel, argument types, constexpr values, launch options -- is written once as
JSON (launches differing only in sizes or pointers compile alike and are one record), merged into the existing file
(`merge`: a record is dropped only when this run recorded its kernel with other argument names). Re-run it after
changing a kernel's parameters (the compile test says so when a record no longer matches its kernel) and after
adding a kernel (add a pass or a direct call that launches it).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import inspect
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402
import triton.runtime.interpreter as interp  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAUNCH_OPTIONS = {"num_warps", "num_stages", "enable_fp_fusion", "num_ctas", "maxnreg"}
DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
          torch.int64: "i64", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1",
          torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}


def arg_type(v: Any) -> str:
    """Triton's signature type of a runtime argument (what the launcher would specialise on)."""
    if isinstance(v, torch.Tensor):
        return "*" + DTYPES[v.dtype]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i32" if -2**31 <= v < 2**31 else "i64"
    if isinstance(v, float):
        return "fp32"
    raise TypeError(f"unrecorded argument type {type(v).__name__}")


def install_recorder(records: dict[str, list]) -> None:
    orig = interp.InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        sig = inspect.signature(fn)
        opts = {k: v for k, v in kwargs.items() if k in LAUNCH_OPTIONS}
        bound = sig.bind(*args, **{k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS})
        bound.apply_defaults()
        types, consts = {}, {}
        for name, p in sig.parameters.items():
            v = bound.arguments[name]
            if "constexpr" in str(p.annotation) or v is None:
                consts[name] = v
            else:
                types[name] = arg_type(v)
        rec = [fn.__module__, fn.__name__, list(sig.parameters), types, consts, opts]
        records.setdefault(json.dumps(rec, sort_keys=True), rec)
        return orig(self, *args, grid=grid, warmup=warmup, **kwargs)

    interp.InterpretedFunction.run = run


def bf16_pass() -> None:
    """The embedded pair in bf16 with every fast path on, K=3 chains, plus direct calls for the paths it does
    not take; then a long prompt with the tiled sparse prefill kernel on (TritonBackend.sparse_prefill_min_q,
    off by default), each of its launches repeated split in two (the engine's split policy keeps CPU steps
    unsplit)."""
    from m3eagle import LLM, SamplingParams
    from m3eagle.kernels.attention import sparse_prefill
    from m3eagle.kernels.fused import gemv
    from m3eagle.kernels.moe import triton_moe

    llm = LLM(None, device="cpu", dtype="bfloat16", attention_backend="triton", moe_backend="triton",
              fused_backend="triton", num_draft_tokens=3, page_size=16, max_model_len=256)
    llm.ops.fused.gemv_max_t = gemv.MAX_T  # the decode GEMV as on CUDA (off the GPU it is taken only when asked)
    long_prompt = [(7 * i + 3) % 500 + 5 for i in range(80)]  # > 4 blocks of 16: the sparse path
    llm.generate([long_prompt, [12, 13, 14]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0.8, seed=1, max_tokens=3, ignore_eos=True))
    # split-KV attention as a GPU runs it (dense, sparse, indexer and the combines): the split policy keeps these
    # short CPU contexts on few programs unsplit, so splits of 16 keys over many waves are asked for here
    attn = llm.ops.attention
    policy = attn.min_keys_per_split, attn.waves
    attn.min_keys_per_split, attn.waves = 16, 64
    try:
        llm.generate([long_prompt[3:75], [21, 22, 23, 24]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    finally:
        attn.min_keys_per_split, attn.waves = policy
    # the tiled sparse prefill kernel (prompt chunks of >= 16 tokens once turned on), unsplit and split
    tiled = sparse_prefill.sparse_prefill_attention

    split_once = [2]

    def both(*a, num_splits=1, **kw):
        if split_once:  # one split launch (+ the combine) is enough: every layer's launch compiles alike
            tiled(*a, num_splits=split_once.pop(), **kw)
        return tiled(*a, num_splits=num_splits, **kw)

    sparse_prefill.sparse_prefill_attention = both
    try:
        llm.ops.attention.sparse_prefill_min_q = sparse_prefill.PREFILL_MIN_Q
        prompt = [(11 * i + 5) % 500 + 5 for i in range(24)]  # >= 16 tokens of one row (PREFILL_MIN_Q)
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    finally:
        sparse_prefill.sparse_prefill_attention = tiled
    # paths the run does not take: split-K and tl.dot GEMV, an expert subset of the MoE
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 256, generator=g).bfloat16(), torch.randn(96, 256, generator=g).bfloat16()
    counters = gemv.SplitCounters()
    for cfg in (gemv.GemvConfig(16, 64, split_k=2), gemv.GemvConfig(32, 64, num_stages=3, use_dot=True, split_k=2)):
        gemv.linear(x[:2] if not cfg.use_dot else x, w, cfg, counters)
    w13, w2 = (torch.randn(8, 128, 64, generator=g).bfloat16(), torch.randn(8, 64, 64, generator=g).bfloat16())
    xs = torch.randn(5, 64, generator=g).bfloat16()
    idx = torch.argsort(torch.rand(5, 8, generator=g), 1)[:, :2]
    triton_moe.fused_experts(xs, torch.full((5, 2), 0.5), idx, w13, w2, 1.702, 7.0, (2, 6))
    # the sorted GEMMs' half-height tail tiles (MoEConfig.split_tail: 64-row blocks, 32-row tails)
    from m3eagle.kernels.moe.tuning import MoEConfig

    xt = torch.randn(40, 64, generator=g).bfloat16()
    idx = torch.argsort(torch.rand(40, 8, generator=g), 1)[:, :2]
    triton_moe.fused_experts(xt, torch.full((40, 2), 0.5), idx, w13, w2, 1.702, 7.0,
                             config=MoEConfig(64, 32, 32, 4, 4, 3, split_tail=1))
    # the decode MoE's router + shared-expert launch and down's weight preload (moe/direct.py; the tuning
    # table asks for them on the H200 only)
    from m3eagle.kernels.moe import direct

    direct.route_direct_experts(xs[:1], torch.randn(8, 64, generator=g), torch.zeros(8), 2,
                                torch.zeros(64, dtype=torch.int32), w13, w2, 1.702, 7.0,
                                MoEConfig(16, 16, 32, num_stages=1, direct=1, down_block_n=8, down_block_k=64,
                                          down_preload=1, route_shared=1), (w13[0], w2[0]), 2.5)
    # several gate_up / down column tiles per program (MoEConfig.gate_rows / down_rows; the H200 table's)
    triton_moe.fused_experts(xs[:1], torch.full((1, 2), 0.5), idx[:1], w13, w2, 1.702, 7.0,
                             config=MoEConfig(16, 8, 32, num_stages=1, direct=1, down_block_n=4, down_block_k=64,
                                              down_preload=1, down_rows=2, gate_rows=2),
                             shared=(w13[0], w2[0]), routed_scale=2.5)
    # the shared expert's down in the routed gate_up launch (MoEConfig.shared_down; the H200's m3-8b entry)
    direct.route_direct_experts(xs[:1], torch.randn(8, 64, generator=g), torch.zeros(8), 2,
                                torch.zeros(64, dtype=torch.int32), w13, w2, 1.702, 7.0,
                                MoEConfig(16, 8, 32, num_stages=1, direct=1, down_block_n=4, down_block_k=64,
                                          down_preload=1, route_shared=1, down_rows=2, gate_rows=2, shared_down=2),
                                (w13[0], w2[0]), 2.5)
    # the tiled router's other block shapes (long prompts, MiniMax-M3's 128 experts)
    from m3eagle.kernels.moe import router

    xr = torch.randn(70, 256, generator=g).bfloat16()
    for n_exp, bm, bh in ((128, None, None), (32, 64, 128), (128, 64, 64)):
        wr = torch.randn(n_exp, 256, generator=g) / 16
        router.route_tiles(xr, router.router_split(wr), torch.zeros(n_exp), 8, bm, bh)
    # the router's separate GEMV + route launches (TritonFused.router_logits / route: what route_tokens falls
    # back to without its counters, and the batch-invariant route)
    wr = torch.randn(32, 256, generator=g) / 16
    router.route(router.router_logits(xr[:4], wr), torch.zeros(32), 4)


def deterministic_pass() -> None:
    """LLM(deterministic=True) with the batch-invariant kernels forced on CPU (the GPU's choice; CPU picks the
    reference): batch_invariant/matmul.py's GEMM for every projection, the batch-invariant attention launch
    shapes, the route launch after the GEMM router; then direct GEMMs for the shapes the pair does not take
    (split with the in-launch sum, the two-launch fallback with `_split_sum_kernel`, unsplit, fp32)."""
    from m3eagle import LLM, SamplingParams
    from m3eagle.kernels.attention import triton_kernels
    from m3eagle.kernels.attention.metadata import build_metadata
    from m3eagle.kernels.batch_invariant import folds, matmul
    from m3eagle.kernels.batch_invariant.moe import BatchInvariantMoE

    bi = "batch_invariant"
    llm = LLM(None, device="cpu", dtype="bfloat16", attention_backend=bi, moe_backend=bi, fused_backend=bi,
              deterministic=True, num_draft_tokens=3, page_size=16, max_model_len=256)
    long_prompt = [(5 * i + 1) % 500 + 5 for i in range(72)]
    llm.generate([long_prompt, [12, 13, 14]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(3, 2048, generator=g).to(dtype)
        w = torch.randn(64, 2048, generator=g).to(dtype)  # one tile: 4 (bf16) / 8 (fp32) splits
        matmul.linear(x, w)  # split: the in-launch reduction
        matmul.linear_two_launch(x, w)  # split: the second launch
        wide = torch.randn(64 * matmul.TARGET_PROGRAMS, 64, generator=g).to(dtype)
        matmul.linear(x[:, :64], wide)  # unsplit (a weight wide enough to fill the programs: 64-deep K tiles)
        # a sparse layer whose context fits the top-k: every block walked without the indexer (ALL)
        k_pool, v_pool = (torch.randn(64, 2, 16, generator=g).to(dtype) for _ in range(2))
        meta = build_metadata([2], torch.tensor([7]), torch.tensor([[1, 2]]), 4, torch.device("cpu"), max_kv=7)
        triton_kernels.sparse_attention(torch.randn(2, 4, 16, generator=g).to(dtype), k_pool, v_pool, meta, 0.25,
                                        (2, 2), 4, sel_chunk=32)
        # the shared expert in the routed launches at the routed width (the pair's is another), fused and
        # separate combine
        e, h, i = 4, 64, 32
        w13, w2 = torch.randn(e, 2 * i, h, generator=g).to(dtype), torch.randn(e, h, i, generator=g).to(dtype)
        s13, s2 = w13[0].clone(), w2[0].clone()
        for t in (3, 20):
            xm = torch.randn(t, h, generator=g).to(dtype)
            idx = torch.randint(0, e, (t, 2), generator=g)
            BatchInvariantMoE().experts_and_shared(xm, torch.rand(t, 2, generator=g), idx, w13, w2, s13, s2, 1.702,
                                                   7.0, 2.0)
        inner, matmul.INNER_SPLIT_TILES = matmul.INNER_SPLIT_TILES, 1
        try:  # the splits summed inside each program, as a step with enough output tiles runs them
            matmul.linear(x, w)
            folds.linear_act(x, w, "swiglu_oai", 1.702, 7.0)
        finally:
            matmul.INNER_SPLIT_TILES = inner


def fp8_pass() -> None:
    """The embedded pair with quantization="fp8" (MXFP8 weights, w8a16.py): the decode GEMV / tiled GEMM of
    mx_linear, the per-pair MoE GEMVs at decode and the sorted MXFP8 MoE for prompts; then mx_linear with each
    distinct config of the tuned table (w8a16_configs.json) and the variants the table does not hold yet
    (fp16 / fp32 activations, ragged K, LEAN split with both sums), the activation epilogues and the prompt-size
    dequantizing launch."""
    import json as _json

    from m3eagle import LLM, SamplingParams
    from m3eagle.kernels.fused import gemv
    from m3eagle.kernels.quant import w8a16
    from m3eagle.kernels.quant.mxfp8 import quantize_mx

    llm = LLM(None, device="cpu", dtype="bfloat16", attention_backend="triton", moe_backend="triton",
              fused_backend="triton", quantization="fp8", num_draft_tokens=3, page_size=16, max_model_len=256)
    llm.ops.fused.gemv_max_t = gemv.MAX_T
    prompt = [(3 * i + 7) % 500 + 5 for i in range(12)]  # > GEMV_MAX_T rows: the tiled GEMM, the sorted MoE
    llm.generate([prompt, [12, 13, 14]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    g = torch.Generator().manual_seed(2)
    doc = _json.loads(w8a16.TUNED_PATH.read_text())
    configs = {(e["t"], w8a16.MxConfig(**e["config"])) for sec in doc["devices"].values() for e in sec.get("gemv", [])}
    C = w8a16.MxConfig
    configs |= {(2, C(False, 2, 32, 256, num_warps=8, split_k=2, lean=True, one_launch=True)),
                (8, C(False, 8, 8, 256, split_k=2, lean=True, one_launch=True)),
                (1, C(False, 1, 8, 1024, split_k=2, lean=True)),
                (1, C(False, 1, 8, 512, split_k=2)),
                (1, C(False, 1, 16, 512, lean=True)),
                (1, C(True, 16, 64, 256, split_k=2, one_launch=True, num_stages=4)),
                (1, C(True, 16, 128, 256, num_warps=8, split_k=2, one_launch=True, num_stages=3)),
                (300, w8a16.pick_config(300, 256, 256))}
    for t, cfg in sorted(configs, key=repr):
        n = 2 * cfg.block_n
        k = cfg.block_k * max(1, cfg.split_k)
        q, s = quantize_mx(torch.randn(n, k, generator=g))
        w8a16.mx_linear(torch.randn(t, k, generator=g).bfloat16(), q, s, config=cfg)
    # fp16 (GROUP_SCALE) and fp32 (IEEE) activations, K not a multiple of BLOCK_K (EVEN_K off)
    q, s = quantize_mx(torch.randn(128, 256, generator=g))
    w8a16.mx_linear(torch.randn(1, 256, generator=g).half(), q, s, config=C(True, 16, 64, 128, split_k=2,
                                                                             one_launch=True, num_stages=4))
    q, s = quantize_mx(torch.randn(128, 320, generator=g))
    w8a16.mx_linear(torch.randn(1, 320, generator=g), q, s, config=C(True, 16, 64, 128, split_k=2, num_stages=3))
    w8a16.mx_linear(torch.randn(5, 320, generator=g).bfloat16(), q, s,
                    config=C(False, 8, 8, 256, split_k=2, lean=True, one_launch=True))
    # the activation epilogue (a packed [gate; up] weight): the plain GEMV, the tiled GEMM unsplit and split with the
    # last program's sum, swiglu-oai and silu, bf16 and fp32
    q, s = quantize_mx(torch.randn(128, 256, generator=g))
    for t, cfg in ((1, C(False, 1, 16, 256)), (2, C(False, 2, 8, 128)), (12, C(True, 16, 64, 64)),
                   (1, C(True, 16, 64, 128, split_k=2, one_launch=True, num_stages=3)),
                   (20, w8a16.pick_config(20, 128, 256))):
        for act, dt in (("swiglu_oai", torch.bfloat16), ("silu", torch.bfloat16), ("swiglu_oai", torch.float32)):
            w8a16.mx_linear(torch.randn(t, 256, generator=g).to(dt), q, s, config=cfg, act=act)
    # the dequantizing launch of prompt-sized steps (DEQUANT_MIN_T rows and more): bf16 / fp32 scratch, K past one
    # 512-wide block and a K of one 256-wide block
    for n, k in ((64, 1056), (32, 256)):
        q, s = quantize_mx(torch.randn(n, k, generator=g))
        for dt in (torch.bfloat16, torch.float32):
            w8a16.mx_dequantize(q, s, dt)
    # the two-launch sum's 1024-wide blocks (N >= 1024)
    q, s = quantize_mx(torch.randn(1024, 1024, generator=g))
    w8a16.mx_linear(torch.randn(1, 1024, generator=g).bfloat16(), q, s, config=C(False, 1, 8, 512, split_k=2))
    # the decode MoE without a shared expert (the engine's layers fuse theirs): an expert-parallel rank's launches
    q13, s13 = quantize_mx(torch.randn(4, 128, 64, generator=g))
    q2, s2 = quantize_mx(torch.randn(4, 64, 64, generator=g))
    w8a16.mx_moe_experts(torch.randn(2, 64, generator=g).bfloat16(), torch.rand(2, 2, generator=g),
                         torch.tensor([[0, 3], [2, 1]]), q13, s13, q2, s2, 1.702, 7.0)
    # the LEAN GEMV body (the tuned table may pick it), without and with a shared expert; K past one 256-wide block
    q13, s13 = quantize_mx(torch.randn(4, 128, 320, generator=g))
    q2, s2 = quantize_mx(torch.randn(4, 320, 64, generator=g))
    sh = (*quantize_mx(torch.randn(128, 320, generator=g)), *quantize_mx(torch.randn(320, 64, generator=g)))
    for shared in (None, sh):
        w8a16.mx_moe_experts(torch.randn(1, 320, generator=g).bfloat16(), torch.rand(1, 2, generator=g),
                             torch.tensor([[1, 2]]), q13, s13, q2, s2, 1.702, 7.0, lean=True, shared=shared,
                             routed_scale=2.0)


def tree_pass() -> None:
    """The embedded pair drafting a 3,4,16 tree with the triton tree ops (the fused backend's name picks them):
    the tree layout kernels, the walk / compaction / rerank kernels and the top-k."""
    from m3eagle import LLM, SamplingParams

    llm = LLM(None, device="cpu", dtype="bfloat16", attention_backend="triton", moe_backend="triton",
              fused_backend="triton", draft_tree="3,4,16", page_size=16, max_model_len=256)
    llm.generate([[5, 6, 7, 8], [12, 13, 14]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    llm.generate([[9, 10, 11]], SamplingParams(temperature=0.8, seed=1, max_tokens=3, ignore_eos=True))
    # the top-k's other lane shapes: a short row without `add`, a vocabulary past 8K columns at depth 8
    from m3eagle.kernels.topk import triton_topk

    g = torch.Generator().manual_seed(3)
    triton_topk.best(torch.randn(2, 16, generator=g), 4)
    triton_topk.best(torch.randn(1, 16400, generator=g), 8, add=torch.zeros(1))


PASSES = {"bf16": bf16_pass, "deterministic": deterministic_pass, "fp8": fp8_pass, "tree": tree_pass}


def run_pass(name: str) -> list[list]:
    """The distinct launches of one pass (in this process, or a worker's)."""
    records: dict[str, list] = {}
    unrecorded = interp.InterpretedFunction.run
    install_recorder(records)
    t0 = time.time()
    try:
        with torch.no_grad():
            PASSES[name]()
    finally:
        interp.InterpretedFunction.run = unrecorded
    print(f"{name}: {time.time() - t0:.0f} s, {len(records)} launches", flush=True)
    return list(records.values())


def record_key(rec: list) -> str:
    return json.dumps(rec, sort_keys=True)


def merge(old: list[list], new: list[list]) -> list[list]:
    """The new launches, plus every old record that can still compile: one is dropped only when the run recorded
    its kernel with other argument names (the kernel's signature changed). So the records kept by hand (kernels or
    shapes no pass launches) and launches of passes not run this time survive a re-run. Sorted as written."""
    sigs: dict[tuple[str, str], set[tuple[str, ...]]] = {}
    for rec in new:
        sigs.setdefault((rec[0], rec[1]), set()).add(tuple(rec[2]))
    out = {record_key(rec): rec for rec in new}
    for rec in old:
        seen = sigs.get((rec[0], rec[1]))
        if seen is None or tuple(rec[2]) in seen:
            out.setdefault(record_key(rec), rec)
    return sorted(out.values(), key=lambda r: (r[0], r[1], json.dumps(r[3:], sort_keys=True)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "kernel_launches.json")
    ap.add_argument("--passes", default=",".join(PASSES),
                    help="comma-separated subset of %(default)s (merged into --out unless --replace)")
    ap.add_argument("--replace", action="store_true",
                    help="write only this run's launches (by default the file's other records that still match "
                         "their kernels' signatures are kept: `merge`)")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                    help="passes run at once, each in its own process (default %(default)s)")
    args = ap.parse_args()
    names = args.passes.split(",")
    records: dict[str, list] = {}
    if args.jobs > 1 and len(names) > 1:
        ctx = multiprocessing.get_context("spawn")  # fresh interpreters: TRITON_INTERPRET before triton's import
        with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
            # the longest pass first, so the others share the second process meanwhile
            for part in pool.map(run_pass, sorted(names, key=lambda n: n != "bf16")):
                for rec in part:
                    records.setdefault(record_key(rec), rec)
    else:
        for name in names:
            for rec in run_pass(name):
                records.setdefault(record_key(rec), rec)
    old = [] if args.replace or not args.out.exists() else json.loads(args.out.read_text())
    rows = merge(old, list(records.values()))
    args.out.write_text(json.dumps(rows, indent=None, separators=(",", ":")).replace("],[", "],\n[") + "\n")
    print(f"{len(rows)} launches of {len({(r[0], r[1]) for r in rows})} kernels -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
