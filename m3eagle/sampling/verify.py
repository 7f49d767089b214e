"""Speculative verification: greedy and rejection sampling, both lossless.

Row b carries k_b drafts d_1..d_k (k_b is 0 for rows that only sample, K for verify rows) and the target
scored K+1 positions: position j predicts the token after d_j (j = 0: after the last accepted token).

Greedy:  accept d_{j+1} while it equals argmax p_j; then emit argmax p_a.  Output = greedy decoding.
Sampled: (Leviathan et al. / Chen et al.) for j = 0..k-1 with target p_j and draft q_j:
    q_j(d) <= p_j(d): always accept
    q_j(d) >  p_j(d): accept with probability p_j(d) / q_j(d)
    first rejection at j: emit a sample of norm(max(0, p_j - q_j)) and stop
    all accepted:        emit a bonus sample of p_k
  Each emitted token is distributed exactly as the target's (processed) distribution.
Coupled (the deterministic mode): every scored position j draws the target's own sample x_j -- the draw that
  decoding without drafts makes there, keyed on (seed, position) -- and d_{j+1} is accepted iff it equals x_j.
  The emitted tokens are x_0..x_a: token for token what decoding without speculation samples, whatever the
  drafts (their number, their values), the batch or a recompute after preemption. The drafts are drawn with
  the same key (inverse CDF of q against x's uniform), so a draft close to the target matches often.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from m3eagle.sampling.sampler import SALT_ACCEPT, SALT_SAMPLE, SamplingTensors, probs_from_logits, sample_from_probs, uniform


def greedy_accept(greedy_tok: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """Greedy verification after the argmax: greedy_tok [B, K+1] (argmax of each scored position), drafts
    [B, K], num_drafts [B] -> num_new [B] = 1 + the number of leading drafts equal to the argmax before
    them (verify's greedy path)."""
    k = drafts.shape[1]
    in_row = torch.arange(k, device=drafts.device)[None, :] < num_drafts[:, None]  # [B, K]
    match = (drafts == greedy_tok[:, :k]) & in_row
    return match.long().cumprod(-1).sum(-1) + 1


def verify(logits: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, st: SamplingTensors,
           positions: torch.Tensor, draft_probs: torch.Tensor | None, any_random: bool = True,
           accept: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
           argmax: Callable[[torch.Tensor], torch.Tensor] | None = None, coupled: bool = False,
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, K+1, V] fp32, drafts [B, K] (target ids), num_drafts [B] (0..K), positions [B, K+1]
    (position of the query that predicts each token), draft_probs [B, K, V] (the distributions the drafts
    were drawn from; None means every draft was chosen deterministically, i.e. q is one-hot on the draft,
    vLLM's convention: accept with probability p(d), resample from p without d), any_random: some row has
    temperature > 0 (host flag; False takes the all-greedy fast path), accept: that path's acceptance count
    (greedy_accept, or the engine's step op), argmax: [N, V] -> [N] (torch.argmax's; the
    engine's fused op), coupled: the coupled acceptance above (draft_probs unused) -> (new_tokens [B, K+1],
    num_new [B]). On the all-greedy path only the argmax reads
    the logits, so they may be in any float dtype there.
    new_tokens[b, :num_new[b]] are the emitted tokens."""
    b, kp1, v = logits.shape
    k = kp1 - 1
    greedy_tok = argmax(logits.reshape(b * kp1, v)).view(b, kp1) if argmax is not None else logits.argmax(-1)
    if not any_random:  # the all-greedy path (one kernel after the argmax with the engine's fused ops)
        return greedy_tok, (accept or greedy_accept)(greedy_tok, drafts, num_drafts)
    in_row = torch.arange(k, device=logits.device)[None, :] < num_drafts[:, None]  # [B, K]
    g_match = (drafts == greedy_tok[:, :k]) & in_row

    rep = st.repeat(kp1)
    p = probs_from_logits(logits.reshape(b * kp1, v), rep).view(b, kp1, v)
    if coupled:
        x = sample_from_probs(p.view(b * kp1, v), rep.seed, positions.reshape(-1), SALT_SAMPLE).view(b, kp1)
        x = torch.where(st.greedy[:, None], greedy_tok, x)  # [B, K+1]
        match = (drafts == x[:, :k]) & in_row
        return x, match.long().cumprod(-1).sum(-1) + 1
    q = draft_probs
    if q is None:  # deterministic drafts: q = one-hot(d)
        q = p.new_zeros(b, k, v).scatter_(-1, drafts[..., None], 1.0)
    p_d = p[:, :k].gather(-1, drafts[..., None])[..., 0]  # [B, K]
    q_d = q.gather(-1, drafts[..., None])[..., 0].clamp_min(1e-20)
    u = uniform(st.seed[:, None].expand(b, k).reshape(-1), positions[:, :k].reshape(-1),
                SALT_ACCEPT).view(b, k)
    s_match = (u * q_d <= p_d) & in_row  # accept with probability min(1, p/q)
    match = torch.where(st.greedy[:, None], g_match, s_match)
    accepted = match.long().cumprod(-1).sum(-1)  # [B] index of the first rejection (or k_b)

    # The emitted distribution at position a: residual if a draft was rejected there, else p_a.
    a_idx = accepted[:, None, None].expand(b, 1, v)
    p_a = p.gather(1, a_idx)[:, 0]  # [B, V]
    rejected = accepted < num_drafts
    q_a = q.gather(1, a_idx.clamp(max=max(k - 1, 0)))[:, 0] if k else torch.zeros_like(p_a)
    resid = (p_a - q_a).clamp_min(0.0)
    # If p == q exactly (residual all zero) a rejection has probability 0; fall back to p_a for safety.
    resid_ok = resid.sum(-1, keepdim=True) > 0
    dist = torch.where(rejected[:, None] & resid_ok, resid, p_a)
    pos_a = positions.gather(1, accepted[:, None])[:, 0]
    final_sampled = sample_from_probs(dist, st.seed, pos_a, SALT_SAMPLE)
    final = torch.where(st.greedy, greedy_tok.gather(1, accepted[:, None])[:, 0], final_sampled)

    new_tokens = torch.cat([drafts, drafts[:, :1]], 1) if k else final[:, None].clone()
    new_tokens = new_tokens.scatter(1, accepted[:, None], final[:, None])
    greedy_rows = st.greedy[:, None].expand(b, kp1)
    new_tokens = torch.where(greedy_rows, greedy_tok, new_tokens)
    return new_tokens, accepted + 1

