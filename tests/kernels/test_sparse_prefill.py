"""The tiled block-sparse prompt kernel (`sparse_prefill`) held equal to the oracle and to the per-token kernel.

Under the Triton interpreter, on mixed steps from the attention tests' `make_step` (shuffled pages, slots past
every row's keys poisoned): a prompt chunk over a cached prefix, rows of different lengths (shorter than a
tile, not a multiple of it), a decode row, a row whose first tokens see no key. Selections are the oracle's
edited by hand, so that tokens share blocks, select disjoint ones, hold -1 entries in the middle, or select
nothing at all. The result must equal `reference.attend` with the same keep mask (1e-4 in fp32, bf16 within
its rounding) and `triton_kernels.sparse_attention` (the per-token kernel); mutants of the kernel's mask (the
union of the tile's selections for every token, a tile-wide causal limit, a walk that skips a block) must not.

bf16: the interpreter's tl.dot multiplies bf16 operands as their raw uint16 bits, so this module's fixture runs
bf16 dots in fp32 on the decoded values (what the GPU's MMA computes, fp32 accumulation).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton` (kernels decorate at import)

import importlib.util  # noqa: E402
import inspect  # noqa: E402
import sys  # noqa: E402
from dataclasses import replace  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

from m3eagle.kernels.attention import reference, sparse_prefill, triton_kernels  # noqa: E402
from m3eagle.kernels.attention.metadata import AttnMetadata, gather_slots  # noqa: E402
from m3eagle.kernels.attention.triton_backend import TritonBackend  # noqa: E402
from m3eagle.kernels.batch_invariant.attention import BatchInvariantBackend  # noqa: E402
from tests.kernels.test_triton_attention import (  # noqa: E402, F401  (poisoned_empty: a fixture)
    Step,
    assert_close,
    make_step,
    padded_keep,
    poisoned_empty,
    ref_selection,
    widen,
)


@pytest.fixture(scope="module", autouse=True)
def bf16_dot():
    """The interpreter's tl.dot on bf16 operands (stored as uint16 bits) -> an fp32 product of their values."""
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    original = InterpreterBuilder.create_dot

    def as_f32(h) -> np.ndarray:
        if h.dtype == tl.bfloat16:
            return (h.data.astype(np.uint32) << 16).view(np.float32)
        return h.data.astype(np.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if tl.bfloat16 not in (a.dtype, b.dtype):
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        out = np.einsum("...mk,...kn->...mn", as_f32(a), as_f32(b), optimize=False)
        return TensorHandle(out.astype(d.data.dtype) + d.data, d.dtype.scalar)

    InterpreterBuilder.create_dot = create_dot
    yield
    InterpreterBuilder.create_dot = original


def edited_selection(s: Step, block: int, topk: int, seed: int) -> torch.Tensor:
    """The oracle's selection [T, Hi, k] (local block 1), edited: every third token takes random blocks of its
    visible range (disjoint from its neighbours', -1 entries anywhere in the list), one token of the
    first row and every token of the last row select nothing, and each list stays distinct. Ascending order
    is not required."""
    sel = ref_selection(s, block, topk, 1).clone()  # [T, Hi, k]
    gen = torch.Generator().manual_seed(seed)
    t, hi, k = sel.shape
    own = torch.div(s.meta.positions.clamp(min=0), block, rounding_mode="floor")  # [T]
    for i in range(0, t, 3):
        for h in range(hi):
            picks = torch.randint(0, int(own[i]) + 1, (k,), generator=gen)
            picks = torch.where(torch.rand(k, generator=gen) < 0.3, -1, picks)
            seen: set[int] = set()
            sel[i, h] = torch.tensor([-1 if (x in seen or seen.add(x)) else x for x in picks.tolist()])
    sel[4] = -1  # a token of the first row that selects nothing: its output is 0
    sel[-int(s.meta.q_lens[-1]):] = -1  # a row whose tokens all select nothing: its tiles walk no block
    return sel


def oracle(s: Step, sel: torch.Tensor, block: int, scale: float) -> torch.Tensor:
    """reference.attend on padded rows with the keep mask of `sel` (q, K/V in fp32) -> [T, Hq, D] fp32."""
    meta = s.meta
    slots = gather_slots(meta, meta.max_kv)  # [B, L]
    ref = reference.attend(reference.pad_queries(s.q.float(), meta), s.k[slots].float(), s.v[slots].float(),
                           reference.padded_positions(meta), scale, padded_keep(sel, meta, block, s.q.shape[1]))
    return ref[meta.tok_row, meta.tok_col]


# (q_lens, kv_lens, page_size, hq, hkv, hi, d, block, topk, splits, dtype), with block_t = 8:
#   rows of 21 or 13 (not a multiple of 8) and 5 (shorter than a tile) tokens over cached prefixes, a decode row, a
#   6-token row over 3 keys (its first 3 tokens see none), and last a row that selects nothing; every MHA / GQA
#   shape, non-power-of-2 block and head_dim
CASES = {
    # page 16, GQA 4 / 2 with 2 index heads (HEADS = group), block 8 (one 16-key tile = 2 blocks), split in 3
    "p16_fp32": ([21, 5, 1, 6, 3], [70, 40, 33, 3, 20], 16, 4, 2, 2, 16, 8, 3, 3, torch.float32),
    # page 128, HEADS = 2 < the KV group of 4 (Hi = 4), head_dim 64, bf16, block 16
    "p128_bf16_gqa": ([13, 5, 1, 2], [90, 37, 50, 9], 128, 8, 2, 4, 64, 16, 3, 1, torch.bfloat16),
    # head_dim 128, one KV and one index head (HEADS = 4), block 32 in two 16-key sub-tiles, split in 2
    "d128_sub_tiles": ([13, 5, 2], [140, 60, 30], 16, 4, 1, 1, 128, 32, 2, 2, torch.float32),
    # head_dim 24 (masked to 32), block 6 (masked to 8, chunks of 2), fp16
    "d24_fp16": ([13, 5, 1, 2], [75, 30, 20, 9], 16, 4, 2, 2, 24, 6, 3, 1, torch.float16),
}
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}


