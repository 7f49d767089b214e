"""Draft trees (engine/draft_tree.py, engine/tree_runner.py): construction, the node rows' attention layout, and the
engine end to end -- greedy tree speculation equals greedy plain decoding token for token, with scripted trees
that force full acceptance down second-choice branches, total rejection and partial paths (never hoping the
head produces them), on the embedded pair and on the tiny random geometry past its sparse-attention threshold;
the committed KV equals plain decoding's; the option's refusals name the fix."""

from __future__ import annotations

import pytest
import torch

from m3eagle import LLM, SamplingParams
from m3eagle.bench.geometries import tiny
from m3eagle.engine.draft_tree import (
    TreeSpec,
    ancestors,
    best,
    expand,
    full_tree,
    rerank,
    tree_mask,
)
from m3eagle.kernels.attention import reference
from m3eagle.kernels.attention.metadata import AttnMetadata

# ---- construction -------------------------------------------------------------------------------------


def test_spec_parse_and_refusals():
    assert TreeSpec.parse("3,4,16") == TreeSpec(3, 4, 16) == TreeSpec.parse((3, 4, 16))
    assert TreeSpec(3, 4, 16).max_candidates == 4 + 2 * 16
    for bad, word in (("3,4", "DEPTH,TOPK,NODES"), ("0,4,4", "depth=0"), ("3,9,16", "topk=9"),
                      ("2,2,7", "nodes=7 exceeds the 6"), ("3,4,65", "nodes=65")):
        with pytest.raises(ValueError, match=word):
            TreeSpec.parse(bad)


def test_expand_keeps_each_parents_topk_and_adds_scores():
    logp = torch.log_softmax(torch.tensor([[[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 4.0]]]), -1)  # [1, 2, 4]
    tok, score = expand(torch.tensor([[-1.0, -2.0]]), logp, 2)
    assert tok.tolist() == [[1, 3, 0, 3]]
    want = torch.tensor([-1.0 + logp[0, 0, 1], -1.0 + logp[0, 0, 3], -2.0 + logp[0, 1, 0], -2.0 + logp[0, 1, 3]])
    assert torch.allclose(score[0], want)
    # ties go to the lower index (a stable sort), whatever the device's topk would do
    assert best(torch.tensor([[1.0, 2.0, 2.0, 0.0]]), 2)[1].tolist() == [[1, 2]]


