"""Sampling and speculative verification on CPU: temperature / top-k / top-p give the right support and
probabilities, draws follow those probabilities (chi-square), the counter-based uniforms are
deterministic per (seed, position, salt), and rejection sampling preserves the target distribution --
with negative controls showing the statistical test has the power to catch a broken verifier."""

from __future__ import annotations

import math

import pytest
import torch

from m3eagle.sampling.params import SamplingParams
from m3eagle.sampling.sampler import (
    SALT_ACCEPT,
    SALT_DRAFT,
    SALT_SAMPLE,
    SamplingTensors,
    probs_from_logits,
    sample,
    sample_from_probs,
    uniform,
    uniform64,
)
from m3eagle.sampling.verify import verify
from tests.helpers.engine_utils import chi2_sf


def tensors(n: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed0: int = 0,
            greedy: bool = False) -> SamplingTensors:
    return SamplingTensors(temperature=torch.full((n,), float(temperature)),
                           top_k=torch.full((n,), top_k, dtype=torch.int64), top_p=torch.full((n,), float(top_p)),
                           seed=torch.arange(n, dtype=torch.int64) + seed0,
                           greedy=torch.full((n,), greedy, dtype=torch.bool))


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """(statistic, degrees of freedom) of tokens against probs; tokens outside the support fail at once."""
    v = probs.shape[-1]
    obs = torch.bincount(tokens, minlength=v).double()
    exp = probs.double() / probs.double().sum() * tokens.numel()
    support = exp > 0
    assert obs[~support].sum() == 0, f"drew tokens outside the support: {obs.tolist()}"
    x = ((obs[support] - exp[support]) ** 2 / exp[support]).sum().item()
    return x, int(support.sum()) - 1


def passes_chi_square(tokens: torch.Tensor, probs: torch.Tensor, alpha: float = 1e-3) -> bool:
    x, df = chi_square(tokens, probs)
    return chi2_sf(x, df) > alpha  # (a table of critical values stopped at df 9 and failed without scipy)


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Independent top-k then top-p (keep the smallest prefix whose mass reaches top_p) on one row."""
    p = torch.softmax(logits.double() / temperature, -1)
    order = p.argsort(descending=True).tolist()
    keep = order[:top_k] if top_k else order
    mass = sum(p[i].item() for i in keep)
    kept, acc = [], 0.0
    for i in keep:
        kept.append(i)
        acc += p[i].item() / mass
        if acc >= top_p:
            break
    out = torch.zeros_like(p)
    out[kept] = p[kept] / p[kept].sum()
    return out.float()


LOGITS = torch.tensor([1.3, -0.2, 2.1, 0.4, -1.5, 0.9, 0.0, 1.7])


# ------------------------------------------------------------------------------------------------
# probabilities
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_temperature_scales_logits(temperature):
    probs = probs_from_logits(LOGITS[None], tensors(1, temperature))[0]
    torch.testing.assert_close(probs, torch.softmax(LOGITS / temperature, -1), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("top_k", [1, 2, 5, 8, 100])
def test_top_k_support_and_renormalisation(top_k):
    probs = probs_from_logits(LOGITS[None], tensors(1, 0.8, top_k=top_k))[0]
    top = set(LOGITS.argsort(descending=True)[:top_k].tolist())
    assert set(probs.nonzero().flatten().tolist()) == top
    torch.testing.assert_close(probs, reference_probs(LOGITS, 0.8, top_k, 1.0), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("top_p", [1e-4, 0.2, 0.45, 0.7, 0.93, 0.999, 1.0])
def test_top_p_keeps_the_smallest_prefix_reaching_top_p(top_p):
    probs = probs_from_logits(LOGITS[None], tensors(1, 1.0, top_p=top_p))[0]
    ref = reference_probs(LOGITS, 1.0, 0, top_p)
    assert (probs > 0).tolist() == (ref > 0).tolist()
    torch.testing.assert_close(probs, ref, rtol=1e-5, atol=1e-7)
    if top_p < 0.3:
        assert (probs > 0).sum() == 1 and probs.argmax() == LOGITS.argmax()


@pytest.mark.parametrize("top_k, top_p", [(3, 0.6), (5, 0.85), (2, 0.99)])
def test_top_p_applies_to_the_top_k_renormalised_distribution(top_k, top_p):
    probs = probs_from_logits(LOGITS[None], tensors(1, 0.7, top_k=top_k, top_p=top_p))[0]
    torch.testing.assert_close(probs, reference_probs(LOGITS, 0.7, top_k, top_p), rtol=1e-5, atol=1e-7)


def test_rows_keep_their_own_parameters():
    """A batch mixing parameters processes each row with its own values."""
    st = SamplingTensors(temperature=torch.tensor([1.0, 0.5, 2.0]), top_k=torch.tensor([0, 3, 0]),
                         top_p=torch.tensor([1.0, 1.0, 0.5]), seed=torch.tensor([1, 2, 3]),
                         greedy=torch.tensor([False, False, False]))
    probs = probs_from_logits(LOGITS[None].expand(3, -1), st)
    for i, (t, k, p) in enumerate([(1.0, 0, 1.0), (0.5, 3, 1.0), (2.0, 0, 0.5)]):
        torch.testing.assert_close(probs[i], reference_probs(LOGITS, t, k, p), rtol=1e-5, atol=1e-7)


def test_greedy_rows_pick_the_argmax_of_raw_logits():
    """Greedy rows ignore temperature / top-k / top-p and take argmax; sampled rows in the same batch
    still sample."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=g)
    st = tensors(64, temperature=1.5, top_k=7)
    st.greedy = torch.arange(64) % 2 == 0
    tok, _ = sample(logits, st, torch.zeros(64, dtype=torch.int64))
    assert torch.equal(tok[::2], logits[::2].argmax(-1))
    assert not torch.equal(tok[1::2], logits[1::2].argmax(-1))
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=0.1).greedy


