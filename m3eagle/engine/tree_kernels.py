"""The draft-tree step's bookkeeping on Triton, one launch each, exact (int64 index arithmetic, copies): the
greedy / coupled verification walk with the emitted tokens, and the accepted path's KV compaction over every
pool, and the tree's final rerank. The plain torch versions they equal are sampling/tree_verify.walk_and_emit,
tree_ops.compact_reference and tree_ops.finish_reference (tests/engine/test_tree_kernels.py).

    _walk_kernel     greedy_walk + gather + pad_columns (D levels of ~11 ops)       ~46 (D = 3) -> 1
    _compact_kernel  _compact: slots of both ends, gather + index_copy_ per pool    2P + ~10 -> 1
    _finish_kernel   the rerank in score order + draft -> target ids + depths         ~24 -> 1

Every launcher reads shapes, strides and host ints only (no host sync): a step using them is CUDA-graph
capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3eagle.engine.pool_table import PoolTable
from m3eagle.engine.step_kernels import _cache_slot
from m3eagle.kernels import pdl
from m3eagle.kernels.pdl import pdl_wait
from m3eagle.kernels.topk.triton_topk import _NONE, score_keys


@triton.jit(do_not_specialize=["n", "width"])
def _walk_kernel(g_ptr, tok_ptr, par_ptr, nn_ptr, path_ptr, num_ptr, out_ptr, n, width, s_g, s_tok, s_par,
                 s_out, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, PDL: tl.constexpr):
    """Row b: from the root, D times, move to the first valid child (storage index < num_nodes[b]) whose token
    is g[b, current] while a move is possible. path[b, 0..D] (0 past the path), num_new[b] = moves + 1,
    out[b, j] = g[b, path[b, j]] for j <= D and 0 past it, j < width."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_N)
    nodes = tl.load(nn_ptr + b)
    valid = (j < n) & (j < nodes)
    tok = tl.load(tok_ptr + b * s_tok + j, mask=valid, other=0)
    par = tl.load(par_ptr + b * s_par + j, mask=valid, other=-1)
    g_row = g_ptr + b * s_g
    root_tok = tl.load(g_row)
    cur = tl.zeros([], tl.int64)
    alive = cur == 0
    moved = cur
    tl.store(path_ptr + b * (D + 1), cur)
    for d in tl.static_range(D):
        want = tl.load(g_row + cur)
        first = tl.min(tl.where(valid & (par == cur) & (tok == want), j, BLOCK_N), axis=0)  # siblings distinct
        alive = alive & (first < BLOCK_N)
        cur = tl.where(alive, first + 1, cur).to(tl.int64)
        step = tl.where(alive, cur, 0)
        moved += alive.to(tl.int64)
        tl.store(path_ptr + b * (D + 1) + d + 1, step)
        if d + 1 < width:
            tl.store(out_ptr + b * s_out + d + 1, tl.where(alive, tl.load(g_row + step), root_tok))
    tl.store(num_ptr + b, moved + 1)
    w = tl.arange(0, BLOCK_W)
    tl.store(out_ptr + b * s_out + w, tl.where(w == 0, root_tok, 0), mask=(w < width) & ((w == 0) | (w > D)))