def test_best_equals_a_stable_descending_sort_with_ties_and_infinities():
    """best() is topk over unique keys; it must pick and order exactly as a stable descending sort would, with
    many ties (bf16-rounded log-probs), -inf (masked tokens), negatives and positives, at several k."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, 300, generator=g).to(torch.bfloat16).float()  # coarse values: ties everywhere
    x[0, 0, :40] = float("-inf")
    x[1, 1, :] = -2.0  # one row all equal
    x[2] = x[2].abs()
    for k in (1, 3, 16, 300):
        vals, idx = best(x, k)
        ref_v, ref_i = x.sort(dim=-1, descending=True, stable=True)
        assert torch.equal(idx, ref_i[..., :k]) and torch.equal(vals, ref_v[..., :k]), k
    lp = torch.log_softmax(torch.randn(4, 1000, generator=g), -1).to(torch.bfloat16)  # the head's dtype
    assert torch.equal(best(lp, 8)[1], lp.sort(dim=-1, descending=True, stable=True)[1][:, :8])


def test_rerank_budget_closure_and_order():
    # candidates: 0,1 at depth 1 (root's), 2,3 under 0, 4,5 under 1, 6 under 3
    parents = torch.tensor([[-1, -1, 0, 0, 1, 1, 3]])
    scores = torch.tensor([[-0.1, -1.0, -0.3, -0.2, -1.5, -1.1, -0.2]])  # 6 ties its parent 3
    sel, par = rerank(scores, parents, 4)
    assert sel.tolist() == [[0, 2, 3, 6]]  # the best four, creation order; 6's parent 3 comes along first
    assert par.tolist() == [[0, 1, 1, 3]]  # storage index of the parent (root 0)
    for n in range(1, 8):  # every budget is closed under ancestors
        sel, par = rerank(scores, parents, n)
        assert all(p <= i for i, p in enumerate(par[0].tolist())), (n, par)


def test_ancestors_and_mask_of_a_hand_built_tree():
    # root -> 1, 2; 1 -> 3, 4; 3 -> 5
    parents, depths = full_tree(torch.tensor([[0, 0, 1, 1, 3]]), torch.tensor([[1, 1, 2, 2, 3]]))
    anc = ancestors(parents, depths, 3)
    assert anc[0, 5].tolist() == [0, 1, 3, 5] and anc[0, 4].tolist() == [0, 1, 4, 4]
    mask = tree_mask(parents, depths, 3)[0].int()
    want = [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0], [1, 1, 0, 1, 0, 0], [1, 1, 0, 0, 1, 0],
            [1, 1, 0, 1, 0, 1]]
    assert mask.tolist() == want
    # root at position 10, nodes stored at 11..15: the storage positions a node's tail override reads
    assert (10 + anc[0, 5, 1:]).tolist() == [11, 13, 15]  # node 1 (depth 1), node 3, itself
    assert (10 + anc[0, 2, 1:2]).tolist() == [12]


@pytest.mark.parametrize("sparse", [False, True])
def test_node_rows_equal_dense_tree_mask_attention(sparse):
    """The node-row layout (each node a causal row over context + ancestors at depth positions, through the
    metadata's tail override as tree_runner lays it out) gives the attention of a dense reference that masks
    a flat [context, tree] key list with the ancestor mask --
    and on a sparse layer the block selection of the node's own path sequence."""
    g = torch.Generator().manual_seed(0)
    p0, ps, hq, hkv, d = 13, 4, 4, 2, 8
    parents, depths = full_tree(torch.tensor([[0, 0, 1, 1, 3, 2]]), torch.tensor([[1, 1, 2, 2, 3, 2]]))
    n1 = parents.shape[1]
    length = p0 + n1
    slots = 64
    k_pool, v_pool = torch.randn(slots, hkv, d, generator=g), torch.randn(slots, hkv, d, generator=g)
    ik_pool = torch.randn(slots, 8, generator=g)
    table = torch.arange(1, 1 + -(-length // ps))[None]  # [1, P] pages 1..
    anc = ancestors(parents, depths, 3)
    # storage position of node i's virtual key v: v up to p0, then its ancestor at depth v - p0
    v = torch.arange(length)
    keys = torch.where(v[None, :] <= p0, v[None, :], p0 + anc[0].gather(1, (v - p0).clamp(0, 3)[None].expand(n1, -1)))
    rows = torch.zeros(n1, dtype=torch.int64)
    tail = table[0, (p0 + anc[0, :, 1:]) // ps] * ps + (p0 + anc[0, :, 1:]) % ps  # [N+1, D] ancestors' slots
    pos = p0 + depths[0]
    q = torch.randn(n1, hq, d, generator=g)
    iq = torch.randn(n1, 2, 8, generator=g)
    ids = torch.arange(n1)
    meta = AttnMetadata(num_rows=n1, max_q=1, max_kv=length, page_size=ps, q_lens=torch.ones(n1, dtype=torch.int64),
                        kv_lens=pos + 1, page_table=table[rows], tok_row=ids, tok_col=torch.zeros_like(ids),
                        q_index=ids[:, None], q_valid=torch.ones(n1, 1, dtype=torch.bool), positions=pos,
                        slot_mapping=None, tail_start=torch.full((n1,), p0 + 1), tail_slots=tail)
    extra = (iq, ik_pool, 4, 1, 1) if sparse else ()
    got = reference.paged_attention(q, k_pool, v_pool, meta, 0.5, *extra)
    flat = table[0, torch.arange(length) // ps] * ps + torch.arange(length) % ps  # storage order: context, tree
    mask = torch.zeros(n1, length, dtype=torch.bool)
    mask[:, :p0] = True
    mask[:, p0:] = tree_mask(parents, depths, 3)[0]
    if sparse:  # the reference's selection on each node's own path sequence, expressed on the flat keys
        for i in range(n1):
            path = keys[i, : pos[i] + 1]
            sel = reference.select_blocks(iq[i][None, None], ik_pool[table[0, path // ps] * ps + path % ps][None],
                                          pos[i].view(1, 1), 4, 1, 1)
            keep = reference.block_keep_mask(sel, path.shape[0], 4, hq)[0, 0, 0]  # [path] (head 0 group)
            seen = torch.zeros(length, dtype=torch.bool)
            seen[path[keep]] = True
            mask[i] &= seen
        assert not mask.all(), "sparse selection must drop something for the check to mean anything"
    qf, kf, vf = q[:, :, None], k_pool[flat].repeat_interleave(2, 1), v_pool[flat].repeat_interleave(2, 1)
    scores = torch.einsum("nhd,lhd->nhl", q, kf) * 0.5
    if sparse:  # heads of index group 1 select on their own: compare the group-0 heads only
        got, scores, qf = got[:, :2], scores[:, :2], qf
        vf = vf[:, :2]
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    want = torch.einsum("nhl,lhd->nhd", torch.softmax(scores, -1), vf)
    assert torch.allclose(got, want, atol=1e-5)


# ---- the engine, with scripted trees ------------------------------------------------------------------------


class ScriptedTree:
    """A scripted tree under construction, nodes in storage order (a parent before its children)."""

    def __init__(self, vocab: int):
        self.vocab, self.toks, self.pars, self.deps = vocab, [], [], []

    def add(self, parent: int, tok: int, depth: int) -> int:
        """Node `tok` (mod vocab) under storage index `parent` (0: the root) -> its own storage index."""
        self.toks.append(tok % self.vocab)
        self.pars.append(parent)
        self.deps.append(depth)
        return len(self.toks)

    def filled(self, nodes: int, filler: int) -> tuple[list[int], list[int], list[int]]:
        """(tokens, parents, depths) of exactly `nodes` nodes: filler leaves filler+1, filler+2, .. under the root."""
        i = 0
        while len(self.toks) < nodes:
            i += 1
            self.add(0, filler + i, 1)
        return self.toks[:nodes], self.pars[:nodes], self.deps[:nodes]


def install_tree_script(llm: LLM, seqs: dict[tuple[int, ...], list[int]], build, patterns: tuple[int, ...]) -> list[int]:
    """Replace the head's trees by scripted ones (the head still runs, its K/V as usual): the c-th tree of a
    request is build(right, patterns[c % len(patterns)]) -> (tokens, parents, depths), `right` the request's
    reference continuation (seqs: prompt + output) for the D + 1 positions after its last accepted token.
    Returns the patterns used, in order."""
    runner, eng = llm.engine.runner, llm.engine
    spec, orig = runner.tree, runner._grow_tree
    used: list[int] = []
    steps: dict[str, int] = {}  # trees grown per request: the pattern cycles whatever each step accepted

    def grow(inp, meta, aux, last_idx, shifted, at, row_ids, chain=False):
        tokens, parents, depths = orig(inp, meta, aux, last_idx, shifted, at, row_ids, chain=chain)
        n = tokens.shape[1]  # a narrow step's growth holds D nodes: the script's first D (closed under ancestors)
        by_slot = {r.slot: r for r in eng.scheduler.running}
        for i, (slot, pos) in enumerate(zip(inp.row_slot.tolist(), at[0].tolist())):
            req = by_slot.get(slot)
            if req is None:
                continue
            seq = seqs[tuple(req.prompt_token_ids)]
            right = [seq[p] if p < len(seq) else 0 for p in range(pos + 2, pos + 3 + spec.depth)]
            pattern = patterns[steps.setdefault(req.request_id, 0) % len(patterns)]
            steps[req.request_id] += 1
            used.append(pattern)
            t, p, d = build(right, pattern)
            tokens[i], parents[i], depths[i] = torch.tensor(t[:n]), torch.tensor(p[:n]), torch.tensor(d[:n])
        return tokens, parents, depths

    runner._grow_tree = grow
    return used


def scripted_trees(llm: LLM, seqs: dict[tuple[int, ...], list[int]], vocab: int) -> list[int]:
    """Scripted trees over the target's own greedy continuation `seqs` (install_tree_script): the c-th tree of a
    request gets pattern c % 3 -- 0: the right path down second-choice branches to full depth, 1: nothing right,
    2: the first node right then only wrong children. Returns the patterns used."""
    spec = llm.engine.runner.tree

    def tree_for(right: list[int], pattern: int) -> tuple[list[int], list[int], list[int]]:
        tree, parent = ScriptedTree(vocab), 0
        for depth in range(1, spec.depth + 1):
            r = right[depth - 1]
            if pattern == 0:
                tree.add(parent, r + 1, depth)
                parent = tree.add(parent, r, depth)
            elif pattern == 1:
                tree.add(parent, r + 1, depth)
                parent = tree.add(parent, r + 2, depth)
            else:
                parent = tree.add(parent, r if depth == 1 else r + 1, depth)
                tree.add(parent - 1 if depth > 1 else 0, r + 3, depth) if depth > 1 else tree.add(0, r + 2, 1)
            if len(tree.toks) >= spec.nodes - 1:
                break
        return tree.filled(spec.nodes, right[0] + 3)  # filler leaves never hold the right token

    return install_tree_script(llm, seqs, tree_for, (0, 1, 2))


@pytest.fixture(scope="module")
def embedded():
    plain = LLM(device="cpu", num_draft_tokens=0, max_model_len=256)
    tree = LLM(device="cpu", draft_tree="3,2,8", max_model_len=256)
    return plain, tree


def _prompts_embedded(llm: LLM) -> list[list[int]]:
    texts = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n\ndef main(argv):\n    parser = ",
             "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"]
    return [list(llm.engine.tokenizer.encode(t)) for t in texts]


def test_greedy_tree_equals_plain_embedded(embedded):
    """The trained head's own trees, then scripted trees (full acceptance on second branches, full rejection,
    partial): the same greedy tokens as plain decoding; the scripted run really accepted full depth."""
    plain, tree = embedded
    prompts = _prompts_embedded(plain)[:2]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, sp)]
    got = [o.outputs[0].token_ids for o in tree.generate(prompts, sp)]
    assert got == ref
    assert tree.stats()["mean_acceptance_length"] > 1.5  # the head's trees are taken
    seqs = {tuple(p): p + r for p, r in zip(prompts, ref)}
    tree.reset_stats()
    used = scripted_trees(tree, seqs, plain.target.cfg.vocab_size)
    try:
        got = [o.outputs[0].token_ids for o in tree.generate(prompts, sp)]
    finally:
        del tree.engine.runner._grow_tree
    assert got == ref
    assert set(used) == {0, 1, 2}
    hist = tree.engine.counters.accept_hist
    assert hist[0] > 0 and hist[1] > 0 and hist[3] > 0, hist  # rejections, partial paths, full depth (3)
    tree.engine.check_integrity()


def tiny_tree_and_reference(spec: str, seed: int, lengths: tuple[int, ...], max_tokens: int):
    """The tiny random geometry (MSA past 16 tokens) with a `spec` tree LLM, seeded prompts of `lengths` tokens,
    greedy params and the plain engine's tokens for them -> (tree LLM, prompts, params, reference, vocab)."""
    t, h = tiny()
    kw = dict(device="cpu", load_format="dummy", max_model_len=160, page_size=8)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, t.vocab_size, (n,), generator=g).tolist() for n in lengths]
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(t, num_draft_tokens=0, **kw).generate(prompts, sp)]
    return LLM(t, draft=h, draft_tree=spec, **kw), prompts, sp, ref, t.vocab_size


def test_greedy_tree_equals_plain_tiny_sparse():
    """The tiny random geometry (MSA block selection active past 16 tokens), prompts of 40-60 tokens, a random
    head plus scripted trees: token for token the plain greedy output, several requests in one batch."""
    tree, prompts, sp, ref, vocab = tiny_tree_and_reference("4,3,12", 3, (40, 47, 60), 36)
    assert [o.outputs[0].token_ids for o in tree.generate(prompts, sp)] == ref
    used = scripted_trees(tree, {tuple(p): p + r for p, r in zip(prompts, ref)}, vocab)
    tree.reset_stats()
    assert [o.outputs[0].token_ids for o in tree.generate(prompts, sp)] == ref
    assert set(used) == {0, 1, 2} and tree.engine.counters.accept_hist[4] > 0
    tree.engine.check_integrity()


def test_kv_commit_equals_plain_decoding(embedded):
    """After scripted trees (paths accepted down second branches, rejections), every committed position of the
    request's pages holds the K / V / index-K plain decoding wrote, and the head's K/V equals the chain's
    (both are the head's step 0 over the committed tokens); page accounting intact."""
    plain, tree = embedded
    chain = LLM(device="cpu", num_draft_tokens=3, max_model_len=256)
    prompt = _prompts_embedded(plain)[2]
    sp = SamplingParams(temperature=0, max_tokens=22, ignore_eos=True)
    ref = plain.generate([prompt], sp)[0].outputs[0].token_ids
    used = scripted_trees(tree, {tuple(prompt): prompt + ref}, plain.target.cfg.vocab_size)
    reqs = []
    try:
        for llm in (tree, plain, chain):
            eng = llm.engine
            req = eng.add_request(list(prompt), SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
            while len(req.output_token_ids) < 16:
                eng.step()
            reqs.append(req)
        n = min(r.num_computed for r in reqs)
        assert n >= len(prompt) + 15 and set(used) == {0, 1, 2}
        assert reqs[0].output_token_ids[:16] == ref[:16]

        def slots(llm, req):
            ps = llm.engine.cfg.page_size
            return torch.tensor([req.pages[p // ps] * ps + p % ps for p in range(n)])

        s_tree, s_plain, s_chain = slots(tree, reqs[0]), slots(plain, reqs[1]), slots(chain, reqs[2])
        for ct, cp in zip(tree.engine.runner.caches, plain.engine.runner.caches):
            for a, b in ((ct.k, cp.k), (ct.v, cp.v), (ct.idx_k, cp.idx_k)):
                if a is not None:
                    assert torch.allclose(a[s_tree], b[s_plain], atol=1e-4, rtol=1e-4)
        dt, dc = tree.engine.runner.draft_cache, chain.engine.runner.draft_cache
        assert torch.allclose(dt.k[s_tree], dc.k[s_chain], atol=1e-4, rtol=1e-4)
        assert torch.allclose(dt.v[s_tree], dc.v[s_chain], atol=1e-4, rtol=1e-4)
        tree.engine.check_integrity()
    finally:
        del tree.engine.runner._grow_tree
        for llm, req in zip((tree, plain, chain), reqs):
            llm.engine.abort(req.request_id)
            llm.engine.step()
    for llm in (tree, plain, chain):
        llm.engine.check_integrity()


def test_sampled_tree_runs_seeded_with_logprobs(embedded):
    """Sampled rows (temperature, top_p, min_p, seed, logprobs) go through the tree's rejection sampling; a seed
    reproduces its tokens; logprobs are the emitted tokens' own."""
    _, tree = embedded
    prompts = _prompts_embedded(tree)[:1]
    sp = SamplingParams(temperature=0.9, top_p=0.95, min_p=0.01, seed=11, max_tokens=12, ignore_eos=True, logprobs=1)
    a = tree.generate(prompts, sp)
    b = tree.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    for o in a:
        c = o.outputs[0]
        assert len(c.logprobs) == len(c.token_ids)
        assert all(t in lp and lp[t].logprob <= 0 for t, lp in zip(c.token_ids, c.logprobs))


def test_refusals_name_the_options():
    with pytest.raises(ValueError, match="pass one"):
        LLM(device="cpu", draft_tree="3,4,16", num_draft_tokens=3)
    # prefill graphs are no refusal: a tree's prompt and mixed steps pad to prefill buckets (test_tree_prefill.py)
    assert LLM(device="cpu", draft_tree="3,4,16", prefill_graphs=True).engine.cfg.prefill_graphs is True
    with pytest.raises(ValueError, match="num_scheduler_steps=2"):
        LLM(device="cpu", draft_tree="3,4,16", num_scheduler_steps=2)


def test_forced_preemption_mid_tree_keeps_greedy_output_and_pages():
    """A preemption forced every 3rd plan under tree drafting (requests recompute from their accepted tokens,
    their tree slots rebuilt from a prompt step): still the plain greedy tokens, preemptions really happened,
    and no page leaks."""
    from tests.helpers.engine_utils import Counters, assert_clean

    tree, prompts, sp, ref, vocab = tiny_tree_and_reference("3,2,6", 5, (20, 33, 41), 24)
    c = Counters(tree, force_every=3)
    assert [o.outputs[0].token_ids for o in tree.generate(prompts, sp)] == ref
    assert c.preempted > 0
    tree.engine.check_integrity()
    # scripted trees (full, partial and rejected paths) between the preemptions
    used = scripted_trees(tree, {tuple(p): p + r for p, r in zip(prompts, ref)}, vocab)
    before = c.preempted
    assert [o.outputs[0].token_ids for o in tree.generate(prompts, sp)] == ref
    assert c.preempted > before and set(used) == {0, 1, 2}
    assert tree.engine.counters.accept_hist[3] > 0  # full-depth paths were accepted between preemptions
    tree.engine.check_integrity()
    assert_clean(tree)
