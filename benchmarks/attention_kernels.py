"""Reference vs Triton paged attention on a CUDA GPU (bf16): latency, achieved bandwidth, and error.

    python benchmarks/attention_kernels.py            # all cases, < 2 minutes on an H200
    python benchmarks/attention_kernels.py --quick    # two cases, a smoke test

Shapes follow a small MiniMax-M3 slice: Hq=8, Hkv=2, D=64, one index head per KV head (Hi=2, Di=64),
page_size 16 with shuffled pages. Each case is decode (1 query token per row), spec-verify (1+K = 4 tokens
per row) or one prompt chunk over a cached prefix. Times are medians of CUDA-graph replay
(`triton.testing.do_bench_cudagraph`, as the engine runs decode), plus Triton's eager time (`do_bench`);
bandwidth counts the K/V (and index-key) bytes the Triton kernels must read, L2 hits included (so a prompt
chunk whose tokens re-read the same blocks can show more than HBM's ~4.8 TB/s).

Before timing, an fp32 check runs the compiled kernels on mixed rows (prompt chunk over a cached prefix,
decode, 1+K verify, trash pages, GQA, index heads != KV heads, a non-power-of-two block) with and without
split-KV (and the indexer in one launch and split), and holds them to the reference at 1e-4 and to its
block selection exactly (as sets): the CPU tests cover the same under the Triton interpreter only. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from m3eagle.kernels.attention import reference  # noqa: E402
from m3eagle.kernels.attention.metadata import build_metadata, gather_slots  # noqa: E402
from m3eagle.kernels.attention.triton_backend import TritonBackend  # noqa: E402

HQ, HKV, D, HI, DI, PAGE = 8, 2, 64, 2, 64, 16


@dataclass(frozen=True)
class Case:
    rows: int
    q_len: int  # query tokens per row this step
    ctx: int  # max KV length (rows get ctx - U[0, ctx/8))
    block: int = 0  # index_block_size; 0 = dense layer
    topk: int = 0

    @property
    def name(self) -> str:
        kind = f"sparse bs{self.block} k{self.topk}" if self.block else "dense"
        return f"{kind:<16} B={self.rows:<3} q={self.q_len:<4} ctx={self.ctx}"


CASES = [
    Case(1, 1, 1024), Case(1, 1, 8192), Case(32, 1, 4096), Case(1, 4, 8192), Case(32, 4, 4096),
    Case(32, 4, 8192), Case(1, 1024, 4096),
    Case(1, 1, 8192, 64, 16), Case(32, 1, 8192, 64, 16), Case(1, 4, 8192, 64, 16), Case(32, 4, 8192, 64, 16),
    Case(32, 4, 4096, 16, 16), Case(32, 4, 8192, 64, 4), Case(1, 1024, 4096, 64, 16),
]


def make_inputs(case: Case, gen: torch.Generator, dev: torch.device):
    short = torch.randint(0, max(1, case.ctx // 8), (case.rows,), generator=gen).tolist()
    kv = [max(case.ctx - s, case.q_len) for s in short]
    width = -(-case.ctx // PAGE)
    perm = torch.randperm(case.rows * width, generator=gen) + 1  # page 0 is the trash page
    table = torch.zeros(case.rows, width, dtype=torch.int64)
    for r, k in enumerate(kv):
        n = -(-k // PAGE)
        table[r, :n] = perm[r * width:r * width + n]
    meta = build_metadata([case.q_len] * case.rows, torch.tensor(kv), table, PAGE, dev, max_kv=case.ctx)
    slots = (case.rows * width + 1) * PAGE
    t = case.rows * case.q_len

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dev, torch.bfloat16)

    return meta, kv, rnd(t, HQ, D), rnd(slots, HKV, D), rnd(slots, HKV, D), rnd(t, HI, DI), rnd(slots, DI)


def bytes_read(case: Case, kv: list[int]) -> int:
    kv_row = HKV * D * 2 * 2  # K and V, bf16, per key
    if not case.block:
        return sum(kv) * kv_row
    # each token reads its own selection (at most topk blocks), plus the index keys of its row once
    per_tok = [min(case.topk * case.block, k) for k in kv]
    return sum(p * case.q_len for p in per_tok) * kv_row + sum(kv) * DI * 2


def run_case(case: Case, gen: torch.Generator, dev: torch.device, tri: TritonBackend) -> dict:
    import triton.testing

    meta, kv, q, k, v, iq, ik = make_inputs(case, gen, dev)
    scale = D ** -0.5
    if case.block:
        args = (q, k, v, meta, scale, iq, ik, case.block, case.topk, 1)
        ref_fn = lambda: reference.paged_attention(*args)  # noqa: E731
        tri_fn = lambda: tri.sparse_attention(*args)  # noqa: E731
    else:
        ref_fn = lambda: reference.paged_attention(q, k, v, meta, scale)  # noqa: E731
        tri_fn = lambda: tri.attention(q, k, v, meta, scale)  # noqa: E731
    ref, out = ref_fn().float(), tri_fn().float()
    err = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
    finite = bool(torch.isfinite(out).all())
    # Decode runs inside captured CUDA graphs in the engine, so graph replay is the number that matters;
    # eager time adds the host's launch overhead (several launches per call on the sparse path).
    ref_ms = triton.testing.do_bench_cudagraph(ref_fn, rep=20, return_mode="median")
    tri_ms = triton.testing.do_bench_cudagraph(tri_fn, rep=20, return_mode="median")
    eager_ms = triton.testing.do_bench(tri_fn, warmup=5, rep=20, return_mode="median")
    return {"case": case.name, "ref_us": ref_ms * 1e3, "triton_us": tri_ms * 1e3,
            "triton_eager_us": eager_ms * 1e3,
            "speedup": ref_ms / tri_ms, "triton_GBps": bytes_read(case, kv) / (tri_ms * 1e-3) / 1e9,
            "max_rel_err": err, "finite": finite}


def check_fp32(dev: torch.device) -> tuple[float, int]:
    """(max relative error, mismatched selections) of TritonBackend vs reference, fp32, mixed rows."""
    from m3eagle.kernels.attention import triton_kernels

    gen = torch.Generator().manual_seed(1)
    worst, mismatched = 0.0, 0
    # (q_lens, kv_lens, hq, hkv, hi, d, block, topk, local)
    shapes = [([37, 1, 4, 1, 5], [300, 1, 77, 513, 5], 8, 2, 2, 64, 16, 4, 1),
              ([64, 4, 1], [1000, 260, 999], 16, 2, 4, 128, 64, 3, 2),
              ([9, 3, 1], [200, 150, 61], 4, 1, 2, 64, 48, 2, 1),
              ([1], [5000], 8, 2, 2, 64, 64, 16, 1)]
    for q_lens, kv_lens, hq, hkv, hi, d, bs, topk, local in shapes:
        max_kv, page = max(kv_lens) + 30, 16
        width = -(-max_kv // page) + 2  # wider than any row holds: the tail reads TRASH_PAGE
        table = torch.zeros(len(q_lens), width, dtype=torch.int64)
        perm = torch.randperm(len(q_lens) * width, generator=gen) + 1
        for r, k in enumerate(kv_lens):
            table[r, :-(-k // page)] = perm[r * width:r * width + -(-k // page)]
        meta = build_metadata(q_lens, torch.tensor(kv_lens), table, page, dev, max_kv=max_kv)
        slots, t = (len(q_lens) * width + 1) * page, sum(q_lens)
        q, k, v = (torch.randn(n, h, d, generator=gen).to(dev)
                   for n, h in ((t, hq), (slots, hkv), (slots, hkv)))
        iq, ik = torch.randn(t, hi, 32, generator=gen).to(dev), torch.randn(slots, 32, generator=gen).to(dev)
        refs = (reference.paged_attention(q, k, v, meta, 0.1),
                reference.paged_attention(q, k, v, meta, 0.1, iq, ik, bs, topk, local))
        # default policy; no split with the tile-wise sparse path (keep mask); forced splits of both
        for tri in (TritonBackend(), TritonBackend(waves=0, sparse_tile_min_q=1),
                    TritonBackend(min_keys_per_split=16, block_n=32, sparse_tile_min_q=1)):
            outs = (tri.attention(q, k, v, meta, 0.1),
                    tri.sparse_attention(q, k, v, meta, 0.1, iq, ik, bs, topk, local))
            for ref, out in zip(refs, outs):
                worst = max(worst, ((out - ref).abs().max() / ref.abs().max()).item())
        ik_rows = ik[gather_slots(meta, max_kv)]  # [B, L, Di]
        ref_sel = reference.select_blocks(reference.pad_queries(iq, meta), ik_rows,
                                          reference.padded_positions(meta), bs, topk, local)
        ref_sel = ref_sel[meta.tok_row, :, meta.tok_col].sort(-1).values
        # one indexer launch, and split over programs + merge (fp32 sums in other orders may only flip
        # exact near-ties, so compare as sets)
        for sel in (triton_kernels.select_blocks(iq, ik, meta, bs, topk, local),
                    TritonBackend(min_index_keys_per_split=bs).select_blocks(iq, ik, meta, bs, topk, local)):
            mismatched += int((sel.sort(-1).values != ref_sel).any(-1).sum())
    return worst, mismatched


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="two cases only")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/attention_kernels.py needs a CUDA device")
    dev = torch.device("cuda")
    fp32_err, fp32_mismatch = check_fp32(dev)
    verdict = "ok" if fp32_err < 1e-4 and fp32_mismatch == 0 else "FAILED"
    print(f"fp32 check vs reference: max rel err {fp32_err:.2e}, mismatched selections {fp32_mismatch} "
          f"-> {verdict}")
    gen = torch.Generator().manual_seed(0)
    tri = TritonBackend()
    cases = [CASES[1], CASES[8]] if args.quick else CASES
    rows = []
    print("times: median us of CUDA-graph replay (eager: plain launches, host overhead included)")
    print(f"{'case':<44} {'ref us':>9} {'triton us':>10} {'eager us':>9} {'speedup':>8} {'GB/s':>7} "
          f"{'rel err':>9}")
    for case in cases:
        r = run_case(case, gen, dev, tri)
        rows.append(r)
        flag = "" if r["finite"] else "  NON-FINITE"
        print(f"{r['case']:<44} {r['ref_us']:>9.1f} {r['triton_us']:>10.1f} {r['triton_eager_us']:>9.1f} "
              f"{r['speedup']:>7.2f}x "
              f"{r['triton_GBps']:>7.0f} {r['max_rel_err']:>9.2e}{flag}", flush=True)
    summary = {"bench": "attention_kernels", "device": torch.cuda.get_device_name(dev), "dtype": "bfloat16",
               "fp32_check": {"max_rel_err": fp32_err, "mismatched_selections": fp32_mismatch,
                              "ok": verdict == "ok"},
               "max_rel_err": max(r["max_rel_err"] for r in rows),
               "all_finite": all(r["finite"] for r in rows),
               "geomean_speedup": float(torch.tensor([r["speedup"] for r in rows]).log().mean().exp()),
               "cases": [{k: (round(x, 4) if isinstance(x, float) else x) for k, x in r.items()}
                         for r in rows]}
    print(json.dumps(summary))
    if verdict != "ok" or not summary["all_finite"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