@pytest.mark.usefixtures("poisoned_empty")  # split partials hold +inf until written: a read before shows
@pytest.mark.parametrize("name", list(CASES))
def test_tiled_equals_oracle_and_per_token_kernel(name):
    q_lens, kv_lens, page, hq, hkv, hi, d, block, topk, splits, dtype = CASES[name]
    s = make_step(len(name) * 7 + d, q_lens, kv_lens, page, hq=hq, hkv=hkv, d=d, hi=hi)
    s = replace(s, q=s.q.to(dtype), k=s.k.to(dtype), v=s.v.to(dtype))
    sel = edited_selection(s, block, topk, seed=d)
    assert (sel < 0).any() and (sel[4] < 0).all() and (s.meta.positions < 0).sum() == 3 * (6 in q_lens)
    scale = d ** -0.5
    ref = oracle(s, sel, block, scale)
    out = torch.full_like(s.q, float("nan"))  # every (token, head) must be written
    sparse_prefill.sparse_prefill_attention(s.q, s.k, s.v, s.meta, scale, sel, block, num_splits=splits, block_t=8,
                                            block_n=16, out=out)
    assert_close(out.float(), ref, TOL[dtype])
    assert (out[4] == 0).all() and (out[-q_lens[-1]:] == 0).all()  # tokens that select nothing see nothing
    per_token = triton_kernels.sparse_attention(s.q, s.k, s.v, s.meta, scale, sel, block)
    assert_close(out.float(), per_token.float(), TOL[dtype])


def test_backend_routes_prompt_steps_to_the_tiled_kernel(monkeypatch):
    """TritonBackend, end to end under a graph-style KV bound (far past every row): the indexer's own selection
    through the tiled kernel when the widest row has >= 16 tokens, equal to the oracle's sparse layer."""
    calls: list[str] = []
    tiled = sparse_prefill.sparse_prefill_attention
    monkeypatch.setattr(sparse_prefill, "sparse_prefill_attention", lambda *a, **k: calls.append("tiled") or tiled(*a, **k))
    block, topk, local = 4, 3, 1
    s = widen(make_step(41, [16, 1, 4], [50, 30, 44], 8, hq=4, hkv=2, hi=2), 96)
    args = (s.q, s.k, s.v, s.meta, 0.3, s.iq, s.ik, block, topk, local)
    on = TritonBackend(sparse_prefill_min_q=sparse_prefill.PREFILL_MIN_Q)
    assert_close(on.sparse_attention(*args), reference.paged_attention(*args))
    assert calls == ["tiled"]