def walk_and_emit(greedy_tok: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor,
                  max_depth: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tree_verify.walk_and_emit in one launch: greedy_tok [B, N+1], tokens / parents [B, N] (any row strides),
    num_nodes [B] -> (emitted [B, width], num_new [B], path [B, D+1])."""
    b, n = tokens.shape
    dev = tokens.device
    path = torch.empty(b, max_depth + 1, dtype=torch.int64, device=dev)
    num_new = torch.empty(b, dtype=torch.int64, device=dev)
    out = torch.empty(b, width, dtype=greedy_tok.dtype, device=dev)
    if b:
        g, tok, par = (x if x.stride(-1) == 1 else x.contiguous() for x in (greedy_tok, tokens, parents))
        nn = num_nodes.contiguous()
        _walk_kernel[(b,)](g, tok, par, nn, path, num_new, out, n, width, g.stride(0), tok.stride(0),
                           par.stride(0), out.stride(0), D=max_depth, BLOCK_N=triton.next_power_of_2(max(n, 2)),
                           BLOCK_W=triton.next_power_of_2(max(width, 2)), num_warps=1, **pdl.args(tok))
    return out, num_new, path


@triton.jit
def _compact_kernel(addr_ptr, words_ptr, stride_ptr, pt_ptr, stride_pt, table_w, page_size, p0_ptr, path_ptr,
                    num_ptr, s_path, D: tl.constexpr, WORD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr,
                    PDL: tl.constexpr):
    """Program (pool p, row b): for j = 1..D with j < num_new[b] and path[b, j] > 0, the pool's row at the
    slot of position p0 + path[b, j] -> the slot of p0 + j, all j of a BLOCK-word chunk at once (every read of
    the chunk before any write, as the reference's gather-then-copy; the chunks are disjoint words)."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    if WORD == 4:
        base = tl.load(addr_ptr + p).to(tl.pointer_type(tl.int32))
    elif WORD == 2:
        base = tl.load(addr_ptr + p).to(tl.pointer_type(tl.int16))
    else:
        base = tl.load(addr_ptr + p).to(tl.pointer_type(tl.int8))
    n_words = tl.load(words_ptr + p)
    stride = tl.load(stride_ptr + p)
    p0 = tl.load(p0_ptr + b)
    num = tl.load(num_ptr + b)
    offs = tl.arange(0, BLOCK)
    j = 1 + tl.arange(0, BLOCK_D).to(tl.int64)  # [BLOCK_D] path columns 1..D
    node = tl.load(path_ptr + b * s_path + j, mask=j <= D, other=0)
    ok = (j <= D) & (num > j) & (node > 0)
    dst = _cache_slot(pt_ptr, b, p0 + j, stride_pt, table_w, page_size, ok)
    src = _cache_slot(pt_ptr, b, p0 + node, stride_pt, table_w, page_size, ok)
    lim = tl.where(ok, n_words, 0)  # an entry not copied masks every word
    for c0 in range(0, n_words, BLOCK):
        w = c0 + offs
        m = w[None, :] < lim[:, None]  # [BLOCK_D, BLOCK]
        x = tl.load(base + src[:, None] * stride + w[None, :], mask=m)
        tl.store(base + dst[:, None] * stride + w[None, :], x, mask=m)


def compact(table: PoolTable, page_table: torch.Tensor, page_size: int, p0: torch.Tensor, path: torch.Tensor,
            num_new: torch.Tensor) -> None:
    """tree_ops.compact_reference in one launch over every pool of `table`: page_table [B, W], p0 [B],
    path [B, D+1], num_new [B]."""
    b, d1 = path.shape
    if b == 0:
        return
    pt = page_table if page_table.stride(-1) == 1 else page_table.contiguous()
    block_d = triton.next_power_of_2(max(d1 - 1, 1))
    block = min(max(4096 // block_d, 16), triton.next_power_of_2(max(table.max_words, 16)))  # a tile of <= 4K words
    _compact_kernel[(table.addrs.shape[0], b)](
        table.addrs, table.words, table.strides, pt, pt.stride(0), pt.shape[1], page_size, p0.contiguous(),
        path, num_new.contiguous(), path.stride(0), D=d1 - 1, WORD=table.word, BLOCK_D=block_d, BLOCK=block,
        num_warps=4 if block * block_d >= 512 else 1, **pdl.args(path))


@triton.jit(do_not_specialize=["m"])
def _finish_kernel(score_ptr, par_ptr, tok_ptr, d2t_ptr, depth_ptr, tok_out, par_out, dep_out, m, s_score, s_par,
                   s_tok, N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """Row b of M candidates: the N best by score (ties to the lower candidate; reference.best's keys), best
    first; for each, its target token (draft id + d2t[id]), its depth, and its parent's storage index (the
    parent candidate's place among the N + 1; 0 for the root or a parent not chosen)."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    b = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_M)
    keys = score_keys(tl.load(score_ptr + b * s_score + c, mask=c < m, other=0.0), c, m, c < m)  # [BLOCK_M]
    jn = tl.arange(0, BLOCK_N)
    sel = tl.zeros([BLOCK_N], tl.int64)
    for j in tl.static_range(N):
        top = tl.max(keys, axis=0)  # unique: one candidate leaves per round
        sel = tl.where(jn == j, (m - 1) - (top & 0xFFFFFFFF), sel)
        keys = tl.where(keys == top, _NONE, keys)
    nm = jn < N
    par_c = tl.load(par_ptr + b * s_par + sel, mask=nm, other=-1)  # [BLOCK_N] candidate index, -1 = root
    at = tl.sum(tl.where((sel[None, :] == par_c[:, None]) & nm[None, :], jn[None, :] + 1, 0), axis=1)
    tok = tl.load(tok_ptr + b * s_tok + sel, mask=nm, other=0)
    tok = tok + tl.load(d2t_ptr + tok, mask=nm, other=0)
    tl.store(tok_out + b * N + jn, tok, mask=nm)
    tl.store(par_out + b * N + jn, tl.where(par_c < 0, 0, at), mask=nm)
    tl.store(dep_out + b * N + jn, tl.load(depth_ptr + sel, mask=nm, other=0), mask=nm)


def finish(scores: torch.Tensor, cand_parent: torch.Tensor, cand_tok: torch.Tensor, d2t: torch.Tensor,
           cand_depth: torch.Tensor, nodes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tree_ops.finish_reference in one launch: scores / cand_parent / cand_tok [B, M] (unit column stride),
    d2t [Vd], cand_depth [M] -> (tokens [B, N] target ids, parents [B, N], depths [B, N])."""
    b, m = scores.shape
    dev = scores.device
    tok_dt = cand_tok.dtype if cand_tok.dtype == d2t.dtype else torch.promote_types(cand_tok.dtype, d2t.dtype)
    tokens = torch.empty(b, nodes, dtype=tok_dt, device=dev)
    parents = torch.empty(b, nodes, dtype=torch.int64, device=dev)
    depths = torch.empty(b, nodes, dtype=cand_depth.dtype, device=dev)
    if b:
        sc, par, tok = (x if x.stride(-1) == 1 else x.contiguous() for x in (scores, cand_parent, cand_tok))
        block_m = triton.next_power_of_2(max(m, 16))
        _finish_kernel[(b,)](sc, par, tok, d2t.contiguous(), cand_depth.contiguous(), tokens, parents, depths, m,
                             sc.stride(0), par.stride(0), tok.stride(0), N=nodes, BLOCK_M=block_m,
                             BLOCK_N=triton.next_power_of_2(max(nodes, 2)), num_warps=4 if block_m >= 512 else 1,
                             **pdl.args(sc))
    return tokens, parents, depths
