"""Draft trees with every sampling invariant the chain has: penalties (repetition / presence / frequency) and
min_tokens score each node with the history plain decoding of its path has (the request's tokens, its ancestors
and itself, never a sibling), logprobs are plain decoding's, and the deterministic mode's coupled walk emits
plain decoding's seeded draws. Engine tests force the condition with scripted trees over the plain output: full
paths down second-choice branches whose decoy siblings carry the very token the next node must not be penalised
for, total rejections and partial paths (tiny random geometry, fp32)."""

from __future__ import annotations

import pytest
import torch

from m3eagle import LLM, SamplingParams
from m3eagle.bench.geometries import tiny
from m3eagle.engine.draft_tree import ancestors, full_tree
from m3eagle.sampling import tree_verify as tv
from m3eagle.sampling.penalties import PenaltyState, PenaltyTensors, penalize_reference
from m3eagle.sampling.sampler import SALT_SAMPLE, SamplingTensors, probs_from_logits, sample_from_probs
from tests.engine.test_draft_tree import ScriptedTree, install_tree_script
from tests.helpers.engine_utils import assert_clean

pytestmark = pytest.mark.usefixtures("one_thread")

# ---- units ------------------------------------------------------------------------------------------------

# root -> 1 (tok 2), 2 (tok 4); 1 -> 3 (tok 0); 2 -> 4 (tok 1), 5 (tok 5); 4 -> 6 (tok 2)
TOKENS = torch.tensor([2, 4, 0, 1, 5, 2])
PARENTS = torch.tensor([0, 0, 1, 2, 2, 4])
DEPTHS = torch.tensor([1, 1, 2, 2, 2, 3])
V = 7


def _paths() -> list[list[int]]:
    """Each node's path tokens (root: none), by storage index."""
    paths: list[list[int]] = [[]]
    for tok, par in zip(TOKENS.tolist(), PARENTS.tolist()):
        paths.append(paths[par] + [tok])
    return paths


def test_tree_penalize_equals_the_reference_on_each_path():
    """Node i is penalised as plain decoding with output = the slot's outputs + its path; min_tokens counts from the
    node's depth position. Two rows: one with the whole tree, one with 4 nodes (the absent ones add nothing)."""
    g = torch.Generator().manual_seed(0)
    b, n1 = 2, TOKENS.shape[0] + 1
    st = PenaltyState(3, V, [6], 2, torch.device("cpu"))
    prompt, outputs = [3, 5], [[1, 4], [4]]
    for s, out in enumerate(outputs):
        st.in_prompt[s, prompt] = True
        for t in out:
            st.counts[s, t] += 1
    pt = PenaltyTensors(presence=torch.tensor([0.7, 0.3]), frequency=torch.tensor([0.4, 0.9]),
                        repetition=torch.tensor([1.3, 1.7]), min_tokens=torch.tensor([4, 0]),
                        prompt_len=torch.tensor([2, 2]), ignore_eos=torch.tensor([False, False]),
                        reset=torch.zeros(b, dtype=torch.bool), src_slot=torch.full((b,), 2),
                        stop_ids=torch.zeros(0, dtype=torch.int64), stop_rows=torch.zeros(0, dtype=torch.int64))
    parents, depths = full_tree(PARENTS.expand(b, -1), DEPTHS.expand(b, -1))
    anc = ancestors(parents, depths, 3)
    logits = torch.randn(b, n1, V, generator=g) * 3
    num_nodes = torch.tensor([6, 4])
    p0 = torch.tensor([2 + 2 - 1, 2 + 1 - 1])  # the root's position: the last emitted token
    node_pos = p0[:, None] + depths
    got = tv.tree_penalize(st, logits, pt, torch.tensor([0, 1]), TOKENS.expand(b, -1), anc, depths, num_nodes,
                           node_pos)
    paths = _paths()
    for r in range(b):
        for i in range(num_nodes[r] + 1):
            want = penalize_reference(logits[r, i], prompt, outputs[r] + paths[i], pt.presence[r].item(),
                                      pt.frequency[r].item(), pt.repetition[r].item(), pt.min_tokens[r].item(), (6,))
            assert torch.allclose(got[r, i], want), (r, i)
    # a sibling's token is not history: node 3 (path 2, 0) and node 4 (path 4, 1) differ from the reference with both
    sib = penalize_reference(logits[0, 4], prompt, outputs[0] + [2, 4, 1], 0.7, 0.4, 1.3, 4, (6,))
    assert not torch.allclose(got[0, 4], sib)


