"""The deterministic mode's folded launches against their unfolded forms, on a CUDA GPU, at a geometry's decode
shapes: what folding the activation into the gate_up GEMM, the argmax into the LM head and the router's GEMM into
its route saves per call and per batch-1 step.

    python benchmarks/batch_invariant_folds.py --geometry m3-mini --json bi_folds.json
    python benchmarks/batch_invariant_folds.py --device cpu --geometry tiny --t 1 --quick   # smoke test

Each op is timed in its forms (m3eagle/kernels/batch_invariant/):

- gate_up + activation (the dense MLPs' and shared experts' SwiGLU-OAI, the draft head's SiLU-and-multiply):
  `folds.linear_act` (one launch) vs `folds.linear_act_two_launch` (the batch-invariant GEMM, then the activation);
- LM head + argmax (the target's; the draft head's with its d2t offsets): `folds.linear_argmax` vs
  `folds.linear_argmax_two_launch` (the GEMM, then the argmax);
- the router: `router.route_tokens` (one launch) vs its two-launch form (`router_logits` + route) vs the mode's
  former path (x cast to fp32, the fp32 batch-invariant GEMM, route: three launches), and beside them the
  triton backend's router (not batch-invariant: the ceiling), also at --prompt-t tokens, where the one-launch
  router's per-token programs are at their slowest.

Every folded form is checked to give its two-launch form's bits at each row count before it is timed. Timing as
benchmarks/gemv.py: calls captured back to back in one CUDA graph over weight copies that span --rotate-mb,
median of --replays replays, per call. `per_step` adds up, for a batch-1 step (T = 1) of the geometry, the
us saved per call times the calls a step makes (layers of each kind, one LM head), and the launches saved; it is
an estimate from isolated calls, not a step measurement (bench_gpu.sh det measures steps).
"""

from __future__ import annotations

import sys

from _interpreter import use_interpreter_for_cpu  # noqa: E402  (the script's own folder)

use_interpreter_for_cpu(sys.argv)  # before anything imports triton

import argparse  # noqa: E402
import json  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gemv import graph_time, weight_copies  # noqa: E402

from m3eagle.kernels.batch_invariant import folds, matmul, router  # noqa: E402
from m3eagle.kernels.moe import router as moe_router  # noqa: E402

Fn = Callable[[torch.Tensor, torch.Tensor], Any]


def fold_ops(name: str) -> list[dict[str, Any]]:
    """The folded ops a decode step of geometry `name` runs: what, kind, weight (N, K, dtype), calls per step."""
    from m3eagle.bench import geometries as geo

    c, draft = geo.NAMED[name]()
    h = c.hidden_size
    n_moe = sum(t == geo.MOE for t in c.mlp_layer_types)
    n_dense = len(c.mlp_layer_types) - n_moe
    ops = []
    if n_dense:
        ops.append({"what": "dense gate_up + swiglu", "kind": "swiglu_oai", "n": 2 * c.dense_intermediate_size, "k": h,
                    "per_step": n_dense})
    if n_moe:
        ops.append({"what": "shared gate_up + swiglu", "kind": "swiglu_oai", "n": 2 * c.shared_intermediate_size,
                    "k": h, "per_step": n_moe})
        ops.append({"what": "router", "kind": "router", "n": c.num_local_experts, "k": h, "top_k": c.num_experts_per_tok,
                    "per_step": n_moe})
    ops.append({"what": "lm_head + argmax", "kind": "argmax", "n": c.vocab_size, "k": h, "per_step": 1})
    if draft is not None:  # a speculative step's draft head (not in a plain step)
        ops.append({"what": "head gate_up + silu", "kind": "silu", "n": 2 * draft.intermediate_size,
                    "k": draft.hidden_size, "per_step": 0})
        ops.append({"what": "head lm_head + argmax", "kind": "argmax_d2t", "n": draft.draft_vocab_size,
                    "k": draft.hidden_size, "per_step": 0})
    return ops