def test_sampling_tensors_repeat():
    st = tensors(3, 0.5, top_k=2)
    rep = st.repeat(4)
    assert rep.seed.tolist() == [0] * 4 + [1] * 4 + [2] * 4 and rep.temperature.shape == (12,)


# ------------------------------------------------------------------------------------------------
# draws
# ------------------------------------------------------------------------------------------------


def test_sample_from_probs_follows_probs():
    """Inverse-CDF draws pick token i with probability p_i; zero-probability tokens never come out."""
    n = 20000
    p = torch.tensor([0.05, 0.0, 0.3, 0.15, 0.0, 0.4, 0.1])
    tok = sample_from_probs(p[None].expand(n, -1), torch.arange(n) + 7, torch.full((n,), 3), SALT_SAMPLE)
    assert passes_chi_square(tok, p)
    # control: a visibly different distribution is rejected by the same test
    assert not passes_chi_square(tok, torch.tensor([0.1, 0.0, 0.25, 0.15, 0.0, 0.4, 0.1]))


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8),
                                                       (0.9, 6, 0.9)])
def test_sample_end_to_end_distribution(temperature, top_k, top_p):
    n = 20000
    st = tensors(n, temperature, top_k, top_p, seed0=123)
    tok, _ = sample(LOGITS[None].expand(n, -1), st, torch.full((n,), 11, dtype=torch.int64))
    assert passes_chi_square(tok, reference_probs(LOGITS, temperature, top_k, top_p))


