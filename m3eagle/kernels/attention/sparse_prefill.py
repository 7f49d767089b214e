"""Block-sparse attention for prompt rows: BLOCK_T consecutive query tokens of one row share each key-block load.

`triton_kernels._sparse_attn_kernel` runs one program per (query token, head group): right for decode and
verify rows, whose few tokens each gather their own selected blocks. A prompt chunk past the selection
threshold (a 128-token suffix over a 4,096-token cached prefix, a long prompt) then gives each MMA only
HEADS rows (8 on m3-mini) and re-reads the same K/V blocks once per token, although consecutive tokens of a
row select mostly the same blocks (their shared local block, and the high-scoring ones).

`_sparse_prefill_kernel` tiles BLOCK_T consecutive tokens of ONE row times the HEADS query heads that share
a KV head and an index head into one program (M = BLOCK_T * BLOCK_G MMA rows), as `_dense_attn_kernel`
tiles a row's tokens. The program holds its tokens' selections in registers (sel [M, K], the token's list
repeated for its heads) and walks the union of them in ascending block order: the next block is the smallest
selected id past the current one (one min reduction), so blocks that no token of the tile selected cost
nothing, and each selected block's K/V is loaded once for the whole tile. Each (row m, key) pair is masked by

    the key's block is in row m's token's selection   (sel[m, :] == block: -1 entries never match)
    key position <= the token's position              (token-causal)
    key position < max_kv

which is the key set `_sparse_attn_kernel` gives that token, so the two kernels agree up to summation order.
Online softmax in base 2 with fp32 accumulators (`_online_softmax_step`), paged K/V reads (`_attend_key_tile`)
and the output / split-partial layout (`_write_result`) are the per-token kernel's own helpers.

Key tiles: a block of BLOCK_BS = next_pow2(block_size) key slots is attended in SUB tiles of BLOCK_N keys
(BLOCK_N = 64 for m3's 128-key blocks: the dense kernel's register budget for 64-row tiles), or, for blocks
under 16 keys (the smallest tl.dot), CHUNK consecutive blocks starting at the next selected one share one tile.
What the tile saves depends on how far its tokens' selections overlap (a tile of disjoint selections loads
BLOCK_T times the blocks of one token, with BLOCK_T times the MMA rows): `benchmarks/attention_kernels.py
--prefill-only` times both kernels on random and on coherent selections.

CUDA graphs (see triton_kernels' module docstring): the grid is (rows * cdiv(max_q, BLOCK_T), Hq // HEADS,
splits), from host ints only; a program past its row's tokens exits at once. Split s covers blocks
[s * bps, (s + 1) * bps) of the tile's visible blocks (bps = cdiv(blocks, splits), from the tile's device
positions) and writes a normalized fp32 partial and its log2-sum-exp for `_combine_kernel`, as the others do.

No tail override (a draft-tree step's metadata): prompt rows of such a step carry none, but its node rows
do, so the whole launch stays on `_sparse_attn_kernel` (`use_prefill_kernel`), and this launcher refuses it.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from m3eagle.kernels import pdl
from m3eagle.kernels.attention.metadata import AttnMetadata
from m3eagle.kernels.attention.triton_kernels import (
    _PARTIALS,
    LOG2E,
    _attend_key_tile,
    _check_pools,
    _combine,
    _dot_precision,
    _partials,
    _pow2,
    _write_result,
    dense_tile,
)
from m3eagle.kernels.pdl import pdl_wait

NO_BLOCK = tl.constexpr(2147483647)  # a -1 selection entry: above every block id, so never "next"

# Per-step ints stay out of the specialization key (see triton_kernels' NOTE on _PARTIALS).
_PREFILL_PER_STEP = _PARTIALS + ["stride_qi", "max_kv", "n_qtiles", "num_splits"]

# Steps whose widest row has at least this many query tokens take the tiled kernel (TritonBackend's default):
# decode and verify rows (1 + K tokens, K <= 15) keep the per-token kernel.
PREFILL_MIN_Q = 16


@triton.jit
def _selected(sel, blk):
    """[M] bool: block `blk` is in row m's selection (sel [M, K]; NO_BLOCK entries never match)."""
    return tl.max((sel == blk).to(tl.int32), 1) > 0


