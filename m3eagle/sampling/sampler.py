"""Batched sampling on device: temperature, top-k, top-p, greedy, with per-request seeds.

Randomness is counter-based: every draw is a hash of (request seed, token position, purpose, vocab id).
So a seeded request reproduces its output whatever else shares its batch, overlap on or off, and the
sampler needs no per-request generator objects and no host-device sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF
# Purposes of a draw, so that accept tests, resamples and draft samples never share random numbers.
SALT_SAMPLE, SALT_ACCEPT, SALT_DRAFT = 1, 2, 3


@dataclass
class SamplingTensors:
    """Per-row sampling parameters on device ([N] each)."""

    temperature: torch.Tensor  # fp32, 0 = greedy
    top_k: torch.Tensor  # int64, 0 = off
    top_p: torch.Tensor  # fp32
    seed: torch.Tensor  # int64
    greedy: torch.Tensor  # bool

    def repeat(self, n: int) -> SamplingTensors:
        """Each row's parameters repeated n times (rows of several sampled positions)."""
        return SamplingTensors(*(t.repeat_interleave(n, 0) for t in
                                 (self.temperature, self.top_k, self.top_p, self.seed, self.greedy)))


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) on int64 tensors; products stay below 2^63."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def uniform(seed: torch.Tensor, position: torch.Tensor, salt: int, width: int | None = None) -> torch.Tensor:
    """U(0,1) in fp32: [N] (width None) or [N, width] (one per vocab id). seed/position [N] int64."""
    h = _mix(_mix(seed ^ (seed >> 32)) ^ _mix(position * 0x9E3779B1 + salt))
    if width is not None:
        ids = torch.arange(width, device=seed.device, dtype=torch.int64)
        h = _mix(h[:, None] ^ _mix(ids[None, :] + 0x632BE5AB))
    # 24 random bits -> exactly representable, strictly inside (0, 1)
    return ((h >> 8).to(torch.float32) + 0.5) / float(1 << 24)


def probs_from_logits(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Apply temperature, top-k and top-p -> probabilities [N, V] fp32. Greedy rows get temperature 1
    (their probabilities are only used for logprobs-free bookkeeping; greedy picks the argmax)."""
    temp = torch.where(st.greedy, torch.ones_like(st.temperature), st.temperature)
    logits = logits.float() / temp[:, None]
    v = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.where(st.top_k > 0, st.top_k.clamp(max=v), torch.full_like(st.top_k, v))
    ranks = torch.arange(v, device=logits.device)[None, :]
    drop = ranks >= k[:, None]  # top-k in sorted order
    sp = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # top-p: drop a token when the mass strictly before it already reaches top_p (keeps >= 1 token)
    drop = drop | ((sp.cumsum(-1) - sp) >= st.top_p[:, None])
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    out = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return torch.softmax(out, dim=-1)


def sample_from_probs(probs: torch.Tensor, seed: torch.Tensor, position: torch.Tensor, salt: int,
                      ) -> torch.Tensor:
    """One draw per row by the exponential race: argmax p_i / E_i, E_i ~ Exp(1). [N, V] -> [N]."""
    e = -torch.log(uniform(seed, position, salt, probs.shape[-1]))
    return (probs / e).argmax(-1)


def sample(logits: torch.Tensor, st: SamplingTensors, position: torch.Tensor,
           salt: int = SALT_SAMPLE) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] -> (tokens [N] int64, probs [N, V]). Greedy rows take the argmax of the raw
    logits; the rest draw from the processed distribution keyed on (seed, position)."""
    probs = probs_from_logits(logits, st)
    drawn = sample_from_probs(probs, st.seed, position, salt)
    return torch.where(st.greedy, logits.argmax(-1), drawn), probs
