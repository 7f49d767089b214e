"""Coupled verification (the deterministic mode's, sampling/verify.py): each scored position draws the target's own
sample keyed on (seed, position), a draft is accepted iff it equals that draw, and the emitted tokens are the
draws -- what sampling without drafts emits, whatever the drafts are."""

from __future__ import annotations

import torch

from m3eagle.sampling.sampler import SALT_SAMPLE, SamplingTensors, probs_from_logits, sample_from_probs
from m3eagle.sampling.verify import verify

B, K, V = 6, 3, 40


def tensors(greedy_rows: tuple[int, ...] = ()) -> SamplingTensors:
    greedy = torch.zeros(B, dtype=torch.bool)
    greedy[list(greedy_rows)] = True
    return SamplingTensors(temperature=torch.where(greedy, 0.0, 0.9), top_k=torch.zeros(B, dtype=torch.int64),
                           top_p=torch.full((B,), 0.95), seed=torch.arange(B, dtype=torch.int64) * 7 + 1,
                           greedy=greedy)


def draws(logits: torch.Tensor, st: SamplingTensors, positions: torch.Tensor) -> torch.Tensor:
    """What sampling without drafts emits at every scored position: [B, K+1]."""
    rep = st.repeat(K + 1)
    p = probs_from_logits(logits.reshape(B * (K + 1), V), rep)
    x = sample_from_probs(p, rep.seed, positions.reshape(-1), SALT_SAMPLE).view(B, K + 1)
    return torch.where(st.greedy[:, None], logits.argmax(-1), x)


def test_emitted_tokens_are_the_draws_whatever_the_drafts():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, K + 1, V, generator=g) * 2
    positions = torch.arange(K + 1)[None, :] + torch.tensor([3, 10, 0, 57, 8, 21])[:, None]
    st = tensors(greedy_rows=(4,))
    x = draws(logits, st, positions)
    cases = [x[:, :K].clone(),  # every draft is the draw: all accepted
             torch.randint(0, V, (B, K), generator=g),  # random drafts: mostly rejected
             torch.cat([x[:, :1], (x[:, 1:2] + 1) % V, x[:, 2:K]], 1)]  # the second draft wrong
    for drafts in cases:
        for nd in (torch.full((B,), K), torch.tensor([0, 1, 2, 3, 3, 1])):
            q = torch.softmax(torch.randn(B, K, V, generator=g), -1)  # ignored: coupled needs no q
            toks, n = verify(logits, drafts, nd, st, positions, q, coupled=True)
            lead = ((drafts == x[:, :K]) & (torch.arange(K)[None, :] < nd[:, None])).long().cumprod(-1).sum(-1)
            assert torch.equal(n, lead + 1)
            for b in range(B):
                assert toks[b, :n[b]].tolist() == x[b, :n[b]].tolist()
    assert torch.equal(verify(logits, cases[0], torch.full((B,), K), st, positions, None, coupled=True)[1],
                       torch.full((B,), K + 1))


def test_a_draft_drawn_with_the_same_key_from_the_same_distribution_is_always_accepted():
    """The drafts' coupling: q == p and the draft drawn by inverse CDF against the draw's own uniform give the
    same token, so a perfect draft head accepts everything (independent draws would not)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(B, K + 1, V, generator=g)
    positions = torch.arange(K + 1)[None, :].expand(B, K + 1) + 5
    st = tensors()
    rep = st.repeat(K + 1)
    p = probs_from_logits(logits.reshape(B * (K + 1), V), rep).view(B, K + 1, V)
    drafts = torch.stack([sample_from_probs(p[:, j], st.seed, positions[:, j], SALT_SAMPLE) for j in range(K)], 1)
    _, n = verify(logits, drafts, torch.full((B,), K), st, positions, p[:, :K], coupled=True)
    assert torch.equal(n, torch.full((B,), K + 1))
