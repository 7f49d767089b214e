"""The draft-tree step's small ops behind one interface: the target's node rows (every per-node-row metadata
tensor of a verify step), the tree's growth (the head's children of each frontier node into the candidate buffers,
each level's frontier with its head call's inputs and metadata), the final rerank, the trees' slot rows, the
greedy / coupled verification walk and the accepted path's KV compaction. `reference` runs the plain torch of
tree_layout.py, draft_tree.py, kernels/topk/reference.py, sampling/tree_verify.py and the `*_reference`
functions here; `triton` runs each as one launch (tree_layout_kernels.py, tree_kernels.py,
kernels/topk/triton_topk.py), bit-equal. An engine takes the implementation named like its fused-ops backend, as
the step's bookkeeping ops (step_ops.py): 'triton' on CUDA, 'reference' on the CPU unless chosen otherwise.

Every method syncs nothing with the host and keeps shapes fixed by its inputs: CUDA-graph capturable.
"""

from __future__ import annotations

from typing import Protocol

import torch

from m3eagle.engine import draft_tree
from m3eagle.engine.pool_table import PoolTable
from m3eagle.engine.tree_layout import Frontier, NodeRows, frontier_reference, node_rows_reference, path_perm_reference
from m3eagle.kernels.attention.metadata import AttnMetadata, slots_for_positions
from m3eagle.sampling.tree_verify import walk_and_emit


def compact_reference(pools: list[torch.Tensor], page_table: torch.Tensor, page_size: int, p0: torch.Tensor,
                      path: torch.Tensor, num_new: torch.Tensor) -> None:
    """Accepted node path[j] (storage position p0 + path[j]) -> position p0 + j, j = 1..num_new - 1, in every
    pool [S, ...] (K, V, index-K). page_table [B, W], p0 [B], path [B, D+1], num_new [B]. Sources are read
    before any write; other entries copy a slot onto itself."""
    b, d1 = path.shape
    j = torch.arange(1, d1, device=path.device)  # [D]
    ok = (j[None, :] < num_new[:, None]) & (path[:, 1:] > 0)  # [B, D]
    rows = torch.arange(b, device=path.device)[:, None].expand(b, d1 - 1)
    dst = slots_for_positions(page_table, rows, p0[:, None] + j, page_size)
    src = slots_for_positions(page_table, rows, p0[:, None] + path[:, 1:], page_size)
    dst, src = dst.reshape(-1), torch.where(ok, src, dst).reshape(-1)
    for pool in pools:
        pool.index_copy_(0, dst, pool[src])


