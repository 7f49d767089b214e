"""The draft-tree step's layout on Triton, one launch each, exact (int64 index arithmetic, copies): every
per-node-row metadata tensor of a verify step, each growth level's frontier with its head call's inputs, the
accepted path's permutation of the verify rows and the grown trees' slot rows. The plain torch they equal is
tree_layout.node_rows_reference, frontier_reference, path_perm_reference and tree_ops.store_reference
(tests/engine/test_tree_layout.py).

    _node_rows_kernel  the stored trees' gathers, full_tree, ancestors, the sub-rows' lengths,
                       query index, page table, tail slots, the sample positions   (~61 torch launches at D = 3)
    _frontier_kernel   a level's top-k frontier, its tokens / target ids / parents' hidden rows,
                       scratch slots, positions, page table, the next candidates' parents       (~20)
    _path_perm_kernel  num_new of the sampling rows, the path's permutation, permuted ids / aux     (~17)
    _store_kernel      the grown trees into their slot rows                                        (3)

Every launcher reads shapes, strides and host ints only (no host sync): a step using them is CUDA-graph
capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3eagle.engine.step_kernels import _cache_slot
from m3eagle.engine.tree_layout import Frontier, NodeRows
from m3eagle.kernels import pdl
from m3eagle.kernels.attention.metadata import AttnMetadata
from m3eagle.kernels.pdl import pdl_wait
from m3eagle.kernels.topk.triton_topk import _NONE, score_keys


@triton.jit
def _token_pos(t, m, sd_ptr, s_slot, rslot_ptr, nd_ptr, q_ptr, kv_ptr, tok_row_ptr, tok_col_ptr, pos_ptr, n1):
    """Flat tokens t (mask m): position (p0 + depth in a tree row, the step's elsewhere), row, column, tree row."""
    tr = tl.load(tok_row_ptr + t, mask=m, other=0)
    tc = tl.load(tok_col_ptr + t, mask=m, other=0)
    is_tree = tl.load(nd_ptr + tr, mask=m, other=0) > 0
    slot = tl.load(rslot_ptr + tr, mask=m, other=0)
    c = tl.minimum(tc, n1 - 1)  # a prompt row's later tokens read the last node's depth, unused
    dep = tl.load(sd_ptr + slot * s_slot + c - 1, mask=m & (c > 0), other=0)
    p0 = tl.load(kv_ptr + tr, mask=m, other=0) - tl.load(q_ptr + tr, mask=m, other=0)
    pos = tl.where(is_tree, p0 + dep, tl.load(pos_ptr + t, mask=m, other=0))
    return pos, tr, tc, is_tree


@triton.jit
def _node_tokens(blk, sd_ptr, s_slot, rslot_ptr, nd_ptr, q_ptr, kv_ptr, tok_row_ptr, tok_col_ptr, pos_ptr, pos_out,
                 tr_out, tc_out, n_tok, n1, uniform, BLOCK: tl.constexpr):
    """Tokens blk * BLOCK.. of a step: position (p0 + depth in a tree row), sub-row and column in it."""
    t = blk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = t < n_tok
    pos, tr, tc, is_tree = _token_pos(t, m, sd_ptr, s_slot, rslot_ptr, nd_ptr, q_ptr, kv_ptr, tok_row_ptr,
                                      tok_col_ptr, pos_ptr, n1)
    split = tl.where(uniform != 0, True, is_tree)
    tl.store(pos_out + t, pos, mask=m)
    tl.store(tr_out + t, tr * n1 + tl.where(split, tc, 0), mask=m)
    tl.store(tc_out + t, tl.where(split, 0, tc), mask=m)


@triton.jit
def _sample_row(b, sd_ptr, s_slot, rslot_ptr, first_ptr, nd_ptr, q_ptr, kv_ptr, tok_row_ptr, tok_col_ptr, pos_ptr,
                ids_ptr, si_out, np_out, di_out, n1, BLOCK_N: tl.constexpr):
    """Step row b's sample positions (step_reference.sample_positions over the node positions): its last
    num_drafts + 1 tokens padded to w + 1 = n1 by its last, their positions, its drafts as input ids."""
    b = b.to(tl.int64)
    j = tl.arange(0, BLOCK_N).to(tl.int64)
    jm = j < n1
    first = tl.load(first_ptr + b)
    last = first + tl.load(q_ptr + b) - 1
    nd = tl.load(nd_ptr + b)
    idx = tl.minimum(last - nd + j, last)
    pos, _, _, _ = _token_pos(idx, jm, sd_ptr, s_slot, rslot_ptr, nd_ptr, q_ptr, kv_ptr, tok_row_ptr, tok_col_ptr,
                              pos_ptr, n1)
    tl.store(si_out + b * n1 + j, idx, mask=jm)
    tl.store(np_out + b * n1 + j, pos, mask=jm)
    dm = j < n1 - 1
    d_idx = tl.minimum(first + j + 1, last)
    draft = tl.load(ids_ptr + d_idx, mask=dm & (j < nd), other=0)
    tl.store(di_out + b * (n1 - 1) + j, draft, mask=dm)


@triton.jit
def _node_row(b, sp_ptr, sd_ptr, s_slot, rslot_ptr, first_ptr, nd_ptr, q_ptr, kv_ptr, pt_ptr, stride_pt, table_w,
              page_size, pos_ptr, par_out, dep_out, anc_out, p0_out, q_out, kv_out, qi_out, qv_out, ts_out, tail_out,
              n1, max_kv, max_q, uniform, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_Q: tl.constexpr):
    """Step row b: its n1 nodes' parents, depths, ancestors and p0, and its sub-rows' lengths, query index and tail
    slots."""
    b = b.to(tl.int64)
    slot = tl.load(rslot_ptr + b)
    qlen = tl.load(q_ptr + b)
    kv = tl.load(kv_ptr + b)
    p0 = kv - qlen
    nd = tl.load(nd_ptr + b)
    is_tree = nd > 0
    split = tl.where(uniform != 0, True, is_tree)
    j = tl.arange(0, BLOCK_N).to(tl.int64)
    jm = j < n1
    row = sp_ptr + slot * s_slot - 1  # node i's parent at column i - 1
    drow = sd_ptr + slot * s_slot - 1
    par = tl.load(row + j, mask=jm & (j > 0), other=0)
    dep = tl.load(drow + j, mask=jm & (j > 0), other=0)
    sub = b * n1 + j  # [BLOCK_N] sub-row index
    tl.store(par_out + sub, par, mask=jm)
    tl.store(dep_out + sub, dep, mask=jm)
    tl.store(p0_out + b, p0)
    # ancestors: walk up D + 1 times, node cur written at its depth (later writes win, as the reference's)
    dc = tl.arange(0, BLOCK_D).to(tl.int64)
    anc = j[:, None] + dc[None, :] * 0  # [BLOCK_N, BLOCK_D] past a node's depth: the node itself
    cur = j
    for _ in tl.static_range(D + 1):
        live = jm & (cur > 0) & (cur < n1)
        d_cur = tl.load(drow + cur, mask=live, other=0)
        anc = tl.where(dc[None, :] == d_cur[:, None], cur[:, None], anc)
        cur = tl.load(row + cur, mask=live, other=0)
    am = jm[:, None] & (dc[None, :] <= D)
    tl.store(anc_out + sub[:, None] * (D + 1) + dc[None, :], anc, mask=am)
    tm = am & (dc[None, :] >= 1)  # depth 1..D: the slot of position p0 + that ancestor
    tail = _cache_slot(pt_ptr, b, p0 + anc, stride_pt, table_w, page_size, tm)
    tl.store(tail_out + sub[:, None] * D + dc[None, :] - 1, tail, mask=tm)
    # sub-rows: tokens, first flat token, kv_len (a split sub-row's: its one token's position + 1)
    q_sub = tl.where(split, (j < qlen).to(tl.int64), tl.where(j == 0, qlen, 0))
    first = tl.load(first_ptr + b) + tl.where(split, j, 0)
    has = tl.where(split, q_sub > 0, False)  # where, not &: a scalar & a block is no bool in the interpreter
    own = tl.where(is_tree, p0 + dep, tl.load(pos_ptr + first, mask=tl.where(nd <= 0, jm & has, False), other=0))
    tl.store(q_out + sub, q_sub, mask=jm)
    tl.store(kv_out + sub, tl.where(has, own + 1, kv), mask=jm)
    tl.store(ts_out + sub, tl.where(is_tree, p0 + 1, max_kv) + j * 0, mask=jm)
    for c0 in range(0, max_q, BLOCK_Q):
        cq = c0 + tl.arange(0, BLOCK_Q)
        valid = cq[None, :] < q_sub[:, None]
        qm = jm[:, None] & (cq[None, :] < max_q)
        tl.store(qi_out + sub[:, None] * max_q + cq[None, :], tl.where(valid, first[:, None] + cq[None, :], 0),
                 mask=qm)
        tl.store(qv_out + sub[:, None] * max_q + cq[None, :], valid, mask=qm)


@triton.jit
def _page_rows(b, chunk, pt_ptr, stride_pt, table_w, pt_out, n1, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr):
    """Columns chunk * BLOCK_P.. of step row b's page table -> each of its n1 sub-rows' (a long table is copied by
    as many programs as it has chunks, not by one)."""
    b = b.to(tl.int64)
    j = tl.arange(0, BLOCK_N).to(tl.int64)
    cp = chunk.to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    pages = tl.load(pt_ptr + b * stride_pt + cp, mask=cp < table_w, other=0)
    tl.store(pt_out + (b * n1 + j)[:, None] * table_w + cp[None, :], pages[None, :] + j[:, None] * 0,
             mask=(j[:, None] < n1) & (cp[None, :] < table_w))


@triton.jit(do_not_specialize=["n_tok", "max_kv", "max_q", "uniform"])
def _node_rows_kernel(sp_ptr, sd_ptr, s_slot, rslot_ptr, first_ptr, nd_ptr, q_ptr, kv_ptr, pt_ptr, stride_pt, table_w,
                      page_size, tok_row_ptr, tok_col_ptr, pos_ptr, par_out, dep_out, anc_out, p0_out, pos_out,
                      q_out, kv_out, pt_out, tr_out, tc_out, qi_out, qv_out, ts_out, tail_out, ids_ptr, si_out,
                      np_out, di_out, held_ptr, nn_out, n_tok, n1, max_kv,
                      max_q, uniform, D: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_P: tl.constexpr, PDL: tl.constexpr):
    """Programs (i, 0), i < cdiv(T, BLOCK), take BLOCK tokens each (position, sub-row, column); program
    (cdiv(T, BLOCK) + b, 0) takes step row b: its w + 1 = n1 nodes' parents, depths and ancestors (stored node i at
    column i - 1 of the row's slot, the root 0 in column 0), p0, its sub-rows' lengths, query index and tail, and
    where it samples (_sample_row) and the nodes it verifies (min(num_drafts, held[slot]): a chain holds fewer
    than a full step's drafts); programs (cdiv(T, BLOCK) + b, c) copy chunk c of its page table."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    pid = tl.program_id(0)
    chunk = tl.program_id(1)  # the page-table chunk a row program copies; the rest is chunk 0's
    n_tok_blocks = tl.cdiv(n_tok, BLOCK)
    if pid < n_tok_blocks:
        if chunk == 0:
            _node_tokens(pid, sd_ptr, s_slot, rslot_ptr, nd_ptr, q_ptr, kv_ptr, tok_row_ptr, tok_col_ptr, pos_ptr,
                         pos_out, tr_out, tc_out, n_tok, n1, uniform, BLOCK)
    else:
        if chunk == 0:
            _node_row(pid - n_tok_blocks, sp_ptr, sd_ptr, s_slot, rslot_ptr, first_ptr, nd_ptr, q_ptr, kv_ptr, pt_ptr,
                      stride_pt, table_w, page_size, pos_ptr, par_out, dep_out, anc_out, p0_out, q_out, kv_out, qi_out,
                      qv_out, ts_out, tail_out, n1, max_kv, max_q, uniform, D, BLOCK_N, BLOCK_D, BLOCK_Q)
            _sample_row(pid - n_tok_blocks, sd_ptr, s_slot, rslot_ptr, first_ptr, nd_ptr, q_ptr, kv_ptr, tok_row_ptr,
                        tok_col_ptr, pos_ptr, ids_ptr, si_out, np_out, di_out, n1, BLOCK_N)
            r = (pid - n_tok_blocks).to(tl.int64)
            tl.store(nn_out + r, tl.minimum(tl.load(nd_ptr + r), tl.load(held_ptr + tl.load(rslot_ptr + r))))
        _page_rows(pid - n_tok_blocks, chunk, pt_ptr, stride_pt, table_w, pt_out, n1, BLOCK_N, BLOCK_P)


def node_rows(meta: AttnMetadata, ids: torch.Tensor, slot_parents: torch.Tensor, slot_depths: torch.Tensor,
              row_slot: torch.Tensor,
              row_first: torch.Tensor, num_drafts: torch.Tensor, width: int, max_depth: int,
              uniform: bool, held: torch.Tensor) -> NodeRows:
    """tree_layout.node_rows_reference in one launch (its constant aranges are not needed): ids [T], slot_parents /
    slot_depths [S+1, N] (unit column stride, equal strides), row_slot / row_first / num_drafts [B], held [S+1]."""
    b, n1, t, d = row_slot.shape[0], width + 1, meta.tok_row.shape[0], max_depth
    mq = 1 if uniform else meta.max_q
    dev, i64 = row_slot.device, torch.int64
    pt = meta.page_table if meta.page_table.stride(-1) == 1 else meta.page_table.contiguous()
    p_w = pt.shape[1]
    out = NodeRows(parents=torch.empty(b, n1, dtype=i64, device=dev), depths=torch.empty(b, n1, dtype=i64, device=dev),
                   anc=torch.empty(b, n1, d + 1, dtype=i64, device=dev), p0=torch.empty(b, dtype=i64, device=dev),
                   positions=torch.empty(t, dtype=i64, device=dev), q_lens=torch.empty(b * n1, dtype=i64, device=dev),
                   kv_lens=torch.empty(b * n1, dtype=i64, device=dev),
                   page_table=torch.empty(b * n1, p_w, dtype=pt.dtype, device=dev),
                   tok_row=torch.empty(t, dtype=i64, device=dev), tok_col=torch.empty(t, dtype=i64, device=dev),
                   q_index=torch.empty(b * n1, mq, dtype=i64, device=dev),
                   q_valid=torch.empty(b * n1, mq, dtype=torch.bool, device=dev),
                   tail_start=torch.empty(b * n1, dtype=i64, device=dev),
                   tail_slots=torch.empty(b * n1, d, dtype=i64, device=dev),
                   sample_idx=torch.empty(b, n1, dtype=i64, device=dev), node_pos=torch.empty(b, n1, dtype=i64, device=dev),
                   drafts_in=torch.empty(b, width, dtype=ids.dtype, device=dev),
                   num_nodes=torch.empty(b, dtype=num_drafts.dtype, device=dev))
    if slot_parents.stride() != slot_depths.stride() or slot_parents.stride(-1) != 1:
        raise ValueError("node_rows: the slot buffers must share strides, with unit column stride")
    block, block_n = 128, triton.next_power_of_2(max(n1, 2))
    block_p = min(triton.next_power_of_2(max(p_w, 2)), max(4096 // block_n, 16))  # [n1, BLOCK_P] tiles of <= 4K
    grid = (triton.cdiv(t, block) + b, triton.cdiv(p_w, block_p))
    if grid[0] and grid[1]:
        _node_rows_kernel[grid](
            slot_parents, slot_depths, slot_parents.stride(0), row_slot.contiguous(), row_first.contiguous(),
            num_drafts.contiguous(), meta.q_lens.contiguous(), meta.kv_lens.contiguous(), pt, pt.stride(0), p_w,
            meta.page_size, meta.tok_row.contiguous(), meta.tok_col.contiguous(), meta.positions.contiguous(),
            *out[:14], ids.contiguous(), *out[14:17], held.contiguous(), out.num_nodes, t, n1, meta.max_kv, mq,
            int(uniform), D=d, BLOCK=block,
            BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(d + 1),
            BLOCK_Q=min(triton.next_power_of_2(max(mq, 2)), max(2048 // block_n, 2)), BLOCK_P=block_p, num_warps=4,
            **pdl.args(row_slot))
    return out


@triton.jit(do_not_specialize=["hd", "table_w", "first0", "per_row"])
def _frontier_kernel(score_ptr, tok_ptr, parent_ptr, s_cand, h_ptr, s_h, d2t_ptr, base_ptr, pt_ptr, stride_pt,
                     table_w, prev_ptr, f_score, f_cand, f_tok, f_par, ids_out, h_out, pos_out, kv_out, slots_out,
                     pt_out, ts_out, hd, first0, per_row, K: tl.constexpr, LEVEL: tl.constexpr,
                     BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_P: tl.constexpr, PDL: tl.constexpr):
    """Row b's frontier of depth LEVEL (tree_layout.frontier_reference): at LEVEL 1 the root's K children, else
    the K best of the previous expansion's K*K candidates (reference.best's keys); their scores, candidates,
    tokens, parents' frontier index, target ids, parents' hidden rows, positions, lengths and scratch slots; the
    next expansion's parents in the candidate buffer; at LEVEL 1 also the -1 parents of the root's children and
    each frontier row's page table and tail start. Programs (b, c) copy chunk c of the hidden rows and page table
    (each picks the frontier itself: K rounds over K*K keys), (b, 0) writes the rest."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    b = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)  # the hidden (and page-table) chunk this program copies; the rest is chunk 0's
    f = tl.arange(0, BLOCK_K).to(tl.int64)
    fm = f < K
    row = b * s_cand
    if LEVEL == 1:
        idx = f
        start = 0
    else:
        start = K + (LEVEL - 2) * K * K
        c = tl.arange(0, BLOCK_C)
        cm = c < K * K
        keys = score_keys(tl.load(score_ptr + row + start + c, mask=cm, other=0.0), c, K * K, cm)  # [BLOCK_C]
        idx = tl.zeros([BLOCK_K], tl.int64)
        for j in tl.static_range(K):
            top = tl.max(keys, axis=0)  # unique: one candidate leaves per round
            idx = tl.where(f == j, (K * K - 1) - (top & 0xFFFFFFFF), idx)
            keys = tl.where(keys == top, _NONE, keys)
    cand = start + idx
    score = tl.load(score_ptr + row + cand, mask=fm, other=0.0)
    tok = tl.load(tok_ptr + row + cand, mask=fm, other=0)
    par = idx // K
    if chunk == 0:
        if LEVEL == 1:
            tl.store(parent_ptr + row + f, tl.full([BLOCK_K], -1, tl.int64), mask=fm)
        nxt = K + (LEVEL - 1) * K * K  # the next expansion's K*K candidates: each frontier node's K children
        ch = tl.arange(0, BLOCK_K)
        tl.store(parent_ptr + row + nxt + f[:, None] * K + ch[None, :], cand[:, None] + ch[None, :] * 0,
                 mask=fm[:, None] & (ch[None, :] < K))
        out = b * K + f  # [BLOCK_K] frontier row
        tl.store(f_score + out, score, mask=fm)
        tl.store(f_cand + out, cand, mask=fm)
        tl.store(f_tok + out, tok, mask=fm)
        tl.store(f_par + out, par, mask=fm)
        tl.store(ids_out + out, tok + tl.load(d2t_ptr + tok, mask=fm, other=0), mask=fm)
        base = tl.load(base_ptr + b)
        tl.store(pos_out + out, base + LEVEL + f * 0, mask=fm)
        tl.store(kv_out + out, base + LEVEL + 1 + f * 0, mask=fm)
        # scratch slots: the parent's LEVEL - 1 (its own row of the previous frontier), then this node's
        d = tl.arange(0, BLOCK_L)
        up = (d[None, :] < LEVEL - 1) & fm[:, None]
        prev = tl.load(prev_ptr + (b * K + par)[:, None] * (LEVEL - 1) + d[None, :], mask=up, other=0)
        own = first0 + b * per_row + (LEVEL - 1) * K + f
        slots = tl.where(d[None, :] == LEVEL - 1, own[:, None], prev)
        tl.store(slots_out + out[:, None] * LEVEL + d[None, :], slots, mask=fm[:, None] & (d[None, :] < LEVEL))
        if LEVEL == 1:
            tl.store(ts_out + out, base + 1 + f * 0, mask=fm)
    # chunk c of each frontier node's input hidden: its parent's h_next row (the root's at LEVEL 1)
    if LEVEL == 1:
        src = b + f * 0
    else:
        src = b * K + par
    h = chunk.to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = fm[:, None] & (h[None, :] < hd)
    x = tl.load(h_ptr + src[:, None] * s_h + h[None, :], mask=hm)
    tl.store(h_out + (b * K + f)[:, None] * hd + h[None, :], x, mask=hm)
    if LEVEL == 1:  # and chunk c of each frontier row's page table: its step row's
        cp = chunk.to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
        pages = tl.load(pt_ptr + b * stride_pt + cp, mask=cp < table_w, other=0)
        tl.store(pt_out + (b * K + f)[:, None] * table_w + cp[None, :], pages[None, :] + f[:, None] * 0,
                 mask=fm[:, None] & (cp[None, :] < table_w))

