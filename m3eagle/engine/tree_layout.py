"""The draft-tree step's layout in plain torch: the target's node rows (every per-node-row metadata tensor of a
verify step), each growth level's frontier (the head call's inputs and metadata over the K frontier nodes of
every row) and the permutation that lays the accepted path out as a verify row. These are the reference (CPU)
implementations of tree_ops.py's `node_rows`, `frontier` and `path_perm`; the Triton kernels that equal them
live in tree_layout_kernels.py (tests/engine/test_tree_layout.py holds them bit-equal).

Everything is device arithmetic on shapes fixed by host ints: no host sync, CUDA-graph capturable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from m3eagle.engine.draft_tree import ancestors, full_tree
from m3eagle.engine.step_reference import sample_positions
from m3eagle.kernels.attention.metadata import AttnMetadata, slots_for_positions


class NodeRows(NamedTuple):
    """A tree step's node rows: every step row b becomes w + 1 sub-rows (b, j), index b * (w + 1) + j."""

    parents: torch.Tensor  # [B, w+1] storage index of each node's parent (root: itself, 0)
    depths: torch.Tensor  # [B, w+1] (root: 0)
    anc: torch.Tensor  # [B, w+1, D+1] draft_tree.ancestors
    p0: torch.Tensor  # [B] position of each row's first token (a tree row's root)
    positions: torch.Tensor  # [T] RoPE / causal position of every token (depth-based in tree rows)
    q_lens: torch.Tensor  # [B(w+1)] tokens per sub-row
    kv_lens: torch.Tensor  # [B(w+1)]
    page_table: torch.Tensor  # [B(w+1), P] each sub-row's step row's
    tok_row: torch.Tensor  # [T] sub-row of every token
    tok_col: torch.Tensor  # [T] column of every token in its sub-row
    q_index: torch.Tensor  # [B(w+1), Qmax'] flat token of each padded query (0 for padding)
    q_valid: torch.Tensor  # [B(w+1), Qmax'] bool
    tail_start: torch.Tensor  # [B(w+1)] first key position read through tail_slots (max_kv: none)
    tail_slots: torch.Tensor  # [B(w+1), D] cache slot of node j's ancestor at depth 1..D
    # where the step samples (step_reference.sample_positions over `positions`; absent from node_rows_from_trees)
    sample_idx: torch.Tensor | None = None  # [B, w+1] flat token of each node's logits
    node_pos: torch.Tensor | None = None  # [B, w+1] its position
    drafts_in: torch.Tensor | None = None  # [B, w] the row's drafts as input ids, 0 past num_drafts
    num_nodes: torch.Tensor | None = None  # [B] nodes each row verifies: min(num_drafts, held[row_slot])


def node_rows_reference(meta: AttnMetadata, ids: torch.Tensor, slot_parents: torch.Tensor, slot_depths: torch.Tensor,
                        row_slot: torch.Tensor, row_first: torch.Tensor, num_drafts: torch.Tensor, width: int,
                        max_depth: int, uniform: bool, cols: torch.Tensor, row_ids: torch.Tensor,
                        row_true: torch.Tensor, held: torch.Tensor) -> NodeRows:
    """The node rows of a verify step of B rows and T tokens (w = `width`, the step's verify width; D = max_depth).
    A tree row's sub-row j is node j alone (position p0 + depth(j), keys: the committed context, then its ancestors
    at their depth positions through the tail override), and empty past the row's own tokens (a row verifying
    fewer nodes); another row is sub-row (b, 0) whole, its other sub-rows empty. With `uniform` (host: every row is
    w + 1 tokens wide) every row is split, prompt-free rows into one-token causal rows, so the widest sub-row is
    one token.

    meta: the step's metadata (its q_lens, kv_lens, page_table, tok_row / tok_col / positions, max_q, max_kv);
    ids [T] the step's input ids; slot_parents / slot_depths [S+1, N] the stored trees, row_slot / row_first /
    num_drafts [B]; cols [>= max(w+1, D)] and row_ids [B] aranges, row_true [B] all true (constants made once);
    held [S+1] the nodes each slot's tree holds (a narrow step's chain: D < N; the columns past it are stale)."""
    parents, depths = full_tree(slot_parents[row_slot, :width], slot_depths[row_slot, :width])  # [B, w+1]
    anc = ancestors(parents, depths, max_depth)  # [B, w+1, D+1]
    lay = node_rows_from_trees(meta, parents, depths, anc, meta.kv_lens - meta.q_lens, row_first, num_drafts, width,
                               uniform, cols, row_ids, row_true)
    sample_idx, node_pos, drafts_in = sample_positions(row_first, meta.q_lens, num_drafts, lay.positions, ids, width)
    return lay._replace(sample_idx=sample_idx, node_pos=node_pos, drafts_in=drafts_in,
                        num_nodes=torch.minimum(num_drafts, held[row_slot]))