def test_sample_is_a_pure_function_of_seed_and_position():
    """Row order, batch size and the other rows do not change a row's draw."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(40, 30, generator=g)
    st = tensors(40, 1.0, seed0=5)
    pos = torch.arange(40, dtype=torch.int64) * 3
    tok, _ = sample(logits, st, pos)
    perm = torch.randperm(40, generator=g)
    st_p = SamplingTensors(*(t[perm] for t in (st.temperature, st.top_k, st.top_p, st.seed, st.greedy)))
    tok_p, _ = sample(logits[perm], st_p, pos[perm])
    assert torch.equal(tok_p, tok[perm])
    one, _ = sample(logits[7:8], tensors(1, 1.0, seed0=12), pos[7:8])
    assert one.item() == tok[7].item()


def test_uniform_range_determinism_and_variation():
    n = 50000
    seed = torch.arange(n, dtype=torch.int64)
    pos = torch.full((n,), 5, dtype=torch.int64)
    u = uniform(seed, pos, SALT_SAMPLE)
    assert u.dtype == torch.float32 and ((u > 0) & (u < 1)).all()
    assert torch.equal(u, uniform(seed, pos, SALT_SAMPLE))
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.003
    # varies with each of seed, position and salt
    assert (u != uniform(seed + 1, pos, SALT_SAMPLE)).float().mean() > 0.999
    assert (u != uniform(seed, pos + 1, SALT_SAMPLE)).float().mean() > 0.999
    for salt in (SALT_ACCEPT, SALT_DRAFT):
        other = uniform(seed, pos, salt)
        assert (u != other).float().mean() > 0.999
        assert abs(torch.corrcoef(torch.stack([u, other]))[0, 1].item()) < 0.03
    # one row along positions: a sequence that looks uniform, uncorrelated with its lag
    seq = uniform(torch.full((n,), 42, dtype=torch.int64), torch.arange(n, dtype=torch.int64), SALT_ACCEPT)
    assert abs(seq.mean().item() - 0.5) < 0.01
    assert abs(torch.corrcoef(torch.stack([seq[:-1], seq[1:]]))[0, 1].item()) < 0.03
    # extreme seeds / positions stay strictly inside (0, 1)
    for fn in (uniform, uniform64):
        big = fn(torch.tensor([0, 2**31 - 1, 2**62, 2**63 - 1]), torch.tensor([0, 2**31 - 1, 10**9, 2**40]), SALT_DRAFT)
        assert ((big > 0) & (big < 1)).all()


def test_uniform64_has_52_bits_and_looks_uniform():
    n = 50000
    u = uniform64(torch.arange(n, dtype=torch.int64), torch.full((n,), 9, dtype=torch.int64), SALT_SAMPLE)
    assert u.dtype == torch.float64 and ((u > 0) & (u < 1)).all()
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.003
    # the low bits are random too (a 24-bit uniform times 2^24 would be an integer + 0.5)
    frac = (u * 2**24) % 1
    assert abs(frac.mean().item() - 0.5) < 0.01


@pytest.mark.parametrize("bits", [0, 2**32 - 1])
def test_extreme_random_bits_never_reach_0_or_1_nor_a_zero_probability_token(monkeypatch, bits):
    """Force every hash to all-zeros / all-ones bits (the draws that used to round to u = 1.0, where
    -log(u) = -0.0 let a p = 0 token win): u stays strictly inside (0, 1) and the draw stays in the
    support, including a support that ends with a tiny mass right before trailing zeros."""
    import m3eagle.sampling.sampler as sampler

    monkeypatch.setattr(sampler, "_hash", lambda seed, position, salt: torch.full_like(seed, bits))
    n = 4
    seed, pos = torch.arange(n), torch.zeros(n, dtype=torch.int64)
    for u in (sampler.uniform(seed, pos, SALT_SAMPLE), sampler.uniform64(seed, pos, SALT_SAMPLE)):
        assert ((u > 0) & (u < 1)).all()
    v = 200064
    p = torch.zeros(n, v)
    p[0, [5, 7]] = torch.tensor([0.999999, 1e-6])  # mass at the front, a tiny last token
    p[1, -1] = 1.0  # only the very last id
    p[2, 0] = 1.0  # only the very first id
    p[3, 1000:1020] = 1.0 / 20
    tok = sampler.sample_from_probs(p, seed, pos, SALT_SAMPLE)
    assert (p[torch.arange(n), tok] > 0).all(), tok.tolist()
    u = sampler.uniform(seed, pos, SALT_ACCEPT)
    assert not (u * 1.0 <= 0.0).any()  # an accept test u * q <= p never passes for p = 0


def test_prefix_sums_run_on_integers_so_no_scan_order_reaches_the_draw(monkeypatch):
    """Top-p and the CDF sum in fixed point: a float cumsum anywhere in sampling fails here (torch's CUDA
    cumsum sums a lone row in another order than a row of a batch, so a float prefix sum made a seeded request's
    tokens depend on its batch on the GPU). The draws are those of the same rows sampled alone."""
    g = torch.Generator().manual_seed(3)
    n, v = 6, 5000
    logits = torch.randn(n, v, generator=g) * 0.05  # nearly flat: the top-p cut and the CDF carry every token
    st = SamplingTensors(torch.full((n,), 0.8), torch.zeros(n, dtype=torch.int64), torch.full((n,), 0.95),
                         torch.arange(n) + 11, torch.zeros(n, dtype=torch.bool))
    pos = torch.arange(n) * 7
    real = torch.Tensor.cumsum

    def ints_only(self, *a, **kw):
        if self.dtype.is_floating_point or kw.get("dtype") in (torch.float32, torch.float64):
            raise AssertionError(f"a float cumsum ({self.dtype}) in sampling: its bits depend on the scan order")
        return real(self, *a, **kw)

    monkeypatch.setattr(torch.Tensor, "cumsum", ints_only)
    batch, _ = sample(logits, st, pos)
    rows = (st.temperature, st.top_k, st.top_p, st.seed, st.greedy)
    alone = [sample(logits[i:i + 1], SamplingTensors(*(t[i:i + 1] for t in rows)), pos[i:i + 1])[0].item()
             for i in range(n)]
    assert batch.tolist() == alone


def test_fixed_point_keeps_zero_probabilities_out_of_the_draw():
    """A zero (or NaN-row) probability is exactly zero in fixed point: the CDF is flat across it and no draw
    lands there; a row with no mass at all falls to the last id (the clamp), as before."""
    import m3eagle.sampling.sampler as sampler

    n, v = 64, 300
    p = torch.zeros(n, v)
    p[:, 1::3] = torch.rand(n, 100, generator=torch.Generator().manual_seed(0))
    p[0] = 0.0
    p[1, 5] = float("nan")
    seed, pos = torch.arange(n), torch.arange(n)
    tok = sampler.sample_from_probs(p, seed, pos, SALT_SAMPLE)
    assert tok[0] == v - 1 and tok[1] == v - 1
    assert (p[torch.arange(2, n), tok[2:]] > 0).all() and (tok[2:] % 3 == 1).all()
    assert sampler.fixed_point(torch.tensor([0.0, 1.0, 2.0 ** -44, 2.0 ** -45])).tolist() == [0, 2 ** 44, 1, 0]
    too_wide = torch.zeros(1, sampler.MAX_VOCAB + 1)  # its int64 sums could overflow: refused by name
    with pytest.raises(ValueError, match="vocabulary of 262145 tokens.*FIXED_BITS"):
        sampler.sample_from_probs(too_wide, seed[:1], pos[:1], SALT_SAMPLE)


# ------------------------------------------------------------------------------------------------
# verification
# ------------------------------------------------------------------------------------------------


def test_greedy_verify_accepts_the_matching_prefix():
    """accepted = length of the prefix of drafts equal to the target argmax; emitted tokens are the
    argmaxes (so greedy speculation reproduces greedy decoding)."""
    v, k = 10, 3
    target = torch.tensor([[4, 1, 7, 2], [4, 1, 7, 2], [4, 1, 7, 2], [4, 1, 7, 2], [4, 1, 7, 2]])
    logits = torch.full((5, k + 1, v), -1.0).scatter(2, target[..., None], 3.0)
    drafts = torch.tensor([[4, 1, 7], [4, 1, 0], [4, 0, 7], [0, 1, 7], [4, 1, 7]])
    num_drafts = torch.tensor([3, 3, 3, 3, 1])
    st = tensors(5, greedy=True)
    pos = torch.arange(k + 1).expand(5, -1)
    new, num_new = verify(logits, drafts, num_drafts, st, pos, None)
    assert num_new.tolist() == [4, 3, 2, 1, 2]
    assert torch.equal(new, target)
    # same result through the sampled code path for greedy rows
    new2, num_new2 = verify(logits, drafts, num_drafts, st, pos, torch.full((5, k, v), 1.0 / v))
    assert torch.equal(num_new2, num_new) and torch.equal(new2, target)


def test_verify_with_draft_equal_to_target_accepts_everything():
    """q == p: u * q <= p always holds, every draft is accepted and the bonus is drawn from p_K."""
    n, k, v = 2000, 3, 5
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(n, k + 1, v, generator=g)
    st = tensors(n, 1.0)
    pos = torch.arange(k + 1).expand(n, -1) + 9
    q = torch.softmax(logits[:, :k], -1)
    drafts = torch.stack([sample_from_probs(q[:, j], st.seed, pos[:, j], SALT_DRAFT) for j in range(k)], 1)
    new, num_new = verify(logits, drafts, torch.full((n,), k), st, pos, q)
    assert (num_new == k + 1).all() and torch.equal(new[:, :k], drafts)


def test_verify_rows_without_drafts_just_sample():
    """num_drafts = 0: one token drawn from p_0 with the plain sampler's randomness (same as `sample`)."""
    n, k, v = 50, 2, 7
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(n, k + 1, v, generator=g)
    st = tensors(n, 0.8, top_k=4)
    pos = torch.arange(n)[:, None].expand(n, k + 1).contiguous()  # unused positions clamp to the row's last
    new, num_new = verify(logits, torch.zeros(n, k, dtype=torch.int64), torch.zeros(n, dtype=torch.int64), st,
                          pos, torch.full((n, k, v), 1.0 / v))
    ref, _ = sample(logits[:, 0], st, pos[:, 0])
    assert (num_new == 1).all() and torch.equal(new[:, 0], ref)


