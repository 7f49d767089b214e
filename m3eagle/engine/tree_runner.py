"""TreeModelRunner.execute: the speculative step with a dynamic draft tree (draft_tree.py) in place of a chain.

One step, for rows verifying a tree of N nodes (q_len N + 1: the last emitted token, the root, then the nodes
in storage order) and for prompt rows alike:

    1. target forward through the extend path; a tree row is split into N + 1 one-token rows whose keys
       are the committed context plus the node's ancestors at their depth positions (the metadata's tail
       override, `tail_start` / `tail_slots`), so each node sees exactly what plain decoding of its path
       would; RoPE positions are depth-based
    2. logits of every node; tree_verify walks the tree (greedy, or recursive rejection over siblings)
    3. the accepted path's K/V (target layers, index-K) is copied into consecutive slots p0 + 1.. p0 + m:
       rejected nodes' K/V stays past the row's new length, where nothing reads it
    4. the head's step 0 over the compacted row (root, accepted path; inputs shifted by one, the bonus token
       last), which writes the head's K/V of the committed positions, then D - 1 batched head calls that grow
       the next tree (one per depth level, over the K frontier nodes); their K/V goes to per-row scratch
       slots past the pool, read by deeper levels under the tree mask and never by anything else
    5. the rerank to N nodes; tokens, parents and depths into the slot buffers the next step gathers from, and
       the node count into slot_held
A narrow step (verify width D < N) grows a chain instead (top-1 at every level: D nodes, the head's greedy path,
what the chain drafter proposes), so its head calls and bookkeeping are the chain's size; a later step verifies
min(its drafts, held) nodes of each row, so a full step after a narrow one verifies the D-node chain, and the
stale columns past it are never accepted.

No host sync: the node rows are laid out by device arithmetic on shapes fixed by host ints alone (every step
row becomes w + 1 sub-rows, tree_layout.py; w is the step's verify width, N, or D on a narrow step that verifies the
first D stored nodes of each tree: draft_tree.verify_width), and every constant index tensor is made once, so
the step can be captured as a CUDA graph. The tree's own small ops (the node rows' layout, the growth's expansions and
frontiers, the rerank, the verification walk, the accepted path's permutation and KV compaction, the trees' slot rows)
run through tree_ops.py: plain torch on the CPU, one Triton launch each on CUDA.

Sampling invariants are the chain's, node by node: penalties and min_tokens score node i with the history plain
decoding of its path would have (the request's tokens, its ancestors and itself: tree_verify.tree_penalize),
device-side like the chain's, so a penalised step stays sync-free and capturable. Structured output masks node
i with the grammar's state after its path and the head's frontier with the state after each frontier node's
path (structured_step.TreeGrammarStep): host work with a sync per level, as the chain's constrained steps are
eager. Logprobs are those of the penalised, unmasked distribution, as the chain's.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from m3eagle.engine import tree_ops
from m3eagle.engine.draft_tree import TreeSpec
from m3eagle.engine.input_builder import StepInput
from m3eagle.engine.model_runner import ModelRunner, StepOutput, _fused, token_logprobs
from m3eagle.engine.pool_table import PoolTable
from m3eagle.engine.structured_step import TreeGrammarStep
from m3eagle.engine.tree_layout import Frontier, NodeRows
from m3eagle.engine.tree_ops import TreeOps
from m3eagle.kernels.attention.metadata import AttnMetadata
from m3eagle.sampling.structured import allowed_from_bitmask, apply_bitmask
from m3eagle.sampling.tree_verify import pad_columns, tree_penalize, tree_verify


class TreeModelRunner(ModelRunner):
    """ModelRunner whose verify rows carry a draft tree (num_draft_tokens = the tree's node budget N)."""

    def __init__(self, *args, tree: TreeSpec, **kwargs):
        super().__init__(*args, **kwargs)
        self.tree = tree
        n, nodes = self.slot_tokens.shape[0], tree.nodes
        self.slot_parents = torch.zeros(n, nodes, dtype=torch.int64, device=self.device)  # [S+1, N]
        self.slot_depths = torch.ones(n, nodes, dtype=torch.int64, device=self.device)  # [S+1, N]
        self.slot_draft_probs = None  # tree children are chosen, not drawn: verification needs no q
        # Nodes each slot's stored tree holds: N after a full growth, D after a narrow step's chain; a step
        # verifies min(its drafts, this) nodes, so the columns past a chain are never accepted.
        self.slot_held = torch.zeros(n, dtype=torch.int64, device=self.device)  # [S+1]
        # Scratch slots of the head's frontier K/V, past the pool: (D - 1) * K per step row.
        self.pool_slots = self.caches[0].k.shape[0]
        self.scratch_per_row = (tree.depth - 1) * tree.topk
        # Constant index tensors of the tree's shapes, made once (a captured step reads them; see ModelRunner's).
        rows, kk, dev = self.row_ids.shape[0], tree.topk, self.device
        wide = rows * max(kk, nodes + 1)  # sub-rows of a step: B * (N + 1) node rows, B * K frontier rows
        self.node_cols = torch.arange(max(nodes + 1, tree.depth), device=dev)  # [max(N+1, D)]
        self.wide_ids = torch.arange(wide, device=dev)  # [W]
        self.wide_ones = torch.ones(wide, dtype=torch.int64, device=dev)  # [W]
        self.wide_zeros = torch.zeros(wide, dtype=torch.int64, device=dev)  # [W]
        self.wide_true = torch.ones(wide, 1, dtype=torch.bool, device=dev)  # [W, 1]
        self.frontier_cols = torch.arange(kk, device=dev)  # [K]
        self.zero_scores = torch.zeros(rows, 1, device=dev)  # [R, 1] the root's score: its children's parent
        # depth of each candidate the expansion creates (K at depth 1, then K*K per level), creation order
        self.cand_depth = torch.cat([torch.ones(kk, dtype=torch.int64)] + [
            torch.full((kk * kk,), lv + 1, dtype=torch.int64) for lv in range(1, tree.depth)]).to(dev)  # [M]
        self.chain_depth = torch.arange(1, tree.depth + 1, device=dev)  # [D] a chain's candidates: one per level
        self._tree_book: dict[str, TreeOps] = {}  # the tree's ops by fused-backend name (_tree_ops)
        self.kv_pools = PoolTable([p for c in self.caches for p in (c.k, c.v, c.idx_k) if p is not None])
        if self.draft is not None:
            self.draft_cache = self.draft.new_cache(self.pool_slots + rows * self.scratch_per_row, self.dtype,
                                                    self.device)

    @torch.inference_mode()
    def execute(self, inp: StepInput) -> StepOutput:
        # w: the step's verify width (host int), N or the narrow width; rows verify their first num_drafts <= w
        # stored nodes (score order: every prefix is closed under ancestors). k1: the slot buffers' width N + 1.
        tree, k1 = self.tree, self.k + 1
        k = self.step_width(inp)
        pen, grammar = inp.penalties, inp.grammar
        if grammar is not None and not isinstance(grammar, TreeGrammarStep):
            raise TypeError("a draft-tree step's grammar is a TreeGrammarStep (its masks follow the tree)")
        ids, meta = self._apply_overlap_correction(inp)
        if pen is not None:  # history first: a prompt chunk's tokens precede the position it samples
            self.penalty.record_inputs(pen, inp.row_slot, inp.row_gather, ids, meta.tok_row, meta.positions)
        fused, book, tops = _fused(meta), self._step_ops(meta), self._tree_ops(meta)
        b = inp.num_rows
        nodes_of = self.row_ids[:b]
        lay = tops.node_rows(meta, ids, self.slot_parents, self.slot_depths, inp.row_slot, inp.row_first,
                             inp.row_num_drafts, k, tree.depth, self._uniform(inp, meta, k), self.node_cols,
                             self.row_ids[:b], self.row_true[:b, 0], self.slot_held)
        parents, depths, anc, p0, tpos = lay.parents, lay.depths, lay.anc, lay.p0, lay.positions  # [B, w+1] x 2, ..
        sample_idx, node_pos, drafts_in = lay.sample_idx, lay.node_pos, lay.drafts_in  # [B, w+1] x 2, [B, w]
        # nodes each row verifies: its drafts, at most the nodes its stored tree holds (a narrow step grew a chain)
        num_nodes = lay.num_nodes  # [B]
        tmeta = self._node_meta(meta, lay)
        aux = self.aux_buf[: inp.num_tokens]  # [T, 3H]
        every = inp.want_prompt_logprobs
        hidden = self.target(ids, tpos, tmeta, self.caches, self.aux_ids, aux,
                             rows=None if every else sample_idx.reshape(-1))
        prompt_lps = self._prompt_logprobs(inp, ids, hidden) if every else None
        sampled = hidden[sample_idx.reshape(-1)] if every else hidden  # [B * (w+1), H]
        if not (inp.any_random or inp.want_logprobs or pen is not None or grammar is not None):
            # all greedy, nothing else reads the logits: the argmax in lm_head's launch, as the chain's
            greedy = self.target.greedy_ids(sampled, fused).view(b, k + 1)  # [B, w+1]
            new_tokens, num_new, path = tops.walk(greedy, drafts_in, parents[:, 1:], num_nodes, tree.depth,
                                                  k1)  # [B, N+1]: the slot buffers' width
        else:
            logits = self.target.compute_logits(sampled, fused).view(b, k + 1, -1)  # [B, w+1, V] fp32
            if pen is not None:  # node i's target distribution given the history and its path
                logits = tree_penalize(self.penalty, logits, pen, inp.row_slot, drafts_in, anc, depths, num_nodes,
                                       node_pos)
            # each node masked by the grammar's state after its path; logprobs stay the unmasked distribution's
            scored = (apply_bitmask(logits, grammar.tree_verify_mask(drafts_in, parents[:, 1:], num_nodes))
                      if grammar is not None else logits)
            new_tokens, num_new, path = tree_verify(scored, drafts_in, parents[:, 1:], num_nodes, tree.depth,
                                                    inp.sampling, node_pos, inp.any_random, fused.argmax,
                                                    self.coupled, walk=tops.walk)
            new_tokens = pad_columns(new_tokens, k1)  # [B, N+1]
        logprobs = None
        if inp.want_logprobs:  # emitted token j was predicted by path node j
            lp_rows = torch.cat([path, path[:, -1:].expand(b, max(k1 - path.shape[1], 0))], 1)[:, :k1]
            logprobs = token_logprobs(logits.gather(1, lp_rows[..., None].expand(-1, -1, logits.shape[-1])),
                                      new_tokens, self.n_top)
        # the rows as if the path had been the verify row: ids / aux of node path[j] at column j ([B], [T], [T, 3H])
        num_new_s, _, ids_c, aux_c = tops.path_perm(ids, aux, inp.row_first, num_new, inp.row_samples,
                                                    inp.row_num_drafts, path, meta.tok_row, meta.tok_col)
        tops.compact(self.kv_pools, meta.page_table, self.page_size, p0, path, num_new_s)
        num_new, s, last_idx, shifted, at, _ = book.commit_outputs(
            new_tokens, num_new, inp.row_samples, inp.row_slot, self.dump_slot, inp.row_num_drafts, inp.row_first,
            inp.row_qlen, inp.row_next_token, ids_c, meta.positions, self.slot_tokens, self.slot_num_new,
            self.slot_dev, self.k, True, tok_row=meta.tok_row,
            chain=(inp.row_chained, meta.kv_lens, inp.meta.kv_lens, inp.row_chained), pages=None)
        if pen is not None:
            self.penalty.record_outputs(new_tokens, num_new, s)
        if grammar is not None:  # what the head's masks start from: this step's emitted tokens
            grammar.emitted = (new_tokens, num_new)
        # a narrow step grows a chain for the next step (top-1 per level: D nodes, the chain drafter's proposal),
        # so its head work and bookkeeping scale like the chain's; a full step grows the K-wide tree of N nodes
        tokens, t_parents, t_depths = self._grow_tree(inp, meta, aux_c, last_idx, shifted, at, nodes_of,
                                                      chain=k < self.k)  # [B, N] or [B, D] x 3
        if grammar is not None:
            grammar.finish(None)
        tops.store(s, (tokens, t_parents, t_depths), (self.slot_drafts, self.slot_parents, self.slot_depths),
                   self.slot_held)
        return StepOutput(new_tokens, num_new, tokens, logprobs, prompt_lps)

    def step_width(self, inp: StepInput) -> int:
        """The step's verify width w (host int): its rows' most drafts, N or the narrow D; N for a step whose rows
        verify nothing (prompt chunks alone: their first trees grow full)."""
        return inp.draft_width if 0 < inp.draft_width <= self.k else self.k

    def _tree_ops(self, meta: AttnMetadata) -> TreeOps:
        """The tree's ops (tree_ops.py): the implementation named like the step's fused backend, as _step_ops."""
        name = _fused(meta).name
        ops = self._tree_book.get(name)
        if ops is None:
            ops = self._tree_book[name] = tree_ops.create(name)
        return ops

    # ---- the target's node rows --------------------------------------------------------------------
    @staticmethod
    def _uniform(inp: StepInput, meta: AttnMetadata, width: int) -> bool:
        """Every row holds exactly w + 1 tokens (host ints only: decode-only steps, a graph bucket's padding rows
        included): every row is then split, prompt-free rows into one-token causal rows (tree_layout)."""
        return inp.num_tokens == inp.num_rows * (width + 1) and meta.max_q == width + 1

    @staticmethod
    def _node_meta(meta: AttnMetadata, lay: NodeRows) -> AttnMetadata:
        """The step's metadata with every step row b turned into w + 1 sub-rows (b, j) (w: the verify width), sub-row index
        b * (w + 1) + j, from the node rows tree_ops laid out (tree_layout.node_rows_reference says how)."""
        return replace(meta, num_rows=lay.q_lens.shape[0], max_q=lay.q_index.shape[1], q_lens=lay.q_lens,
                       kv_lens=lay.kv_lens, page_table=lay.page_table, tok_row=lay.tok_row, tok_col=lay.tok_col,
                       q_index=lay.q_index, q_valid=lay.q_valid, positions=lay.positions, tail_start=lay.tail_start,
                       tail_slots=lay.tail_slots)

    # ---- drafting ----------------------------------------------------------------------------------
    def _grow_tree(self, inp: StepInput, meta: AttnMetadata, aux: torch.Tensor, last_idx: torch.Tensor,
                   shifted: torch.Tensor, at: torch.Tensor, row_ids: torch.Tensor, chain: bool = False,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The head's step 0 over the compacted rows (aux [T, 3H] permuted like them), then the tree grown level
        by level from each row's last accepted token (position at[0]). -> (tokens [B, n] target ids, parents
        [B, n] storage index, depths [B, n]); n = N, or with `chain` n = D: top-1 at every level, node i's parent
        node i - 1 (a child never outscores its parent, so score order is creation order)."""
        tree, head, fused, grammar = self.tree, self.draft, _fused(meta), inp.grammar
        tops = self._tree_ops(meta)
        kk, b = (1 if chain else tree.topk), inp.num_rows
        m, nodes, cand_depth = ((tree.depth, tree.depth, self.chain_depth) if chain
                                else (tree.max_candidates, tree.nodes, self.cand_depth))
        h_out, h_next = head(shifted, meta.positions, aux, meta, self.draft_cache, True, rows=last_idx)  # [B, H]
        # the logits in the weights' dtype, made fp32 inside log_softmax's one launch (no cast launch per level)
        logits = head.compute_logits(h_out, fused, fp32=False)  # [B, Vd]
        if grammar is not None:  # the root's children stay inside the grammar (state after the emitted tokens)
            logits = self._mask_draft(logits, grammar.draft_mask(0, None))
        logp = torch.log_softmax(logits, -1, dtype=torch.float32)  # [B, Vd]
        # every candidate's score, draft id and parent candidate (-1: the root), creation order: the root's K
        # children, then K*K per level; the expansions and frontiers write their columns
        cand_score = torch.empty(b, m, dtype=logp.dtype, device=logp.device)  # [B, M]
        cand_tok = torch.empty(b, m, dtype=torch.int64, device=logp.device)  # [B, M]
        cand_parent = torch.empty(b, m, dtype=torch.int64, device=logp.device)  # [B, M]
        zero = self.zero_scores[:b] if logp.dtype == self.zero_scores.dtype else logp.new_zeros(b, 1)  # [B, 1]
        tops.expand_into(zero, logp[:, None], kk, cand_score[:, :kk], cand_tok[:, :kk])
        if tree.depth == 1:
            cand_parent.fill_(-1)
        base = at[0]  # [B]
        length = inp.meta.max_kv + tree.depth
        front, f_path, n_made = None, None, kk
        for level in range(1, tree.depth):
            front = tops.frontier(front, cand_score, cand_tok, cand_parent, h_next, head.d2t, base, meta.page_table,
                                  level, kk, (self.pool_slots, self.scratch_per_row), row_ids,
                                  self.frontier_cols[:kk])
            h_out, h_next = head(front.ids, front.positions, front.hidden, self._frontier_meta(meta, front, length),
                                 self.draft_cache, False)  # [B*K, H]
            logits = head.compute_logits(h_out, fused, fp32=False).view(b, kk, -1)  # [B, K, Vd]
            if grammar is not None:  # each frontier node's children: the state after its own path (draft ids)
                f_path = front.tok[..., None] if f_path is None else torch.cat(
                    [f_path.gather(1, front.par[..., None].expand(-1, -1, level - 1)), front.tok[..., None]], -1)
                logits = self._mask_draft(logits, grammar.frontier_mask(head.draft_to_target(f_path)))
            logp = torch.log_softmax(logits, -1, dtype=torch.float32)  # [B, K, Vd]
            tops.expand_into(front.score, logp, kk, cand_score[:, n_made:n_made + kk * kk],
                             cand_tok[:, n_made:n_made + kk * kk])
            n_made += kk * kk
        return tops.finish(cand_score, cand_parent, cand_tok, head.d2t, cand_depth, nodes)  # [B, n] x 3

    def _mask_draft(self, logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The head's logits [..., Vd] with every draft id whose target id the grammar mask (int32 [..., W]) refuses
        at -inf; a node whose allowed tokens all lie outside the draft vocabulary drafts unmasked (its children
        are then rejected by the masked target), as the chain's constrained drafts do."""
        vd = logits.shape[-1]
        target_ids = torch.arange(vd, device=logits.device) + self.draft.d2t  # [Vd]
        allowed = allowed_from_bitmask(mask, self.target.cfg.vocab_size)[..., target_ids]  # [..., Vd]
        allowed = allowed | ~allowed.any(-1, keepdim=True)
        return logits.masked_fill(~allowed, float("-inf"))

    def _frontier_meta(self, meta: AttnMetadata, front: Frontier, length: int) -> AttnMetadata:
        """Metadata of one head call over the K frontier nodes of one depth level of each row, one row each
        (tree_layout.Frontier): its position, K/V to its scratch slot, keys = the row's committed head K/V
        (positions 0..base) then its ancestors' scratch slots (the tail override from base + 1)."""
        n = front.positions.shape[0]  # B*K
        ids = self.wide_ids[:n]
        return AttnMetadata(num_rows=n, max_q=1, max_kv=length, page_size=self.page_size, q_lens=self.wide_ones[:n],
                            kv_lens=front.kv_lens, page_table=front.page_table, tok_row=ids, tok_col=self.wide_zeros[:n],
                            q_index=ids[:, None], q_valid=self.wide_true[:n], positions=front.positions,
                            slot_mapping=front.slots[:, -1], ops=meta.ops, tail_start=front.tail_start,
                            tail_slots=front.slots)