def node_rows_from_trees(meta: AttnMetadata, parents: torch.Tensor, depths: torch.Tensor, anc: torch.Tensor,
                         p0: torch.Tensor, row_first: torch.Tensor, num_drafts: torch.Tensor, width: int, uniform: bool,
                         cols: torch.Tensor, row_ids: torch.Tensor, row_true: torch.Tensor) -> NodeRows:
    """node_rows_reference from the trees themselves: parents / depths [B, w+1] (draft_tree.full_tree), anc
    [B, w+1, D+1] (draft_tree.ancestors), p0 [B] each row's first position."""
    q_lens, kv_lens, page_table, page_size = meta.q_lens, meta.kv_lens, meta.page_table, meta.page_size
    tok_row, tok_col, positions, max_kv, max_q = meta.tok_row, meta.tok_col, meta.positions, meta.max_kv, meta.max_q
    b, n1, t = depths.shape[0], width + 1, tok_row.shape[0]
    is_tree = num_drafts > 0  # [B]
    split = row_true if uniform else is_tree  # [B] rows cut into one-token sub-rows
    j = cols[:n1]  # [w+1]
    tr, tc = tok_row, tok_col  # [T]
    t_split = split[tr]
    tok_depth = depths[tr, tc.clamp(max=n1 - 1)]
    tpos = torch.where(is_tree[tr], p0[tr] + tok_depth, positions)  # [T]
    # per sub-row [B, w+1]: tokens, first flat token, kv_len
    q_sub = torch.where(split[:, None], (j < q_lens[:, None]).long(), torch.where(j == 0, q_lens[:, None], 0))
    first = row_first[:, None] + torch.where(split[:, None], j, 0)
    own_pos = tpos[first.clamp(max=t - 1)]  # a split sub-row's one token
    kv = torch.where(split[:, None] & (q_sub > 0), own_pos + 1, kv_lens[:, None])  # empty: the row's
    mq = 1 if uniform else max_q
    c = cols[:mq] if mq <= n1 else torch.arange(mq, device=p0.device)
    q_valid = c[None, :] < q_sub.reshape(-1, 1)  # [B(w+1), Qmax']
    q_index = torch.where(q_valid, first.reshape(-1, 1) + c[None, :], 0)
    # node j's virtual positions p0 + 1 .. p0 + depth(j) hold its ancestors at depths 1 .. depth(j)
    tail = slots_for_positions(page_table, row_ids[:, None, None], p0[:, None, None] + anc[:, :, 1:],
                               page_size)  # [B, w+1, D]
    tail_start = torch.where(is_tree, p0 + 1, max_kv)  # [B]: other rows keep their page table
    return NodeRows(parents, depths, anc, p0, tpos, q_sub.reshape(-1), kv.reshape(-1),
                    page_table.repeat_interleave(n1, 0), tr * n1 + torch.where(t_split, tc, 0),
                    torch.where(t_split, 0, tc), q_index, q_valid, tail_start.repeat_interleave(n1),
                    tail.reshape(b * n1, -1))


class Frontier(NamedTuple):
    """The K frontier nodes of depth `level` of every row (B rows): what the head's call over them reads."""

    score: torch.Tensor  # [B, K] cumulative score of each frontier node
    cand: torch.Tensor  # [B, K] its candidate index
    tok: torch.Tensor  # [B, K] its draft id
    par: torch.Tensor  # [B, K] its parent's frontier index (0 under the root)
    ids: torch.Tensor  # [B*K] its target id: the head's input
    hidden: torch.Tensor  # [B*K, H] its parent's h_next: the head's input
    positions: torch.Tensor  # [B*K] base + level
    kv_lens: torch.Tensor  # [B*K] positions + 1
    slots: torch.Tensor  # [B*K, level] scratch slot of its ancestor at depth 1..level (itself last)
    page_table: torch.Tensor  # [B*K, P] its step row's
    tail_start: torch.Tensor  # [B*K] base + 1: keys past the committed context read `slots`