# Rejection sampling: B independent rows (one seed each), fixed target logits per position and a
# different draft distribution. p has a zero (top-k) and q has a zero where p does not.
B, K, V = 20000, 2, 6
TARGET_LOGITS = torch.tensor([[2.0, 1.0, 0.0, 0.5, -1.0, 0.3],
                              [0.0, 1.5, 1.0, -0.5, 0.7, 0.2],
                              [1.0, 0.0, 2.0, 0.0, 0.5, -2.0]])
DRAFT_Q = torch.tensor([[0.05, 0.50, 0.20, 0.05, 0.20, 0.00],
                        [0.30, 0.05, 0.05, 0.40, 0.10, 0.10]])
TEMP, TOPK = 0.9, 5


@pytest.fixture(scope="module")
def rejection_run():
    st = tensors(B, TEMP, top_k=TOPK, seed0=1000)
    pos = (17 + torch.arange(K + 1))[None].expand(B, -1).contiguous()
    q = DRAFT_Q[None].expand(B, -1, -1).contiguous()
    # drafts are drawn as the engine draws them: from q, keyed on (seed, position, SALT_DRAFT)
    drafts = torch.stack([sample_from_probs(q[:, j], st.seed, pos[:, j], SALT_DRAFT) for j in range(K)], 1)
    logits = TARGET_LOGITS[None].expand(B, -1, -1).contiguous()
    new, num_new = verify(logits, drafts, torch.full((B,), K), st, pos, q)
    p = torch.stack([reference_probs(TARGET_LOGITS[j], TEMP, TOPK, 1.0) for j in range(K + 1)])
    return dict(st=st, pos=pos, q=q, drafts=drafts, new=new, num_new=num_new, p=p)


