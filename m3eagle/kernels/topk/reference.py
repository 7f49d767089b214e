"""The plain torch top-k with ties to the lower index: topk over keys made unique (the oracle of triton_topk)."""

from __future__ import annotations

import torch


def best(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of scores [..., M] along the last dim, ties to the lower index -> (values [..., k],
    indices [..., k]), in that order.

    A stable descending sort gives this order, but a full sort of the draft vocabulary per frontier node costs
    several radix-sort passes per level. topk alone leaves the order of equal values unspecified (it differs
    between devices), so it runs on keys made unique: each fp32 score's bits mapped to an int32 that orders
    like the float, shifted above (M - 1 - index), so a tie goes to the lower index. Scores are log-probs
    (no NaN); -0.0 ranks just below 0.0, where the sort would call them equal."""
    m = scores.shape[-1]
    if scores.dtype == torch.float64 or m >= 2 ** 31:  # past the 32-bit key: the sort, same order
        vals, idx = scores.sort(dim=-1, descending=True, stable=True)
        return vals[..., :k], idx[..., :k]
    bits = scores.float().view(torch.int32)
    ordered = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(torch.int64)  # int order == float order
    low = (m - 1) - torch.arange(m, device=scores.device)  # [M] larger for lower indices
    keys = (ordered << 32) | low
    top = keys.topk(k, dim=-1).values  # [..., k] descending, all distinct
    idx = (m - 1) - (top & 0xFFFFFFFF)
    return scores.gather(-1, idx), idx