def finish_reference(scores: torch.Tensor, cand_parent: torch.Tensor, cand_tok: torch.Tensor, d2t: torch.Tensor,
                     cand_depth: torch.Tensor, nodes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The grown tree's last step: the `nodes` best of M candidates in score order (draft_tree.rerank), as
    stored nodes. scores / cand_parent / cand_tok [B, M] (cumulative score, parent candidate (-1: the root),
    draft id), d2t [Vd] (draft id -> target id offset), cand_depth [M] -> (tokens [B, N] target ids, parents
    [B, N] storage index, depths [B, N])."""
    sel, parents = draft_tree.rerank(scores, cand_parent, nodes, score_order=True)  # [B, N] each
    tok = cand_tok.gather(1, sel)
    return tok + d2t[tok], parents, cand_depth[sel]


def store_reference(slot: torch.Tensor, trees: tuple[torch.Tensor, ...], bufs: tuple[torch.Tensor, ...],
                    held: torch.Tensor) -> None:
    """The grown trees (tokens, parents, depths [B, n], n <= N) into the first n columns of rows slot [B] of the
    slot buffers (slot_drafts, slot_parents, slot_depths [S+1, N]) the next step reads, and n into held [S+1]
    (the nodes each slot's tree holds: the columns past it are stale). Rows that sample nothing share the dump
    slot."""
    n = trees[0].shape[1]
    for buf, x in zip(bufs, trees):
        buf[:, :n].index_copy_(0, slot, x)
    held.index_fill_(0, slot, n)


def expand_reference(parent_scores: torch.Tensor, logp: torch.Tensor, k: int, score_out: torch.Tensor,
                     tok_out: torch.Tensor) -> None:
    """draft_tree.expand into the candidate buffers' columns: score_out / tok_out [B, F*k] views."""
    tok, score = draft_tree.expand(parent_scores, logp, k)
    score_out.copy_(score)
    tok_out.copy_(tok)


class TreeOps(Protocol):
    name: str

    def best(self, scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """draft_tree.best: the k largest of scores [..., M], ties to the lower index -> (values, indices)."""
        ...

    def expand(self, parent_scores: torch.Tensor, logp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """draft_tree.expand: each frontier node's k best children -> (draft ids [B, F*k], scores [B, F*k])."""
        ...

    def walk(self, greedy_tok: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor,
             max_depth: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tree_verify.walk_and_emit: the greedy walk -> (emitted [B, width], num_new [B], path [B, D+1])."""
        ...

    def expand_into(self, parent_scores: torch.Tensor, logp: torch.Tensor, k: int, score_out: torch.Tensor,
                    tok_out: torch.Tensor) -> None:
        """expand_reference: each frontier node's k best children into the candidate buffers' columns."""
        ...

    def frontier(self, prev: Frontier | None, cand_score: torch.Tensor, cand_tok: torch.Tensor,
                 cand_parent: torch.Tensor, h_next: torch.Tensor, d2t: torch.Tensor, base: torch.Tensor,
                 page_table: torch.Tensor, level: int, k: int, scratch: tuple[int, int], row_ids: torch.Tensor,
                 frontier_cols: torch.Tensor) -> Frontier:
        """tree_layout.frontier_reference: the frontier of depth `level` and its head call's inputs."""
        ...

    def finish(self, scores: torch.Tensor, cand_parent: torch.Tensor, cand_tok: torch.Tensor, d2t: torch.Tensor,
               cand_depth: torch.Tensor, nodes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """finish_reference: the rerank -> (tokens [B, N] target ids, parents [B, N], depths [B, N])."""
        ...

    def store(self, slot: torch.Tensor, trees: tuple[torch.Tensor, ...], bufs: tuple[torch.Tensor, ...],
              held: torch.Tensor) -> None:
        """store_reference: the grown trees into their slot rows, their node count into held."""
        ...

    def compact(self, pools: PoolTable, page_table: torch.Tensor, page_size: int, p0: torch.Tensor,
                path: torch.Tensor, num_new: torch.Tensor) -> None:
        """compact_reference over the pools of `pools`."""
        ...

    def node_rows(self, meta: AttnMetadata, ids: torch.Tensor, slot_parents: torch.Tensor, slot_depths: torch.Tensor,
                  row_slot: torch.Tensor, row_first: torch.Tensor, num_drafts: torch.Tensor, width: int,
                  max_depth: int, uniform: bool, cols: torch.Tensor, row_ids: torch.Tensor,
                  row_true: torch.Tensor, held: torch.Tensor) -> NodeRows:
        """tree_layout.node_rows_reference: every per-node-row metadata tensor of a verify step."""
        ...

    def path_perm(self, ids: torch.Tensor, aux: torch.Tensor, row_first: torch.Tensor, num_new: torch.Tensor,
                  row_samples: torch.Tensor, num_drafts: torch.Tensor, path: torch.Tensor, tok_row: torch.Tensor,
                  tok_col: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """tree_layout.path_perm_reference -> (num_new of sampling rows [B], perm [T], ids[perm] [T], aux[perm])."""
        ...


class ReferenceTreeOps:
    """The plain torch ops: the CPU path and the oracle. Stateless."""

    name = "reference"

    def best(self, scores, k):
        return draft_tree.best(scores, k)

    def expand(self, parent_scores, logp, k):
        return draft_tree.expand(parent_scores, logp, k)

    def walk(self, greedy_tok, tokens, parents, num_nodes, max_depth, width):
        return walk_and_emit(greedy_tok, tokens, parents, num_nodes, max_depth, width)

    def expand_into(self, parent_scores, logp, k, score_out, tok_out):
        expand_reference(parent_scores, logp, k, score_out, tok_out)

    def frontier(self, prev, cand_score, cand_tok, cand_parent, h_next, d2t, base, page_table, level, k, scratch,
                 row_ids, frontier_cols):
        return frontier_reference(prev, cand_score, cand_tok, cand_parent, h_next, d2t, base, page_table, level, k,
                                  scratch, row_ids, frontier_cols, draft_tree.best)

    def finish(self, scores, cand_parent, cand_tok, d2t, cand_depth, nodes):
        return finish_reference(scores, cand_parent, cand_tok, d2t, cand_depth, nodes)

    def store(self, slot, trees, bufs, held):
        store_reference(slot, trees, bufs, held)

    def compact(self, pools, page_table, page_size, p0, path, num_new):
        compact_reference(pools.pools, page_table, page_size, p0, path, num_new)

    def node_rows(self, meta, ids, slot_parents, slot_depths, row_slot, row_first, num_drafts, width, max_depth,
                  uniform, cols, row_ids, row_true, held):
        return node_rows_reference(meta, ids, slot_parents, slot_depths, row_slot, row_first, num_drafts, width,
                                   max_depth, uniform, cols, row_ids, row_true, held)

    def path_perm(self, ids, aux, row_first, num_new, row_samples, num_drafts, path, tok_row, tok_col):
        return path_perm_reference(ids, aux, row_first, num_new, row_samples, num_drafts, path, tok_row, tok_col)


class TritonTreeOps:
    """Each op as one Triton launch. Stateless; triton is imported when this is built."""

    name = "triton"

    def __init__(self) -> None:
        # these import triton: only when an engine asks for this backend
        from m3eagle.engine import tree_kernels, tree_layout_kernels
        from m3eagle.kernels.topk import triton_topk

        self._topk, self._k, self._lay = triton_topk, tree_kernels, tree_layout_kernels

    def best(self, scores, k):
        if scores.dtype == torch.float64 or (scores.shape[-1] > 1024 and k > self._topk.MAX_DEPTH):
            return draft_tree.best(scores, k)  # outside the kernel's range: the reference, same order
        return self._topk.best(scores, k)

    def expand(self, parent_scores, logp, k):
        if logp.dtype != torch.float32 or parent_scores.dtype != torch.float32 or k > self._topk.MAX_DEPTH:
            return draft_tree.expand(parent_scores, logp, k)  # the reference's dtype rules: fp32 sums only here
        score, tok = self._topk.best(logp, k, add=parent_scores)  # [B, F, k] each: parent + log q in one launch
        return tok.flatten(1), score.flatten(1)

    def walk(self, greedy_tok, tokens, parents, num_nodes, max_depth, width):
        return self._k.walk_and_emit(greedy_tok, tokens, parents, num_nodes, max_depth, width)

    def expand_into(self, parent_scores, logp, k, score_out, tok_out):
        b, f = logp.shape[:2]
        if (logp.dtype != torch.float32 or parent_scores.dtype != torch.float32 or k > self._topk.MAX_DEPTH
                or score_out.dtype != torch.float32 or tok_out.dtype != torch.int64):
            expand_reference(parent_scores, logp, k, score_out, tok_out)  # the reference's dtype rules
        else:  # parent + log q straight into the buffers, in one launch
            self._topk.best(logp, k, add=parent_scores, out=(score_out.view(b, f, k), tok_out.view(b, f, k)))

    def frontier(self, prev, cand_score, cand_tok, cand_parent, h_next, d2t, base, page_table, level, k, scratch,
                 row_ids, frontier_cols):
        if cand_score.dtype == torch.float64:  # the keys are fp32's: the reference, same order
            return frontier_reference(prev, cand_score, cand_tok, cand_parent, h_next, d2t, base, page_table, level,
                                      k, scratch, row_ids, frontier_cols, draft_tree.best)
        return self._lay.frontier(prev, cand_score, cand_tok, cand_parent, h_next, d2t, base, page_table, level, k,
                                  scratch)

    def finish(self, scores, cand_parent, cand_tok, d2t, cand_depth, nodes):
        if scores.dtype == torch.float64 or scores.shape[1] > 1024:  # past one block: the reference
            return finish_reference(scores, cand_parent, cand_tok, d2t, cand_depth, nodes)
        return self._k.finish(scores, cand_parent, cand_tok, d2t, cand_depth, nodes)

    def store(self, slot, trees, bufs, held):
        if len({x.dtype for x in trees + bufs + (held,)}) != 1 or len({x.stride() for x in trees}) != 1 or \
                len({x.stride() for x in bufs}) != 1:
            store_reference(slot, trees, bufs, held)  # the kernel copies int rows of one layout
        else:
            self._lay.store(slot, trees, bufs, held)

    def compact(self, pools, page_table, page_size, p0, path, num_new):
        if not pools.current():
            compact_reference(pools.pools, page_table, page_size, p0, path, num_new)  # rows not word-copyable
        else:
            self._k.compact(pools, page_table, page_size, p0, path, num_new)

    def node_rows(self, meta, ids, slot_parents, slot_depths, row_slot, row_first, num_drafts, width, max_depth,
                  uniform, cols, row_ids, row_true, held):
        return self._lay.node_rows(meta, ids, slot_parents, slot_depths, row_slot, row_first, num_drafts, width, max_depth,
                                   uniform, held)

    def path_perm(self, ids, aux, row_first, num_new, row_samples, num_drafts, path, tok_row, tok_col):
        return self._lay.path_perm(ids, aux, row_first, num_new, row_samples, num_drafts, path, tok_row, tok_col)


def create(name: str) -> TreeOps:
    """The tree ops named like an engine's fused-ops backend ('triton' or 'reference'; 'batch_invariant' takes
    the triton kernels: each row's answer is computed by one program alone, the same bits for any batch)."""
    if name in ("triton", "batch_invariant"):
        return TritonTreeOps()
    if name == "reference":
        return ReferenceTreeOps()
    raise ValueError(f"tree ops {name!r} are unknown; choose 'reference' or 'triton'")
