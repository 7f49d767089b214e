"""Record every Triton kernel launch of a bf16 engine run, for tests/kernels/test_kernels_compile.py.

    python scripts/record_kernel_launches.py [--out tests/data/kernel_launches.json]   (CPU, ~5 min)

Why: the CPU suite runs the kernels under the Triton interpreter, which accepts code that the GPU compiler
rejects (tl.dot tiles under 16, layouts and types only the compiler checks).
This script runs the embedded pair with every fast path on (triton attention, MoE and fused ops; bf16, as
on the GPU; K=3 speculation; a prompt past the indexer's top-k blocks so the sparse kernels run; a few
direct calls for paths the run does not take: split-K GEMV, an expert subset, the MoE's split-tail tiles, the
tiled router's other block shapes) under the interpreter and
writes each distinct launch -- kernel, argument types, constexpr values, launch options -- as JSON. The
test compiles every recorded launch for sm_90 without a GPU. Re-run it after changing a kernel's
parameters (the test says so when a record no longer matches its kernel).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402
import triton.runtime.interpreter as interp  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAUNCH_OPTIONS = {"num_warps", "num_stages", "enable_fp_fusion", "num_ctas", "maxnreg"}
DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
          torch.int64: "i64", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}


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


def workload() -> None:
    from m3eagle import LLM, SamplingParams
    from m3eagle.kernels.fused import gemv
    from m3eagle.kernels.moe import triton_moe

    llm = LLM(None, device="cpu", dtype="bfloat16", attention_backend="triton", moe_backend="triton",
              fused_backend="triton", num_draft_tokens=3, page_size=16, max_model_len=256)
    llm.ops.fused.gemv_max_t = gemv.MAX_T  # the decode GEMV as on CUDA (off the GPU it is taken only when asked)
    long_prompt = [(7 * i + 3) % 500 + 5 for i in range(80)]  # > 4 blocks of 16: the sparse path
    llm.generate([long_prompt, [12, 13, 14]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0.8, seed=1, max_tokens=3, ignore_eos=True))
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "kernel_launches.json")
    args = ap.parse_args()
    records: dict[str, list] = {}
    install_recorder(records)
    with torch.no_grad():
        workload()
    rows = sorted(records.values(), key=lambda r: (r[0], r[1], json.dumps(r[3:], sort_keys=True)))
    args.out.write_text(json.dumps(rows, indent=None, separators=(",", ":")).replace("],[", "],\n[") + "\n")
    print(f"{len(rows)} launches of {len({(r[0], r[1]) for r in rows})} kernels -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
