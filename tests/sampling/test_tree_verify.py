"""Tree verification (sampling/tree_verify.py): the greedy walk follows the argmax through siblings, and recursive
rejection sampling over siblings emits exactly the target's (processed) distribution -- a chi-square test on a
small vocabulary with fixed seeds, forced trees whose first children are often rejected, and a mutated residual
that the same test must reject."""

from __future__ import annotations

import pytest
import torch

from m3eagle.sampling import tree_verify as tv
from m3eagle.sampling.sampler import SamplingTensors, probs_from_logits

# root -> 1 (tok 2), 2 (tok 4); 1 -> 3 (tok 0); 2 -> 4 (tok 1), 5 (tok 5)
TOKENS = torch.tensor([2, 4, 0, 1, 5])
PARENTS = torch.tensor([0, 0, 1, 2, 2])
V = 6


def _st(b: int, greedy: bool = False, min_p: float = 0.0) -> SamplingTensors:
    return SamplingTensors(temperature=torch.full((b,), 0.0 if greedy else 1.0), top_k=torch.zeros(b, dtype=torch.int64),
                           top_p=torch.ones(b), seed=torch.arange(b, dtype=torch.int64) * 7919 + 3,
                           greedy=torch.full((b,), greedy), min_p=torch.full((b,), min_p))


def test_greedy_walk_takes_the_matching_sibling():
    logits = torch.full((1, 6, V), -5.0)
    logits[0, 0, 4] = 5.0  # root's argmax: node 2's token (the second sibling)
    logits[0, 2, 5] = 5.0  # node 2's argmax: node 5's token (second sibling again)
    logits[0, 5, 3] = 5.0  # the bonus after node 5 (a leaf)
    st = _st(1, greedy=True)
    new, num_new, path = tv.tree_verify(logits, TOKENS[None], PARENTS[None], torch.tensor([5]), 2, st,
                                        torch.tensor([[10, 11, 11, 12, 12, 12]]), any_random=False)
    assert path.tolist() == [[0, 2, 5]] and num_new.tolist() == [3] and new[0, :3].tolist() == [4, 5, 3]
    # the sampled path's greedy rows agree; a row with no nodes emits the root's argmax
    new2, num2, _ = tv.tree_verify(logits.expand(2, -1, -1), TOKENS.expand(2, -1), PARENTS.expand(2, -1),
                                   torch.tensor([5, 0]), 2, _st(2, greedy=True), torch.zeros(2, 6, dtype=torch.int64))
    assert num2.tolist() == [3, 1] and new2[0, :3].tolist() == [4, 5, 3] and new2[1, 0].item() == 4


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    exp = probs * n
    keep = exp > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - exp[keep]) ** 2 / exp[keep]).sum())


def _emitted(b: int, logits: torch.Tensor, min_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    new, num_new, _ = tv.tree_verify(logits.expand(b, -1, -1), TOKENS.expand(b, -1), PARENTS.expand(b, -1),
                                     torch.full((b,), 5), 2, _st(b, min_p=min_p),
                                     torch.tensor([[40, 41, 41, 42, 42, 42]]).expand(b, -1))
    return new, num_new


@pytest.fixture(scope="module")
def target():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, V, generator=g)
    logits[0, 2], logits[0, 4] = 1.2, 1.0  # the root's children are likely but far from certain
    logits[2, 5], logits[2, 1] = 0.9, 0.8
    logits[0, 3] = -6.0  # below min_p: the processed distribution drops it
    probs = probs_from_logits(logits, _st(6, min_p=0.02))  # [6, V] what each node's emitted token must follow
    assert probs[0, 3] == 0
    return logits[None], probs


def _check(logits: torch.Tensor, probs: torch.Tensor, b: int = 30000, strict: bool = True) -> list[float]:
    new, num_new = _emitted(b, logits, 0.02)
    first = new[:, 0]
    chis = [_chi2(torch.bincount(first, minlength=V).double(), probs[0].double())]
    if not strict:
        return chis
    # a first token that is a child's was accepted there, and the next token follows that child's distribution
    for child, tok in ((1, 2), (2, 4)):
        rows = first == tok
        assert (num_new[rows] >= 2).all()
        chis.append(_chi2(torch.bincount(new[rows, 1], minlength=V).double(), probs[child].double()))
    assert (num_new[(first != 2) & (first != 4)] == 1).all()
    return chis


def test_rejection_sampling_over_siblings_is_the_target_distribution(target):
    logits, probs = target
    # chi-square, 5 degrees of freedom (4 where min_p drops a token): P(> 25) < 1.4e-4 for a correct sampler
    assert max(_check(logits, probs)) < 25.0


def test_a_wrong_residual_fails_the_same_test(target, monkeypatch):
    """Mutation: a rejected sibling stays in the residual (the naive 'resample from p'): the first token's
    distribution is biased toward the root's children, and the test above catches it."""
    logits, probs = target
    monkeypatch.setattr(tv, "remove_rejected", lambda resid, tok, rejected: resid)
    assert _check(logits, probs, strict=False)[0] > 100.0
    with pytest.raises(AssertionError):  # and a rejected child's token is emitted without its subtree
        _check(logits, probs)
