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
    5. the rerank to N nodes; tokens, parents and depths into the slot buffers the next step gathers from

No host sync: the node rows are laid out by device arithmetic on shapes fixed by host ints alone (every step
row becomes w + 1 sub-rows, `_node_rows`; w is the step's verify width, N, or D on a narrow step that verifies the
first D stored nodes of each tree: draft_tree.verify_width), and every constant index tensor is made once, so
the step can be captured as a CUDA graph. The tree's own small ops (the growth's top-k, the rerank, the verification
walk, the KV compaction) run through tree_ops.py: plain torch on the CPU, one Triton launch each on CUDA.

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
from m3eagle.engine.draft_tree import TreeSpec, ancestors, full_tree
from m3eagle.engine.input_builder import StepInput
from m3eagle.engine.model_runner import ModelRunner, StepOutput, _fused, token_logprobs
from m3eagle.engine.structured_step import TreeGrammarStep
from m3eagle.engine.tree_ops import PoolTable, TreeOps
from m3eagle.kernels.attention.metadata import AttnMetadata, slots_for_positions
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
        self.frontier_rows = self.row_ids.repeat_interleave(kk)  # [R*K] each frontier node's step row
        self.frontier_cols = torch.arange(kk, device=dev)  # [K]
        # depth of each candidate the expansion creates (K at depth 1, then K*K per level), creation order
        self.cand_depth = torch.cat([torch.ones(kk, dtype=torch.int64)] + [
            torch.full((kk * kk,), lv + 1, dtype=torch.int64) for lv in range(1, tree.depth)]).to(dev)  # [M]
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
        k = inp.draft_width if 0 < inp.draft_width <= self.k else self.k
        pen, grammar = inp.penalties, inp.grammar
        if grammar is not None and not isinstance(grammar, TreeGrammarStep):
            raise TypeError("a draft-tree step's grammar is a TreeGrammarStep (its masks follow the tree)")
        ids, meta = self._apply_overlap_correction(inp)
        if pen is not None:  # history first: a prompt chunk's tokens precede the position it samples
            self.penalty.record_inputs(pen, inp.row_slot, inp.row_gather, ids, meta.tok_row, meta.positions)
        fused, book, tops = _fused(meta), self._step_ops(meta), self._tree_ops(meta)
        b = inp.num_rows
        nodes_of = self.row_ids[:b]
        parents, depths = full_tree(self.slot_parents[inp.row_slot, :k], self.slot_depths[inp.row_slot, :k])  # [B, w+1]
        anc = ancestors(parents, depths, tree.depth)  # [B, w+1, D+1]
        p0 = meta.kv_lens - inp.row_qlen  # [B] position of each row's first token (a tree row's root)
        tmeta, tpos = self._node_rows(inp, meta, depths, anc, p0, k)
        aux = self.aux_buf[: inp.num_tokens]  # [T, 3H]
        sample_idx, node_pos, drafts_in = book.sample_positions(
            inp.row_first, inp.row_qlen, inp.row_num_drafts, tpos, ids, k)  # [B, w+1] x 2, [B, w]
        every = inp.want_prompt_logprobs
        hidden = self.target(ids, tpos, tmeta, self.caches, self.aux_ids, aux,
                             rows=None if every else sample_idx.reshape(-1))
        prompt_lps = self._prompt_logprobs(inp, ids, hidden) if every else None
        sampled = hidden[sample_idx.reshape(-1)] if every else hidden  # [B * (w+1), H]
        if not (inp.any_random or inp.want_logprobs or pen is not None or grammar is not None):
            # all greedy, nothing else reads the logits: the argmax in lm_head's launch, as the chain's
            greedy = self.target.greedy_ids(sampled, fused).view(b, k + 1)  # [B, w+1]
            new_tokens, num_new, path = tops.walk(greedy, drafts_in, parents[:, 1:], inp.row_num_drafts,
                                                  tree.depth, k1)  # [B, N+1]: the slot buffers' width
        else:
            logits = self.target.compute_logits(sampled, fused).view(b, k + 1, -1)  # [B, w+1, V] fp32
            if pen is not None:  # node i's target distribution given the history and its path
                logits = tree_penalize(self.penalty, logits, pen, inp.row_slot, drafts_in, anc, depths,
                                       inp.row_num_drafts, node_pos)
            # each node masked by the grammar's state after its path; logprobs stay the unmasked distribution's
            scored = (apply_bitmask(logits, grammar.tree_verify_mask(drafts_in, parents[:, 1:], inp.row_num_drafts))
                      if grammar is not None else logits)
            new_tokens, num_new, path = tree_verify(scored, drafts_in, parents[:, 1:], inp.row_num_drafts,
                                                    tree.depth, inp.sampling, node_pos, inp.any_random, fused.argmax,
                                                    self.coupled, walk=tops.walk)
            new_tokens = pad_columns(new_tokens, k1)  # [B, N+1]
        logprobs = None
        if inp.want_logprobs:  # emitted token j was predicted by path node j
            lp_rows = torch.cat([path, path[:, -1:].expand(b, max(k1 - path.shape[1], 0))], 1)[:, :k1]
            logprobs = token_logprobs(logits.gather(1, lp_rows[..., None].expand(-1, -1, logits.shape[-1])),
                                      new_tokens, self.n_top)
        num_new_s = torch.where(inp.row_samples, num_new, 0)
        tops.compact(self.kv_pools, meta.page_table, self.page_size, p0, path, num_new_s)
        # The row as if the path had been the verify row: ids / aux of node path[j] at column j.
        perm = torch.arange(inp.num_tokens, device=ids.device)
        cols = torch.arange(1, path.shape[1], device=ids.device)  # [D]
        moved = (cols[None, :] < num_new_s[:, None]) & (inp.row_num_drafts[:, None] > 0)  # [B, D]
        dump = torch.full_like(path[:, 1:], inp.num_tokens)
        perm = torch.cat([perm, perm.new_zeros(1)])
        perm.index_put_((torch.where(moved, inp.row_first[:, None] + cols, dump),),
                        torch.where(moved, inp.row_first[:, None] + path[:, 1:], 0))
        perm = perm[: inp.num_tokens]
        ids_c = ids[perm]
        num_new, s, last_idx, shifted, at, _ = book.commit_outputs(
            new_tokens, num_new, inp.row_samples, inp.row_slot, self.dump_slot, inp.row_num_drafts, inp.row_first,
            inp.row_qlen, inp.row_next_token, ids_c, meta.positions, self.slot_tokens, self.slot_num_new,
            self.slot_dev, self.k, True, tok_row=meta.tok_row,
            chain=(inp.row_chained, meta.kv_lens, inp.meta.kv_lens, inp.row_chained), pages=None)
        if pen is not None:
            self.penalty.record_outputs(new_tokens, num_new, s)
        if grammar is not None:  # what the head's masks start from: this step's emitted tokens
            grammar.emitted = (new_tokens, num_new)
        tokens, t_parents, t_depths = self._grow_tree(inp, meta, aux[perm], last_idx, shifted, at, nodes_of)
        if grammar is not None:
            grammar.finish(None)
        self.slot_drafts.index_copy_(0, s, tokens)
        self.slot_parents.index_copy_(0, s, t_parents)
        self.slot_depths.index_copy_(0, s, t_depths)
        return StepOutput(new_tokens, num_new, tokens, logprobs, prompt_lps)

    def _tree_ops(self, meta: AttnMetadata) -> TreeOps:
        """The tree's ops (tree_ops.py): the implementation named like the step's fused backend, as _step_ops."""
        name = _fused(meta).name
        ops = self._tree_book.get(name)
        if ops is None:
            ops = self._tree_book[name] = tree_ops.create(name)
        return ops

    # ---- the target's node rows --------------------------------------------------------------------
    def _node_rows(self, inp: StepInput, meta: AttnMetadata, depths: torch.Tensor, anc: torch.Tensor,
                   p0: torch.Tensor, width: int) -> tuple[AttnMetadata, torch.Tensor]:
        """The step's metadata with every step row b turned into w + 1 sub-rows (b, j) (w = `width`, the step's
        verify width), sub-row index b * (w + 1) + j, by device arithmetic on fixed shapes (no host read of a
        device value): a tree row's sub-row j is node j alone (position p0 + depth(j), keys: the committed
        context, then its ancestors at their depth positions through the tail override), and empty past the
        row's own tokens (a row verifying fewer nodes); another row is sub-row (b, 0) whole, its other
        sub-rows empty. When every row holds exactly w + 1 tokens (decode-only steps, a graph bucket's
        padding rows included) every row is split, prompt-free rows into one-token causal rows, so the
        widest sub-row is one token. depths [B, w+1], anc [B, w+1, D+1]. -> (metadata, positions [T])."""
        b, n1, t = inp.num_rows, width + 1, inp.num_tokens
        uniform = t == b * n1 and meta.max_q == n1  # host ints only: every row is w + 1 tokens wide
        is_tree = inp.row_num_drafts > 0  # [B]
        split = self.row_true[:b, 0] if uniform else is_tree  # [B] rows cut into one-token sub-rows
        j = self.node_cols[:n1]  # [w+1]
        tr, tc = meta.tok_row, meta.tok_col  # [T]
        t_split = split[tr]
        tok_depth = depths[tr, tc.clamp(max=n1 - 1)]
        tpos = torch.where(is_tree[tr], p0[tr] + tok_depth, meta.positions)  # [T]
        # per sub-row [B, w+1]: tokens, first flat token, kv_len
        q_sub = torch.where(split[:, None], (j < inp.row_qlen[:, None]).long(),
                            torch.where(j == 0, inp.row_qlen[:, None], 0))
        first = inp.row_first[:, None] + torch.where(split[:, None], j, 0)
        own_pos = tpos[first.clamp(max=t - 1)]  # a split sub-row's one token
        kv = torch.where(split[:, None] & (q_sub > 0), own_pos + 1, meta.kv_lens[:, None])  # empty: the row's
        max_q = 1 if uniform else meta.max_q
        c = self.node_cols[:max_q] if max_q <= n1 else torch.arange(max_q, device=p0.device)
        q_valid = c[None, :] < q_sub.reshape(-1, 1)  # [B(w+1), Qmax']
        q_index = torch.where(q_valid, first.reshape(-1, 1) + c[None, :], 0)
        # node j's virtual positions p0 + 1 .. p0 + depth(j) hold its ancestors at depths 1 .. depth(j)
        rows = self.row_ids[:b]
        tail = slots_for_positions(meta.page_table, rows[:, None, None], p0[:, None, None] + anc[:, :, 1:],
                                   self.page_size)  # [B, w+1, D]
        tail_start = torch.where(is_tree, p0 + 1, meta.max_kv)  # [B]: other rows keep their page table
        tmeta = replace(meta, num_rows=b * n1, max_q=max_q, q_lens=q_sub.reshape(-1), kv_lens=kv.reshape(-1),
                        page_table=meta.page_table.repeat_interleave(n1, 0), tok_row=tr * n1 + torch.where(t_split, tc, 0),
                        tok_col=torch.where(t_split, 0, tc), q_index=q_index, q_valid=q_valid, positions=tpos,
                        tail_start=tail_start.repeat_interleave(n1), tail_slots=tail.reshape(b * n1, -1))
        return tmeta, tpos

    # ---- drafting ----------------------------------------------------------------------------------
    def _grow_tree(self, inp: StepInput, meta: AttnMetadata, aux: torch.Tensor, last_idx: torch.Tensor,
                   shifted: torch.Tensor, at: torch.Tensor, row_ids: torch.Tensor,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The head's step 0 over the compacted rows (aux [T, 3H] permuted like them), then the tree grown level
        by level from each row's last accepted token (position at[0]). -> (tokens [B, N] target ids, parents
        [B, N] storage index, depths [B, N])."""
        tree, head, fused, grammar = self.tree, self.draft, _fused(meta), inp.grammar
        tops = self._tree_ops(meta)
        kk, b = tree.topk, inp.num_rows
        h_out, h_next = head(shifted, meta.positions, aux, meta, self.draft_cache, True, rows=last_idx)  # [B, H]
        logits = head.compute_logits(h_out, fused)  # [B, Vd]
        if grammar is not None:  # the root's children stay inside the grammar (state after the emitted tokens)
            logits = self._mask_draft(logits, grammar.draft_mask(0, None))
        logp = torch.log_softmax(logits, -1)  # [B, Vd]
        tok, score = tops.expand(logp.new_zeros(b, 1), logp[:, None], kk)  # [B, K] each
        cand_tok, cand_score = [tok], [score]
        cand_parent = [torch.full_like(tok, -1)]
        f_tok, f_score, f_cand = tok, score, self.frontier_cols.expand(b, kk)
        f_h = h_next[:, None].expand(b, kk, h_next.shape[-1])  # [B, K, H] the parents' h_next
        f_anc = self.frontier_cols.expand(b, kk)[..., None]  # [B, K, l] frontier index per level
        f_path = tok[..., None]  # [B, K, l] draft ids of each frontier node's path (a constrained step's masks)
        base = at[0]  # [B]
        length = inp.meta.max_kv + tree.depth
        scratch = self.pool_slots + row_ids * self.scratch_per_row  # [B]
        n_made = kk
        for level in range(1, tree.depth):
            lvl_slots = scratch[:, None, None] + self.node_cols[:level][None, None, :] * kk + f_anc
            fmeta = self._frontier_meta(meta, base, level, lvl_slots, length)
            pos = (base + level).repeat_interleave(kk)
            h_out, h_next = head(head.draft_to_target(f_tok).reshape(-1), pos, f_h.reshape(b * kk, -1), fmeta,
                                 self.draft_cache, False)  # [B*K, H]
            logits = head.compute_logits(h_out, fused).view(b, kk, -1)  # [B, K, Vd]
            if grammar is not None:  # each frontier node's children: the state after its own path
                logits = self._mask_draft(logits, grammar.frontier_mask(head.draft_to_target(f_path)))
            logp = torch.log_softmax(logits, -1)  # [B, K, Vd]
            c_tok, c_score = tops.expand(f_score, logp, kk)  # [B, K*K]
            cand_tok.append(c_tok)
            cand_score.append(c_score)
            cand_parent.append(f_cand.repeat_interleave(kk, 1))
            if level + 1 < tree.depth:
                f_score, idx = tops.best(c_score, kk)  # [B, K] the next frontier
                f_tok = c_tok.gather(1, idx)
                f_cand = n_made + idx
                par = idx // kk  # its parent's frontier index
                f_h = h_next.view(b, kk, -1).gather(1, par[..., None].expand(-1, -1, h_next.shape[-1]))
                f_anc = torch.cat([f_anc.gather(1, par[..., None].expand(-1, -1, level)),
                                   self.frontier_cols.expand(b, kk)[..., None]], -1)
                if grammar is not None:
                    f_path = torch.cat([f_path.gather(1, par[..., None].expand(-1, -1, level)),
                                        c_tok.gather(1, idx)[..., None]], -1)
            n_made += kk * kk
        return tops.finish(torch.cat(cand_score, 1), torch.cat(cand_parent, 1), torch.cat(cand_tok, 1), head.d2t,
                           self.cand_depth, tree.nodes)  # [B, N] x 3, best first

    def _mask_draft(self, logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The head's logits [..., Vd] with every draft id whose target id the grammar mask (int32 [..., W]) refuses
        at -inf; a node whose allowed tokens all lie outside the draft vocabulary drafts unmasked (its children
        are then rejected by the masked target), as the chain's constrained drafts do."""
        vd = logits.shape[-1]
        target_ids = torch.arange(vd, device=logits.device) + self.draft.d2t  # [Vd]
        allowed = allowed_from_bitmask(mask, self.target.cfg.vocab_size)[..., target_ids]  # [..., Vd]
        allowed = allowed | ~allowed.any(-1, keepdim=True)
        return logits.masked_fill(~allowed, float("-inf"))

    def _frontier_meta(self, meta: AttnMetadata, base: torch.Tensor, level: int, lvl_slots: torch.Tensor,
                       length: int) -> AttnMetadata:
        """Metadata of one head call over the K frontier nodes of depth `level` of each row, one row each: position
        base + level, K/V to its scratch slot, keys = the row's committed head K/V (positions 0..base) then its
        ancestors' scratch slots (the tail override from base + 1). base [B]; lvl_slots [B, K, level] scratch
        slot of the node's ancestor at depth 1..level (the node itself last)."""
        b, kk, _ = lvl_slots.shape
        rows = self.frontier_rows[: b * kk]  # [B*K] each frontier node's step row
        n = b * kk
        ids = self.wide_ids[:n]
        pos = base[rows] + level
        return AttnMetadata(num_rows=n, max_q=1, max_kv=length, page_size=self.page_size,
                            q_lens=self.wide_ones[:n], kv_lens=pos + 1, page_table=meta.page_table[rows], tok_row=ids,
                            tok_col=self.wide_zeros[:n], q_index=ids[:, None], q_valid=self.wide_true[:n],
                            positions=pos, slot_mapping=lvl_slots[..., -1].reshape(-1), ops=meta.ops,
                            tail_start=base[rows] + 1, tail_slots=lvl_slots.reshape(n, level))
