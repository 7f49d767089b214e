"""Verification of a draft tree: greedy walk and recursive rejection sampling over siblings, both lossless.

Row b carries a tree of n_b nodes (0 for rows that only sample): node i (1..N) holds token tokens[i-1]
and hangs under node parents[i-1] (0 = the root, the last emitted token); the target scored all N+1
nodes, node i's distribution predicting the token after it. The walk starts at the root:

Greedy:  accept the child whose token is argmax p(node); move there; stop when no child matches, then emit
         argmax p(node). Output = greedy decoding, whatever the tree.
Sampled: the children are tried in storage order (the head's best first). The tree's children are the
         head's top-k -- chosen, not drawn -- so each is a deterministic draft (q = one-hot on it): accept
         child c with probability r(c) / sum(r), where r starts as p(node); on a rejection r loses c
         (the residual max(0, r - q) renormalised); with a child accepted, move there (r = p(child));
         with every child rejected (or none), emit a sample of r and stop. Trying c then sampling the
         residual is exactly a sample of r, recursively, so every emitted token follows the target's
         (processed) distribution -- SpecInfer's multi-draft rule for one-hot draft distributions.

Coupled (the deterministic mode): every node draws the target's own sample x(node) -- the draw decoding
         without drafts makes at the node's position, keyed on (seed, position, SALT_SAMPLE) -- and the walk
         accepts the child whose token equals x(node) (siblings are distinct: at most one), emitting x of
         each node on the path. That is the greedy walk over the draws: the output is token for token what
         decoding without speculation samples along the accepted path, whatever the tree.

Random numbers are counter-based as in the chain: the accept test of child j at a node is keyed on (seed,
the node's position, SALT_TREE + j) and the final sample on (seed, position, SALT_SAMPLE), so no two
draws of a row share a number.

History-dependent processing (penalties, min_tokens; `tree_penalize`) scores each node with the history plain
decoding of its path would have: the request's tokens, then the node's ancestors and the node itself, never
its siblings or their subtrees.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from m3eagle.sampling.penalties import PenaltyState, PenaltyTensors, penalize
from m3eagle.sampling.sampler import SALT_SAMPLE, SamplingTensors, probs_from_logits, sample_from_probs, uniform

SALT_TREE = 16  # + the child's storage index (< 64): the tree's accept tests, apart from the chain's salts


def remove_rejected(resid: torch.Tensor, tok: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """The residual after a one-hot draft is rejected: resid [B, V] without token tok [B] on rejected rows [B]
    (max(0, r - r_total * onehot) up to scale; sample_from_probs takes any scale)."""
    return torch.where(rejected[:, None], resid.scatter(1, tok[:, None], 0.0), resid)


def greedy_walk(greedy_tok: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor,
                max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """greedy_tok [B, N+1] (argmax of every node), tokens / parents [B, N], num_nodes [B] (0 or N) ->
    (path [B, D+1] storage indices of the accepted nodes, root first, 0 past the path; num_new [B] =
    accepted + 1). The emitted tokens are greedy_tok.gather(1, path)[:, :num_new]."""
    b, n = tokens.shape
    valid = torch.arange(n, device=tokens.device)[None, :] < num_nodes[:, None]
    cur = torch.zeros(b, dtype=torch.int64, device=tokens.device)
    alive = torch.ones(b, dtype=torch.bool, device=tokens.device)
    path = torch.zeros(b, max_depth + 1, dtype=torch.int64, device=tokens.device)
    for d in range(max_depth):
        want = greedy_tok.gather(1, cur[:, None])  # [B, 1]
        match = valid & (parents == cur[:, None]) & (tokens == want)
        alive = alive & match.any(-1)
        cur = torch.where(alive, match.long().argmax(-1) + 1, cur)  # the first match (siblings are distinct)
        path[:, d + 1] = torch.where(alive, cur, 0)
    return path, (path[:, 1:] > 0).sum(-1) + 1


def walk_and_emit(greedy_tok: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor,
                  max_depth: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """greedy_walk and the tokens it emits: (greedy_tok of each path node, padded with zeros to [B, width],
    num_new [B], path [B, D+1]); arguments as greedy_walk's."""
    path, num_new = greedy_walk(greedy_tok, tokens, parents, num_nodes, max_depth)
    return pad_columns(greedy_tok.gather(1, path), width), num_new, path


