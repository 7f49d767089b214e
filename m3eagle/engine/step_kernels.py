"""The step's own bookkeeping on Triton, one launch each, exact (int64): the overlap scheduler's input
correction (ids, KV lengths, positions, slots), the sampled rows' positions, the greedy acceptance rule and
the commit of a step's outputs into the slot buffers the next step reads. `step_reference.py` holds the
plain torch versions they equal (tests/engine/test_step_ops.py).

    _step_inputs_kernel overlap_ids_kv + derive_positions_and_slots     25 (K=0) / 46 (K=3) -> 1
                        (or the positions and slots alone)              9 -> 1
    _sample_pos_kernel  sample_positions (sampled tokens, positions, drafts)  8 (K=0) / 13 (K>0) -> 1
    _commit_kernel      commit_outputs (slot writes; the drafter's inputs)  6 (no draft) / 18 (draft) -> 1
                        (+ the draft steps' cache slots: K-1 positions_slots launches -> 0)
    _accept_kernel      greedy_accept (after the argmax)                   3 (K=0) / 8 (K=3) -> 1

Every launcher reads shapes and strides only (no host sync), so a step using them is CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3eagle.kernels import pdl
from m3eagle.kernels.pdl import pdl_wait


@triton.jit
def _cache_slot(pt_ptr, row, pos, stride_pt, table_w, page_size, m):
    """Cache slot of (row, position) pairs (any matching shapes, int64): the page in column floor(pos /
    page_size) of the row's page table, clamped to the table (attention.metadata.slots_for_positions)."""
    pc = pos // page_size
    pc = tl.where((pc * page_size != pos) & (pos < 0), pc - 1, pc)  # floor, not truncation
    page = tl.load(pt_ptr + row * stride_pt + tl.minimum(tl.maximum(pc, 0), table_w - 1), mask=m, other=0)
    return page * page_size + (pos - pc * page_size)