@triton.jit
def _chunk_hits(sel, cur, blk_of_key, CHUNK: tl.constexpr):
    """[M, N] bool: key n's block (cur + blk_of_key[n], blk_of_key [N] in 0..CHUNK-1) is in row m's selection
    (sel [M, K]). One [M, K] comparison per block of the chunk, no [M, N, K] temporary."""
    hits = _selected(sel, cur)[:, None] & (blk_of_key == 0)[None, :]
    for c in tl.static_range(1, CHUNK):
        hits = hits | (_selected(sel, cur + c)[:, None] & (blk_of_key == c)[None, :])
    return hits


@triton.jit(do_not_specialize=_PREFILL_PER_STEP)
def _sparse_prefill_kernel(
    Q, K, V, Out, PartO, PartLse,
    PageTable, QIndex, QLens, Positions, Sel,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh,
    stride_pb, stride_qi, stride_pos, stride_pot, stride_poh, stride_pls, stride_plt, stride_st, stride_sh,
    qk_scale, page_size, num_page_cols, max_kv, block_size, num_sel, n_qtiles, num_splits,
    HEAD_DIM: tl.constexpr, HEADS: tl.constexpr, GROUP_KV: tl.constexpr, GROUP_IDX: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_BS: tl.constexpr,
    BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr):
    """Grid (rows * n_qtiles, Hq // HEADS, splits). One program: BLOCK_T tokens of one row times HEADS query
    heads sharing a KV head and an index head (M = BLOCK_T * BLOCK_G rows), over the union of the tokens'
    selected blocks (Sel [T, Hi, num_sel], -1 = none) in ascending order; each row sees only its own
    token's blocks, token-causal. Per step: one block (CHUNK == 1) in SUB key tiles of BLOCK_N, or CHUNK
    consecutive blocks in one key tile (blocks under 16 keys)."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    pid = tl.program_id(0)
    row = pid // n_qtiles
    qtile = pid % n_qtiles
    h0 = tl.program_id(1) * HEADS
    split = tl.program_id(2)
    q_len = tl.load(QLens + row)
    if qtile * BLOCK_T >= q_len:  # a tile past the row's tokens (rows narrower than max_q)
        return
    BLOCK_M: tl.constexpr = BLOCK_T * BLOCK_G
    kvh = h0 // GROUP_KV
    ih = h0 // GROUP_IDX

    offs_m = tl.arange(0, BLOCK_M)
    qi = qtile * BLOCK_T + offs_m // BLOCK_G  # [M] token index inside the row
    g = offs_m % BLOCK_G
    row_ok = (qi < q_len) & (g < HEADS)
    tok = tl.load(QIndex + row * stride_qi) + qi  # [M] flat token (q_index[row, 0] is the row's first)
    head = h0 + g  # [M]
    # Masked-off rows get position -1: they see no key and are never stored.
    pos = tl.load(Positions + tok, mask=row_ok, other=-1).to(tl.int32)  # [M]

    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_ptr = Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr, mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(K.dtype.element_ty)  # [M, D]

    # Each row's token's selection, in registers for the whole walk; -1 and masked rows -> NO_BLOCK.
    offs_k = tl.arange(0, BLOCK_K)
    sel_ptr = Sel + tok[:, None] * stride_st + ih * stride_sh + offs_k[None, :]
    sel = tl.load(sel_ptr, mask=row_ok[:, None] & (offs_k < num_sel)[None, :], other=-1).to(tl.int32)  # [M, K]
    sel = tl.where(sel >= 0, sel, NO_BLOCK)

    # Blocks of this split: its share of the blocks the tile can see (keys < min(last position + 1, max_kv)).
    seen = tl.minimum(tl.max(pos, 0) + 1, max_kv)
    n_blocks = tl.cdiv(tl.maximum(seen, 0), block_size)
    per_split = tl.cdiv(n_blocks, num_splits)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, n_blocks)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    pt_row = PageTable + row * stride_pb
    offs_n = tl.arange(0, BLOCK_N)
    # The smallest block >= lo that some row selected; NO_BLOCK (>= hi) when none: the walk ends.
    cur = tl.min(tl.min(tl.where(sel >= lo, sel, NO_BLOCK), 1), 0)
    while cur < hi:
        if CHUNK == 1:
            hit = _selected(sel, cur)[:, None]  # [M, 1]: row m's token selected block cur
        else:
            hit = _chunk_hits(sel, cur, offs_n // BLOCK_BS, CHUNK)  # [M, N]
        for sub in tl.static_range(SUB):
            offs = sub * BLOCK_N + offs_n  # [N] key slot inside the run of CHUNK blocks from cur
            blk = cur + offs // BLOCK_BS
            keys = blk * block_size + offs % BLOCK_BS  # [N] key positions
            k_in = (offs % BLOCK_BS < block_size) & (blk < hi) & (keys < max_kv)  # [N] (blk < hi: the split's)
            valid = hit & k_in[None, :] & (keys[None, :] <= pos[:, None])  # [M, N] selected, token-causal
            needed = tl.max(valid.to(tl.int32), 0) > 0  # [N] keys some row sees: the only K/V loaded
            if tl.max(needed.to(tl.int32), 0) > 0:  # a sub-tile past every row's position is skipped
                m_i, l_i, acc = _attend_key_tile(q, K, V, pt_row, keys, needed, valid, kvh, offs_d, d_ok, m_i, l_i,
                                                 acc, stride_ks, stride_kh, stride_vs, stride_vh, qk_scale,
                                                 page_size, num_page_cols, pt_row, 0, 1, DOT_PREC, False)
        cur = tl.min(tl.min(tl.where(sel >= cur + CHUNK, sel, NO_BLOCK), 1), 0)

    _write_result(acc, m_i, l_i, tok, head, row_ok, offs_d, d_ok, split, Out, stride_ot, stride_oh,
                  PartO, PartLse, stride_pos, stride_pot, stride_poh, stride_pls, stride_plt, SPLIT)


# ---- launchers -----------------------------------------------------------------------------------------


def use_prefill_kernel(meta: AttnMetadata, min_q: int | None) -> bool:
    """The selection rule, from host metadata only (a captured graph fixes it): the tiled kernel when the
    step's widest row has >= min_q query tokens (None: never) and the step has no tail override."""
    return min_q is not None and meta.max_q >= min_q and meta.tail_start is None