Walk = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int],
                tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def tree_verify(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor,
                max_depth: int, st: SamplingTensors, node_pos: torch.Tensor, any_random: bool = True,
                argmax: Callable[[torch.Tensor], torch.Tensor] | None = None, coupled: bool = False,
                walk: Walk = walk_and_emit) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [B, N+1, V] (fp32 where any_random), tokens / parents [B, N] (target ids; parent storage index,
    0 = root), num_nodes [B] (0..N: nodes past it are absent), node_pos [B, N+1] (each node's position: the
    counter of its draws), any_random: some row has temperature > 0 (False: the greedy walk alone), coupled:
    the coupled walk above (the deterministic mode), walk: walk_and_emit or a fast path equal to it.
    -> (new_tokens [B, N+1], the first num_new valid; num_new [B]; path [B, D+1] as greedy_walk's)."""
    b, n1, v = logits.shape
    n = n1 - 1
    greedy_tok = (argmax(logits.reshape(b * n1, v)).view(b, n1) if argmax is not None
                  else logits.argmax(-1))  # [B, N+1]
    if not any_random:
        return walk(greedy_tok, tokens, parents, num_nodes, max_depth, n1)

    rep = st.repeat(n1)
    p = probs_from_logits(logits.reshape(b * n1, v), rep).view(b, n1, v)
    if coupled:  # each node's own draw, keyed as decoding without drafts keys its position
        x = sample_from_probs(p.view(b * n1, v), rep.seed, node_pos.reshape(-1), SALT_SAMPLE).view(b, n1)
        x = torch.where(st.greedy[:, None], greedy_tok, x)  # [B, N+1]
        return walk(x, tokens, parents, num_nodes, max_depth, n1)
    valid = torch.arange(n, device=logits.device)[None, :] < num_nodes[:, None]
    cur = torch.zeros(b, dtype=torch.int64, device=logits.device)
    alive = torch.ones(b, dtype=torch.bool, device=logits.device)
    path = torch.zeros(b, max_depth + 1, dtype=torch.int64, device=logits.device)
    resid = p[:, 0].clone()  # [B, V] what the current node emits if it accepts no child
    for d in range(max_depth):
        kids = valid & (parents == cur[:, None]) & alive[:, None]  # [B, N]
        g_want = greedy_tok.gather(1, cur[:, None])[:, 0]
        pos = node_pos.gather(1, cur[:, None])[:, 0]
        took = torch.zeros(b, dtype=torch.bool, device=logits.device)
        nxt = cur
        for j in range(n):
            tried = kids[:, j] & ~took
            tok = tokens[:, j]
            r_tok = resid.gather(1, tok[:, None])[:, 0]
            u = uniform(st.seed, pos, SALT_TREE + j)
            # u * total < r(c): probability r(c) / total, never for r(c) = 0 (u > 0)
            ok = tried & torch.where(st.greedy, tok == g_want, u * resid.sum(-1) < r_tok)
            took = took | ok
            nxt = torch.where(ok, j + 1, nxt)
            resid = remove_rejected(resid, tok, tried & ~ok)
        alive = alive & took
        cur = torch.where(alive, nxt, cur)
        path[:, d + 1] = torch.where(alive, cur, 0)
        resid = torch.where(alive[:, None], p.gather(1, cur[:, None, None].expand(b, 1, v))[:, 0], resid)
    num_new = (path[:, 1:] > 0).sum(-1) + 1
    pos = node_pos.gather(1, cur[:, None])[:, 0]
    final = torch.where(st.greedy, greedy_tok.gather(1, cur[:, None])[:, 0],
                        sample_from_probs(resid, st.seed, pos, SALT_SAMPLE))
    # accepted nodes' tokens, then the final token at column num_new - 1
    node_tok = torch.cat([tokens.new_zeros(b, 1), tokens], 1).gather(1, path)  # [B, D+1]: path[j]'s token
    out = torch.cat([node_tok[:, 1:], node_tok[:, :1]], 1)  # emitted token j is path node j+1's
    out = out.scatter(1, (num_new - 1)[:, None], final[:, None])
    return pad_columns(out, n1), num_new, path


def path_history(tokens: torch.Tensor, anc: torch.Tensor, depths: torch.Tensor, num_nodes: torch.Tensor,
                 vocab: int) -> torch.Tensor:
    """What each node adds to its row's output history: its path's tokens (ancestors at depths 1..depth(i), the
    node itself last; the root is emitted output already). tokens [B, N] (target ids), anc [B, N+1, D+1]
    (draft_tree.ancestors), depths [B, N+1] (root 0), num_nodes [B] (nodes past it are absent) -> counts
    [B, N+1, V] int32."""
    b, n1, d1 = anc.shape
    node_tok = torch.cat([tokens.new_zeros(b, 1), tokens], 1)  # [B, N+1] storage index -> token
    on_path = anc[:, :, 1:]  # [B, N+1, D]
    d = torch.arange(1, d1, device=anc.device)
    live = torch.arange(n1, device=anc.device)[None, :] <= num_nodes[:, None]  # [B, N+1]
    keep = (d[None, None, :] <= depths[..., None]) & live[..., None]  # [B, N+1, D]
    toks = node_tok.gather(1, on_path.reshape(b, -1)).view(b, n1, d1 - 1)
    inc = torch.zeros(b, n1, vocab, dtype=torch.int32, device=anc.device)
    return inc.scatter_add_(2, toks, keep.to(torch.int32))


def tree_penalize(state: PenaltyState, logits: torch.Tensor, pt: PenaltyTensors, row_slot: torch.Tensor,
                  tokens: torch.Tensor, anc: torch.Tensor, depths: torch.Tensor, num_nodes: torch.Tensor,
                  node_pos: torch.Tensor) -> torch.Tensor:
    """PenaltyState.apply on a tree: logits [B, N+1, V] of every node -> penalised [B, N+1, V]. Node i's output
    history is the slot's plus its path (path_history); min_tokens counts the outputs before the token it
    predicts from its position node_pos [B, N+1] (p0 + depth). Device arithmetic only (graph-capturable)."""
    b, n1, v = logits.shape
    counts = state.counts[row_slot][:, None] + path_history(tokens, anc, depths, num_nodes, v)  # [B, N+1, V]
    stop = state.stop_mask[row_slot] | (state.eos_mask[None] & ~pt.ignore_eos[:, None])  # [B, V]
    n_out = node_pos + 1 - pt.prompt_len[:, None]  # [B, N+1] output tokens before the one sampled here
    hold = stop[:, None] & (n_out < pt.min_tokens[:, None])[..., None]  # [B, N+1, V]
    logits = logits.masked_fill(hold, float("-inf"))
    rep = lambda x: x.repeat_interleave(n1, 0)  # noqa: E731 -- per-row parameters to per-node rows
    out = penalize(logits.reshape(b * n1, v), counts.reshape(b * n1, v), rep(state.in_prompt[row_slot]),
                   rep(pt.presence), rep(pt.frequency), rep(pt.repetition))
    return out.view(b, n1, v)


def pad_columns(x: torch.Tensor, width: int) -> torch.Tensor:
    """[B, W] -> [B, width] (zeros past W; W <= width)."""
    return torch.cat([x, x.new_zeros(x.shape[0], width - x.shape[1])], 1) if x.shape[1] < width else x[:, :width]