def forms(op: dict[str, Any], dev: torch.device) -> dict[str, tuple[Fn, int]]:
    """The op's forms: name -> (fn(x, w), launches per call). The first is the folded one, the second its
    two-launch reference."""
    kind = op["kind"]
    if kind in ("swiglu_oai", "silu"):
        return {"folded": (lambda x, w: folds.linear_act(x, w, kind, 1.702, 7.0), 1),
                "two_launch": (lambda x, w: folds.linear_act_two_launch(x, w, kind, 1.702, 7.0), 2)}
    if kind in ("argmax", "argmax_d2t"):
        off = torch.randint(0, 4, (op["n"],), device=dev) if kind == "argmax_d2t" else None
        return {"folded": (lambda x, w: folds.linear_argmax(x, w, off), 1),
                "two_launch": (lambda x, w: folds.linear_argmax_two_launch(x, w, off), 2)}
    bias = torch.zeros(op["n"], device=dev)
    k = op["top_k"]
    counters = torch.zeros(moe_router.ROUTER_GEMV_MAX_T, dtype=torch.int32, device=dev)
    split: dict[int, torch.Tensor] = {}

    def triton_router(x: torch.Tensor, w: torch.Tensor) -> Any:  # TritonFused.route_tokens' choice
        big = x.shape[0] > moe_router.ROUTER_GEMV_MAX_T and moe_router.router_tile_ok(x, w)
        sp = split.setdefault(id(w), moe_router.router_split(w)) if big else None
        return moe_router.route_tokens(x, w, bias, k, counters, sp)

    return {"folded": (lambda x, w: router.route_tokens(x, w, bias, k), 1),
            "two_launch": (lambda x, w: router.route_tokens_two_launch(x, w, bias, k), 2),
            "former": (lambda x, w: moe_router.route(matmul.linear(x.to(w.dtype), w).float(), bias, k), 3),
            "triton": (triton_router, 1)}


def _same(a: Any, b: Any) -> bool:
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    return all(torch.equal(p, q) for p, q in zip(a, b))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--geometry", default="m3-mini", help="m3-mini, m3-8b, m3 or tiny")
    p.add_argument("--device", default="cuda")
    p.add_argument("--t", default="1,4,32", help="rows per call (the first is the per-step estimate's)")
    p.add_argument("--prompt-t", type=int, default=8192, help="router tokens of a prompt chunk (0: skip)")
    p.add_argument("--rotate-mb", type=float, default=256.0)
    p.add_argument("--max-copies", type=int, default=512)
    p.add_argument("--replays", type=int, default=10)
    p.add_argument("--min-calls", type=int, default=50)
    p.add_argument("--quick", action="store_true", help="no prompt-size router (the CPU smoke test)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("batch_invariant_folds.py: needs a CUDA GPU (or --device cpu for a smoke test)")
        return 2
    torch.manual_seed(0)
    ts = [int(t) for t in args.t.split(",")]
    doc: dict[str, Any] = {"command": " ".join(["python", "benchmarks/batch_invariant_folds.py",
                                                *(argv if argv is not None else sys.argv[1:])]),
                           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                           "geometry": args.geometry, "ops": []}
    saved_us, saved_launches = 0.0, 0
    for op in fold_ops(args.geometry):
        router_op = op["kind"] == "router"
        dtype = torch.float32 if router_op else torch.bfloat16
        ws = weight_copies(op["n"], op["k"], dtype, dev, args.rotate_mb if dev.type == "cuda" else 0,
                           args.max_copies)
        fs = forms(op, dev)
        rows = ts + ([args.prompt_t] if router_op and args.prompt_t and not args.quick else [])
        for t in rows:
            x = torch.randn(t, op["k"], device=dev).to(torch.bfloat16)  # [T, K]
            folded, two = fs["folded"][0](x, ws[0]), fs["two_launch"][0](x, ws[0])
            if not _same(folded, two):
                raise AssertionError(f"{op['what']} at T = {t}: the folded form differs from its two launches")
            calls = max(4, args.min_calls // (8 if t > 64 else 1))
            us = {name: graph_time(fn, x, ws, args.replays, calls) for name, (fn, _) in fs.items()}
            row = {**op, "t": t, "us": us, "launches": {name: n for name, (_, n) in fs.items()}}
            doc["ops"].append(row)
            print(f"{op['what']:24s} {op['n']}x{op['k']} T={t:<5d} "
                  + "  ".join(f"{name} {v:8.2f} us" for name, v in us.items()))
            if t == ts[0] == 1 and op["per_step"]:
                unfolded = "former" if router_op else "two_launch"
                saved_us += op["per_step"] * (us[unfolded] - us["folded"])
                saved_launches += op["per_step"] * (fs[unfolded][1] - fs["folded"][1])
    if ts[0] == 1:
        doc["per_step"] = {"us_saved_isolated": saved_us, "launches_saved": saved_launches}
        print(f"batch-1 plain step, {args.geometry}: {saved_launches} launches fewer, {saved_us:.1f} us less "
              "(sum of isolated calls)")
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