def test_coupled_walk_emits_the_draws_for_any_tree():
    """Coupled tree verification: every emitted token is the target's own draw at its node's position (plain
    decoding's key), the path follows the child equal to each draw, whatever the tree."""
    g = torch.Generator().manual_seed(1)
    b, n1 = 64, TOKENS.shape[0] + 1
    logits = torch.randn(b, n1, V, generator=g)
    logits[:, :, 2] += 2.0  # node 1's and node 6's token: paths get accepted
    st = SamplingTensors(temperature=torch.full((b,), 0.9), top_k=torch.zeros(b, dtype=torch.int64),
                         top_p=torch.ones(b), seed=torch.arange(b, dtype=torch.int64) * 31 + 5,
                         greedy=torch.zeros(b, dtype=torch.bool))
    node_pos = 40 + torch.cat([torch.zeros(1, dtype=torch.int64), DEPTHS])[None].expand(b, -1)
    new, num_new, path = tv.tree_verify(logits, TOKENS.expand(b, -1), PARENTS.expand(b, -1), torch.full((b,), 6), 3,
                                        st, node_pos, True, coupled=True)
    p = probs_from_logits(logits.reshape(b * n1, V), st.repeat(n1))
    x = sample_from_probs(p, st.repeat(n1).seed, node_pos.reshape(-1), SALT_SAMPLE).view(b, n1)
    kids = {i: [j + 1 for j, par in enumerate(PARENTS.tolist()) if par == i] for i in range(n1)}
    for r in range(b):
        cur, want = 0, []
        while True:
            want.append(x[r, cur].item())
            nxt = [c for c in kids[cur] if TOKENS[c - 1].item() == want[-1]]
            if not nxt:
                break
            cur = nxt[0]
        assert new[r, : num_new[r]].tolist() == want, r
    assert (num_new > 2).any() and (num_new == 1).any()


# ---- the engine -------------------------------------------------------------------------------------------


def forced_trees(llm: LLM, seqs: dict[tuple[int, ...], list[int]], vocab: int,
                 patterns: tuple[int, ...] = (0, 1, 2)) -> list[int]:
    """Replace the head's trees by scripted ones over each request's reference continuation `seqs` (prompt +
    output; install_tree_script). The c-th tree of a request takes pattern patterns[c % len(patterns)] -- 0: the
    right path to full depth, each right node after a decoy sibling that holds the token the right node's child
    must predict (a history that took siblings would penalise it); 1: decoys only; 2: the first node right, then
    decoys. Returns the patterns used."""
    spec = llm.engine.runner.tree

    def tree_for(right: list[int], pattern: int) -> tuple[list[int], list[int], list[int]]:
        tree, parent = ScriptedTree(vocab), 0
        for depth in range(1, spec.depth + 1):
            r = right[depth - 1]
            decoy = right[depth] if depth < spec.depth and right[depth] != r else r + 1
            tree.add(parent, decoy, depth)
            if pattern == 0 or (pattern == 2 and depth == 1):
                parent = tree.add(parent, r, depth)
            elif pattern == 1 or len(tree.toks) >= spec.nodes:
                break
        return tree.filled(spec.nodes, right[0] + 1)  # filler leaves never hold the right token

    return install_tree_script(llm, seqs, tree_for, patterns)


KW = dict(device="cpu", load_format="dummy", max_model_len=96, page_size=8)
PEN = dict(presence_penalty=1.5, frequency_penalty=0.7, repetition_penalty=1.4)


@pytest.fixture(scope="module")
def pair():
    t, h = tiny()
    return LLM(t, num_draft_tokens=0, **KW), LLM(t, draft=h, draft_tree="3,2,7", **KW)


def _prompts(seed: int, lengths: tuple[int, ...], vocab: int = 512) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_penalties_tree_equals_plain_with_logprobs(pair):
    """Repetition / presence / frequency penalties: scripted trees (full depth down second branches, rejections,
    partial paths) give plain decoding's tokens and logprobs (of the penalised distribution); the penalties
    change the output (the test means something)."""
    plain, tree = pair
    prompts = _prompts(3, (9, 14))
    sp = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=2, **PEN)
    ref_outs = plain.generate(prompts, sp)
    ref = _tokens(ref_outs)
    assert ref != _tokens(plain.generate(prompts, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)))
    used = forced_trees(tree, {tuple(p): p + r for p, r in zip(prompts, ref)}, 512)
    tree.reset_stats()
    try:
        outs = tree.generate(prompts, sp)
    finally:
        del tree.engine.runner._grow_tree
    assert _tokens(outs) == ref
    assert set(used) == {0, 1, 2} and tree.engine.counters.accept_hist[3] > 0
    for o, r in zip(outs, ref_outs):
        for a, b, t in zip(o.outputs[0].logprobs, r.outputs[0].logprobs, r.outputs[0].token_ids):
            assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)
            assert sorted(a) == sorted(b)
    assert_clean(tree)