def test_rejection_sampling_first_token_is_distributed_as_p0(rejection_run):
    r = rejection_run
    assert passes_chi_square(r["new"][:, 0], r["p"][0])


def test_rejection_sampling_token_after_an_accepted_draft_is_distributed_as_p1(rejection_run):
    r = rejection_run
    sel = r["num_new"] >= 2
    assert sel.sum() > 3000
    assert torch.equal(r["new"][sel, 0], r["drafts"][sel, 0])  # accepted drafts are emitted unchanged
    assert passes_chi_square(r["new"][sel, 1], r["p"][1])
    sel = r["num_new"] == 3  # both drafts accepted: the bonus comes from p_2
    assert passes_chi_square(r["new"][sel, 2], r["p"][2])


def test_rejection_sampling_acceptance_rate_is_sum_of_min_p_q(rejection_run):
    """P(accept d_1) = sum_x min(p_0(x), q_0(x)) (Leviathan et al.), within 5 standard errors."""
    r = rejection_run
    alpha = torch.minimum(r["p"][0], DRAFT_Q[0]).sum().item()
    rate = (r["num_new"] >= 2).float().mean().item()
    assert abs(rate - alpha) < 5 * math.sqrt(alpha * (1 - alpha) / B)


def test_rejection_sampling_negative_controls(rejection_run):
    """The same chi-square test rejects (a) drafts returned unverified and (b) a subtly wrong verifier
    that resamples from p instead of the residual norm(max(0, p - q)) after a rejection."""
    r = rejection_run
    p0 = r["p"][0]
    unverified = r["drafts"][:, 0]
    assert not passes_chi_square(unverified[p0[unverified] > 0], p0)
    d1 = r["drafts"][:, 0]
    u = uniform(r["st"].seed, r["pos"][:, 0], SALT_ACCEPT)
    accept = u * DRAFT_Q[0][d1].clamp_min(1e-20) <= p0[d1]
    from_p = sample_from_probs(p0[None].expand(B, -1), r["st"].seed, r["pos"][:, 0], SALT_SAMPLE)
    wrong = torch.where(accept, d1, from_p)
    assert not passes_chi_square(wrong, p0)
    # and the real verifier's emitted tokens agree with this hand-made accept decision
    assert torch.equal(r["num_new"] >= 2, accept)


