"""Decode / verify attention and indexer launch policy sweep on a CUDA GPU (CUDA-graph replay, bf16).

    python benchmarks/decode_sweep.py            # m3-mini / m3-8b / embedded head shapes

The engine's graph-shaped steps have few query tokens per row, so one program per (row, KV head) walks
the whole context serially and the kernel is latency-bound. This sweeps the knobs TritonBackend exposes
(keys per tile, minimum keys per split, warps for the indexer) on the shapes of the bench geometries and
prints the best per shape next to the current default; the defaults in attention/triton_backend.py come
from it. One JSON line at the end.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from m3eagle.kernels.attention.metadata import build_metadata  # noqa: E402
from m3eagle.kernels.attention.triton_backend import TritonBackend  # noqa: E402

PAGE = 16
# (name, hq, hkv, d, hi, di, block, topk)
SHAPES = [("m3-mini", 16, 2, 128, 2, 128, 128, 16), ("m3-8b", 32, 4, 128, 4, 128, 128, 16),
          ("embedded", 4, 2, 64, 2, 32, 16, 4)]


def inputs(rows: int, q_len: int, ctx: int, max_kv: int, hq: int, hkv: int, d: int, hi: int, di: int,
           gen: torch.Generator, dev: torch.device):
    width = -(-max_kv // PAGE) + 1
    perm = torch.randperm(rows * width, generator=gen) + 1
    table = torch.zeros(rows, width, dtype=torch.int64)
    for r in range(rows):
        table[r, :-(-ctx // PAGE)] = perm[r * width:r * width + -(-ctx // PAGE)]
    meta = build_metadata([q_len] * rows, torch.full((rows,), ctx), table, PAGE, dev, max_kv=max_kv)
    slots, t = (rows * width + 1) * PAGE, rows * q_len

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dev, torch.bfloat16)

    return meta, rnd(t, hq, d), rnd(slots, hkv, d), rnd(slots, hkv, d), rnd(t, hi, di), rnd(slots, di)


def timed(fn, *args) -> float:
    """Median µs of CUDA-graph replays of fn(*args)."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(lambda: fn(*args), rep=15, return_mode="median") * 1e3


def main() -> None:
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    out = []
    for (name, hq, hkv, d, hi, di, block, topk), (rows, q_len), ctx in itertools.product(
            SHAPES, [(1, 1), (32, 4)], [137, 4096]):
        max_kv = max(2048, ctx + 64)  # what a graph captured for max_model_len >= 2k sees
        meta, q, k, v, iq, ik = inputs(rows, q_len, ctx, max_kv, hq, hkv, d, hi, di, gen, dev)
        res = {"shape": name, "rows": rows, "q": q_len, "ctx": ctx}
        dense = {}
        for bn, mk in itertools.product([32, 64, 128], [64, 128, 256]):
            tri = TritonBackend(block_n=bn, min_keys_per_split=mk)
            dense[f"bn{bn}_mk{mk}"] = timed(tri.attention, q, k, v, meta, 0.1)
        default = TritonBackend()
        dense["default"] = timed(default.attention, q, k, v, meta, 0.1)
        best = min(dense, key=dense.get)
        res["dense_default_us"], res["dense_best"], res["dense_best_us"] = dense["default"], best, dense[best]
        idx = {}
        for mk, w in itertools.product([block * 2, block * 4], [2, 4]):
            tri = TritonBackend(min_index_keys_per_split=mk, index_num_warps=w)
            idx[f"mk{mk}_w{w}"] = timed(tri.select_blocks, iq, ik, meta, block, topk, 1)
        idx["default"] = timed(default.select_blocks, iq, ik, meta, block, topk, 1)
        best = min(idx, key=idx.get)
        res["index_default_us"], res["index_best"], res["index_best_us"] = idx["default"], best, idx[best]
        out.append(res)
        print(f"{name:<9} B={rows:<3} q={q_len} ctx={ctx:<5} dense {res['dense_default_us']:7.1f} us -> "
              f"{res['dense_best_us']:7.1f} ({res['dense_best']}); indexer {res['index_default_us']:7.1f} -> "
              f"{res['index_best_us']:7.1f} ({res['index_best']})", file=sys.stderr, flush=True)
    print(json.dumps({"results": out}))


if __name__ == "__main__":
    main()
