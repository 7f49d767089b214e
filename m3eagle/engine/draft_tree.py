"""Dynamic draft trees (EAGLE-2/3): the option, the tree's construction and its attention layout.

A tree of depth D, top-k K and node budget N is grown by the Eagle3 head one depth level at a time:

    level 1     the K best tokens of the head's distribution after the last accepted token
    level l+1   each of the K frontier nodes of level l proposes its K best children (one batched head call
                over the frontier); score = parent score + log q(child), a cumulative log-probability;
                the frontier of level l+1 is the K best of those K*K children
    rerank      the N best of all K + (D-1)K^2 candidates by score, stored best first (score order)

A child's score never exceeds its parent's (log q <= 0, and fp32 addition is monotonic) and a parent is
created before its children, so a stable sort by score (ties to the lower creation index) puts every parent
ahead of its children: the N best are closed under ancestors, and score order is a topological order. So is
every prefix of it: the first M stored nodes are the tree EAGLE-2 builds with budget M, and a step may verify
only them (`verify_width`: the full tree at small batch, M = D at large).

Storage: node i (1..N) of a row is verify token i after the root (token 0, the last emitted token) and its
K/V lives at position p0 + i of the row (p0: the root's position); its RoPE / causal position is
p0 + depth(i). A node's attention reads the committed context (positions 0..p0) and its ancestors; the
row layout that expresses this (the attention metadata's tail override, see tree_runner.py) gives, for
virtual key position v of node i, the storage position of the key the node sees there: v itself up to p0,
then its ancestor at depth v - p0.
Seen that way each node is an ordinary causal sequence, so dense and MSA sparse layers (whose block
selection max-pools index scores over key positions) treat it exactly as the reference treats that
sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from m3eagle.kernels.topk.reference import best

MAX_DEPTH, MAX_TOPK, MAX_NODES = 8, 8, 64


@dataclass(frozen=True)
class TreeSpec:
    """draft_tree = "D,K,N": depth D, top-k K per expanded node, node budget N (the verify rows' drafts)."""

    depth: int
    topk: int
    nodes: int

    @property
    def max_candidates(self) -> int:
        """Nodes the expansion creates before the rerank: K at level 1, K*K at each later level."""
        return self.topk + (self.depth - 1) * self.topk * self.topk

    def __str__(self) -> str:
        return f"{self.depth},{self.topk},{self.nodes}"

    @classmethod
    def parse(cls, value: object) -> TreeSpec:
        """A TreeSpec, "D,K,N" or a (D, K, N) sequence -> a validated TreeSpec; errors name the field and the fix."""
        if isinstance(value, TreeSpec):
            spec = value
        else:
            parts = value.split(",") if isinstance(value, str) else value
            try:
                d, k, n = (int(str(x).strip()) for x in parts)  # type: ignore[union-attr]
            except (TypeError, ValueError):
                raise ValueError(f"draft_tree={value!r} must be 'DEPTH,TOPK,NODES' (e.g. '3,4,16': depth 3, the 4 "
                                 "best children per expanded node, 16 nodes verified)") from None
            spec = cls(d, k, n)
        for name, v, hi in (("depth", spec.depth, MAX_DEPTH), ("topk", spec.topk, MAX_TOPK),
                            ("nodes", spec.nodes, MAX_NODES)):
            if not 1 <= v <= hi:
                raise ValueError(f"draft_tree {name}={v} must be in 1..{hi} (draft_tree='{spec}')")
        if spec.nodes > spec.max_candidates:
            raise ValueError(f"draft_tree nodes={spec.nodes} exceeds the {spec.max_candidates} nodes that depth "
                             f"{spec.depth} with topk {spec.topk} creates (topk + (depth - 1) * topk^2); lower "
                             "nodes or raise depth / topk")
        return spec


def check_tree_engine(spec: TreeSpec, scheduler_steps: int, tp_size: int) -> None:
    """Tree drafting runs eagerly or replays CUDA graphs (decode steps, and prompt / mixed steps with prefill
    graphs), with or without overlap. Not yet: several steps per plan, several ranks."""
    bad = [name for name, on in ((f"num_scheduler_steps={scheduler_steps}", scheduler_steps != 1),
                                 (f"tensor_parallel_size={tp_size}", tp_size != 1)) if on]
    if bad:
        raise ValueError(f"draft_tree='{spec}' cannot be combined with {', '.join(bad)}: pass "
                         "num_scheduler_steps=1, tensor_parallel_size=1 (or use the chain, num_draft_tokens=K)")


# ------------------------------------------------------------------------------------------------
# The automatic choice: the full tree or its first D nodes
# ------------------------------------------------------------------------------------------------

# The prior on what the full tree gains over its first D nodes: a fixed function of the tree's shape, never of
# a request's acceptance. A depth level of the accepted path is reached with probability PRIOR_ALPHA from one
# candidate per level, and 1 - (1 - PRIOR_ALPHA) ** (c ** PRIOR_EXPONENT) from c = M / D candidates per level
# (siblings fail together more often than independent drafts: diminishing returns). The two constants put
# 3,4,16 at MAL 3.85 and its first 3 nodes at 3.39 (the H100 embedded pair measures 3.82 and 3.39).
PRIOR_ALPHA, PRIOR_EXPONENT = 0.89, 0.3
# Without measured costs (CPU, graphs off) the full tree is kept while a step's verify tokens B * (N + 1) fit
# this many: a small step is bound by launches and weights, not by its token count.
SHAPE_RULE_TOKENS = 256


def narrow_width(spec: TreeSpec) -> int:
    """The nodes a step verifies when the full tree does not pay: the first D in score order (min(D, N))."""
    return min(spec.depth, spec.nodes)


def expected_mal(depth: int, width: int) -> float:
    """The prior's mean accepted length (emitted tokens per step) of a best-first tree of `width` nodes, depth `depth`."""
    a = 1.0 - (1.0 - PRIOR_ALPHA) ** ((width / depth) ** PRIOR_EXPONENT)
    return sum(a ** d for d in range(depth + 1))


def expected_gain(spec: TreeSpec) -> float:
    """The prior's MAL ratio of the full tree over its first D nodes (>= 1)."""
    return expected_mal(spec.depth, spec.nodes) / expected_mal(spec.depth, narrow_width(spec))


def tree_max_batch_from_costs(costs: dict[int, tuple[float, float]], gain: float) -> int:
    """The largest batch at which a step verifies the full tree, from measured step costs: costs maps a graph
    bucket (rows) to (seconds of the full-tree step, seconds of the narrow step). Tokens per second are MAL / cost,
    so the tree pays at a bucket when cost_full <= gain * cost_narrow; the threshold is the largest bucket up to
    which every bucket pays (0: the narrow step at every batch). A pure function of its arguments."""
    out = 0
    for b in sorted(costs):
        full, narrow = costs[b]
        if full > gain * narrow:
            break
        out = b
    return out


def tree_max_batch_from_shape(spec: TreeSpec) -> int:
    """The threshold without measured costs: the full tree while B * (N + 1) <= SHAPE_RULE_TOKENS."""
    return SHAPE_RULE_TOKENS // (spec.nodes + 1)


def verify_width(spec: TreeSpec, tree_max_batch: int, batch_size: int) -> int:
    """The nodes every tree row of a step of `batch_size` rows verifies: N up to tree_max_batch, else the first D.
    Host ints only: the choice is made per step from its shape, never from a device value or a request's timing."""
    return spec.nodes if batch_size <= tree_max_batch else narrow_width(spec)


# ------------------------------------------------------------------------------------------------
# Construction
# ------------------------------------------------------------------------------------------------


def expand(parent_scores: torch.Tensor, logp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each of F frontier nodes' k best children: parent_scores [B, F], logp [B, F, Vd] (the head's log-probs
    after each node) -> (child draft ids [B, F * k], cumulative scores [B, F * k]); child f * k + c is
    parent f's c-th best (best(): ties to the lower draft id)."""
    lp, tok = best(logp, k)  # [B, F, k]
    return tok.flatten(1), (parent_scores[..., None] + lp).flatten(1)


def rerank(scores: torch.Tensor, parents: torch.Tensor, nodes: int, score_order: bool = False,
           topk: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]] = best,
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The `nodes` best candidates, closed under ancestors, in creation order, or with `score_order` best first
    (ties to the lower creation index); both are topological orders, and every prefix of score order is the
    best tree of that budget.

    scores [B, M] cumulative log-probs, parents [B, M] candidate index of each candidate's parent (-1: the
    root) -> (sel [B, N] candidate indices, parent [B, N] storage index of each selected node's parent: 0 for
    the root, i + 1 for sel[:, i]). topk: best() or a fast path equal to it."""
    b, m = scores.shape
    _, top = topk(scores, nodes)  # [B, N] best first
    if score_order:
        rank = torch.zeros(b, m, dtype=torch.int64, device=scores.device)  # [B, M] storage index 1..N, 0 elsewhere
        rank.scatter_(1, top, torch.arange(1, nodes + 1, device=scores.device).expand(b, nodes))
        par = parents.gather(1, top)  # [B, N] candidate index, -1 = root (a chosen node's parent is chosen)
        return top, torch.where(par < 0, 0, rank.gather(1, par.clamp(min=0)))
    # Ascending candidate order without a sort: mark the chosen, number them by a running count.
    chosen = torch.zeros(b, m, dtype=torch.int64, device=scores.device).scatter_(1, top, 1)  # [B, M]
    store = chosen.cumsum(1) * chosen  # [B, M] storage index 1..N of each chosen candidate, 0 elsewhere
    sel = torch.zeros(b, nodes + 1, dtype=torch.int64, device=scores.device)
    sel.scatter_(1, store, torch.arange(m, device=scores.device).expand(b, m))  # column 0 takes the unchosen
    sel = sel[:, 1:]  # [B, N]
    par = parents.gather(1, sel)  # [B, N] candidate index, -1 = root
    return sel, torch.where(par < 0, 0, store.gather(1, par.clamp(min=0)))


# ------------------------------------------------------------------------------------------------
# Layout
# ------------------------------------------------------------------------------------------------


def full_tree(parents: torch.Tensor, depths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """parents, depths [B, N] of nodes 1..N -> the same with the root in column 0 ([B, N+1]; the root is its
    own parent, depth 0)."""
    zero = parents.new_zeros(parents.shape[0], 1)
    return torch.cat([zero, parents], 1), torch.cat([zero, depths], 1)


def ancestors(parents: torch.Tensor, depths: torch.Tensor, max_depth: int) -> torch.Tensor:
    """anc [B, N+1, D+1]: anc[b, i, d] = storage index of node i's ancestor at depth d (d <= depth(i); node i
    itself at d = depth(i), the root 0 at d = 0), and i past its depth. parents / depths [B, N+1] (full_tree)."""
    b, n1 = parents.shape
    cur = torch.arange(n1, device=parents.device).expand(b, n1)
    anc = cur[..., None].repeat(1, 1, max_depth + 1)
    for _ in range(max_depth + 1):  # walk up: every node is at most max_depth steps below the root
        anc.scatter_(2, depths.gather(1, cur)[..., None], cur[..., None])
        cur = parents.gather(1, cur)
    return anc


def tree_mask(parents: torch.Tensor, depths: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[B, N+1, N+1] bool: node i may attend to node j (j is i or one of its ancestors)."""
    anc = ancestors(parents, depths, max_depth)  # past a node's depth: the node itself
    mask = torch.zeros(*parents.shape, parents.shape[1], dtype=torch.bool, device=parents.device)
    return mask.scatter_(2, anc, True)