def frontier(prev: Frontier | None, cand_score: torch.Tensor, cand_tok: torch.Tensor, cand_parent: torch.Tensor,
             h_next: torch.Tensor, d2t: torch.Tensor, base: torch.Tensor, page_table: torch.Tensor, level: int, k: int,
             scratch: tuple[int, int]) -> Frontier:
    """tree_layout.frontier_reference in one launch: cand_score / cand_tok / cand_parent [B, M] (equal strides,
    unit column stride), h_next [B or B*K, H] (unit column stride), base [B], page_table [B, P]."""
    b = cand_score.shape[0]
    hd, dev, i64 = h_next.shape[-1], cand_score.device, torch.int64
    if not (cand_score.stride() == cand_tok.stride() == cand_parent.stride() and cand_score.stride(-1) == 1):
        raise ValueError("frontier: the candidate buffers must share strides, with unit column stride")
    h = h_next if h_next.stride(-1) == 1 else h_next.contiguous()
    pt = page_table if page_table.stride(-1) == 1 else page_table.contiguous()
    n = b * k
    if prev is None:
        pt_rows = torch.empty(n, pt.shape[1], dtype=pt.dtype, device=dev)
        tail_start = torch.empty(n, dtype=i64, device=dev)
        prev_slots = tail_start  # not read at level 1
    else:
        pt_rows, tail_start, prev_slots = prev.page_table, prev.tail_start, prev.slots
    def new(*shape: int, dtype: torch.dtype = i64) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device=dev)

    out = Frontier(score=new(b, k, dtype=cand_score.dtype), cand=new(b, k), tok=new(b, k, dtype=cand_tok.dtype),
                   par=new(b, k), ids=new(n, dtype=cand_tok.dtype), hidden=new(n, hd, dtype=h.dtype),
                   positions=new(n), kv_lens=new(n), slots=new(n, level), page_table=pt_rows, tail_start=tail_start)
    block_k = triton.next_power_of_2(max(k, 2))
    block_h = min(triton.next_power_of_2(max(hd, 16)), max(2048 // block_k, 16))  # [K, BLOCK_H] tiles of <= 2K
    block_p = min(triton.next_power_of_2(max(pt.shape[1], 2)), max(2048 // block_k, 16))
    chunks = max(triton.cdiv(hd, block_h), triton.cdiv(pt.shape[1], block_p) if prev is None else 1)
    if b:
        _frontier_kernel[(b, chunks)](
            cand_score, cand_tok, cand_parent, cand_score.stride(0), h, h.stride(0), d2t.contiguous(),
            base.contiguous(), pt, pt.stride(0), pt.shape[1], prev_slots, *out[:9], pt_rows, tail_start, hd,
            scratch[0], scratch[1], K=k, LEVEL=level, BLOCK_K=block_k, BLOCK_C=triton.next_power_of_2(max(k * k, 16)),
            BLOCK_L=triton.next_power_of_2(max(level, 2)), BLOCK_H=block_h, BLOCK_P=block_p, num_warps=4,
            **pdl.args(cand_score))
    return out


@triton.jit
def _store_kernel(slot_ptr, tok_ptr, par_ptr, dep_ptr, st_out, sp_out, sd_out, held_out, s_tree, s_slot, n,
                  BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """Row b's grown tree (tokens, parents, depths; n nodes) -> row slot[b] of the three slot buffers, n -> its
    held count."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_N)
    m = j < n
    src = b * s_tree + j
    dst = tl.load(slot_ptr + b) * s_slot + j
    tl.store(st_out + dst, tl.load(tok_ptr + src, mask=m), mask=m)
    tl.store(sp_out + dst, tl.load(par_ptr + src, mask=m), mask=m)
    tl.store(sd_out + dst, tl.load(dep_ptr + src, mask=m), mask=m)
    tl.store(held_out + tl.load(slot_ptr + b), n.to(tl.int64))


def store(slot: torch.Tensor, trees: tuple[torch.Tensor, ...], bufs: tuple[torch.Tensor, ...],
          held: torch.Tensor) -> None:
    """tree_ops.store_reference in one launch: trees (tokens, parents, depths [B, n], one layout with unit column
    stride) -> the first n columns of rows slot [B] of bufs (slot_drafts, slot_parents, slot_depths [S+1, >= n],
    one layout), n -> held[slot] (held [S+1] contiguous)."""
    b, n = trees[0].shape
    if trees[0].stride(-1) != 1 or bufs[0].stride(-1) != 1 or held.stride(-1) != 1:
        raise ValueError("store: the trees, the slot buffers and held need unit column strides")
    if b:
        _store_kernel[(b,)](slot.contiguous(), *trees, *bufs, held, trees[0].stride(0), bufs[0].stride(0), n,
                            BLOCK_N=triton.next_power_of_2(max(n, 2)), num_warps=1, **pdl.args(slot))


@triton.jit(do_not_specialize=["n_tok", "n_rows"])
def _path_perm_kernel(ids_ptr, aux_ptr, s_aux, first_ptr, nn_ptr, samples_ptr, nd_ptr, path_ptr, s_path, tok_row_ptr,
                      tok_col_ptr, nns_out, perm_out, ids_out, aux_out, n_tok, n_rows, width, D: tl.constexpr,
                      BLOCK: tl.constexpr, BLOCK_A: tl.constexpr, PDL: tl.constexpr):
    """Programs (i, c), i < cdiv(T, BLOCK), take BLOCK tokens each: token t, column j of row b, takes node
    path[b, j]'s place when 1 <= j <= D, j < num_new_s[b] and row b verifies a tree; program (i, c) copies
    columns c * BLOCK_A.. of the aux rows from there, those with c = 0 also the perm and the ids. The programs
    (i >= cdiv(T, BLOCK), 0) write num_new_s for BLOCK rows each (num_new where the row samples, else 0)."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    pid = tl.program_id(0)
    chunk = tl.program_id(1)
    n_tok_blocks = tl.cdiv(n_tok, BLOCK)
    offs = tl.arange(0, BLOCK)
    if pid < n_tok_blocks:
        t = pid.to(tl.int64) * BLOCK + offs
        m = t < n_tok
        b = tl.load(tok_row_ptr + t, mask=m, other=0)
        j = tl.load(tok_col_ptr + t, mask=m, other=0)
        nns = tl.where(tl.load(samples_ptr + b, mask=m, other=0) != 0, tl.load(nn_ptr + b, mask=m, other=0), 0)
        moved = m & (j >= 1) & (j <= D) & (j < nns) & (tl.load(nd_ptr + b, mask=m, other=0) > 0)
        node = tl.load(path_ptr + b * s_path + j, mask=moved, other=0)
        perm = tl.where(moved, tl.load(first_ptr + b, mask=moved, other=0) + node, t)
        if chunk == 0:
            tl.store(perm_out + t, perm, mask=m)
            tl.store(ids_out + t, tl.load(ids_ptr + perm, mask=m, other=0), mask=m)
        a = chunk.to(tl.int64) * BLOCK_A + tl.arange(0, BLOCK_A)
        am = m[:, None] & (a[None, :] < width)
        x = tl.load(aux_ptr + perm[:, None] * s_aux + a[None, :], mask=am)
        tl.store(aux_out + t[:, None] * width + a[None, :], x, mask=am)
    elif chunk == 0:
        r = (pid - n_tok_blocks).to(tl.int64) * BLOCK + offs
        m = r < n_rows
        nns = tl.where(tl.load(samples_ptr + r, mask=m, other=0) != 0, tl.load(nn_ptr + r, mask=m, other=0), 0)
        tl.store(nns_out + r, nns, mask=m)


def path_perm(ids: torch.Tensor, aux: torch.Tensor, row_first: torch.Tensor, num_new: torch.Tensor,
              row_samples: torch.Tensor, num_drafts: torch.Tensor, path: torch.Tensor, tok_row: torch.Tensor,
              tok_col: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """tree_layout.path_perm_reference in one launch (ids [T], aux [T, A] (unit column stride), row_first / num_new
    / row_samples / num_drafts [B], path [B, D+1] (unit column stride), tok_row / tok_col [T])."""
    t, b, width = ids.shape[0], row_first.shape[0], aux.shape[1]
    nns = torch.empty(b, dtype=num_new.dtype, device=ids.device)
    perm = torch.empty(t, dtype=torch.int64, device=ids.device)
    ids_c = torch.empty_like(ids)
    aux_c = torch.empty(t, width, dtype=aux.dtype, device=aux.device)
    block, block_a = 32, min(triton.next_power_of_2(max(width, 16)), 128)  # tiles of <= 4K aux elements
    grid = (triton.cdiv(t, block) + triton.cdiv(b, block), triton.cdiv(width, block_a))
    if grid[0] and grid[1]:
        p = path if path.stride(-1) == 1 else path.contiguous()
        x = aux if aux.stride(-1) == 1 else aux.contiguous()
        _path_perm_kernel[grid](ids.contiguous(), x, x.stride(0), row_first.contiguous(), num_new.contiguous(),
                                row_samples.contiguous(), num_drafts.contiguous(), p, p.stride(0),
                                tok_row.contiguous(), tok_col.contiguous(), nns, perm, ids_c, aux_c, t, b, width,
                                D=p.shape[1] - 1, BLOCK=block, BLOCK_A=block_a, num_warps=4, **pdl.args(ids))
    return nns, perm, ids_c, aux_c