def test_min_tokens_tree_equals_plain(pair):
    """min_tokens with stop ids that greedy decoding would emit early: no stop before min_tokens, then the same
    stop as plain decoding. Scripted full paths (4 tokens a step after the prompt step's one) put the min_tokens
    boundary of min_tokens 6 / 7 inside a tree, at depth 1 / 2: the stop is emitted by a node past the root."""
    plain, tree = pair
    prompts = _prompts(5, (11, 7))
    free = _tokens(plain.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)))
    early = sorted({t for r in free for t in r[:8]})
    sps = [SamplingParams(temperature=0, max_tokens=16, min_tokens=6 + i, stop_token_ids=early) for i in range(2)]
    held = _tokens(plain.generate(prompts, sps))
    # each request's stops also take the token it emits at the boundary (not seen before it: the prefix stays)
    assert all(r[sp.min_tokens] not in r[: sp.min_tokens] for sp, r in zip(sps, held))
    sps = [SamplingParams(temperature=0, max_tokens=16, min_tokens=sp.min_tokens,
                          stop_token_ids=early + [r[sp.min_tokens]]) for sp, r in zip(sps, held)]
    ref_outs = plain.generate(prompts, sps)
    ref = _tokens(ref_outs)
    assert [len(r) for r in ref] == [7, 8]  # stopped right at the boundary
    assert all(t not in sp.stop_token_ids for sp, r in zip(sps, ref) for t in r[:-1])
    used = forced_trees(tree, {tuple(p): p + r for p, r in zip(prompts, ref)}, 512, patterns=(0,))
    tree.reset_stats()
    try:
        outs = tree.generate(prompts, sps)
    finally:
        del tree.engine.runner._grow_tree
    assert _tokens(outs) == ref and all(o.outputs[0].finish_reason == "stop" for o in outs)
    assert used and tree.engine.counters.accept_hist[3] > 0
    assert_clean(tree)


def test_seeded_penalties_tree_reproducible(pair):
    """Seeded sampling with penalties and min_tokens through the tree's rejection sampling: a seed reproduces its
    tokens, within a batch and alone; logprobs are the emitted tokens'."""
    _, tree = pair
    prompts = _prompts(7, (10, 6))
    sps = [SamplingParams(temperature=0.9, top_p=0.95, seed=40 + i, max_tokens=10, min_tokens=4, logprobs=1, **PEN)
           for i in range(2)]
    a = tree.generate(prompts, sps)
    assert _tokens(a) == _tokens(tree.generate(prompts, sps))
    assert _tokens(a)[1:] == _tokens(tree.generate(prompts[1:], sps[1:]))
    for o in a:
        c = o.outputs[0]
        assert all(t in lp and lp[t].logprob <= 0 for t, lp in zip(c.token_ids, c.logprobs))
    assert_clean(tree)


def test_penalised_tree_steps_are_sync_free_in_graph_buckets():
    """Penalised tree steps padded to graph buckets (what a CUDA replay computes) read nothing back from the
    device and give plain decoding's tokens; the penalty modes of every bucket warm up (a padding-only step)."""
    from tests.engine.test_tree_graphs import _guard_execute, _NoSync

    t, h = tiny()
    plain = LLM(t, num_draft_tokens=0, **KW)
    tree = LLM(t, draft=h, draft_tree="3,2,6", graph_shapes=True, **KW)
    keys = [k for k in tree.engine.graphs.warm_keys() if not isinstance(k[0], tuple) and k[1][2]]
    assert keys and all(tree.engine.graphs.warm(b, m) for b, m in keys[-2:])
    prompts = _prompts(9, (8, 12, 5))
    sps = [SamplingParams(temperature=0, max_tokens=8 + 3 * i, ignore_eos=True, min_tokens=3, **PEN) for i in range(3)]
    ref = _tokens(plain.generate(prompts, sps))
    counts: dict[str, int] = {}
    _guard_execute(tree, counts)
    forced_trees(tree, {tuple(p): p + r for p, r in zip(prompts, ref)}, 512)
    tree.engine.runner._grow_tree = _NoSync.allowed(tree.engine.runner._grow_tree)  # the script reads tokens
    assert _tokens(tree.generate(prompts, sps)) == ref
    assert counts.get("decode", 0) > 3 and tree.engine.counters.accept_hist[3] > 0, counts
    assert_clean(tree)


