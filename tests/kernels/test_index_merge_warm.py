"""The warm-up's indexer merge variants: `index_plan.merge_classes` lists every (pow2 splits, block_k) class the
plan can give, and `TritonBackend.warm_index_merges` launches the merge exactly as eager steps of any row count,
query width and context up to the bound do (same constexprs, warps and specialized scalars), so no merge variant
is left to compile while serving. On CPU under the Triton interpreter, with the GPU's SM count."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first `import triton`, as every CPU kernel test

import pytest  # noqa: E402
import torch  # noqa: E402

from m3eagle.kernels.attention import index_plan, triton_backend, triton_kernels  # noqa: E402
from m3eagle.kernels.attention.metadata import build_metadata  # noqa: E402
from m3eagle.kernels.attention.triton_backend import TritonBackend  # noqa: E402

CPU = torch.device("cpu")


def every_class(max_blocks: int, k: int, block_size: int, min_bps: int, max_splits: int) -> set[tuple[int, int]]:
    """merge_classes by brute force: every NB and every asked-for split count."""
    out = set()
    for nb in range(k + 1, max_blocks + 1):
        for s in range(2, min(max_splits, -(-nb // min_bps)) + 1):
            plan = index_plan.index_plan(nb, k, block_size, s, min_bps)
            if plan.splits > 1:
                out.add((index_plan.pow2(plan.splits), plan.block_k))
    return out


@pytest.mark.parametrize("max_blocks,k,block_size,min_bps,max_splits", [
    (130, 4, 16, 2, 512),   # the embedded pair at 2,048 tokens
    (300, 16, 128, 2, 512),  # MiniMax-M3's top-16 of 128-token blocks
    (200, 3, 8, 1, 40),
    (150, 2, 4, 3, 64),
    (700, 300, 16, 1, 64),  # lists so wide that MAX_MERGE_CANDIDATES cuts the split count
])
def test_merge_classes_equal_every_split_tried(max_blocks, k, block_size, min_bps, max_splits):
    got = index_plan.merge_classes(max_blocks, k, block_size, min_bps, max_splits)
    assert set(got) == every_class(max_blocks, k, block_size, min_bps, max_splits)
    assert len(got) >= 3


class _Recorder:
    """Stands in for `_index_merge_kernel`: records what decides a launch's compiled variant (constexprs,
    warps, PDL, the specialized scalars and sel's strides), then launches the real kernel (`run`)."""

    def __init__(self, kernel, run: bool = True) -> None:
        self.kernel, self.run, self.keys = kernel, run, set()

    def __getitem__(self, grid):
        def launch(*args, **kw):
            # args: PartKey, Sel, TokRow, KvLens, Positions, stride_pt, stride_ph, stride_st, stride_sh,
            # block_size, num_blocks, num_splits, min_blocks_per_split, local_blocks (stride_pt, stride_ph,
            # num_blocks and num_splits are not specialized)
            ptrs = tuple(a.dtype for a in args[:5])
            self.keys.add((ptrs, args[7], args[8], args[9], args[12], args[13], tuple(sorted(kw.items()))))
            if self.run:
                self.kernel[grid](*args, **kw)
        return launch


class _Skip:
    """Stands in for a kernel whose launches are not needed: launching it does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kw: None


def _select(be: TritonBackend, q_lens: list[int], kv_lens: list[int], hi: int, block: int, topk: int, local: int,
            seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    page = 16
    width = max(-(-n // page) for n in kv_lens)
    table = torch.arange(len(q_lens) * width, dtype=torch.int64).view(len(q_lens), width) + 1
    meta = build_metadata(q_lens, torch.tensor(kv_lens), table, page, CPU, max_kv=max(kv_lens))
    iq = torch.randn(sum(q_lens), hi, 8, generator=gen)
    ik = torch.randn((len(q_lens) * width + 1) * page, 8, generator=gen)
    be.select_blocks(iq, ik, meta, block, topk, local)


def test_warm_launches_every_merge_variant_eager_steps_launch(monkeypatch):
    """Steps of 1-6 rows, 1-40 query tokens and contexts up to the bound, split by the H100's 132 SMs: every
    merge variant they launch is one the warm-up launched, and they reach more than one class."""
    monkeypatch.setattr(triton_backend, "_num_sms", lambda device: 132)
    hi, block, topk, local, max_kv = 2, 8, 3, 1, 400
    be = TritonBackend()
    warm = _Recorder(triton_kernels._index_merge_kernel)
    monkeypatch.setattr(triton_kernels, "_index_merge_kernel", warm)
    assert be.warm_index_merges(hi, block, topk, local, max_kv, CPU) == len(warm.keys)
    # the steps' merges are recorded, not run, and their indexer is skipped: only the launch shapes matter here
    # (the selection itself is tests/kernels/test_triton_attention.py's)
    steps = _Recorder(warm.kernel, run=False)
    monkeypatch.setattr(triton_kernels, "_index_merge_kernel", steps)
    monkeypatch.setattr(triton_kernels, "_indexer_kernel", _Skip())
    gen = torch.Generator().manual_seed(0)
    for i in range(24):
        rows = int(torch.randint(1, 7, (), generator=gen))
        q_lens = torch.randint(1, 41, (rows,), generator=gen).tolist()
        kv_lens = [int(torch.randint(q + block * topk + 1, max_kv + 1, (), generator=gen)) for q in q_lens]
        _select(be, q_lens, kv_lens, hi, block, topk, local, seed=i)
    assert len(steps.keys) >= 2, steps.keys
    assert steps.keys <= warm.keys, steps.keys - warm.keys


def test_warm_covers_the_bound_not_less():
    """A context past the warmed bound can need a class the warm-up did not compile: the bound is what is
    covered (the engine passes max_model_len)."""
    short = index_plan.merge_classes(-(-64 // 8), 3, 8, 2, 512)
    full = index_plan.merge_classes(-(-400 // 8), 3, 8, 2, 512)
    assert set(short) < set(full)
