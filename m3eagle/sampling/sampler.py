"""Batched sampling on device: temperature, top-k, top-p, greedy, with per-request seeds.

Randomness is counter-based: every draw is a hash of (request seed, token position, purpose).
So a seeded request reproduces its output whatever else shares its batch, overlap on or off, and the
sampler needs no per-request generator objects and no host-device sync.

The prefix sums (top-p's mass before a token, the draw's CDF) run on integers: each probability in fixed
point (`FIXED_BITS` fractional bits, truncated), summed in int64. Integer addition is associative, so a row's
sums have the same bits whatever scan order a kernel picks -- and a float cumsum's order does depend on the
batch: torch's CUDA cumsum runs a lone row through CUB's device-wide scan and several rows through a
row-blocked scan, so a request sampled alone and inside a batch could draw different tokens. A zero
probability is exactly zero in fixed point, so the CDF is flat across it and the draw never lands there.
The sort before top-p is stable (tied logits keep vocabulary order), for the same reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF
# Purposes of a draw, so that accept tests, resamples and draft samples never share random numbers.
SALT_SAMPLE, SALT_ACCEPT, SALT_DRAFT = 1, 2, 3
# Fixed-point bits of a probability in the prefix sums: a row of up to 2^18 (262,144) tokens, each at most
# 2^44 units, sums below 2^62; a token below 2^-44 of the row's largest probability (of its total, for top-p)
# counts as zero there, at most V * 2^-44 (~1e-8) of the mass.
FIXED_BITS = 44
MAX_VOCAB = 1 << (62 - FIXED_BITS)


@dataclass
class SamplingTensors:
    """Per-row sampling parameters on device ([N] each)."""

    temperature: torch.Tensor  # fp32, 0 = greedy
    top_k: torch.Tensor  # int64, 0 = off
    top_p: torch.Tensor  # fp32
    seed: torch.Tensor  # int64
    greedy: torch.Tensor  # bool
    min_p: torch.Tensor | None = None  # fp32, 0 = off; None: off for every row

    def repeat(self, n: int) -> SamplingTensors:
        """Each row's parameters repeated n times (rows of several sampled positions)."""
        return SamplingTensors(*(t.repeat_interleave(n, 0) if t is not None else None for t in
                                 (self.temperature, self.top_k, self.top_p, self.seed, self.greedy, self.min_p)))


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) on int64 tensors; products stay below 2^63."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def _hash(seed: torch.Tensor, position: torch.Tensor, salt: int) -> torch.Tensor:
    """32 random bits per (seed, position, salt): [N] int64 in [0, 2^32)."""
    return _mix(_mix(seed ^ (seed >> 32)) ^ _mix(position * 0x9E3779B1 + salt))


def uniform(seed: torch.Tensor, position: torch.Tensor, salt: int) -> torch.Tensor:
    """U(0,1) in fp32, [N] for seed/position [N] int64. Always strictly inside (0, 1).

    NOTE: 23 bits, not 24: ((2^24 - 1) + 0.5) / 2^24 rounds to 1.0 in fp32, and a u of exactly 1 (or 0)
    breaks every test built on it. (n + 0.5) / 2^23 for n < 2^23 is exact in fp32 and lies in
    [2^-24, 1 - 2^-24]."""
    return ((_hash(seed, position, salt) >> 9).to(torch.float32) + 0.5) / float(1 << 23)


def uniform64(seed: torch.Tensor, position: torch.Tensor, salt: int) -> torch.Tensor:
    """U(0,1) in fp64 with 52 random bits, strictly inside (0, 1): [N]. Inverse-CDF sampling needs this
    resolution: with 24 bits, every token of probability < 2^-24 would be quantised, and at a vocab of
    200k those errors add up to a visible bias. (52, not 53: n + 0.5 must stay exact in fp64.)"""
    hi = _hash(seed, position, salt) >> 6  # 26 bits
    lo = _hash(seed ^ 0x5BD1E995, position, salt + 0x68E31DA4) >> 6  # 26 bits
    n = (hi << 26) | lo  # 52 bits
    return (n.to(torch.float64) + 0.5) / float(1 << 52)