@triton.jit(do_not_specialize=["n_tok", "n_rows"])  # per-step counts: one compiled variant
def _step_inputs_kernel(ids_ptr, kv_ptr, q_ptr, tok_row_ptr, tok_col_ptr, pt_ptr, stride_pt, table_w, page_size,
                        slot_ptr, gather_ptr, nd_ptr, correct_ptr, chained_ptr, st_ptr, stride_st, nn_ptr, dev_ptr,
                        sd_ptr, stride_sd, ids_out, kv_out, pos_out, slots_out, n_tok, n_rows,
                        K: tl.constexpr, OVERLAP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Programs [0, cdiv(T, BLOCK)) take BLOCK tokens each: the corrected kv_len of the token's row, its
    position (kv_len - q_len + col) and cache slot (floor division as torch's), and with OVERLAP its input
    id (slot's last token at col 0 of a gather row, its drafts at cols 1..num_drafts). The programs after
    them write kv_out for BLOCK rows each. All int64: bit-exact with the reference."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    pid = tl.program_id(0)
    n_tok_blocks = tl.cdiv(n_tok, BLOCK)
    offs = tl.arange(0, BLOCK)
    if pid < n_tok_blocks:
        t = pid * BLOCK + offs
        m = t < n_tok
        row = tl.load(tok_row_ptr + t, mask=m, other=0)
        col = tl.load(tok_col_ptr + t, mask=m, other=0)
        kv = tl.load(kv_ptr + row, mask=m, other=0)
        if OVERLAP:
            slot = tl.load(slot_ptr + row, mask=m, other=0)
            nn = tl.load(nn_ptr + slot, mask=m, other=1)
            correct = (tl.load(correct_ptr + row, mask=m, other=0) != 0) & (tl.load(chained_ptr + row, mask=m,
                                                                                    other=0) == 0)
            kv = kv + tl.where(correct, tl.load(dev_ptr + slot, mask=m & correct, other=0), 0)
        pos = kv - tl.load(q_ptr + row, mask=m, other=0) + col
        tl.store(pos_out + t, pos, mask=m)
        tl.store(slots_out + t, _cache_slot(pt_ptr, row, pos, stride_pt, table_w, page_size, m), mask=m)
        if OVERLAP:
            gather = tl.load(gather_ptr + row, mask=m, other=0) != 0
            nd = tl.load(nd_ptr + row, mask=m, other=0)
            last = tl.load(st_ptr + slot * stride_st + tl.maximum(nn - 1, 0), mask=m & gather & (col == 0), other=0)
            use_d = gather & (col >= 1) & (col <= nd) & (col <= K)
            draft = tl.load(sd_ptr + slot * stride_sd + tl.maximum(col - 1, 0), mask=m & use_d, other=0)
            tid = tl.load(ids_ptr + t, mask=m, other=0)
            tid = tl.where(gather & (col == 0), last, tl.where(use_d, draft, tid))
            tl.store(ids_out + t, tid, mask=m)
    else:
        r = (pid - n_tok_blocks) * BLOCK + offs
        m = r < n_rows
        kv = tl.load(kv_ptr + r, mask=m, other=0)
        if OVERLAP:
            slot = tl.load(slot_ptr + r, mask=m, other=0)
            correct = (tl.load(correct_ptr + r, mask=m, other=0) != 0) & (tl.load(chained_ptr + r, mask=m,
                                                                                  other=0) == 0)
            kv = kv + tl.where(correct, tl.load(dev_ptr + slot, mask=m & correct, other=0), 0)
        tl.store(kv_out + r, kv, mask=m)


@triton.jit(do_not_specialize=["n_rows"])
def _sample_pos_kernel(first_ptr, qlen_ptr, nd_ptr, pos_ptr, ids_ptr, idx_out, pos_out, drafts_out, n_rows,
                       K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_J: tl.constexpr, PDL: tl.constexpr):
    """BLOCK_R rows x (K + 1) columns: column j samples token min(last - num_drafts + j, last); draft j - 1
    is token min(first + j, last) when j <= num_drafts, else 0."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    j = tl.arange(0, BLOCK_J)
    rm = r < n_rows
    first = tl.load(first_ptr + r, mask=rm, other=0)
    last = first + tl.load(qlen_ptr + r, mask=rm, other=1) - 1
    nd = tl.load(nd_ptr + r, mask=rm, other=0)
    m = rm[:, None] & (j[None, :] <= K)
    idx = tl.minimum((last - nd)[:, None] + j[None, :], last[:, None])  # [BR, BJ]
    tl.store(idx_out + r[:, None] * (K + 1) + j[None, :], idx, mask=m)
    tl.store(pos_out + r[:, None] * (K + 1) + j[None, :], tl.load(pos_ptr + idx, mask=m, other=0), mask=m)
    if K > 0:
        dm = rm[:, None] & (j[None, :] >= 1) & (j[None, :] <= K)
        d_idx = tl.minimum(first[:, None] + j[None, :], last[:, None])
        tok = tl.load(ids_ptr + d_idx, mask=dm & (j[None, :] <= nd[:, None]), other=0)
        tl.store(drafts_out + r[:, None] * K + (j[None, :] - 1), tok, mask=dm)


def sample_positions(row_first: torch.Tensor, row_qlen: torch.Tensor, row_num_drafts: torch.Tensor,
                     positions: torch.Tensor, ids: torch.Tensor, k: int,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """reference.sample_positions in one launch (int64, exact)."""
    row_first, row_qlen, row_num_drafts, positions, ids = (
        x.contiguous() for x in (row_first, row_qlen, row_num_drafts, positions, ids))
    b, dev = row_first.shape[0], row_first.device
    idx = torch.empty(b, k + 1, dtype=torch.int64, device=dev)
    pos = torch.empty(b, k + 1, dtype=torch.int64, device=dev)
    drafts = torch.empty(b, k, dtype=ids.dtype, device=dev)
    if b:
        block_r = 32
        _sample_pos_kernel[(triton.cdiv(b, block_r),)](row_first, row_qlen, row_num_drafts, positions, ids, idx, pos,
                                                        drafts if k else idx, b, K=k, BLOCK_R=block_r,
                                                        BLOCK_J=triton.next_power_of_2(k + 1), num_warps=1, **pdl.args(ids))
    return idx, pos, drafts


@triton.jit(do_not_specialize=["n_rows", "n_tok"])
def _commit_kernel(new_ptr, nn_ptr, samples_ptr, slot_ptr, dump_slot, nd_ptr, first_ptr, qlen_ptr, next_ptr,
                   ids_ptr, pos_ptr, tok_row_ptr, st_ptr, stride_st, snn_ptr, sdev_ptr, chained_ptr, kv_ptr,
                   kv_out, chained_out, nn_out, s_out, last_out, shifted_out, at_out, pt_ptr, stride_pt, table_w,
                   page_size, at_slot_out, n_rows, n_tok,
                   K: tl.constexpr, DRAFT: tl.constexpr, CHAIN: tl.constexpr, SLOTS: tl.constexpr,
                   BLOCK: tl.constexpr, BLOCK_J: tl.constexpr, PDL: tl.constexpr):
    """Programs [0, cdiv(B, BLOCK)): BLOCK rows each -- masked count, slot writes (tokens, count, deviation),
    with CHAIN the advance of the step's kv_len / chained inputs, and with DRAFT the last accepted index
    and the at table (with SLOTS its cache slots, `_step_inputs_kernel`'s lookup). Programs after them
    (DRAFT only): BLOCK tokens of the shifted ids; a token that is
    its row's last accepted one takes the bonus (or next known) token. A row reads and writes only its own
    slot's deviation and its own input entries, so programs never race (the dump slot's writers aside)."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    pid = tl.program_id(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK)
    offs = tl.arange(0, BLOCK)
    if pid < n_row_blocks:
        r = pid * BLOCK + offs
        m = r < n_rows
        samples = tl.load(samples_ptr + r, mask=m, other=0) != 0
        nn = tl.where(samples, tl.load(nn_ptr + r, mask=m, other=0), 0)
        s = tl.where(samples, tl.load(slot_ptr + r, mask=m, other=0), dump_slot)
        nd = tl.load(nd_ptr + r, mask=m, other=0)
        tl.store(nn_out + r, nn, mask=m)
        tl.store(s_out + r, s, mask=m)
        j = tl.arange(0, BLOCK_J)
        jm = m[:, None] & (j[None, :] <= K)
        toks = tl.load(new_ptr + r[:, None] * (K + 1) + j[None, :], mask=jm, other=0)
        tl.store(st_ptr + s[:, None] * stride_st + j[None, :], toks, mask=jm)
        tl.store(snn_ptr + s, nn, mask=m)
        dev = nn - (nd + 1)
        if CHAIN:
            chained = tl.load(chained_ptr + r, mask=m, other=0) != 0
            slot = tl.load(slot_ptr + r, mask=m, other=0)
            dev += tl.load(sdev_ptr + slot, mask=m & chained, other=0)
            kv = tl.load(kv_ptr + r, mask=m, other=0)
            tl.store(kv_out + r, kv + nn, mask=m & samples)
            tl.store(chained_out + r, (chained | samples).to(tl.int1), mask=m)
        tl.store(sdev_ptr + s, dev, mask=m)
        if DRAFT:
            last = (tl.load(first_ptr + r, mask=m, other=0) + tl.load(qlen_ptr + r, mask=m, other=1) - 1 - nd
                    + tl.maximum(nn - 1, 0))
            tl.store(last_out + r, last, mask=m)
            pos = tl.load(pos_ptr + last, mask=m, other=0)
            at = pos[:, None] + j[None, :]  # [BLOCK, BLOCK_J]
            tl.store(at_out + j[None, :] * n_rows + r[:, None], at, mask=jm)
            if SLOTS:
                tl.store(at_slot_out + j[None, :] * n_rows + r[:, None],
                         _cache_slot(pt_ptr, r[:, None], at, stride_pt, table_w, page_size, jm), mask=jm)
    else:
        t = (pid - n_row_blocks) * BLOCK + offs
        m = t < n_tok
        tid = tl.load(ids_ptr + t + 1, mask=m & (t + 1 < n_tok), other=0)
        row = tl.load(tok_row_ptr + t, mask=m, other=0)
        samples = tl.load(samples_ptr + row, mask=m, other=0) != 0
        nn = tl.where(samples, tl.load(nn_ptr + row, mask=m, other=0), 0)
        acc = tl.maximum(nn - 1, 0)
        last = (tl.load(first_ptr + row, mask=m, other=0) + tl.load(qlen_ptr + row, mask=m, other=1) - 1
                - tl.load(nd_ptr + row, mask=m, other=0) + acc)
        hit = m & (t == last)
        bonus = tl.load(new_ptr + row * (K + 1) + acc, mask=hit & samples, other=0)
        nxt = tl.load(next_ptr + row, mask=hit & ~samples, other=0)
        tid = tl.where(hit, tl.where(samples, bonus, nxt), tid)
        tl.store(shifted_out + t, tid, mask=m)


def _unit_stride_error(x: torch.Tensor) -> torch.Tensor:
    # chain's tensors are written in place: a contiguous copy would take the writes away from the caller
    raise ValueError(f"commit_outputs(chain=...) needs unit-stride vectors, got stride {x.stride()}")


def commit_outputs(new_tokens: torch.Tensor, num_new: torch.Tensor, row_samples: torch.Tensor,
                   row_slot: torch.Tensor, dump_slot: int, row_num_drafts: torch.Tensor, row_first: torch.Tensor,
                   row_qlen: torch.Tensor, row_next_token: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
                   slot_tokens: torch.Tensor, slot_num_new: torch.Tensor, slot_dev: torch.Tensor, k: int,
                   draft: bool, tok_row: torch.Tensor | None = None, chain: tuple | None = None,
                   pages: tuple[torch.Tensor, int] | None = None) -> tuple[torch.Tensor, ...]:
    """reference.commit_outputs in one launch (int64, exact). `tok_row` [T] (the step's) is needed with
    `draft`. Slot buffers: [S+1, K+1] with unit inner stride, [S+1], [S+1]. `pages` = (page_table, page_size):
    the at table's cache slots too (the draft steps' slot mapping, in this launch instead of one per step)."""
    new_tokens, num_new, row_samples, row_slot, row_num_drafts, row_first, row_qlen, row_next_token = (
        x.contiguous() for x in (new_tokens, num_new, row_samples, row_slot, row_num_drafts, row_first, row_qlen,
                                 row_next_token))
    b, t, dev = num_new.shape[0], ids.shape[0], num_new.device
    nn_out, s_out = torch.empty_like(num_new), torch.empty_like(row_slot)
    if draft:
        if tok_row is None:
            raise ValueError("commit_outputs(draft=True) needs the step's tok_row")
        ids, positions, tok_row = ids.contiguous(), positions.contiguous(), tok_row.contiguous()
        last = torch.empty(b, dtype=torch.int64, device=dev)
        shifted = torch.empty_like(ids)
        at = torch.empty(k + 1, b, dtype=torch.int64, device=dev)
    else:
        last = shifted = at = None
        tok_row = num_new  # never read
    slots = draft and pages is not None
    at_slots = torch.empty_like(at) if slots else None
    pt = pages[0].contiguous() if slots else num_new  # num_new: never read (SLOTS=False)
    if chain is not None:  # (row_chained, kv_lens, kv_out, chained_out): the kernel steps them with unit stride
        chain_args = tuple(x if x.stride(0) == 1 else _unit_stride_error(x) for x in chain)
    else:
        chain_args = (num_new,) * 4  # never read (CHAIN=False)
    block = 64
    grid = triton.cdiv(b, block) + (triton.cdiv(t, block) if draft else 0)
    if b:
        _commit_kernel[(grid,)](new_tokens, num_new, row_samples, row_slot, dump_slot, row_num_drafts, row_first,
                                row_qlen, row_next_token, ids, positions, tok_row, slot_tokens, slot_tokens.stride(0),
                                slot_num_new, slot_dev, *chain_args, nn_out, s_out,
                                last if draft else nn_out, shifted if draft else nn_out, at if draft else nn_out,
                                pt, pt.stride(0), pt.shape[-1], pages[1] if slots else 1,
                                at_slots if slots else nn_out, b, t, K=k, DRAFT=draft, CHAIN=chain is not None,
                                SLOTS=slots, BLOCK=block, BLOCK_J=triton.next_power_of_2(k + 1),
                                num_warps=2, **pdl.args(new_tokens))
    return nn_out, s_out, last, shifted, at, at_slots


@triton.jit(do_not_specialize=["n_rows"])
def _accept_kernel(greedy_ptr, drafts_ptr, nd_ptr, out_ptr, n_rows, K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """BLOCK rows: 1 + the number of leading drafts equal to the argmax of the position before them."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = r < n_rows
    nd = tl.load(nd_ptr + r, mask=m, other=0)
    alive = m
    n = tl.full([BLOCK], 1, tl.int64)
    for j in tl.static_range(K):
        d = tl.load(drafts_ptr + r * K + j, mask=m, other=0)
        g = tl.load(greedy_ptr + r * (K + 1) + j, mask=m, other=0)
        alive = alive & (d == g) & (j < nd)
        n = n + alive.to(tl.int64)
    tl.store(out_ptr + r, n, mask=m)


def greedy_accept(greedy_tok: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """reference.greedy_accept in one launch (int64, exact)."""
    greedy_tok, drafts, num_drafts = (x.contiguous() for x in (greedy_tok, drafts, num_drafts))
    b, k = drafts.shape
    out = torch.empty(b, dtype=torch.int64, device=drafts.device)
    if b:
        block = 64
        _accept_kernel[(triton.cdiv(b, block),)](greedy_tok, drafts, num_drafts, out, b, K=k, BLOCK=block,
                                                  num_warps=1, **pdl.args(drafts))
    return out


STEP_BLOCK = 128


def step_inputs(kv_lens: torch.Tensor, q_lens: torch.Tensor, tok_row: torch.Tensor, tok_col: torch.Tensor,
                page_table: torch.Tensor, page_size: int, overlap: tuple | None = None,
                ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [T] or None, kv_lens [B], positions [T], slots [T]). `overlap` = (input_ids, row_slot, row_first,
    row_gather, row_num_drafts, row_correct, row_chained, slot_tokens, slot_num_new, slot_dev, slot_drafts, k) adds
    reference.overlap_ids_kv's ids and length correction; None derives positions and slots from kv_lens as
    they are (then kv_lens comes back unchanged). Index tensors are int64, flags bool; slot buffers have unit
    inner stride."""
    # The kernel indexes every vector with unit stride (a no-op for the engine's carved views and rows).
    kv_lens, q_lens, tok_row, tok_col = (x.contiguous() for x in (kv_lens, q_lens, tok_row, tok_col))
    n_tok, n_rows = tok_row.shape[0], kv_lens.shape[0]
    dev = kv_lens.device
    pos = torch.empty(n_tok, dtype=torch.int64, device=dev)
    slots = torch.empty(n_tok, dtype=torch.int64, device=dev)
    pt = page_table if page_table.stride(-1) == 1 else page_table.contiguous()
    if overlap is None:  # positions and slots only: the overlap pointers are never read (OVERLAP=False)
        ids, kv_out, ids_in, k = None, kv_lens, kv_lens, 0
        rest = (kv_lens, kv_lens, kv_lens, kv_lens, kv_lens, kv_lens, 0, kv_lens, kv_lens, kv_lens, 0)
        grid = triton.cdiv(n_tok, STEP_BLOCK)
    else:
        ids_in, row_slot, _first, gather, nd, correct, chained, st, nn, dev_, sd, k = (
            x.contiguous() if isinstance(x, torch.Tensor) else x for x in overlap)
        ids, kv_out = torch.empty_like(ids_in), torch.empty_like(kv_lens)
        rest = (row_slot, gather, nd, correct, chained, st, st.stride(0), nn, dev_, sd, sd.stride(0))
        grid = triton.cdiv(n_tok, STEP_BLOCK) + triton.cdiv(n_rows, STEP_BLOCK)
    if grid:
        _step_inputs_kernel[(grid,)](ids_in, kv_lens, q_lens, tok_row, tok_col, pt, pt.stride(0), pt.shape[1],
                                     page_size, *rest, ids if ids is not None else pos, kv_out, pos, slots,
                                     n_tok, n_rows, K=k, OVERLAP=overlap is not None, BLOCK=STEP_BLOCK,
                                     num_warps=4, **pdl.args(kv_lens))
    return ids, kv_out, pos, slots