# ------------------------------------------------------------------------------------------------
# zero-probability tokens never come out, at MiniMax-M3's vocab size
# ------------------------------------------------------------------------------------------------

BIG_V = 200064
N_DRAWS = 20000


def _big_logits(seed: int) -> torch.Tensor:
    """[BIG_V]: 40 strong ids spread over the vocab (the last id among them), the rest far below."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.full((BIG_V,), -8.0)
    ids = torch.cat([torch.randperm(BIG_V - 1, generator=g)[:39], torch.tensor([BIG_V - 1])])
    logits[ids] = torch.randn(40, generator=g) + 4.0
    return logits


def _draws_in_support(probs: torch.Tensor, salt: int, seed0: int) -> torch.Tensor:
    """N_DRAWS seeded draws from one [V] distribution through the real sampler; asserts none has p = 0."""
    tok = sample_from_probs(probs[None], torch.arange(N_DRAWS) + seed0, torch.full((N_DRAWS,), 77), salt)
    outside = int((probs[tok] == 0).sum())
    assert outside == 0, f"{outside} of {N_DRAWS} draws have probability 0"
    return tok


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 20, 1.0), (0.8, 0, 0.7), (1.3, 25, 0.9)])
def test_big_vocab_draws_stay_in_the_top_k_top_p_support(temperature, top_k, top_p):
    logits = _big_logits(1)
    st = tensors(1, temperature, top_k, top_p)
    probs = probs_from_logits(logits[None], st)[0]
    assert 0 < int((probs > 0).sum()) <= (top_k or BIG_V)
    tok = _draws_in_support(probs, SALT_SAMPLE, 5000)
    assert passes_chi_square(tok, reference_probs(logits, temperature, top_k, top_p).float())


def test_big_vocab_residual_after_rejection_stays_in_support():
    """The token emitted after a rejection comes from norm(max(0, p - q)): 20,000 draws at vocab 200,064
    never land where the residual is 0 (where q >= p, or outside p's top-k), and follow it (chi-square).
    Then the real verifier, with every draft forced to be rejected (p(d) = 0), emits residual tokens only."""
    p = probs_from_logits(_big_logits(2)[None], tensors(1, 1.0, top_k=20))[0]
    q = probs_from_logits(_big_logits(2)[None] + torch.randn(BIG_V, generator=torch.Generator().manual_seed(3)),
                          tensors(1, 1.0, top_k=20))[0]
    resid = (p - q).clamp_min(0.0)
    assert 0 < int((resid > 0).sum()) < int((p > 0).sum())
    tok = _draws_in_support(resid, SALT_SAMPLE, 9000)
    assert passes_chi_square(tok, resid / resid.sum())

    n, k = 24, 1
    st = tensors(n, 1.0, top_k=20, seed0=40)
    logits = _big_logits(2)[None, None].expand(n, k + 1, BIG_V).contiguous()
    dead = int((p == 0).nonzero()[0])  # a token the target's top-k excludes: p(d) = 0, reject for sure
    drafts = torch.full((n, k), dead)
    q_rows = torch.zeros(n, k, BIG_V)
    q_rows[..., dead] = 1.0
    new, num_new = verify(logits, drafts, torch.full((n,), k), st, torch.arange(k + 1).expand(n, -1) + 3, q_rows)
    assert (num_new == 1).all()
    assert (p[new[:, 0]] > 0).all() and (new[:, 0] != dead).all()


def test_verify_without_draft_probs_treats_drafts_as_deterministic():
    """draft_probs=None on sampled rows means q = one-hot(d) (vLLM's convention): d is accepted with
    probability p(d), and after a rejection the emitted token is never d and follows p without d."""
    n = 20000
    logits = torch.tensor([[0.5, 1.0, 0.0, 2.0, -1.0, 0.3], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    st = tensors(n, 1.0, seed0=77)
    d = torch.full((n, 1), 3)
    new, num_new = verify(logits[None].expand(n, -1, -1), d, torch.ones(n, dtype=torch.int64), st,
                          torch.tensor([[4, 5]]).expand(n, -1), None)
    p0 = torch.softmax(logits[0], -1)
    rate = (num_new == 2).float().mean().item()
    assert abs(rate - p0[3].item()) < 5 * math.sqrt(p0[3] * (1 - p0[3]) / n)
    rej = num_new == 1
    assert (new[rej, 0] != 3).all()
    without_d = p0.clone()
    without_d[3] = 0
    assert passes_chi_square(new[rej, 0], without_d)
    assert passes_chi_square(new[:, 0], p0)  # and overall the first token is still distributed as p


def test_issue_repro_seeded_top_k_draw_stays_in_the_top_k():
    """The reported case: the embedded model, plain sampling, top_k=20, seed 4000455 emitted a token
    outside the top 20. Checked against the model's own logits for that prompt."""
    from m3eagle import LLM

    llm = LLM(num_draft_tokens=0, device="cpu")
    prompt = "def fibonacci(n):\n    "
    out = llm.generate(prompt, SamplingParams(max_tokens=1, seed=4000455, temperature=1.0, top_k=20))[0]
    ids = llm.encode(prompt)
    with torch.no_grad():
        hidden, _ = llm.target.forward_seq(torch.tensor([ids]))
        top20 = llm.target.compute_logits(hidden[0, -1]).topk(20).indices.tolist()
    assert out.outputs[0].token_ids[0] in top20
