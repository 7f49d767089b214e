"""Triton kernels for paged attention: dense extend, block-sparse extend, the lightning indexer's block
scores and top-k, and the split-KV combine. `reference.py` is the oracle; `tests/test_triton_attention.py`
holds these equal to it.

All kernels read K/V straight from the paged pools: key position j of row b lives at slot

    page_table[b, min(j // page_size, P - 1)] * page_size + j % page_size

(the clamp is `metadata.slots_for_positions`'s: columns past the table width read TRASH_PAGE). Every query
token t attends to keys 0..positions[t] of its row (token-causal), so prompt chunks, decode rows and
spec-verify rows of 1+K tokens are one code path.

Launchers size their grids from host ints of the metadata only (num_rows, max_q, max_kv, num_tokens) and
never read a device value back: no blocking CPU operation in this path, so it can be captured in a CUDA
graph.

Split-KV (flash-decoding): when the grid is too small to fill the GPU (batch-1 decode over a long context),
the key range (dense) or the selected-block list (sparse) is cut into `num_splits` pieces; each piece writes
a normalized fp32 partial and its log2-sum-exp, and `_combine_kernel` merges them.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .metadata import AttnMetadata

LOG2E = 1.4426950408889634


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(max(1, n)))


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs must not drop to TF32 (the oracle is exact fp32). bf16/fp16 products are exact in fp32
    # and accumulate in fp32, so the flag does not matter for them.
    return "ieee" if dtype == torch.float32 else "tf32"


# ---- shared device helpers -----------------------------------------------------------------------------


@triton.jit
def _page_slots(page_table_row, keys, page_size, num_page_cols, mask):
    """Cache slots [N] (int64) of key positions `keys` [N] of one row; TRASH_PAGE past the held pages."""
    col = tl.minimum(keys // page_size, num_page_cols - 1)
    page = tl.load(page_table_row + col, mask=mask, other=0)
    return page * page_size + keys % page_size


@triton.jit
def _online_softmax_step(q, k, v, valid, m_i, l_i, acc, qk_scale, DOT_PREC: tl.constexpr):
    """One key tile of online softmax in base 2. q [M, D], k/v [N, D], valid [M, N] (or broadcastable).

    A row whose keys so far are all masked keeps m = -inf; `m_use` pins it to 0 so that exp2 never sees
    (-inf) - (-inf) = NaN, and the row accumulates nothing (p = 0, alpha = 0)."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [M, N] fp32, log2 units
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _attend_key_tile(q, K, V, pt_row, keys, k_ok, valid, kvh, offs_d, d_ok, m_i, l_i, acc,
                     stride_ks, stride_kh, stride_vs, stride_vh, qk_scale, page_size, num_page_cols,
                     DOT_PREC: tl.constexpr):
    """Gather the K/V of key positions `keys` [N] (loads masked by k_ok [N]) from the pools and run one
    online-softmax step with the mask `valid` ([M, N] or [1, N])."""
    slots = _page_slots(pt_row, keys, page_size, num_page_cols, k_ok)  # [N] int64
    kv_mask = k_ok[:, None] & d_ok[None, :]
    k = tl.load(K + slots[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :], mask=kv_mask,
                other=0.0)  # [N, D]
    v = tl.load(V + slots[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
    return _online_softmax_step(q, k, v, valid, m_i, l_i, acc, qk_scale, DOT_PREC)


@triton.jit
def _write_result(acc, m_i, l_i, tok, head, row_ok, offs_d, d_ok, split,
                  Out, stride_ot, stride_oh, PartO, PartLse,
                  stride_pos, stride_pot, stride_poh, stride_pls, stride_plt, SPLIT: tl.constexpr):
    """Store acc / l into Out (one split), or a normalized fp32 partial and its log2-sum-exp.

    acc [M, D], m_i / l_i / tok / head / row_ok [M]."""
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    mask = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        # An empty split (no visible key) still writes: lse = -inf gives it weight 0 in the combine.
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        split = split.to(tl.int64)  # splits * T * Hq * D can pass 2^31
        po = PartO + split * stride_pos + tok * stride_pot + head * stride_poh  # [M]
        tl.store(po[:, None] + offs_d[None, :], o, mask=mask)
        tl.store(PartLse + split * stride_pls + tok * stride_plt + head, lse, mask=row_ok)
    else:
        ptr = Out + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(ptr, o.to(Out.dtype.element_ty), mask=mask)


# ---- kernels -------------------------------------------------------------------------------------------


@triton.jit
def _dense_attn_kernel(
    Q, K, V, Out, PartO, PartLse,
    PageTable, QStart, QLens, Positions, Keep,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh,
    stride_pb, stride_pos, stride_pot, stride_poh, stride_pls, stride_plt, stride_keep_t, stride_keep_h,
    qk_scale, page_size, num_page_cols, max_kv, keys_per_split, keep_block, n_qtiles,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, GROUP_IDX: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_KEEP: tl.constexpr, KEEP_PER_TILE: tl.constexpr, SPLIT: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Grid (rows * n_qtiles, Hkv, splits). One program: BLOCK_Q query tokens of one row times the GROUP
    query heads of one KV head, flattened into M = BLOCK_Q * BLOCK_G rows, so every K/V tile it loads is
    shared by the whole GQA group and by all of the tile's tokens (a verify row reads its KV once).

    HAS_KEEP (block-sparse prompt chunks): Keep [T, Hi, NB] int8 marks the key blocks (of `keep_block`
    keys) each token's index head selected; head h reads index head h // GROUP_IDX. A key tile that no
    row of the program selected is skipped without loading K/V, so the tile reads the union of its
    tokens' selections once instead of once per token. KEEP_PER_TILE: every key tile lies inside one
    keep block (BLOCK_N divides keep_block, tiles start on multiples of BLOCK_N)."""
    pid = tl.program_id(0)
    row = pid // n_qtiles
    qtile = pid % n_qtiles
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_G

    offs_m = tl.arange(0, BLOCK_M)
    qi = qtile * BLOCK_Q + offs_m // BLOCK_G  # [M] token index inside the row
    g = offs_m % BLOCK_G
    q_len = tl.load(QLens + row)
    row_ok = (qi < q_len) & (g < GROUP)
    tok = tl.load(QStart + row) + qi  # [M] flat token
    head = kvh * GROUP + g
    ih = head // GROUP_IDX  # [M] index head (HAS_KEEP only)
    # Masked-off rows get position -1: they see no key and are never stored.
    pos = tl.load(Positions + tok, mask=row_ok, other=-1).to(tl.int32)  # [M]

    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_ptr = Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr, mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(K.dtype.element_ty)  # [M, D]

    # Keys this program visits: its split's range, cut at the tile's last visible key and at max_kv
    # (the oracle only looks at keys < max_kv).
    lo = split * keys_per_split
    hi = tl.minimum(tl.minimum(lo + keys_per_split, tl.max(pos, 0) + 1), max_kv)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    pt_row = PageTable + row * stride_pb
    keep_row = Keep + tok * stride_keep_t + ih * stride_keep_h  # [M] (HAS_KEEP only)
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        keys = start + offs_n  # [N]
        k_ok = keys < hi
        valid = k_ok[None, :] & (keys[None, :] <= pos[:, None])  # [M, N] token-causal
        if HAS_KEEP:
            if KEEP_PER_TILE:
                # the key tile lies inside one keep block: one flag per row, not per key
                kp = tl.load(keep_row + start // keep_block, mask=row_ok, other=0)  # [M]
                valid = valid & (kp != 0)[:, None]
            else:
                keep_ptr = keep_row[:, None] + (keys // keep_block)[None, :]
                valid = valid & (tl.load(keep_ptr, mask=valid, other=0) != 0)
            needed = tl.max(valid.to(tl.int32), 0) > 0  # [N] keys some row of the tile selected
            if tl.max(needed.to(tl.int32), 0) > 0:
                m_i, l_i, acc = _attend_key_tile(q, K, V, pt_row, keys, needed, valid, kvh, offs_d, d_ok,
                                                 m_i, l_i, acc, stride_ks, stride_kh, stride_vs, stride_vh,
                                                 qk_scale, page_size, num_page_cols, DOT_PREC)
        else:
            m_i, l_i, acc = _attend_key_tile(q, K, V, pt_row, keys, k_ok, valid, kvh, offs_d, d_ok, m_i, l_i,
                                             acc, stride_ks, stride_kh, stride_vs, stride_vh, qk_scale,
                                             page_size, num_page_cols, DOT_PREC)

    _write_result(acc, m_i, l_i, tok, head, row_ok, offs_d, d_ok, split, Out, stride_ot, stride_oh,
                  PartO, PartLse, stride_pos, stride_pot, stride_poh, stride_pls, stride_plt, SPLIT)


@triton.jit
def _sparse_attn_kernel(
    Q, K, V, Out, PartO, PartLse,
    PageTable, TokRow, Positions, Sel,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh,
    stride_pb, stride_pos, stride_pot, stride_poh, stride_pls, stride_plt, stride_st, stride_sh,
    qk_scale, page_size, num_page_cols, max_kv, block_size, num_sel, sel_per_split,
    HEAD_DIM: tl.constexpr, HEADS: tl.constexpr, GROUP_KV: tl.constexpr, GROUP_IDX: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_BS: tl.constexpr, SEL_CHUNK: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Grid (T, Hq // HEADS, splits). One program: one query token times HEADS query heads that share
    both a KV head and an index head, visiting only its selected key blocks (sel[t, ih, :], -1 = none).
    Tokens are not tiled together because each token has its own block selection.

    Each iteration gathers SEL_CHUNK selected blocks at once (key tile of SEL_CHUNK * BLOCK_BS), so a
    decode token's short list of blocks costs few dependent load chains (sel -> page table -> K/V)."""
    tok = tl.program_id(0).to(tl.int64)
    h0 = tl.program_id(1) * HEADS
    split = tl.program_id(2)
    kvh = h0 // GROUP_KV
    ih = h0 // GROUP_IDX
    BLOCK_N: tl.constexpr = SEL_CHUNK * BLOCK_BS

    g = tl.arange(0, BLOCK_G)
    row_ok = g < HEADS
    head = h0 + g  # [G]
    tok_v = tl.zeros([BLOCK_G], tl.int64) + tok
    row = tl.load(TokRow + tok)
    pos = tl.load(Positions + tok).to(tl.int32)

    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_ptr = Q + tok * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr, mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(K.dtype.element_ty)  # [G, D]

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    pt_row = PageTable + row * stride_pb
    sel_row = Sel + tok * stride_st + ih * stride_sh
    offs_n = tl.arange(0, BLOCK_N)
    chunk = offs_n // BLOCK_BS  # [N] which selection entry of the iteration a key belongs to
    within = offs_n % BLOCK_BS  # [N] key offset inside its block
    lo = split * sel_per_split
    hi = tl.minimum(lo + sel_per_split, num_sel)
    for i0 in range(lo, hi, SEL_CHUNK):
        entry = i0 + chunk
        blk = tl.load(sel_row + entry, mask=entry < hi, other=-1).to(tl.int32)  # [N]
        keys = blk * block_size + within
        # Selected blocks are distinct, so no key is counted twice; a -1 entry masks its whole block.
        k_ok = (blk >= 0) & (within < block_size) & (keys <= pos) & (keys < max_kv)  # [N]
        m_i, l_i, acc = _attend_key_tile(q, K, V, pt_row, keys, k_ok, k_ok[None, :], kvh, offs_d, d_ok, m_i,
                                         l_i, acc, stride_ks, stride_kh, stride_vs, stride_vh, qk_scale,
                                         page_size, num_page_cols, DOT_PREC)

    _write_result(acc, m_i, l_i, tok_v, head, row_ok, offs_d, d_ok, split, Out, stride_ot, stride_oh,
                  PartO, PartLse, stride_pos, stride_pot, stride_poh, stride_pls, stride_plt, SPLIT)


@triton.jit
def _combine_kernel(
    PartO, PartLse, Out,
    stride_pos, stride_pot, stride_poh, stride_pls, stride_plt, stride_ot, stride_oh, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid (T, Hq): out = sum_s 2^(lse_s - max) * o_s / sum_s 2^(lse_s - max)."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_s64 = offs_s.to(tl.int64)
    lse = tl.load(PartLse + offs_s64 * stride_pls + tok * stride_plt + head, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # [S], 0 for empty splits
    o_ptr = PartO + offs_s64[:, None] * stride_pos + tok * stride_pot + head * stride_poh + offs_d[None, :]
    o = tl.load(o_ptr, mask=s_ok[:, None] & d_ok[None, :], other=0.0)  # [S, D]
    den = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(den == 0.0, 1.0, den)
    tl.store(Out + tok * stride_ot + head * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=d_ok)


@triton.jit
def _index_scores_kernel(
    IQ, IK, Scores, PageTable, QStart, QLens, Positions,
    stride_qt, stride_qh, stride_ks, stride_st, stride_sh, stride_pb,
    page_size, num_page_cols, max_kv, block_size, num_blocks, blocks_per_prog, local_blocks, n_qtiles,
    INDEX_DIM: tl.constexpr, N_HEADS: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_BS: tl.constexpr, BLOCKS_PER_ITER: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Grid (rows * n_qtiles, cdiv(num_blocks, blocks_per_prog)). Block scores of the lightning indexer:

        Scores[t, h, n] = max_{j in block n, j <= pos[t]} <iq[t, h], ik[j]>   (fp32)
                          +inf for the query's own `local_blocks` blocks

    Only blocks up to the tile's last visible key are written: every later block is -inf for every token
    of the tile, so callers either pre-fill -inf or read each token's blocks only up to its own."""
    pid = tl.program_id(0)
    row = pid // n_qtiles
    qtile = pid % n_qtiles
    chunk = tl.program_id(1)
    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_H

    offs_m = tl.arange(0, BLOCK_M)
    qi = qtile * BLOCK_Q + offs_m // BLOCK_H
    hh = offs_m % BLOCK_H
    q_len = tl.load(QLens + row)
    row_ok = (qi < q_len) & (hh < N_HEADS)
    tok = tl.load(QStart + row) + qi  # [M]
    pos = tl.load(Positions + tok, mask=row_ok, other=-1).to(tl.int32)
    own = tl.where(pos >= 0, pos // block_size, -1)  # [M]; // truncates, so guard the -1 rows

    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < INDEX_DIM
    iq_ptr = IQ + tok[:, None] * stride_qt + hh[:, None] * stride_qh + offs_d[None, :]
    iq = tl.load(iq_ptr, mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(IK.dtype.element_ty)  # [M, Di]

    max_pos = tl.max(pos, 0)
    last_block = tl.where(max_pos >= 0, max_pos // block_size + 1, 0)
    nb_lo = chunk * blocks_per_prog
    nb_hi = tl.minimum(tl.minimum(nb_lo + blocks_per_prog, last_block), num_blocks)
    pt_row = PageTable + row * stride_pb
    BLOCK_N: tl.constexpr = BLOCKS_PER_ITER * BLOCK_BS
    offs_n = tl.arange(0, BLOCK_N)
    within = offs_n % BLOCK_BS  # [N] key offset inside its block
    offs_b = tl.arange(0, BLOCKS_PER_ITER)
    s_ptr = Scores + tok * stride_st + hh * stride_sh  # [M]
    for nb0 in range(nb_lo, nb_hi, BLOCKS_PER_ITER):
        blk = nb0 + offs_n // BLOCK_BS  # [N]
        keys = blk * block_size + within
        k_ok = (within < block_size) & (blk < nb_hi) & (keys < max_kv) & (keys <= max_pos)
        slots = _page_slots(pt_row, keys, page_size, num_page_cols, k_ok)
        ik = tl.load(IK + slots[:, None] * stride_ks + offs_d[None, :], mask=k_ok[:, None] & d_ok[None, :],
                     other=0.0)  # [N, Di]
        s = tl.dot(iq, tl.trans(ik), input_precision=DOT_PREC)  # [M, N] fp32
        s = tl.where(k_ok[None, :] & (keys[None, :] <= pos[:, None]), s, float("-inf"))
        best = tl.max(tl.reshape(s, (BLOCK_M, BLOCKS_PER_ITER, BLOCK_BS)), 2)  # [M, B] max-pool per block
        nbs = nb0 + offs_b  # [B]
        local = (nbs[None, :] <= own[:, None]) & (nbs[None, :] > own[:, None] - local_blocks)
        best = tl.where(local, float("inf"), best)
        tl.store(s_ptr[:, None] + nbs[None, :], best, mask=row_ok[:, None] & (nbs < nb_hi)[None, :])


@triton.jit
def _topk_blocks_kernel(
    Scores, Sel, Positions, stride_st, stride_sh, stride_selt, stride_selh, block_size, num_blocks,
    TOPK: tl.constexpr, BLOCK_NB: tl.constexpr,
):
    """Grid (T, Hi). sel[t, h, :] = the TOPK best blocks of Scores[t, h, :], best first (ties to the lower
    block id), -1 once only -inf is left. Reads only blocks 0..pos[t] // block_size -- the ones the score
    kernel wrote for this token (later blocks hold no visible key, so they are -inf by definition)."""
    tok = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    last = tl.load(Positions + tok) // block_size
    offs = tl.arange(0, BLOCK_NB)
    x = tl.load(Scores + tok * stride_st + h * stride_sh + offs, mask=(offs <= last) & (offs < num_blocks),
                other=float("-inf"))  # [NB]
    for i in tl.static_range(TOPK):
        best = tl.max(x, 0)
        idx = tl.min(tl.where(x == best, offs, BLOCK_NB), 0)
        tl.store(Sel + tok * stride_selt + h * stride_selh + i, tl.where(best == float("-inf"), -1, idx))
        x = tl.where(offs == idx, float("-inf"), x)  # taken: it can only come back as -1


# ---- launchers -----------------------------------------------------------------------------------------


def _q_tile(group: int, max_q: int, target_rows: int = 64) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_G): tokens per tile and padded heads per token. M = BLOCK_Q * BLOCK_G is kept >= 16
    (the smallest tl.dot) and near `target_rows`; a tile never holds more tokens than the widest row."""
    block_g = _pow2(group)
    block_q = min(_pow2(max_q), max(1, target_rows // block_g))
    block_q = max(block_q, _pow2(-(-16 // block_g)))
    return block_q, block_g


def dense_programs(meta: AttnMetadata, num_q_heads: int, num_kv_heads: int) -> int:
    """Programs of one dense launch before splitting (the split policy's input)."""
    block_q, _ = _q_tile(num_q_heads // num_kv_heads, meta.max_q)
    return meta.num_rows * -(-meta.max_q // block_q) * num_kv_heads


def sparse_programs(meta: AttnMetadata, num_q_heads: int, num_kv_heads: int, num_index_heads: int) -> int:
    """Programs of one sparse launch before splitting."""
    heads = math.gcd(num_q_heads // num_kv_heads, num_q_heads // num_index_heads)
    return meta.num_tokens * (num_q_heads // heads)


def _partials(num_splits: int, t: int, hq: int, d: int, device: torch.device):
    # [splits, T, Hq, D] fp32 normalized partial outputs, [splits, T, Hq] fp32 log2-sum-exp
    return (torch.empty(num_splits, t, hq, d, dtype=torch.float32, device=device),
            torch.empty(num_splits, t, hq, dtype=torch.float32, device=device))


def _combine(part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor) -> None:
    s, t, hq, d = part_o.shape
    _combine_kernel[(t, hq)](
        part_o, part_lse, out, *part_o.stride()[:3], *part_lse.stride()[:2], out.stride(0), out.stride(1), s,
        HEAD_DIM=d, BLOCK_S=_pow2(s), BLOCK_D=_pow2(d, 16))


def _check_pools(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> None:
    if q.shape[1] % k_pool.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k_pool.shape[1]})")
    for name, x in (("q", q), ("k_pool", k_pool), ("v_pool", v_pool)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim (got strides {x.stride()})")


def dense_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttnMetadata,
                    scale: float, num_splits: int = 1, block_n: int = 64, keep: torch.Tensor | None = None,
                    keep_block: int = 0, out: torch.Tensor | None = None, num_warps: int = 4) -> torch.Tensor:
    """q [T, Hq, D] over paged K/V [S, Hkv, D] -> out [T, Hq, D] (q's dtype). Token-causal per row.

    keep [T, Hi, NB] int8 (optional): only key blocks of `keep_block` keys marked nonzero for the token's
    index head are visible -- the block-sparse layer computed tile-wise (see `_dense_attn_kernel`)."""
    _check_pools(q, k_pool, v_pool)
    t, hq, d = q.shape
    hkv = k_pool.shape[1]
    out = torch.empty_like(q) if out is None else out
    if t == 0:
        return out
    block_q, block_g = _q_tile(hq // hkv, meta.max_q)
    n_qtiles = -(-meta.max_q // block_q)
    keys_per_split = block_n * -(-meta.max_kv // (num_splits * block_n))  # a whole number of key tiles
    splits = max(1, -(-meta.max_kv // keys_per_split))
    part_o, part_lse = _partials(splits, t, hq, d, q.device) if splits > 1 else (out, out)
    pstr = (*part_o.stride()[:3], *part_lse.stride()[:2]) if splits > 1 else (0,) * 5
    page_table = meta.page_table.contiguous()
    q_start = meta.q_index[:, 0].contiguous()  # [B] flat index of each row's first token
    if keep is not None and (keep.stride(-1) != 1 or hq % keep.shape[1] or keep_block <= 0):
        raise ValueError("keep must be [T, Hi, NB], contiguous in NB, Hq a multiple of Hi, keep_block > 0")
    keep_args = (keep, keep.stride(0), keep.stride(1)) if keep is not None else (q, 0, 0)
    # Split ranges and tiles start on multiples of block_n, so a power-of-two block_n that divides
    # keep_block keeps each tile inside one keep block.
    per_tile = keep is not None and keep_block % block_n == 0
    _dense_attn_kernel[(meta.num_rows * n_qtiles, hkv, splits)](
        q, k_pool, v_pool, out, part_o, part_lse, page_table, q_start, meta.q_lens, meta.positions,
        keep_args[0],
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        out.stride(0), out.stride(1), page_table.stride(0), *pstr, keep_args[1], keep_args[2],
        scale * LOG2E, meta.page_size, page_table.shape[1], meta.max_kv, keys_per_split, max(1, keep_block),
        n_qtiles, HEAD_DIM=d, GROUP=hq // hkv,
        GROUP_IDX=hq // keep.shape[1] if keep is not None else 1,
        BLOCK_Q=block_q, BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=_pow2(d, 16), HAS_KEEP=keep is not None,
        KEEP_PER_TILE=per_tile, SPLIT=splits > 1, DOT_PREC=_dot_precision(k_pool.dtype), num_warps=num_warps)
    if splits > 1:
        _combine(part_o, part_lse, out)
    return out


def selection_mask(sel: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """sel [T, Hi, k] (-1 padded) -> keep [T, Hi, NB] int8, 1 on the selected blocks. Device-only ops."""
    t, hi, _ = sel.shape
    keep = torch.zeros(t, hi, num_blocks + 1, dtype=torch.int8, device=sel.device)
    keep.scatter_(2, sel.masked_fill(sel < 0, num_blocks), 1)  # -1 lands in a throwaway column
    return keep[..., :num_blocks]


def sparse_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttnMetadata,
                     scale: float, sel: torch.Tensor, block_size: int, num_splits: int = 1,
                     keys_per_iter: int = 128, out: torch.Tensor | None = None, num_warps: int = 4,
                     ) -> torch.Tensor:
    """q [T, Hq, D], sel [T, Hi, k] (block ids, -1 = none) -> out [T, Hq, D]: each token sees only the keys
    of its selected blocks, token-causal. Attention head h reads index head h // (Hq // Hi)."""
    _check_pools(q, k_pool, v_pool)
    t, hq, d = q.shape
    hkv, hi, num_sel = k_pool.shape[1], sel.shape[1], sel.shape[2]
    if hq % hi:
        raise ValueError(f"query heads ({hq}) must be a multiple of index heads ({hi})")
    out = torch.empty_like(q) if out is None else out
    if t == 0:
        return out
    group_kv, group_idx = hq // hkv, hq // hi
    heads = math.gcd(group_kv, group_idx)  # heads that share both their KV head and their index head
    per_split = max(1, -(-num_sel // max(1, num_splits)))
    splits = max(1, -(-num_sel // per_split))
    part_o, part_lse = _partials(splits, t, hq, d, q.device) if splits > 1 else (out, out)
    pstr = (*part_o.stride()[:3], *part_lse.stride()[:2]) if splits > 1 else (0,) * 5
    page_table = meta.page_table.contiguous()
    # Gather several selected blocks per iteration (~keys_per_iter keys), never more than a split holds,
    # and at least 16 keys (the smallest tl.dot).
    block_bs = _pow2(block_size)
    sel_chunk = min(max(1, keys_per_iter // block_bs), _pow2(per_split))
    sel_chunk = max(sel_chunk, _pow2(-(-16 // block_bs)))
    _sparse_attn_kernel[(t, hq // heads, splits)](
        q, k_pool, v_pool, out, part_o, part_lse, page_table, meta.tok_row, meta.positions, sel,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        out.stride(0), out.stride(1), page_table.stride(0), *pstr, sel.stride(0), sel.stride(1),
        scale * LOG2E, meta.page_size, page_table.shape[1], meta.max_kv, block_size, num_sel, per_split,
        HEAD_DIM=d, HEADS=heads, GROUP_KV=group_kv, GROUP_IDX=group_idx, BLOCK_G=_pow2(heads, 16),
        BLOCK_BS=block_bs, SEL_CHUNK=sel_chunk, BLOCK_D=_pow2(d, 16), SPLIT=splits > 1,
        DOT_PREC=_dot_precision(k_pool.dtype), num_warps=num_warps)
    if splits > 1:
        _combine(part_o, part_lse, out)
    return out


def index_block_scores(iq: torch.Tensor, ik_pool: torch.Tensor, meta: AttnMetadata, block_size: int,
                       local_blocks: int, out: torch.Tensor | None = None, target_programs: int = 256,
                       max_keys_per_prog: int = 512, keys_per_iter: int = 128) -> torch.Tensor:
    """iq [T, Hi, Di], ik_pool [S, Di] -> block scores [T, Hi, NB] fp32 (NB = ceil(max_kv / block_size)),
    -inf where a block has no visible key, +inf on the query's own `local_blocks` blocks.

    With `out` given, only blocks up to each token tile's last visible key are written (the rest of `out`
    is left as it was, and is -inf by definition); without it the result is complete.
    Each program scores a run of blocks for a tile of one row's tokens: long runs for big steps, down to
    one block when the grid would otherwise be too small to fill the GPU (batch-1 decode)."""
    t, hi, di = iq.shape
    nb = -(-meta.max_kv // block_size)
    if out is None:
        out = torch.full((t, hi, nb), float("-inf"), dtype=torch.float32, device=iq.device)
    if t == 0:
        return out
    # The oracle scores in fp32. Matching bf16/fp16 inputs multiply exactly in fp32 inside tl.dot; anything
    # else (fp32, or mixed dtypes) is computed in fp32 without TF32.
    same_half = iq.dtype == ik_pool.dtype and iq.dtype in (torch.bfloat16, torch.float16)
    ik = ik_pool if same_half or ik_pool.dtype == torch.float32 else ik_pool.float()
    if ik.stride(-1) != 1 or iq.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("iq, ik_pool and out must be contiguous in their last dim")
    block_q, block_h = _q_tile(hi, meta.max_q)
    n_qtiles = -(-meta.max_q // block_q)
    tiles = meta.num_rows * n_qtiles
    per_prog = max(1, min(max_keys_per_prog // block_size, tiles * nb // max(1, target_programs)))
    # Score ~keys_per_iter keys per iteration (several small blocks at once, max-pooled by a reshape), and
    # at least 16 (the smallest tl.dot).
    block_bs = _pow2(block_size)
    per_iter = min(max(1, keys_per_iter // block_bs), _pow2(per_prog))
    per_iter = max(per_iter, _pow2(-(-16 // block_bs)))
    page_table = meta.page_table.contiguous()
    q_start = meta.q_index[:, 0].contiguous()
    _index_scores_kernel[(tiles, -(-nb // per_prog))](
        iq, ik, out, page_table, q_start, meta.q_lens, meta.positions,
        iq.stride(0), iq.stride(1), ik.stride(0), out.stride(0), out.stride(1), page_table.stride(0),
        meta.page_size, page_table.shape[1], meta.max_kv, block_size, nb, per_prog, local_blocks, n_qtiles,
        INDEX_DIM=di, N_HEADS=hi, BLOCK_Q=block_q, BLOCK_H=block_h, BLOCK_BS=block_bs,
        BLOCKS_PER_ITER=per_iter, BLOCK_D=_pow2(di, 16), DOT_PREC=_dot_precision(ik.dtype))
    return out


# Past this many blocks per row the row no longer sits comfortably in one program's registers; the
# selection then falls back to torch.topk over fully written scores.
MAX_KERNEL_TOPK_BLOCKS = 8192


def select_blocks(iq: torch.Tensor, ik_pool: torch.Tensor, meta: AttnMetadata, block_size: int, topk: int,
                  local_blocks: int) -> torch.Tensor:
    """Lightning-indexer selection on flat tokens: sel [T, Hi, k] int64, k = min(topk, NB), best first,
    -1 where the slot only found -inf. Same set as `reference.select_blocks` (order may differ on ties)."""
    t, hi, _ = iq.shape
    nb = -(-meta.max_kv // block_size)
    k = min(topk, nb)
    if nb > MAX_KERNEL_TOPK_BLOCKS:
        scores = index_block_scores(iq, ik_pool, meta, block_size, local_blocks)  # [T, Hi, NB]
        top, idx = scores.topk(k, dim=-1)
        return idx.masked_fill(top == float("-inf"), -1)
    # No -inf fill needed: the top-k kernel reads only the blocks the score kernel wrote.
    scores = torch.empty(t, hi, nb, dtype=torch.float32, device=iq.device)
    index_block_scores(iq, ik_pool, meta, block_size, local_blocks, out=scores)
    return topk_blocks(scores, meta, block_size, k)


def topk_blocks(scores: torch.Tensor, meta: AttnMetadata, block_size: int, k: int) -> torch.Tensor:
    """scores [T, Hi, NB] (valid up to each token's own block) -> sel [T, Hi, k] int64, -1 padded."""
    t, hi, nb = scores.shape
    sel = torch.empty(t, hi, k, dtype=torch.int64, device=scores.device)
    if t == 0 or k == 0:
        return sel
    _topk_blocks_kernel[(t, hi)](
        scores, sel, meta.positions, scores.stride(0), scores.stride(1), sel.stride(0), sel.stride(1),
        block_size, nb, TOPK=k, BLOCK_NB=_pow2(nb), num_warps=4 if nb <= 2048 else 8)
    return sel