def test_only_prompt_steps_of_the_triton_backend_take_it(monkeypatch):
    """Decode / verify-sized steps (widest row < 16) and the batch-invariant backend (determinism mode: its
    own fixed per-token launch) keep `_sparse_attn_kernel`; sparse_prefill_min_q=None (the default, until the
    kernel is timed on a GPU) turns the tiled one off; the named backend `triton_sparse_prefill`
    (`--attention-backend triton_sparse_prefill`) turns it on."""
    from m3eagle.kernels.attention import backend as attention_backend

    calls: list[str] = []
    for mod, fn, tag in ((sparse_prefill, "sparse_prefill_attention", "tiled"),
                         (triton_kernels, "sparse_attention", "per_token")):
        monkeypatch.setattr(mod, fn, lambda q, *a, _tag=tag, **k: calls.append(_tag) or torch.zeros_like(q))
    on, named = TritonBackend(sparse_prefill_min_q=sparse_prefill.PREFILL_MIN_Q), attention_backend.create(
        "triton_sparse_prefill")
    for q_lens, backend, want in (([16, 1], on, "tiled"), ([15, 1], on, "per_token"),
                                  ([16, 1], named, "tiled"), ([15, 1], named, "per_token"),
                                  ([16, 1], TritonBackend(), "per_token"),
                                  ([16, 1], BatchInvariantBackend(), "per_token")):
        s = make_step(42, q_lens, [50, 30], 8, hq=4, hkv=2, hi=2)
        backend.attend_selected(s.q, s.k, s.v, s.meta, 0.3, ref_selection(s, 4, 3, 1), 4)
        assert calls.pop() == want and not calls, (q_lens, type(backend).__name__)


def test_selection_rule_is_host_metadata_only():
    meta = make_step(43, [16, 1], [30, 9], 8).meta
    assert sparse_prefill.use_prefill_kernel(meta, 16)
    assert not sparse_prefill.use_prefill_kernel(replace(meta, max_q=15), 16)
    assert not sparse_prefill.use_prefill_kernel(meta, None)
    tail = replace(meta, tail_start=torch.full((2,), meta.max_kv), tail_slots=torch.zeros(2, 1, dtype=torch.int64))
    assert not sparse_prefill.use_prefill_kernel(tail, 16)  # a draft-tree step stays per token
    s = make_step(43, [16, 1], [30, 9], 8)
    with pytest.raises(ValueError, match="tail override"):
        sparse_prefill.sparse_prefill_attention(s.q, s.k, s.v, tail, 0.3, ref_selection(s, 4, 2, 1), 4)


def _mutant(tmp_path, old: str, new: str):
    """sparse_prefill's source with `old` (found exactly once) replaced by `new`, loaded as its own module."""
    src = inspect.getsource(sparse_prefill)
    assert src.count(old) == 1, old
    path = tmp_path / f"mutant_{abs(hash(old))}.py"
    path.write_text(src.replace(old, new))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod  # the interpreter re-reads a kernel's source through its module
    spec.loader.exec_module(mod)
    return mod


MUTANTS = {
    # every row sees every block some row of its tile selected (the union), not only its own token's
    "union": ("return tl.max((sel == blk).to(tl.int32), 1) > 0", "return tl.max((sel == blk).to(tl.int32), 1) > -1"),
    # rows see keys up to the tile's last position (causal per tile, not per token)
    "tile_causal": ("(keys[None, :] <= pos[:, None])", "(keys[None, :] <= tl.max(pos, 0))"),
    # the walk skips the block right after one it visited
    "skip_next": ("tl.where(sel >= cur + CHUNK, sel, NO_BLOCK)", "tl.where(sel > cur + CHUNK, sel, NO_BLOCK)"),
}