def probs_from_logits(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Apply temperature, min-p, top-k and top-p -> probabilities [N, V] fp32. Greedy rows get temperature 1
    (their probabilities are only used for logprobs-free bookkeeping; greedy picks the argmax).

    min-p keeps tokens with p >= min_p * p_max, i.e. logit >= max_logit + log(min_p) after temperature (vLLM).
    It is a ratio to the top token, which top-k and top-p renormalisation leave unchanged, so applying it
    before them or after gives the same support."""
    temp = torch.where(st.greedy, torch.ones_like(st.temperature), st.temperature)
    logits = logits.float() / temp[:, None]
    if st.min_p is not None:
        floor = logits.max(-1, keepdim=True).values + torch.log(st.min_p)[:, None]  # log(0) = -inf: off
        logits = logits.masked_fill(logits < floor, float("-inf"))
    v = _vocab(logits)
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    k = torch.where(st.top_k > 0, st.top_k.clamp(max=v), torch.full_like(st.top_k, v))
    ranks = torch.arange(v, device=logits.device)[None, :]
    drop = ranks >= k[:, None]  # top-k in sorted order
    sp = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # top-p: drop a token when the mass strictly before it already reaches top_p (keeps >= 1 token); in fixed
    # point, so the sum's bits do not depend on the batch (module docstring)
    q = fixed_point(sp)  # [N, V] int64
    drop = drop | ((q.cumsum(-1) - q) >= fixed_point(st.top_p)[:, None])
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    out = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return torch.softmax(out, dim=-1)


def _vocab(t: torch.Tensor) -> int:
    """t's last dim, refused past MAX_VOCAB: the int64 prefix sums of longer rows could overflow."""
    if t.shape[-1] > MAX_VOCAB:
        raise ValueError(f"sampling: a vocabulary of {t.shape[-1]} tokens is past the {MAX_VOCAB} the sampler's "
                         f"int64 fixed-point sums hold (FIXED_BITS = {FIXED_BITS}); lower FIXED_BITS to sample it")
    return t.shape[-1]


def fixed_point(p: torch.Tensor) -> torch.Tensor:
    """p in [0, 1] (any float dtype) in units of 2^-FIXED_BITS, truncated -> int64 of p's shape; NaN -> 0.
    In fp32 the scaling by a power of two and the floor are exact."""
    scaled = p.float() * float(1 << FIXED_BITS)  # a new tensor: the in-place steps below leave p alone
    return scaled.nan_to_num_(nan=0.0).floor_().to(torch.int64)


def sample_from_probs(probs: torch.Tensor, seed: torch.Tensor, position: torch.Tensor, salt: int,
                      ) -> torch.Tensor:
    """One draw per (seed, position) by inverse CDF -> [N] token ids. probs: [N, V], or [1, V] for N draws
    from one shared distribution; any non-negative scale (it need not sum to 1).

    The cumulative sum runs in int64 over vocab order on the probabilities in fixed point, scaled so the row's
    largest is 2^FIXED_BITS (any scale in, the same bits out for every batch: module docstring); the draw is
    the first id whose CDF exceeds floor(u * total). That id always has probability > 0: CDF[i] > x >= CDF[i-1]
    means its fixed-point value, hence p_i, is > 0. x is kept below the total (u * total can round up to it),
    so some id always qualifies; a row of zeros or NaNs has total 0 and none does."""
    _vocab(probs)
    probs = probs.float()
    cdf = fixed_point(probs / probs.amax(-1, keepdim=True)).cumsum(-1)  # [N or 1, V] int64
    total = cdf[:, -1:]  # [N or 1, 1]
    x = (uniform64(seed, position, salt)[:, None] * total.double()).to(torch.int64)  # [N, 1]: floor (both >= 0)
    x = torch.minimum(x, total - 1).clamp_(min=0)  # total 0 (no mass): x = 0, which no CDF entry exceeds
    if cdf.shape[0] == 1 and x.shape[0] != 1:
        idx = torch.searchsorted(cdf[0], x[:, 0], right=True)
    else:
        idx = torch.searchsorted(cdf, x, right=True)[:, 0]
    # The clamp only matters for NaN probabilities (then no id qualifies); it keeps the index in range.
    return idx.clamp_(max=probs.shape[-1] - 1)


def sample(logits: torch.Tensor, st: SamplingTensors, position: torch.Tensor,
           salt: int = SALT_SAMPLE) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] -> (tokens [N] int64, probs [N, V]). Greedy rows take the argmax of the raw
    logits; the rest draw from the processed distribution keyed on (seed, position)."""
    probs = probs_from_logits(logits, st)
    drawn = sample_from_probs(probs, st.seed, position, salt)
    return torch.where(st.greedy, logits.argmax(-1), drawn), probs
