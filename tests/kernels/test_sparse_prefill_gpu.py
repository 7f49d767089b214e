"""The tiled block-sparse prompt kernel (`sparse_prefill`) on a GPU, at m3-mini's head shapes.

Run: `python -m pytest -q -m gpu tests/kernels/test_sparse_prefill_gpu.py` (one H100 / H200, seconds).
tests/kernels/test_sparse_prefill.py holds the kernel's masks to the oracle under the interpreter on small
shapes; here the real compiler runs it where the engine would: 128-token prompt chunks over a 4,096-token cached
prefix (a prefix-cache hit), 128-key blocks, the indexer's own top-16 selection, beside a decode row. The
backend with the tiled kernel switched on must equal the oracle and the per-token kernel within bf16 rounding.
"""

from __future__ import annotations

import pytest
import torch

from m3eagle.kernels.attention import reference, sparse_prefill
from m3eagle.kernels.attention.metadata import build_metadata, gather_slots
from m3eagle.kernels.attention.triton_backend import TritonBackend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

HQ, HKV, D, HI, DI = 16, 2, 128, 2, 128  # m3-mini's attention and indexer heads
BLOCK, TOPK, LOCAL = 128, 16, 1
PAGE = 16


def _step(q_lens: list[int], kv_lens: list[int], seed: int):
    """Random paged pools on shuffled pages; q, iq for the new tokens."""
    gen = torch.Generator().manual_seed(seed)
    held = [-(-n // PAGE) for n in kv_lens]
    width = max(held) + 1
    pages = (torch.randperm(sum(held), generator=gen) + 1).tolist()  # page 0 is the trash page
    table = torch.zeros((len(q_lens), width), dtype=torch.int64)
    for r, n in enumerate(held):
        table[r, :n] = torch.tensor(pages[:n])
        pages = pages[n:]
    dev = torch.device("cuda")
    meta = build_metadata(q_lens, torch.tensor(kv_lens), table.to(dev), PAGE, dev, max_kv=max(kv_lens))
    slots = (sum(held) + 1) * PAGE
    t = sum(q_lens)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dev, torch.bfloat16)

    return meta, rnd(t, HQ, D), rnd(slots, HKV, D), rnd(slots, HKV, D), rnd(t, HI, DI), rnd(slots, DI)


def test_tiled_prompt_chunks_over_a_cached_prefix_equal_the_oracle_and_the_per_token_kernel() -> None:
    q_lens = [128] * 8 + [1, 37]  # eight cache hits' suffixes, a decode row, a short chunk (not a tile multiple)
    kv_lens = [4096 + 128] * 8 + [3000, 2085]
    meta, q, k, v, iq, ik = _step(q_lens, kv_lens, seed=7)
    scale = D ** -0.5
    assert sparse_prefill.use_prefill_kernel(meta, sparse_prefill.PREFILL_MIN_Q)
    assert not sparse_prefill.use_prefill_kernel(meta, None)
    # one selection (the indexer kernel's) for all three, so that near-tied blocks cannot differ between them
    sel = TritonBackend().select_blocks(iq, ik, meta, BLOCK, TOPK, LOCAL)  # [T, Hi, k]
    assert (sel >= 0).sum(-1).max() == TOPK  # the long rows select a real top-k, not every block
    tiled = TritonBackend(sparse_prefill_min_q=sparse_prefill.PREFILL_MIN_Q).attend_selected(q, k, v, meta, scale,
                                                                                            sel, BLOCK)
    per_token = TritonBackend().attend_selected(q, k, v, meta, scale, sel, BLOCK)

    slots = gather_slots(meta, meta.max_kv)  # [B, L]
    keep = reference.block_keep_mask(sel[meta.q_index].permute(0, 2, 1, 3), meta.max_kv, BLOCK, HQ)  # [B, Hq, Qmax, L]
    ref = reference.attend(reference.pad_queries(q.float(), meta), k[slots].float(), v[slots].float(),
                           reference.padded_positions(meta), scale, keep)[meta.tok_row, meta.tok_col]  # [T, Hq, D]

    for out in (tiled, per_token):
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    err = ((tiled.float() - ref).abs().max() / ref.abs().max()).item()
    assert err <= 1.2e-2, f"tiled vs oracle: max relative error {err:.2e}"
    err = ((tiled.float() - per_token.float()).abs().max() / ref.abs().max()).item()
    assert err <= 1.2e-2, f"tiled vs per-token kernel: max relative error {err:.2e}"