@pytest.mark.parametrize("name", ["none", *MUTANTS])
def test_mask_mutants_fail(name, tmp_path):
    """Each mutant of the kernel's mask or walk misses the oracle both with tiles of 2 blocks (block 8, CHUNK 2)
    and with single blocks (block 16, CHUNK 1); the unmutated kernel ("none") meets it on the same inputs."""
    s = make_step(60, [13, 5, 6], [60, 40, 3], 16, hq=4, hkv=2, hi=2)
    mod = sparse_prefill if name == "none" else _mutant(tmp_path, *MUTANTS[name])
    for block in (8, 16):
        sel = edited_selection(s, block, 3, seed=61)
        ref = oracle(s, sel, block, 0.3)
        out = mod.sparse_prefill_attention(s.q, s.k, s.v, s.meta, 0.3, sel, block, block_t=8, block_n=16)
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        assert (err <= 1e-4) == (name == "none"), (block, err)


def test_prefill_tile_shapes():
    """m3-mini (Hq 16, Hkv 2, Hi 2, head_dim 128, block 128): 8 tokens x 8 heads = 64 MMA rows, 64-key tiles,
    two per block; tiny blocks share a 16-key tile; wide heads take fewer rows."""
    assert sparse_prefill.prefill_tile(128, 8, 128, 128)[:5] == (8, 8, 64, 1, 2)
    assert sparse_prefill.prefill_tile(128, 8, 16, 4)[:5] == (8, 8, 16, 4, 1)
    assert sparse_prefill.prefill_tile(64, 1, 3, 64)[:2] == (16, 1)  # M >= 16 even for a 3-token row
    bt, bg, n = sparse_prefill.prefill_tile(512, 8, 128, 128)[:3]
    assert bt * bg == 16 and n == 16
    meta = AttnMetadata.__new__(AttnMetadata)
    meta.num_rows, meta.max_q = 3, 20
    assert sparse_prefill.prefill_programs(meta, 16, 2, 2, 128, 128) == 3 * 3 * 2


def test_model_prompt_steps_match_the_reference_backend(monkeypatch):
    """A tiny MiniMax-M3 (block 4, top-2: sparse past 8 keys) on the triton backend, as the engine hands it
    (`meta.ops`): a prefill of a 20- and a 9-token prompt, then a 17-token chunk beside a decode row. Both steps
    take the tiled kernel in each sparse layer; the logits equal the reference backend's."""
    from m3eagle.kernels.attention import backend
    from m3eagle.kernels.attention.metadata import build_metadata
    from m3eagle.kernels.ops import REFERENCE
    from tests.kernels.test_triton_attention import POISON, tiny_model

    calls: list[int] = []
    tiled = sparse_prefill.sparse_prefill_attention
    monkeypatch.setattr(sparse_prefill, "sparse_prefill_attention", lambda *a, **k: calls.append(1) or tiled(*a, **k))
    model = tiny_model(1)
    page, max_kv = 4, 48
    table = torch.zeros(2, max_kv // page + 1, dtype=torch.int64)
    table[0, :10] = torch.randperm(10, generator=torch.Generator().manual_seed(3)) + 1  # 40 slots, shuffled
    table[1, :3] = torch.tensor([13, 11, 12])
    steps = [([20, 9], [20, 9]), ([17, 1], [37, 10])]  # (q_lens, kv_lens after the step)
    logits = {}
    for name in ("reference", "triton"):
        caches = model.new_caches(14 * page, torch.float32, torch.device("cpu"))
        for c in caches:  # slots no row owns: a read shows
            c.k.fill_(POISON), c.v.fill_(POISON)
            if c.idx_k is not None:
                c.idx_k.fill_(POISON)
        att = backend.create(name)
        if name == "triton":  # the tiled kernel on (the backend's default keeps it off until timed on a GPU)
            att.sparse_prefill_min_q = sparse_prefill.PREFILL_MIN_Q
        ops = replace(REFERENCE, attention=att)
        gen = torch.Generator().manual_seed(5)
        logits[name] = []
        with torch.no_grad():
            for q_lens, kv_lens in steps:
                meta = replace(build_metadata(q_lens, torch.tensor(kv_lens), table, page, torch.device("cpu"),
                                              max_kv=max_kv), ops=ops)
                ids = torch.randint(0, 64, (sum(q_lens),), generator=gen)
                logits[name].append(model.compute_logits(model(ids, meta.positions, meta, caches)))
    for tri, ref in zip(logits["triton"], logits["reference"]):
        assert_close(tri, ref)
    assert len(calls) == 2 * 2  # two sparse layers, two steps
