"""Triton kernels for paged attention: dense extend, block-sparse extend, the lightning indexer (block
scores, max-pool and top-k fused in one pass), and the split-KV combine. `reference.py` is the oracle;
`tests/kernels/test_triton_attention.py` holds these equal to it.

All kernels read K/V straight from the paged pools: key position j of row b lives at slot

    page_table[b, min(j // page_size, P - 1)] * page_size + j % page_size

(the clamp is `metadata.slots_for_positions`'s: columns past the table width read TRASH_PAGE), or, with the
metadata's tail override, at tail_slots[b, j - tail_start[b]] for j >= tail_start[b] (a draft-tree node row
reads its ancestors there: its keys are the committed context, then its path at its depth positions). Every query
token t attends to keys 0..positions[t] of its row (token-causal), so prompt chunks, decode rows and
spec-verify rows of 1+K tokens are one code path.

CUDA graphs: launchers size their grids from host ints of the metadata only (num_rows, max_q, max_kv,
num_tokens) and never read a device value back -- no blocking CPU operation in this path. Where the work
depends on the lengths, the kernels read them from the device (q_lens, kv_lens, positions): a program
past its row's tokens or keys exits at once, and split ranges are cut from the row's real kv_len. So a
graph captured with max_kv = max_model_len replays correctly (and cheaply) for any shorter context.

Split-KV (flash-decoding): when the grid is too small to fill the GPU (batch-1 decode over a long context),
the key range (dense) or the selected-block list (sparse) is cut into `num_splits` pieces; each piece writes
a normalized fp32 partial and its log2-sum-exp, and `_combine_kernel` merges them in split order (the same
sum every replay: deterministic).

Indexer: one program scores a tile of one row's query tokens (times the index heads) against a run of the
row's index-K blocks, max-pools each block and streams it into a running top-k list held in registers
(as int64 keys whose integer order is the selection order: `_pack_key`); neither [tokens x context] scores
nor block scores reach memory. Few rows (decode) split the blocks over programs; each keeps its own top-k
and `_index_merge_kernel` picks the final k from those lists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from m3eagle.kernels import pdl
from m3eagle.kernels.attention.index_plan import MAX_MERGE_CANDIDATES, IndexPlan, index_plan  # noqa: F401 (re-exported)
from m3eagle.kernels.attention.index_plan import pow2 as _pow2
from m3eagle.kernels.attention.metadata import AttnMetadata
from m3eagle.kernels.pdl import pdl_wait

LOG2E = 1.4426950408889634


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs must not drop to TF32 (the oracle is exact fp32). bf16/fp16 products are exact in fp32
    # and accumulate in fp32, so the flag does not matter for them.
    return "ieee" if dtype == torch.float32 else "tf32"


# ---- shared device helpers -----------------------------------------------------------------------------


# NOTE: Triton compiles one variant of a kernel per combination of "this int argument is 1" and "is a
# multiple of 16". Arguments that change from step to step -- the KV bound, split and tile counts, the
# strides of per-step buffers (q_index is [rows, widest row]) -- are kept out of that key, or a new prompt-chunk shape would
# compile a new variant (hundreds of ms) in the middle of serving. Strides of the pools, of q and of the
# page table are fixed per engine and stay specialized.
_PARTIALS = ["stride_pos", "stride_pot", "stride_pls", "stride_plt"]  # [splits, T, ...] scratch: T varies
_TAIL = ["stride_tail", "tail_width"]  # a tree's tail override: its width is the node's depth (1 for some calls)
_DENSE_PER_STEP = _PARTIALS + _TAIL + ["stride_qi", "stride_keep_t", "stride_keep_h", "max_kv", "num_splits", "n_qtiles"]
_SPARSE_PER_STEP = _PARTIALS + _TAIL + ["max_kv", "sel_per_split"]
_COMBINE_PER_STEP = _PARTIALS + ["num_splits"]
_INDEX_PER_STEP = _TAIL + ["stride_qi", "stride_pt", "stride_ph", "max_kv", "num_blocks", "n_qtiles", "num_splits"]
_MERGE_PER_STEP = ["stride_pt", "stride_ph", "num_blocks", "num_splits"]


@triton.jit
def _page_slots(page_table_row, keys, page_size, num_page_cols, mask):
    """Cache slots [N] (int64) of key positions `keys` [N] of one row; TRASH_PAGE past the held pages."""
    col = tl.minimum(keys // page_size, num_page_cols - 1)
    page = tl.load(page_table_row + col, mask=mask, other=0)
    return page * page_size + keys % page_size


@triton.jit
def _key_slots(pt_row, keys, page_size, num_page_cols, mask, tail_row, tail_start, tail_width, TAIL: tl.constexpr):
    """`_page_slots`, with the metadata's tail override when TAIL: keys >= tail_start (the row's) read their
    slot from tail_row[keys - tail_start] (clamped to the tail's width; the row's kv_len stops inside it)."""
    slots = _page_slots(pt_row, keys, page_size, num_page_cols, mask)
    if TAIL:
        rel = keys - tail_start
        in_tail = mask & (rel >= 0)
        t = tl.load(tail_row + tl.minimum(tl.maximum(rel, 0), tail_width - 1), mask=in_tail, other=0)
        slots = tl.where(in_tail, t, slots)
    return slots


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
                     tail_row, tail_start, tail_width, DOT_PREC: tl.constexpr, TAIL: tl.constexpr):
    """Gather the K/V of key positions `keys` [N] (loads masked by k_ok [N]) from the pools and run one
    online-softmax step with the mask `valid` ([M, N] or [1, N])."""
    slots = _key_slots(pt_row, keys, page_size, num_page_cols, k_ok, tail_row, tail_start, tail_width, TAIL)
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
        # An empty split (no visible key) writes only lse = -inf: weight 0, and the combine does not read
        # its partial output (a short row in a grid sized for max_kv leaves most splits empty).
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        split = split.to(tl.int64)  # splits * T * Hq * D can pass 2^31
        po = PartO + split * stride_pos + tok * stride_pot + head * stride_poh  # [M]
        tl.store(po[:, None] + offs_d[None, :], o, mask=mask & (l_i > 0.0)[:, None])
        tl.store(PartLse + split * stride_pls + tok * stride_plt + head, lse, mask=row_ok)
    else:
        ptr = Out + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(ptr, o.to(Out.dtype.element_ty), mask=mask)


# ---- kernels -------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=_DENSE_PER_STEP)
def _dense_attn_kernel(
    Q, K, V, Out, PartO, PartLse,
    PageTable, QIndex, QLens, KvLens, Positions, Keep, TailStart, TailSlots,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh,
    stride_pb, stride_qi, stride_pos, stride_pot, stride_poh, stride_pls, stride_plt, stride_keep_t, stride_keep_h,
    stride_tail, qk_scale, page_size, num_page_cols, max_kv, num_splits, keep_block, n_qtiles, tail_width,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, GROUP_IDX: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_KEEP: tl.constexpr, KEEP_PER_TILE: tl.constexpr, SPLIT: tl.constexpr, DOT_PREC: tl.constexpr,
    TAIL: tl.constexpr, PDL: tl.constexpr):
    """Grid (rows * n_qtiles, Hkv, splits). One program: BLOCK_Q query tokens of one row times the GROUP
    query heads of one KV head, flattened into M = BLOCK_Q * BLOCK_G rows, so every K/V tile it loads is
    shared by the whole GQA group and by all of the tile's tokens (a verify row reads its KV once).

    HAS_KEEP (block-sparse prompt chunks): Keep [T, Hi, NB] int8 marks the key blocks (of `keep_block`
    keys) each token's index head selected; head h reads index head h // GROUP_IDX. A key tile that no
    row of the program selected is skipped without loading K/V, so the tile reads the union of its
    tokens' selections once instead of once per token. KEEP_PER_TILE: every key tile lies inside one
    keep block (BLOCK_N divides keep_block, tiles start on multiples of BLOCK_N).

    Split s covers keys [s * kps, (s + 1) * kps) with kps = cdiv(kv_len, splits) rounded up to whole
    key tiles, from the row's device kv_len: a grid sized for max_kv spreads a short row over as many
    programs as it can use, and the rest find an empty range and write an empty partial. TAIL: key positions
    >= TailStart[row] of the row read their slots from TailSlots[row] (`_key_slots`)."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
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
    tok = tl.load(QIndex + row * stride_qi) + qi  # [M] flat token (q_index[row, 0] is the row's first)
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
    kv = tl.minimum(tl.load(KvLens + row), max_kv)
    kps = tl.maximum(tl.cdiv(tl.cdiv(kv, num_splits), BLOCK_N), 1) * BLOCK_N
    lo = split * kps
    hi = tl.minimum(tl.minimum(lo + kps, tl.max(pos, 0) + 1), max_kv)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    pt_row = PageTable + row * stride_pb
    tail_row = TailSlots + row * stride_tail
    tail_start = tl.load(TailStart + row) if TAIL else 0
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
                                                 qk_scale, page_size, num_page_cols, tail_row, tail_start,
                                                 tail_width, DOT_PREC, TAIL)
        else:
            m_i, l_i, acc = _attend_key_tile(q, K, V, pt_row, keys, k_ok, valid, kvh, offs_d, d_ok, m_i, l_i,
                                             acc, stride_ks, stride_kh, stride_vs, stride_vh, qk_scale,
                                             page_size, num_page_cols, tail_row, tail_start, tail_width,
                                             DOT_PREC, TAIL)

    _write_result(acc, m_i, l_i, tok, head, row_ok, offs_d, d_ok, split, Out, stride_ot, stride_oh,
                  PartO, PartLse, stride_pos, stride_pot, stride_poh, stride_pls, stride_plt, SPLIT)


