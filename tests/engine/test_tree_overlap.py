"""Draft trees under the overlap scheduler: the host plans step n+1 while step n runs, assuming every node of its
tree accepted; the device corrects each row's length, positions and slots from what step n really accepted (the
chain's correction: slot_dev) and gathers its ids and tree from the slot buffers. Overlap on equals overlap off:
the plain greedy tokens, with scripted full / partial / rejected paths, in graph buckets too, and through
forced preemptions; steps really ran corrected rows."""

from __future__ import annotations

import pytest

from tests.engine.test_draft_tree import scripted_trees, tiny_tree_and_reference
from tests.engine.test_tree_graphs import _same_with
from tests.helpers.engine_utils import Counters, assert_clean


def _count_corrected(llm, seen: list[int]) -> None:
    """Record, per step, how many rows take the on-device correction (planned while a step was in flight)."""
    runner = llm.engine.runner
    orig = runner.execute

    def execute(inp):
        seen.append(int((inp.row_correct & (inp.row_num_drafts > 0)).sum()))
        return orig(inp)

    runner.execute = execute


@pytest.mark.parametrize("graph_shapes", [False, True], ids=["eager", "buckets"])
def test_tree_overlap_equals_plain_greedy(graph_shapes):
    tree, prompts, sp, ref, vocab = tiny_tree_and_reference("3,3,8", 7, (30, 41, 19), 20)
    tree = _same_with(tree, overlap=True, graph_shapes=graph_shapes)
    assert tree.engine.cfg.overlap
    seen: list[int] = []
    _count_corrected(tree, seen)
    assert [o.outputs[0].token_ids for o in tree.generate(prompts, sp)] == ref
    used = scripted_trees(tree, {tuple(p): p + r for p, r in zip(prompts, ref)}, vocab)
    assert [o.outputs[0].token_ids for o in tree.generate(prompts, sp)] == ref
    assert set(used) == {0, 1, 2} and tree.engine.counters.accept_hist[3] > 0
    assert sum(n > 0 for n in seen) > 10, seen  # tree rows planned with a step in flight, corrected on device
    assert_clean(tree)


def test_tree_overlap_with_forced_preemption():
    tree, prompts, sp, ref, vocab = tiny_tree_and_reference("3,2,6", 5, (20, 33, 41), 24)
    tree = _same_with(tree, overlap=True)
    c = Counters(tree, force_every=3)
    used = scripted_trees(tree, {tuple(p): p + r for p, r in zip(prompts, ref)}, vocab)
    assert [o.outputs[0].token_ids for o in tree.generate(prompts, sp)] == ref
    assert c.preempted > 0 and set(used) == {0, 1, 2}
    assert_clean(tree)