def _heads(hq: int, hkv: int, hi: int) -> int:
    """Query heads of one program: those that share both their KV head and their index head."""
    return math.gcd(hq // hkv, hq // hi)


def prefill_tile(head_dim: int, heads: int, max_q: int, block_size: int, block_n: int = 64,
                 block_t: int | None = None) -> tuple[int, int, int, int, int, int, int | None]:
    """(BLOCK_T, BLOCK_G, BLOCK_N, CHUNK, SUB, num_warps, num_stages) -- the dense kernel's register budget
    (`dense_tile`: ~64 rows of head_dim <= 128, fewer for wider heads), the key tile no wider than a block
    unless a block is under 16 keys. block_t (tests): tokens per tile, a power of two."""
    tile = dense_tile(head_dim, heads, max_q, block_n)
    block_g = tile.block_g
    if block_t is None:
        block_t = tile.block_q
    block_t = max(block_t, _pow2(-(-16 // block_g)))  # M >= 16: the smallest tl.dot
    block_bs = _pow2(block_size)
    n = min(tile.block_n, max(block_bs, 16))
    return block_t, block_g, n, max(1, n // block_bs), max(1, block_bs // n), tile.num_warps, tile.num_stages


def prefill_programs(meta: AttnMetadata, num_q_heads: int, num_kv_heads: int, num_index_heads: int,
                     head_dim: int, block_size: int) -> int:
    """Programs of one tiled launch before splitting (the split policy's input)."""
    heads = _heads(num_q_heads, num_kv_heads, num_index_heads)
    block_t = prefill_tile(head_dim, heads, meta.max_q, block_size)[0]
    return meta.num_rows * -(-meta.max_q // block_t) * (num_q_heads // heads)


def sparse_prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttnMetadata,
                             scale: float, sel: torch.Tensor, block_size: int, num_splits: int = 1,
                             block_n: int = 64, block_t: int | None = None, out: torch.Tensor | None = None,
                             num_warps: int | None = None) -> torch.Tensor:
    """q [T, Hq, D], sel [T, Hi, k] (block ids, -1 = none) -> out [T, Hq, D] (q's dtype): what
    `triton_kernels.sparse_attention` computes, with a row's BLOCK_T consecutive tokens per program. Split s
    of `num_splits` takes the s-th share of each tile's visible blocks (+ `_combine_kernel`)."""
    _check_pools(q, k_pool, v_pool)
    if meta.tail_start is not None:
        raise ValueError("sparse_prefill_attention has no tail override: a draft-tree step runs "
                         "triton_kernels.sparse_attention (use_prefill_kernel)")
    t, hq, d = q.shape
    hkv, hi, num_sel = k_pool.shape[1], sel.shape[1], sel.shape[2]
    if hq % hi:
        raise ValueError(f"query heads ({hq}) must be a multiple of index heads ({hi})")
    if k_pool.shape[-1] != d or v_pool.shape[-1] != d:
        raise ValueError(f"q head_dim {d} but k_pool / v_pool head_dim {k_pool.shape[-1]} / {v_pool.shape[-1]}")
    if block_t is not None and block_t != _pow2(block_t):
        raise ValueError(f"block_t must be a power of two (got {block_t})")
    out = torch.empty_like(q) if out is None else out
    if t == 0:
        return out
    heads = _heads(hq, hkv, hi)
    block_t, block_g, n, chunk, sub, warps, stages = prefill_tile(d, heads, meta.max_q, block_size, block_n, block_t)
    n_qtiles = -(-meta.max_q // block_t)
    splits = max(1, min(num_splits, -(-meta.max_kv // block_size)))  # at most one split per block of max_kv
    part_o, part_lse = _partials(splits, t, hq, d, q.device) if splits > 1 else (out, out)
    pstr = (*part_o.stride()[:3], *part_lse.stride()[:2]) if splits > 1 else (0,) * 5
    page_table = meta.page_table.contiguous()
    sel = sel if sel.stride(-1) == 1 else sel.contiguous()
    stage_opt = {"num_stages": stages} if stages is not None else {}
    _sparse_prefill_kernel[(meta.num_rows * n_qtiles, hq // heads, splits)](
        q, k_pool, v_pool, out, part_o, part_lse, page_table, meta.q_index, meta.q_lens, meta.positions, sel,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        out.stride(0), out.stride(1), page_table.stride(0), meta.q_index.stride(0), *pstr, sel.stride(0),
        sel.stride(1), scale * LOG2E, meta.page_size, page_table.shape[1], meta.max_kv, block_size, num_sel,
        n_qtiles, splits,
        HEAD_DIM=d, HEADS=heads, GROUP_KV=hq // hkv, GROUP_IDX=hq // hi, BLOCK_T=block_t, BLOCK_G=block_g,
        BLOCK_K=_pow2(num_sel), BLOCK_BS=_pow2(block_size), BLOCK_N=n, CHUNK=chunk, SUB=sub, BLOCK_D=_pow2(d, 16),
        SPLIT=splits > 1, DOT_PREC=_dot_precision(k_pool.dtype), num_warps=num_warps or warps, **stage_opt,
        **pdl.args(q))
    if splits > 1:
        _combine(part_o, part_lse, out)
    return out