def test_constrained_tree_equals_constrained_plain():
    """Structured output (the embedded pair): greedy constrained tree decoding == greedy constrained plain decoding
    token for token, with the head's own (masked) trees and with scripted trees whose decoys are the next
    right token; every output parses and validates."""
    from tests.engine.test_structured_engine import _check_valid, _so_cases

    cases = [c for i, c in enumerate(_so_cases()) if i in (0, 6, 21, 22)]  # schemas, a choice, a regex
    prompts = [p for p, _ in cases]
    sps = [SamplingParams(temperature=0, max_tokens=24, structured_outputs=so) for _, so in cases]
    kw = dict(device="cpu", max_model_len=128)
    plain, tree = LLM(num_draft_tokens=0, **kw), LLM(draft_tree="3,2,6", **kw)
    ref_outs = plain.generate(prompts, sps, use_tqdm=False)
    _check_valid(ref_outs, cases)
    ref = _tokens(ref_outs)
    outs = tree.generate(prompts, sps, use_tqdm=False)
    assert _tokens(outs) == ref
    _check_valid(outs, cases)
    assert tree.stats()["mean_acceptance_length"] > 1.3  # masked trees are taken
    ids = [list(o.prompt_token_ids) for o in ref_outs]
    forced_trees(tree, {tuple(p): p + r for p, r in zip(ids, ref)}, plain.target.cfg.vocab_size)
    tree.reset_stats()
    try:
        outs = tree.generate(prompts, sps, use_tqdm=False)
    finally:
        del tree.engine.runner._grow_tree
    assert _tokens(outs) == ref and tree.engine.counters.accept_hist[3] > 0
    _check_valid(outs, cases)
    assert_clean(tree)


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_deterministic_tree_equals_deterministic_plain(seeded):
    """deterministic=True with a tree: coupled tree verification emits the draws of decoding without drafts --
    greedy and seeded (with penalties), with the random head's own trees (mostly rejected) and with scripted
    trees over the plain draws (accepted to full depth down second branches)."""
    t, h = tiny()
    kw = dict(KW, deterministic=True)
    prompts = _prompts(11, (9, 13, 6))
    sps = [SamplingParams(temperature=0.9 if seeded else 0.0, top_p=0.95, seed=7 + i, max_tokens=10 + 2 * i,
                          ignore_eos=True, **(PEN if seeded else {})) for i in range(3)]
    ref = _tokens(LLM(t, num_draft_tokens=0, **kw).generate(prompts, sps))
    tree = LLM(t, draft=h, draft_tree="3,2,6", **kw)
    assert _tokens(tree.generate(prompts, sps)) == ref
    assert _tokens(tree.generate(prompts[1:2], sps[1:2])) == ref[1:2]
    forced_trees(tree, {tuple(p): p + r for p, r in zip(prompts, ref)}, 512)
    tree.reset_stats()
    assert _tokens(tree.generate(prompts, sps)) == ref
    assert tree.engine.counters.accept_hist[3] > 0
    assert_clean(tree)


def test_penalties_tree_under_overlap_equals_plain():
    """Under overlap (step n+1 planned while step n runs, rows corrected on the device) the penalty history of
    each slot stays exact: scripted trees give plain decoding's penalised tokens, with min_tokens."""
    t, h = tiny()
    plain, tree = LLM(t, num_draft_tokens=0, **KW), LLM(t, draft=h, draft_tree="3,2,6", overlap=True, **KW)
    assert tree.engine.cfg.overlap
    prompts = _prompts(13, (7, 10, 12))
    sps = [SamplingParams(temperature=0, max_tokens=9 + 2 * i, ignore_eos=True, min_tokens=4, **PEN) for i in range(3)]
    ref = _tokens(plain.generate(prompts, sps))
    forced_trees(tree, {tuple(p): p + r for p, r in zip(prompts, ref)}, 512)
    assert _tokens(tree.generate(prompts, sps)) == ref
    assert tree.engine.counters.accept_hist[3] > 0
    assert_clean(tree)