@triton.jit(do_not_specialize=_SPARSE_PER_STEP)
def _sparse_attn_kernel(
    Q, K, V, Out, PartO, PartLse,
    PageTable, TokRow, Positions, Sel, TailStart, TailSlots,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh,
    stride_pb, stride_pos, stride_pot, stride_poh, stride_pls, stride_plt, stride_st, stride_sh, stride_tail,
    qk_scale, page_size, num_page_cols, max_kv, block_size, num_sel, sel_per_split, tail_width,
    HEAD_DIM: tl.constexpr, HEADS: tl.constexpr, GROUP_KV: tl.constexpr, GROUP_IDX: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_BS: tl.constexpr, SEL_CHUNK: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PREC: tl.constexpr, TAIL: tl.constexpr, ALL: tl.constexpr, PDL: tl.constexpr):
    """Grid (T, Hq // HEADS, splits). One program: one query token times HEADS query heads that share
    both a KV head and an index head, visiting only its selected key blocks (sel[t, ih, :], -1 = none).
    ALL: every block is selected (a context that fits the top-k): entry j is block j, Sel is not read.
    Tokens are not tiled together because each token has its own block selection; prompt steps (a row of
    >= 16 tokens) run `sparse_prefill._sparse_prefill_kernel` instead, which tiles a row's tokens over the
    union of their selections.

    Each iteration gathers SEL_CHUNK selected blocks at once (key tile of SEL_CHUNK * BLOCK_BS), so a
    decode token's short list of blocks costs few dependent load chains (sel -> page table -> K/V)."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
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
    tail_row = TailSlots + row * stride_tail
    tail_start = tl.load(TailStart + row) if TAIL else 0
    sel_row = Sel + tok * stride_st + ih * stride_sh
    offs_n = tl.arange(0, BLOCK_N)
    chunk = offs_n // BLOCK_BS  # [N] which selection entry of the iteration a key belongs to
    within = offs_n % BLOCK_BS  # [N] key offset inside its block
    lo = split * sel_per_split
    hi = tl.minimum(lo + sel_per_split, num_sel)
    for i0 in range(lo, hi, SEL_CHUNK):
        entry = i0 + chunk
        if ALL:  # the indexer's list for a context of <= top-k blocks: 0, 1, .., then -1 past the token
            blk = tl.where(entry < hi, entry, -1).to(tl.int32)  # [N] (a block past pos is masked below either way)
        else:
            blk = tl.load(sel_row + entry, mask=entry < hi, other=-1).to(tl.int32)  # [N]
        keys = blk * block_size + within
        # Selected blocks are distinct, so no key is counted twice; a -1 entry masks its whole block.
        k_ok = (blk >= 0) & (within < block_size) & (keys <= pos) & (keys < max_kv)  # [N]
        m_i, l_i, acc = _attend_key_tile(q, K, V, pt_row, keys, k_ok, k_ok[None, :], kvh, offs_d, d_ok, m_i,
                                         l_i, acc, stride_ks, stride_kh, stride_vs, stride_vh, qk_scale,
                                         page_size, num_page_cols, tail_row, tail_start, tail_width, DOT_PREC,
                                         TAIL)

    _write_result(acc, m_i, l_i, tok_v, head, row_ok, offs_d, d_ok, split, Out, stride_ot, stride_oh,
                  PartO, PartLse, stride_pos, stride_pot, stride_poh, stride_pls, stride_plt, SPLIT)


@triton.jit(do_not_specialize=_COMBINE_PER_STEP)
def _combine_kernel(
    PartO, PartLse, Out,
    stride_pos, stride_pot, stride_poh, stride_pls, stride_plt, stride_ot, stride_oh, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr):
    """Grid (T, Hq, cdiv(HEAD_DIM, BLOCK_D)): out = sum_s 2^(lse_s - max) * o_s / sum_s 2^(lse_s - max), one
    BLOCK_D-wide slice of the head per program (so [BLOCK_S, BLOCK_D] stays small for head_dim 256 / 512)."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < num_splits
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_s64 = offs_s.to(tl.int64)
    lse = tl.load(PartLse + offs_s64 * stride_pls + tok * stride_plt + head, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # [S], 0 for empty splits
    o_ptr = PartO + offs_s64[:, None] * stride_pos + tok * stride_pot + head * stride_poh + offs_d[None, :]
    # Splits past a short row's keys (a graph's grid is sized for max_kv) hold lse = -inf and weigh 0:
    # their partial outputs are not read at all.
    used = s_ok & (lse > float("-inf"))
    o = tl.load(o_ptr, mask=used[:, None] & d_ok[None, :], other=0.0)  # [S, D]
    den = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(den == 0.0, 1.0, den)
    tl.store(Out + tok * stride_ot + head * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=d_ok)


# ---- lightning indexer ---------------------------------------------------------------------------------
#
# Order of blocks, as the oracle's stable sort defines it: block a beats block b iff
#     score[a] > score[b], or score[a] == score[b] and a < b.
# Each (score, block) is packed into one int64 key whose signed order IS that order (`_pack_key`):
#
#     bits 63..32   the fp32 score's bits as a monotone int32 (sign-magnitude -> two's complement)
#     bits 31..0    INT32_MAX - block (0 <= block <= INT32_MAX): on equal scores the lower id is larger
#
# so "best" is one integer max and "worst" one integer min. A score with no visible key (-inf), or a NaN
# (only a NaN index-K can produce one), packs to KEY_NONE, below every real key: such a block is never
# taken into a list and emits -1, as before keys (a NaN never entered a list: NaN > x is false). -0.0
# packs as +0.0 (they compare equal, and the oracle's sort keeps them in id order). A top-k list is kept
# unordered in registers ([M, BLOCK_K] keys, one list per query row) and ordered only when written out.

INT32_MAX = tl.constexpr(2147483647)
KEY_NONE = tl.constexpr(-(2**63))  # no block: below every real key
KEY_PAD = tl.constexpr(2**63 - 1)  # list slots past the capacity: above every key, so never evicted


@triton.jit
def _pack_key(score, block):
    """fp32 scores and int block ids (broadcastable) -> int64 keys in the block order (see above)."""
    bits = score.to(tl.int32, bitcast=True)
    # Negative floats order by decreasing magnitude: negate the magnitude. -0.0 (0x80000000) -> 0 = +0.0.
    mono = tl.where(bits < 0, -(bits & INT32_MAX), bits)
    # (INT32_MAX - block, written tensor first: the interpreter keeps `constexpr - tensor` a constexpr)
    key = (mono.to(tl.int64) << 32) | (block.to(tl.int64) * -1 + INT32_MAX)
    return tl.where(score > float("-inf"), key, KEY_NONE)  # false for -inf and NaN


@triton.jit
def _key_block(key):
    """The block id of a real key (int32); meaningless for KEY_NONE / KEY_PAD."""
    return (key & INT32_MAX).to(tl.int32) * -1 + INT32_MAX


@triton.jit
def _topk_insert(keys, cand, BLOCK_K: tl.constexpr):
    """Offer a block (key cand [M]) to every row's running list [M, BLOCK_K] of keys.

    The candidate enters iff it beats the list's worst entry, which it evicts: one min reduction that also
    gives the slot. (Blocks arrive in increasing id, so on an equal score the candidate has the smaller
    key and loses, as the oracle's order wants; the key decides it.) Empty slots hold KEY_NONE, so a
    block with no visible key (KEY_NONE too) never enters; slots past the capacity hold KEY_PAD and are
    never the worst."""
    offs_k = tl.arange(0, BLOCK_K)
    worst, slot = tl.min(keys, 1, return_indices=True)  # [M], [M]
    hit = (cand > worst)[:, None] & (offs_k[None, :] == slot[:, None])
    return tl.where(hit, cand[:, None], keys)


@triton.jit
def _topk_emit(keys, TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_O: tl.constexpr):
    """Unordered lists of keys [M, C] (distinct, or KEY_NONE) -> [M, BLOCK_O] int32: the TOPK best blocks,
    listed in ascending id, -1 once only KEY_NONE is left, padding last (the oracle's set and canonical
    form). One max reduction per emitted entry: the key holds the tie rule."""
    offs_o = tl.arange(0, BLOCK_O)
    out = tl.full([BLOCK_M, BLOCK_O], KEY_NONE, tl.int64)
    for i in tl.static_range(TOPK):
        best = tl.max(keys, 1)  # [M]
        out = tl.where(offs_o[None, :] == i, best[:, None], out)
        keys = tl.where(keys == best[:, None], KEY_NONE, keys)  # taken (a no-op once best is KEY_NONE)
    ids = tl.where(out == KEY_NONE, INT32_MAX, _key_block(out))  # INT32_MAX: none (sorts last)
    ids = tl.sort(ids, 1)
    return tl.where(ids == INT32_MAX, -1, ids)


@triton.jit
def _all_visible(own, local_blocks, BLOCK_O: tl.constexpr):
    """[M] own block ids (-1 for a token that sees no key) -> [M, BLOCK_O] int32: the selection of a token
    whose visible blocks all fit in the top-k, which is every one of them whatever the scores: blocks
    0..own ascending; for a token that sees nothing, the forced (clamped) local block 0, or none when
    local_blocks is 0; -1 padded."""
    offs_o = tl.arange(0, BLOCK_O)
    last = tl.where(own >= 0, own, tl.where(local_blocks > 0, 0, -1))  # [M]
    return tl.where(offs_o[None, :] <= last[:, None], offs_o[None, :], -1)


@triton.jit
def _index_split_range(kv_len, num_blocks, block_size, num_splits, min_blocks_per_split):
    """Blocks per split of a row: cdiv(row's blocks, splits), at least min_blocks_per_split. The indexer
    and the merge both derive it from the row's device kv_len, so they agree on which split holds what."""
    row_blocks = tl.minimum(tl.cdiv(kv_len, block_size), num_blocks)
    return tl.maximum(tl.cdiv(row_blocks, num_splits), min_blocks_per_split)


@triton.jit(do_not_specialize=_INDEX_PER_STEP)
def _indexer_kernel(
    IQ, IK, PageTable, QIndex, QLens, KvLens, Positions, Sel, PartKey, TailStart, TailSlots,
    stride_qt, stride_qh, stride_ks, stride_pb, stride_qi, stride_st, stride_sh, stride_pt, stride_ph, stride_tail,
    page_size, num_page_cols, max_kv, block_size, num_blocks, local_blocks, n_qtiles, num_splits,
    min_blocks_per_split, tail_width,
    INDEX_DIM: tl.constexpr, N_HEADS: tl.constexpr, TOPK: tl.constexpr, CAP: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_BS: tl.constexpr, BLOCKS_PER_ITER: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr,
    DIRECT: tl.constexpr, MIXED: tl.constexpr, DOT_PREC: tl.constexpr, TAIL: tl.constexpr,
    PDL: tl.constexpr):
    """Grid (rows * n_qtiles, splits). One program: BLOCK_Q query tokens of one row times its N_HEADS index
    heads (M = BLOCK_Q * BLOCK_H query rows) against the row's index-K blocks of this split:

        score[m, j] = <iq[m], ik[j]>                 fp32, -inf past the token's position (token-causal)
        block[m, n] = max_{j in block n} score       (max-pool; -inf when the block has no visible key)
        block[m, n] = +inf for the token's own `local_blocks` blocks (they always win)

    Each block's key (`_pack_key`) is streamed into a running top-CAP list per query row (`_topk_insert`),
    so the row's index-K is read once for all its tokens and heads, and nothing of size [tokens x
    context] is written. DIRECT (the launcher proved that no split of any row holds more than CAP
    blocks: long-context decode, 2 blocks per split): each block just takes its own slot. SPLIT: the
    list goes to PartKey [T, Hi, splits * BLOCK_K] (int64 keys) for `_index_merge_kernel`; else the TOPK
    best, ascending ids, go to Sel [T, Hi, TOPK] (int64, -1 padded).

    A tile whose every token sees at most TOPK blocks selects all of them whatever the scores: it reads no
    index-K (a short row under a CUDA graph's long KV bound costs a launch, not a scan)."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    pid = tl.program_id(0)
    row = pid // n_qtiles
    qtile = pid % n_qtiles
    split = tl.program_id(1)
    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_H
    q_len = tl.load(QLens + row)
    if qtile * BLOCK_Q >= q_len:  # a tile past the row's tokens (rows narrower than max_q)
        return

    offs_m = tl.arange(0, BLOCK_M)
    qi = qtile * BLOCK_Q + offs_m // BLOCK_H  # [M] token index inside the row
    hh = offs_m % BLOCK_H  # [M] index head
    row_ok = (qi < q_len) & (hh < N_HEADS)
    tok = tl.load(QIndex + row * stride_qi) + qi  # [M] flat token
    pos = tl.load(Positions + tok, mask=row_ok, other=-1).to(tl.int32)  # [M]; -1 rows see no key
    # The token's own block; a position below 0 (no visible key) counts as block -1, whose forced local
    # blocks the oracle clamps to block 0. (// truncates toward zero, so guard the negative rows.)
    own = tl.where(pos >= 0, pos // block_size, -1)  # [M]
    max_pos = tl.max(pos, 0)
    if tl.where(max_pos >= 0, max_pos // block_size, -1) < TOPK:
        # Every token of the tile sees at most TOPK blocks, so it selects all of them, whatever the
        # scores: no index-K to read (short contexts under a graph's long KV bound). Split: the merge
        # writes the same per token.
        if not SPLIT:
            out = _all_visible(own, local_blocks, BLOCK_O)
            offs_o = tl.arange(0, BLOCK_O)
            ptr = Sel + tok[:, None] * stride_st + hh[:, None] * stride_sh + offs_o[None, :]
            tl.store(ptr, out.to(tl.int64), mask=row_ok[:, None] & (offs_o < TOPK)[None, :])
        return

    # Blocks of this program: its split of the row, cut after the tile's last visible block (block 0 at
    # least: it is where a token that sees nothing has its forced local block).
    bps = _index_split_range(tl.load(KvLens + row).to(tl.int32), num_blocks, block_size, num_splits,
                             min_blocks_per_split)
    nb_lo = split * bps
    nb_hi = tl.minimum(tl.minimum(nb_lo + bps, tl.maximum(max_pos, 0) // block_size + 1), num_blocks)
    if nb_lo >= nb_hi:  # nothing visible here; the merge never reads this split for these tokens
        return

    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < INDEX_DIM
    iq = tl.load(IQ + tok[:, None] * stride_qt + hh[:, None] * stride_qh + offs_d[None, :],
                 mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [M, Di]
    if MIXED:  # iq and ik dtypes differ: score both in fp32, as the oracle does
        iq = iq.to(tl.float32)
    else:
        iq = iq.to(IK.dtype.element_ty)

    offs_k = tl.arange(0, BLOCK_K)
    if DIRECT:  # every block of the split has its own slot: all KEY_NONE until written
        lst = tl.full([BLOCK_M, BLOCK_K], KEY_NONE, tl.int64)
    else:  # empty slots KEY_NONE; slots past the capacity KEY_PAD, so that they are never evicted into
        lst = tl.where(offs_k[None, :] < CAP, KEY_NONE, KEY_PAD) + tl.zeros([BLOCK_M, BLOCK_K], tl.int64)

    pt_row = PageTable + row * stride_pb
    tail_row = TailSlots + row * stride_tail
    tail_start = tl.load(TailStart + row) if TAIL else 0
    BLOCK_N: tl.constexpr = BLOCKS_PER_ITER * BLOCK_BS
    offs_n = tl.arange(0, BLOCK_N)
    within = offs_n % BLOCK_BS  # [N] key offset inside its block
    offs_b = tl.arange(0, BLOCKS_PER_ITER)
    for nb0 in range(nb_lo, nb_hi, BLOCKS_PER_ITER):
        blk = nb0 + offs_n // BLOCK_BS  # [N]
        keys = blk * block_size + within
        k_ok = (within < block_size) & (blk < nb_hi) & (keys <= max_pos) & (keys < max_kv)
        slots = _key_slots(pt_row, keys, page_size, num_page_cols, k_ok, tail_row, tail_start, tail_width, TAIL)
        ik = tl.load(IK + slots[:, None] * stride_ks + offs_d[None, :], mask=k_ok[:, None] & d_ok[None, :],
                     other=0.0)  # [N, Di]
        if MIXED:
            ik = ik.to(tl.float32)
        s = tl.dot(iq, tl.trans(ik), input_precision=DOT_PREC)  # [M, N] fp32
        s = tl.where(k_ok[None, :] & (keys[None, :] <= pos[:, None]), s, float("-inf"))
        best = tl.max(tl.reshape(s, (BLOCK_M, BLOCKS_PER_ITER, BLOCK_BS)), 2)  # [M, B] max-pool per block
        nbs = nb0 + offs_b  # [B]
        # forced: blocks clamp(own - i, 0) for i < local_blocks, as the oracle scatters them
        local = (nbs[None, :] <= tl.maximum(own, 0)[:, None]) & (nbs[None, :] > own[:, None] - local_blocks)
        best = tl.where(local & (local_blocks > 0), float("inf"), best)
        best = tl.where((nbs < nb_hi)[None, :], best, float("-inf"))  # a later split's block: not ours
        bkey = _pack_key(best, nbs[None, :])  # [M, B]
        if DIRECT:
            # Block nb goes to slot nb - nb_lo (< blocks per split <= CAP): no comparison at all. Each
            # slot is written by one block only, so a max with the KEY_NONE it holds is a write.
            put = (nbs - nb_lo)[:, None] == offs_k[None, :]  # [B, K]
            new = tl.max(tl.where(put[None, :, :], bkey[:, :, None], KEY_NONE), 1)  # [M, K]
            lst = tl.maximum(lst, new)
        else:
            for b in tl.static_range(BLOCKS_PER_ITER):
                cand = tl.max(tl.where(offs_b[None, :] == b, bkey, KEY_NONE), 1)  # [M] column b
                lst = _topk_insert(lst, cand, BLOCK_K)

    if not DIRECT:
        lst = tl.where(offs_k[None, :] < CAP, lst, KEY_NONE)  # drop the KEY_PAD placeholders
    if SPLIT:
        off = tok[:, None] * stride_pt + hh[:, None] * stride_ph + split * BLOCK_K + offs_k[None, :]
        tl.store(PartKey + off, lst, mask=row_ok[:, None])
    else:
        out = _topk_emit(lst, TOPK, BLOCK_M, BLOCK_O)
        offs_o = tl.arange(0, BLOCK_O)
        ptr = Sel + tok[:, None] * stride_st + hh[:, None] * stride_sh + offs_o[None, :]
        tl.store(ptr, out.to(tl.int64), mask=row_ok[:, None] & (offs_o < TOPK)[None, :])


@triton.jit(do_not_specialize=_MERGE_PER_STEP)
def _index_merge_kernel(
    PartKey, Sel, TokRow, KvLens, Positions,
    stride_pt, stride_ph, stride_st, stride_sh, block_size, num_blocks, num_splits, min_blocks_per_split,
    local_blocks,
    TOPK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, SMALL_C: tl.constexpr,
    BLOCK_O: tl.constexpr,
    PDL: tl.constexpr):
    """Grid (T, Hi). Sel[t, h] = the TOPK best of the splits' lists, ascending ids, -1 padded. Only splits
    that start at or before the token's own block are read: later ones hold nothing it can see, and their
    programs may have exited without writing. Every list holds its split's best min(TOPK, blocks), so the
    union holds the global top-TOPK. A token that sees at most TOPK blocks takes all of them without
    reading any list (the indexer wrote none when its whole tile was such tokens). When the live lists
    hold at most SMALL_C entries the emit runs at that width (its cost grows with the width it scans)."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    tok = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_o = tl.arange(0, BLOCK_O)
    pos = tl.load(Positions + tok).to(tl.int32)
    own = tl.where(pos >= 0, pos // block_size, -1)
    if own < TOPK:  # every visible block fits: all of them (the indexer skipped this token's tile or not)
        out = _all_visible(tl.full([1], 0, tl.int32) + own, local_blocks, BLOCK_O)  # [1, O]
        tl.store(Sel + tok * stride_st + h * stride_sh + offs_o[None, :], out.to(tl.int64),
                 mask=(offs_o < TOPK)[None, :])
        return
    row = tl.load(TokRow + tok)
    bps = _index_split_range(tl.load(KvLens + row).to(tl.int32), num_blocks, block_size, num_splits,
                             min_blocks_per_split)
    live = tl.minimum(num_splits, own // bps + 1) * BLOCK_K  # candidates of the splits that start <= own
    base = tok * stride_pt + h * stride_ph
    if live <= SMALL_C:  # few live splits (a shorter row under a long bound): a narrower, cheaper emit
        out = _merge_lists(PartKey, base, live, TOPK, SMALL_C, BLOCK_O)
    else:
        out = _merge_lists(PartKey, base, live, TOPK, BLOCK_C, BLOCK_O)
    tl.store(Sel + tok * stride_st + h * stride_sh + offs_o[None, :], out.to(tl.int64),
             mask=(offs_o < TOPK)[None, :])


@triton.jit
def _merge_lists(PartKey, base, live, TOPK: tl.constexpr, WIDTH: tl.constexpr, BLOCK_O: tl.constexpr):
    """The TOPK best of the first `live` (<= WIDTH) list keys at base -> [1, BLOCK_O] (`_topk_emit`)."""
    offs_c = tl.arange(0, WIDTH)
    keys = tl.load(PartKey + base + offs_c, mask=offs_c < live, other=KEY_NONE)  # [C] int64
    return _topk_emit(tl.reshape(keys, (1, WIDTH)), TOPK, 1, BLOCK_O)


# ---- launchers -----------------------------------------------------------------------------------------


def _q_tile(group: int, max_q: int, target_rows: int = 64) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_G): tokens per tile and padded heads per token. M = BLOCK_Q * BLOCK_G is kept >= 16
    (the smallest tl.dot) and near `target_rows`; a tile never holds more tokens than the widest row."""
    block_g = _pow2(group)
    block_q = min(_pow2(max_q), max(1, target_rows // block_g))
    block_q = max(block_q, _pow2(-(-16 // block_g)))
    return block_q, block_g


# Register budget of the dense kernel, in elements of one [rows, BLOCK_D] or [keys, BLOCK_D] tile per
# 4 warps: 64 x 128 is the measured D <= 128 shape (the fp32 accumulator alone is then 64 registers a
# thread). Wider heads keep tiles of the same size by taking fewer query rows and keys per tile.
_DENSE_TILE_ELEMS = 64 * 128


@dataclass(frozen=True)
class DenseTile:
    """Launch shape of `_dense_attn_kernel`: a pure function of (head_dim, GQA group, widest row, asked-for
    key tile) -- `dense_tile`."""

    block_q: int  # query tokens per program
    block_g: int  # padded query heads per KV head
    block_n: int  # keys per tile
    block_d: int  # padded head_dim
    num_warps: int
    num_stages: int | None  # None: the compiler's default (unchanged for head_dim <= 128)


def dense_tile(head_dim: int, group: int, max_q: int, block_n: int = 64) -> DenseTile:
    """Tiles and warps for one head shape. head_dim <= 128 (the target's 128, the measured policy): 64 query
    rows, `block_n` keys, 4 warps, as before. Wider heads (192 / 256 / 512): the [M, D] fp32 accumulator,
    the q tile and the [N, D] K/V tiles would need 2-4x the registers (D=512 at M=64 spilled and overflowed
    shared memory on Hopper), so M and N shrink in proportion to D -- M to 32 / 16 rows, N to 32 / 16 keys --
    and D=512 runs 8 warps over 2 pipeline stages (two 16 x 512 bf16 K/V tiles per stage: 64 KB)."""
    block_d = _pow2(head_dim, 16)
    rows = max(16, _DENSE_TILE_ELEMS // max(block_d, 128))  # 64 / 32 / 16 for D <= 128 / 256 / 512
    block_q, block_g = _q_tile(group, max_q, target_rows=rows)
    if block_d <= 128:
        return DenseTile(block_q, block_g, block_n, block_d, 4, None)
    block_n = max(16, min(_pow2(block_n, 16), _DENSE_TILE_ELEMS // block_d))
    warps = 8 if block_d >= 512 or block_q * block_g * block_d > _DENSE_TILE_ELEMS else 4
    return DenseTile(block_q, block_g, block_n, block_d, warps, 2)


def dense_programs(meta: AttnMetadata, num_q_heads: int, num_kv_heads: int, head_dim: int = 128) -> int:
    """Programs of one dense launch before splitting (the split policy's input)."""
    tile = dense_tile(head_dim, num_q_heads // num_kv_heads, meta.max_q)
    return meta.num_rows * -(-meta.max_q // tile.block_q) * num_kv_heads


def sparse_programs(meta: AttnMetadata, num_q_heads: int, num_kv_heads: int, num_index_heads: int) -> int:
    """Programs of one sparse launch before splitting."""
    heads = math.gcd(num_q_heads // num_kv_heads, num_q_heads // num_index_heads)
    return meta.num_tokens * (num_q_heads // heads)


def _partials(num_splits: int, t: int, hq: int, d: int, device: torch.device):
    # [splits, T, Hq, D] fp32 normalized partial outputs, [splits, T, Hq] fp32 log2-sum-exp
    return (torch.empty(num_splits, t, hq, d, dtype=torch.float32, device=device),
            torch.empty(num_splits, t, hq, dtype=torch.float32, device=device))


# Widest head slice one combine program merges: [splits, 128] fp32 stays in registers at 64 splits.
_COMBINE_MAX_D = 128


def _combine(part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor) -> None:
    s, t, hq, d = part_o.shape
    block_d = min(_pow2(d, 16), _COMBINE_MAX_D)
    _combine_kernel[(t, hq, -(-d // block_d))](
        part_o, part_lse, out, *part_o.stride()[:3], *part_lse.stride()[:2], out.stride(0), out.stride(1), s,
        HEAD_DIM=d, BLOCK_S=_pow2(s), BLOCK_D=block_d, **pdl.args(part_o))


def _tail_args(meta: AttnMetadata, dummy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int, bool]:
    """(TailStart, TailSlots, stride_tail, tail_width, TAIL) of the metadata's tail override (`dummy` pointers
    when it has none)."""
    if meta.tail_start is None:
        return dummy, dummy, 0, 1, False
    slots = meta.tail_slots.contiguous()
    return meta.tail_start, slots, slots.stride(0), slots.shape[1], True


def _check_pools(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> None:
    if q.shape[1] % k_pool.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k_pool.shape[1]})")
    for name, x in (("q", q), ("k_pool", k_pool), ("v_pool", v_pool)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim (got strides {x.stride()})")


def dense_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttnMetadata,
                    scale: float, num_splits: int = 1, block_n: int = 64, keep: torch.Tensor | None = None,
                    keep_block: int = 0, out: torch.Tensor | None = None, num_warps: int | None = None,
                    tile_max_q: int | None = None) -> torch.Tensor:
    """q [T, Hq, D] over paged K/V [S, Hkv, D] -> out [T, Hq, D] (q's dtype). Token-causal per row.

    keep [T, Hi, NB] int8 (optional): only key blocks of `keep_block` keys marked nonzero for the token's
    index head are visible -- the block-sparse layer computed tile-wise (see `_dense_attn_kernel`).
    block_n is a request: heads wider than 128 cap it (`dense_tile`); num_warps None = `dense_tile`'s.
    tile_max_q (the batch-invariant mode): the query tile is sized as for a row of that many tokens, whatever
    the step's widest row, so every step runs one tile shape."""
    _check_pools(q, k_pool, v_pool)
    t, hq, d = q.shape
    hkv = k_pool.shape[1]
    if k_pool.shape[-1] != d or v_pool.shape[-1] != d:
        raise ValueError(f"q head_dim {d} but k_pool / v_pool head_dim {k_pool.shape[-1]} / {v_pool.shape[-1]}")
    out = torch.empty_like(q) if out is None else out
    if t == 0:
        return out
    tile = dense_tile(d, hq // hkv, tile_max_q or meta.max_q, block_n)
    block_q, block_g, block_n = tile.block_q, tile.block_g, tile.block_n
    n_qtiles = -(-meta.max_q // block_q)
    # At most one split per key tile of max_kv; the kernel cuts each row's real kv_len into `splits`.
    splits = max(1, min(num_splits, -(-meta.max_kv // block_n)))
    part_o, part_lse = _partials(splits, t, hq, d, q.device) if splits > 1 else (out, out)
    pstr = (*part_o.stride()[:3], *part_lse.stride()[:2]) if splits > 1 else (0,) * 5
    page_table = meta.page_table.contiguous()
    if keep is not None and (keep.stride(-1) != 1 or hq % keep.shape[1] or keep_block <= 0):
        raise ValueError("keep must be [T, Hi, NB], contiguous in NB, Hq a multiple of Hi, keep_block > 0")
    keep_args = (keep, keep.stride(0), keep.stride(1)) if keep is not None else (q, 0, 0)
    # Split ranges and tiles start on multiples of block_n, so a power-of-two block_n that divides
    # keep_block keeps each tile inside one keep block.
    per_tile = keep is not None and keep_block % block_n == 0
    stages = {"num_stages": tile.num_stages} if tile.num_stages is not None else {}
    tail_start, tail_slots, stride_tail, tail_width, has_tail = _tail_args(meta, page_table)
    _dense_attn_kernel[(meta.num_rows * n_qtiles, hkv, splits)](
        q, k_pool, v_pool, out, part_o, part_lse, page_table, meta.q_index, meta.q_lens, meta.kv_lens,
        meta.positions, keep_args[0], tail_start, tail_slots,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        out.stride(0), out.stride(1), page_table.stride(0), meta.q_index.stride(0), *pstr, keep_args[1],
        keep_args[2], stride_tail, scale * LOG2E, meta.page_size, page_table.shape[1], meta.max_kv, splits,
        max(1, keep_block), n_qtiles, tail_width, HEAD_DIM=d, GROUP=hq // hkv,
        GROUP_IDX=hq // keep.shape[1] if keep is not None else 1,
        BLOCK_Q=block_q, BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=tile.block_d, HAS_KEEP=keep is not None,
        KEEP_PER_TILE=per_tile, SPLIT=splits > 1, DOT_PREC=_dot_precision(k_pool.dtype), TAIL=has_tail,
        num_warps=num_warps or tile.num_warps, **stages, **pdl.args(q))
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
                     scale: float, sel: torch.Tensor | tuple[int, int], block_size: int, num_splits: int = 1,
                     keys_per_iter: int = 128, out: torch.Tensor | None = None, num_warps: int = 4,
                     sel_chunk: int | None = None) -> torch.Tensor:
    """q [T, Hq, D], sel [T, Hi, k] (block ids, -1 = none) -> out [T, Hq, D]: each token sees only the keys
    of its selected blocks, token-causal. Attention head h reads index head h // (Hq // Hi). sel = (Hi, k)
    selects every block of a context of k <= top-k blocks without a selection tensor: the same visits, and
    bits, as the indexer's list for it (blocks 0, 1, .. up to the token's own, then -1)."""
    _check_pools(q, k_pool, v_pool)
    t, hq, d = q.shape
    every = not isinstance(sel, torch.Tensor)
    hkv = k_pool.shape[1]
    hi, num_sel = sel if every else (sel.shape[1], sel.shape[2])
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
    if sel_chunk is None:  # else fixed by the caller (the batch-invariant mode: never from the step)
        sel_chunk = min(max(1, keys_per_iter // block_bs), _pow2(per_split))
        sel_chunk = max(sel_chunk, _pow2(-(-16 // block_bs)))
    tail_start, tail_slots, stride_tail, tail_width, has_tail = _tail_args(meta, page_table)
    _sparse_attn_kernel[(t, hq // heads, splits)](
        q, k_pool, v_pool, out, part_o, part_lse, page_table, meta.tok_row, meta.positions,
        meta.positions if every else sel, tail_start, tail_slots, q.stride(0), q.stride(1), k_pool.stride(0),
        k_pool.stride(1), v_pool.stride(0), v_pool.stride(1), out.stride(0), out.stride(1), page_table.stride(0),
        *pstr, 0 if every else sel.stride(0), 0 if every else sel.stride(1), stride_tail,
        scale * LOG2E, meta.page_size, page_table.shape[1], meta.max_kv, block_size, num_sel, per_split, tail_width,
        HEAD_DIM=d, HEADS=heads, GROUP_KV=group_kv, GROUP_IDX=group_idx, BLOCK_G=_pow2(heads, 16),
        BLOCK_BS=block_bs, SEL_CHUNK=sel_chunk, BLOCK_D=_pow2(d, 16), SPLIT=splits > 1,
        DOT_PREC=_dot_precision(k_pool.dtype), TAIL=has_tail, ALL=every, num_warps=num_warps, **pdl.args(q))
    if splits > 1:
        _combine(part_o, part_lse, out)
    return out


def index_programs(meta: AttnMetadata, num_index_heads: int) -> int:
    """Programs of one indexer launch before splitting: one per (row, query tile)."""
    block_q, _ = _q_tile(num_index_heads, meta.max_q)
    return meta.num_rows * -(-meta.max_q // block_q)


# Merges scan only the live lists' width while it is at most this many candidates (`_index_merge_kernel`).
MERGE_SMALL_CANDIDATES = 256


def select_blocks(iq: torch.Tensor, ik_pool: torch.Tensor, meta: AttnMetadata, block_size: int, topk: int,
                  local_blocks: int, num_splits: int = 1, min_blocks_per_split: int = 1, keys_per_iter: int = 128,
                  num_warps: int = 4, merge_small_candidates: int = MERGE_SMALL_CANDIDATES, direct_lists: bool = True,
                  merge_num_warps: int | None = None, tile_max_q: int | None = None) -> torch.Tensor:
    """Lightning-indexer selection on flat tokens: iq [T, Hi, Di], ik_pool [S, Di] -> sel [T, Hi, k] int64,
    k = min(topk, NB), NB = ceil(max_kv / block_size): exactly `reference.select_blocks` -- the same blocks
    (score desc, ties to the lower block id), listed in ascending id, -1 where only -inf was left.

    One launch (`_indexer_kernel`) when num_splits == 1. Otherwise each row's blocks are cut into
    `num_splits` runs of at least `min_blocks_per_split` blocks (from the row's device kv_len), each run
    keeps its own top-k, and `_index_merge_kernel` picks the final k: two launches, for steps with too few
    rows to fill the GPU. Device memory: sel plus, when split, [T, Hi, splits, <=k] int64 keys. The merge
    scans `merge_small_candidates` list entries instead of all when a token's live splits hold no more
    (1: always all); a run that fits its list fills it directly unless `direct_lists` is False (always
    insert). Both switches exist so that the tests force each path. tile_max_q (the batch-invariant mode):
    the query tile and the score tile are sized from it and from keys_per_iter alone, never from the step."""
    t, hi, di = iq.shape
    nb = -(-meta.max_kv // block_size)
    k = min(topk, nb)
    sel = torch.empty(t, hi, k, dtype=torch.int64, device=iq.device)
    if t == 0 or k == 0:
        return sel
    if ik_pool.stride(-1) != 1 or iq.stride(-1) != 1:
        raise ValueError("iq and ik_pool must be contiguous in their last dim")
    mixed = iq.dtype != ik_pool.dtype
    block_q, block_h = _q_tile(hi, tile_max_q or meta.max_q)
    n_qtiles = -(-meta.max_q // block_q)
    min_bps = max(1, min_blocks_per_split)
    plan = index_plan(nb, k, block_size, num_splits, min_bps, keys_per_iter, span_bound=tile_max_q is None)
    splits, block_k = plan.splits, plan.block_k
    page_table = meta.page_table.contiguous()
    # [T, Hi, splits * BLOCK_K] int64: each split's list of packed keys (`_pack_key`)
    part_key = torch.empty(t, hi, splits * block_k, dtype=torch.int64, device=iq.device) if splits > 1 else sel
    tail_start, tail_slots, stride_tail, tail_width, has_tail = _tail_args(meta, page_table)
    _indexer_kernel[(meta.num_rows * n_qtiles, splits)](
        iq, ik_pool, page_table, meta.q_index, meta.q_lens, meta.kv_lens, meta.positions, sel, part_key,
        tail_start, tail_slots, iq.stride(0), iq.stride(1), ik_pool.stride(0), page_table.stride(0),
        meta.q_index.stride(0), sel.stride(0), sel.stride(1), part_key.stride(0), part_key.stride(1), stride_tail,
        meta.page_size, page_table.shape[1], meta.max_kv, block_size, nb, local_blocks, n_qtiles, splits, min_bps,
        tail_width,
        INDEX_DIM=di, N_HEADS=hi, TOPK=k, CAP=plan.cap, BLOCK_K=block_k, BLOCK_O=_pow2(k), BLOCK_Q=block_q,
        BLOCK_H=block_h, BLOCK_BS=_pow2(block_size), BLOCKS_PER_ITER=plan.blocks_per_iter,
        BLOCK_D=_pow2(di, 16), SPLIT=splits > 1, DIRECT=direct_lists and plan.direct, MIXED=mixed,
        DOT_PREC="ieee" if mixed else _dot_precision(ik_pool.dtype), TAIL=has_tail, num_warps=num_warps,
        **pdl.args(iq))
    if splits > 1:
        _merge(part_key, sel, meta.tok_row, meta.kv_lens, meta.positions, block_size, nb, splits, min_bps,
               local_blocks, k, block_k, merge_small_candidates, merge_num_warps)
    return sel


def _merge(part_key: torch.Tensor, sel: torch.Tensor, tok_row: torch.Tensor, kv_lens: torch.Tensor,
           positions: torch.Tensor, block_size: int, nb: int, splits: int, min_bps: int, local_blocks: int, k: int,
           block_k: int, merge_small_candidates: int, merge_num_warps: int | None) -> None:
    """The split lists part_key [T, Hi, splits * block_k] -> sel [T, Hi, k] in one `_index_merge_kernel`
    launch, whose variant follows (pow2(splits), block_k) and the engine's fixed shapes."""
    block_c = _pow2(splits) * block_k
    _index_merge_kernel[(sel.shape[0], sel.shape[1])](
        part_key, sel, tok_row, kv_lens, positions,
        part_key.stride(0), part_key.stride(1), sel.stride(0), sel.stride(1), block_size, nb, splits, min_bps,
        local_blocks, TOPK=k, BLOCK_K=block_k, BLOCK_C=block_c,
        SMALL_C=min(block_c, _pow2(max(1, merge_small_candidates))), BLOCK_O=_pow2(k),
        num_warps=merge_num_warps or (4 if block_c <= 1024 else 8), **pdl.args(sel))


def warm_index_merge(num_index_heads: int, k: int, block_size: int, min_bps: int, local_blocks: int,
                     classes: list[tuple[int, int]], device: torch.device,
                     merge_small_candidates: int = MERGE_SMALL_CANDIDATES,
                     merge_num_warps: int | None = None) -> None:
    """Compile the merge variant of each (pow2 splits, block_k) class as an eager step launches it: one token
    at position -1 (it takes the early exit), the real sel shape [1, Hi, k] and scalars, so the launch
    specializes as a serving step's does."""
    sel = torch.empty(1, num_index_heads, k, dtype=torch.int64, device=device)
    ints = torch.zeros(1, dtype=torch.int64, device=device)
    for splits, block_k in classes:
        part_key = torch.empty(1, num_index_heads, splits * block_k, dtype=torch.int64, device=device)
        _merge(part_key, sel, ints, ints, ints - 1, block_size, splits * min_bps, splits, min_bps, local_blocks, k,
               block_k, merge_small_candidates, merge_num_warps)
