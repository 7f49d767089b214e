"""Reference vs Triton paged attention on a CUDA GPU (bf16): latency, achieved bandwidth, and error.

    python benchmarks/attention_kernels.py                 # all cases, < 2 minutes on an H200
    python benchmarks/attention_kernels.py --quick         # two cases (and one prompt-chunk case), a smoke test
    python benchmarks/attention_kernels.py --prefill-only  # the fp32 check and the prompt-chunk cases only

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

Prompt chunks past the selection threshold (PREFILL_CASES, m3-mini's attention heads: Hq=16, Hkv=2, Hi=2, D=128,
block 128, top-16): the attention half alone (`attend_selected`, one selection from the indexer) on the per-token
sparse kernel and on the tiled one (sparse_prefill.py), with the blocks each loads per query token (per token: its
own selection; tiled: the union of its tile's selections over the tile's tokens) and their bf16 difference. The
indexer queries are random ("random": neighbouring tokens share few high-scoring blocks) or one per row plus small
per-token noise ("coherent": they share most, as real prompts tend to).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from m3eagle.kernels.attention import reference, sparse_prefill  # noqa: E402
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


@dataclass(frozen=True)
class PrefillCase:
    rows: int
    q_len: int  # prompt tokens per row this step
    prefix: int  # cached tokens before them
    coherent: bool  # neighbouring tokens' indexer queries nearly equal (shared selections)

    @property
    def name(self) -> str:
        return f"B={self.rows:<2} q={self.q_len:<5} prefix={self.prefix:<6} {'coherent' if self.coherent else 'random'}"


# m3-mini's attention and indexer heads (m3eagle/bench/geometries.py)
PF_HQ, PF_HKV, PF_HI, PF_D, PF_DI, PF_BLOCK, PF_TOPK = 16, 2, 2, 128, 128, 128, 16
PREFILL_CASES = [PrefillCase(1, 128, 4096, False), PrefillCase(1, 128, 4096, True), PrefillCase(4, 128, 4096, False),
                 PrefillCase(1, 512, 4096, False), PrefillCase(1, 1024, 16384, False),
                 PrefillCase(1, 1024, 16384, True), PrefillCase(1, 4096, 0, False), PrefillCase(8, 512, 8192, False)]


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


def union_blocks_per_token(sel: torch.Tensor, meta, block_t: int) -> float:
    """Mean over (tile, index head) of |union of the tile's tokens' selections| / tokens of the tile: the
    blocks the tiled kernel loads per query token (the per-token kernel loads its own selection, <= k)."""
    loads, tokens = 0, 0
    for first, n in zip(meta.q_index[:, 0].tolist(), meta.q_lens.tolist()):
        for t0 in range(0, n, block_t):
            tile = sel[first + t0:first + min(n, t0 + block_t)]  # [tokens, Hi, k]
            for h in range(sel.shape[1]):
                ids = tile[:, h].flatten()
                loads += int(ids[ids >= 0].unique().numel())
            tokens += tile.shape[0] * sel.shape[1]
    return loads / max(1, tokens)


def run_prefill_case(case: PrefillCase, gen: torch.Generator, dev: torch.device) -> dict:
    """Per-token vs tiled sparse attention over one indexer selection (bf16, graph replay)."""
    import triton.testing

    kv = [case.prefix + case.q_len] * case.rows
    width = -(-max(kv) // PAGE)
    perm = torch.randperm(case.rows * width, generator=gen) + 1  # page 0 is the trash page
    table = torch.zeros(case.rows, width, dtype=torch.int64)
    for r in range(case.rows):
        table[r] = perm[r * width:(r + 1) * width]
    meta = build_metadata([case.q_len] * case.rows, torch.tensor(kv), table, PAGE, dev, max_kv=max(kv))
    slots, t = (case.rows * width + 1) * PAGE, case.rows * case.q_len

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dev, torch.bfloat16)

    q, k, v, ik = rnd(t, PF_HQ, PF_D), rnd(slots, PF_HKV, PF_D), rnd(slots, PF_HKV, PF_D), rnd(slots, PF_DI)
    iq = rnd(t, PF_HI, PF_DI)
    if case.coherent:  # one query direction per row, small per-token noise: neighbours select nearly the same
        base = rnd(case.rows, PF_HI, PF_DI).repeat_interleave(case.q_len, 0)
        iq = (base + 0.1 * iq.float()).to(torch.bfloat16)
    scale = PF_D ** -0.5
    per_token, tiled = TritonBackend(sparse_prefill_min_q=None), TritonBackend()
    sel = tiled.select_blocks(iq, ik, meta, PF_BLOCK, PF_TOPK, 1)  # [T, Hi, k]
    pt_fn = lambda: per_token.attend_selected(q, k, v, meta, scale, sel, PF_BLOCK)  # noqa: E731
    tl_fn = lambda: tiled.attend_selected(q, k, v, meta, scale, sel, PF_BLOCK)  # noqa: E731
    a, b = pt_fn().float(), tl_fn().float()
    diff = ((a - b).abs().max() / a.abs().max().clamp_min(1e-6)).item()
    pt_ms = triton.testing.do_bench_cudagraph(pt_fn, rep=20, return_mode="median")
    tl_ms = triton.testing.do_bench_cudagraph(tl_fn, rep=20, return_mode="median")
    heads = math.gcd(PF_HQ // PF_HKV, PF_HQ // PF_HI)
    block_t = sparse_prefill.prefill_tile(PF_D, heads, meta.max_q, PF_BLOCK)[0]
    return {"case": case.name, "per_token_us": pt_ms * 1e3, "tiled_us": tl_ms * 1e3, "speedup": pt_ms / tl_ms,
            "blocks_per_token": float((sel >= 0).sum(-1).float().mean()),
            "tiled_blocks_per_token": union_blocks_per_token(sel.cpu(), meta, block_t), "block_t": block_t,
            "max_rel_diff": diff, "finite": bool(torch.isfinite(b).all())}


def check_fp32(dev: torch.device) -> tuple[float, int]:
    """(max relative error, mismatched selections) of TritonBackend vs reference, fp32, mixed rows."""
    from m3eagle.kernels.attention import triton_kernels

    gen = torch.Generator().manual_seed(1)
    worst, mismatched = 0.0, 0
    # (q_lens, kv_lens, hq, hkv, hi, d, block, topk, local)
    shapes = [([37, 1, 4, 1, 5], [300, 1, 77, 513, 5], 8, 2, 2, 64, 16, 4, 1),
              ([64, 4, 1], [1000, 260, 999], 16, 2, 4, 128, 64, 3, 2),
              ([9, 3, 1], [200, 150, 61], 4, 1, 2, 64, 48, 2, 1),
              ([1], [5000], 8, 2, 2, 64, 64, 16, 1),
              # a prompt chunk past the selection threshold at m3-mini's heads (the tiled kernel) beside a decode row
              ([128, 1], [4224, 3000], 16, 2, 2, 128, 128, 16, 1)]
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
        # default policy (the tiled prompt kernel at >= 16 tokens); per token only; the tiled kernel for every
        # step, unsplit and forced to split; no split with the dense kernel's keep mask; forced splits of it
        for tri in (TritonBackend(), TritonBackend(sparse_prefill_min_q=None),
                    TritonBackend(waves=0, sparse_prefill_min_q=1),
                    TritonBackend(min_keys_per_split=16, sparse_prefill_min_q=1),
                    TritonBackend(waves=0, sparse_tile_min_q=1),
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
    ap.add_argument("--quick", action="store_true", help="two cases only (and one prompt-chunk case)")
    ap.add_argument("--prefill-only", action="store_true", help="the fp32 check and the prompt-chunk cases only")
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
    cases = [] if args.prefill_only else [CASES[1], CASES[8]] if args.quick else CASES
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
    prefill = []
    print(f"\nprompt chunks past the selection threshold, attention half only (Hq={PF_HQ} Hkv={PF_HKV} Hi={PF_HI} "
          f"D={PF_D} block {PF_BLOCK} top-{PF_TOPK}): per-token vs tiled kernel, median us of graph replay")
    print(f"{'case':<40} {'per-token':>10} {'tiled':>9} {'speedup':>8} {'blk/tok':>8} {'tiled blk/tok':>14} "
          f"{'bf16 diff':>10}")
    for case in PREFILL_CASES[:1] if args.quick else PREFILL_CASES:
        r = run_prefill_case(case, gen, dev)
        prefill.append(r)
        flag = "" if r["finite"] else "  NON-FINITE"
        print(f"{r['case']:<40} {r['per_token_us']:>10.1f} {r['tiled_us']:>9.1f} {r['speedup']:>7.2f}x "
              f"{r['blocks_per_token']:>8.2f} {r['tiled_blocks_per_token']:>14.2f} {r['max_rel_diff']:>10.2e}{flag}",
              flush=True)

    def rounded(rs: list[dict]) -> list[dict]:
        return [{k: (round(x, 4) if isinstance(x, float) else x) for k, x in r.items()} for r in rs]

    summary = {"bench": "attention_kernels", "device": torch.cuda.get_device_name(dev), "dtype": "bfloat16",
               "fp32_check": {"max_rel_err": fp32_err, "mismatched_selections": fp32_mismatch,
                              "ok": verdict == "ok"},
               "max_rel_err": max((r["max_rel_err"] for r in rows), default=0.0),
               "all_finite": all(r["finite"] for r in rows + prefill),
               "geomean_speedup": float(torch.tensor([r["speedup"] for r in rows]).log().mean().exp()) if rows else None,
               "cases": rounded(rows),
               "prefill_geomean_speedup": float(torch.tensor([r["speedup"] for r in prefill]).log().mean().exp()),
               "prefill_cases": rounded(prefill)}
    print(json.dumps(summary))
    if verdict != "ok" or not summary["all_finite"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