def frontier_reference(prev: Frontier | None, cand_score: torch.Tensor, cand_tok: torch.Tensor,
                       cand_parent: torch.Tensor, h_next: torch.Tensor, d2t: torch.Tensor, base: torch.Tensor,
                       page_table: torch.Tensor, level: int, k: int, scratch: tuple[int, int],
                       row_ids: torch.Tensor, frontier_cols: torch.Tensor,
                       best: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]) -> Frontier:
    """The frontier of depth `level` (1..D-1) from the candidates made so far, and the parents of the K*K
    candidates its expansion makes next. Level 1: the root's K children (candidates 0..K-1, in their order);
    level l > 1: the K best of the previous expansion's K*K (candidates K + (l-2)K^2.., best(): ties to the lower
    index).

    prev: level - 1's frontier (None at level 1); cand_score / cand_tok / cand_parent [B, M] the step's candidate
    buffers (cand_parent is written: the root's children -1 at level 1, the next expansion's K*K); h_next [B, H]
    (level 1: the root's) or [B*K, H] (the previous frontier's); d2t [Vd]; base [B] the position of each row's
    last accepted token; page_table [B, P]; scratch = (first scratch slot, scratch slots per row): row b's
    frontier nodes of depth d keep their K/V at slots first + b * per_row + (d - 1) * K + f; row_ids [B] /
    frontier_cols [K] aranges."""
    b, hd = cand_score.shape[0], h_next.shape[-1]
    cols = frontier_cols[None, :]  # [1, K]
    first = scratch[0] + row_ids * scratch[1]  # [B] row b's scratch slots
    if prev is None:
        score, tok = cand_score[:, :k], cand_tok[:, :k]  # [B, K]
        cand, par = cols.expand(b, k), torch.zeros_like(tok)
        cand_parent[:, :k] = -1
        hidden = h_next[:, None].expand(b, k, hd)
        slots = (first[:, None] + cols)[..., None]  # [B, K, 1]
        rows = row_ids.repeat_interleave(k)  # [B*K]
        pt, tail_start = page_table[rows], base[rows] + 1
    else:
        start = k + (level - 2) * k * k
        score, idx = best(cand_score[:, start:start + k * k], k)  # [B, K]
        tok = cand_tok[:, start:start + k * k].gather(1, idx)
        cand, par = start + idx, idx // k
        hidden = h_next.view(b, k, hd).gather(1, par[..., None].expand(-1, -1, hd))
        up = prev.slots.view(b, k, level - 1).gather(1, par[..., None].expand(-1, -1, level - 1))
        slots = torch.cat([up, (first[:, None] + (level - 1) * k + cols)[..., None]], -1)  # [B, K, level]
        pt, tail_start = prev.page_table, prev.tail_start
    nxt = k + (level - 1) * k * k
    cand_parent[:, nxt:nxt + k * k] = cand.repeat_interleave(k, 1)
    pos = (base[:, None] + level).expand(b, k).reshape(-1)  # [B*K]
    return Frontier(score, cand, tok, par, (tok + d2t[tok]).reshape(-1), hidden.reshape(b * k, hd), pos, pos + 1,
                    slots.reshape(b * k, level), pt, tail_start)


def path_perm_reference(ids: torch.Tensor, aux: torch.Tensor, row_first: torch.Tensor, num_new: torch.Tensor,
                        row_samples: torch.Tensor, num_drafts: torch.Tensor, path: torch.Tensor, tok_row: torch.Tensor,
                        tok_col: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The verify rows as if the accepted path had been the row: flat token row_first + j takes node path[j]'s
    place, j = 1..num_new - 1, in tree rows that sample. ids [T]; aux [T, A] (the target's tapped hidden states);
    row_first / num_new / row_samples / num_drafts [B]; path [B, D+1]; tok_row / tok_col [T] (a kernel's per-token
    view of the rows) -> (num_new of the rows that sample, 0 elsewhere [B], perm [T] the flat token whose ids / aux
    move to each token, ids[perm] [T], aux[perm] [T, A])."""
    t = ids.shape[0]
    num_new_s = torch.where(row_samples, num_new, 0)  # [B]
    perm = torch.arange(t, device=ids.device)
    cols = torch.arange(1, path.shape[1], device=ids.device)  # [D]
    moved = (cols[None, :] < num_new_s[:, None]) & (num_drafts[:, None] > 0)  # [B, D]
    dump = torch.full_like(path[:, 1:], t)
    perm = torch.cat([perm, perm.new_zeros(1)])
    perm.index_put_((torch.where(moved, row_first[:, None] + cols, dump),),
                    torch.where(moved, row_first[:, None] + path[:, 1:], 0))
    perm = perm[:t]
    return num_new_s, perm, ids[perm], aux[perm]
