"""The dense routed-experts oracle: every expert of the range runs on every token.

It is E/k times the routed FLOPs, but it has no data-dependent shapes and no host-device sync, it is
differentiable (the training path), and it is the math the Triton kernels in `triton_moe.py` are held to.
"""

from __future__ import annotations

import torch

from m3eagle.kernels.fused.reference import swiglu_oai


def local_experts(gate_up_proj: torch.Tensor, down_proj: torch.Tensor, expert_range: tuple[int, int] | None,
                  ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The weights of experts [e0, e1) and e0. The stacks hold either every expert (then they are sliced:
    a view, no copy) or exactly the range (a rank-local shard under expert parallelism).

    gate_up_proj [E, 2I, H], down_proj [E, H, I] -> ([e1-e0, 2I, H], [e1-e0, H, I], e0)."""
    n = gate_up_proj.shape[0]
    if expert_range is None:
        return gate_up_proj, down_proj, 0
    e0, e1 = int(expert_range[0]), int(expert_range[1])
    if not 0 <= e0 <= e1:
        raise ValueError(f"expert_range={expert_range!r} must satisfy 0 <= e0 <= e1")
    if e1 - e0 == n:
        return gate_up_proj, down_proj, e0
    if e1 <= n:
        return gate_up_proj[e0:e1], down_proj[e0:e1], e0
    raise ValueError(f"expert_range={expert_range!r} does not fit weights of {n} experts: pass all experts "
                     f"or exactly the {e1 - e0} of the range")


def experts(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, gate_up_proj: torch.Tensor,
            down_proj: torch.Tensor, alpha: float, limit: float,
            expert_range: tuple[int, int] | None = None) -> torch.Tensor:
    """x [T, H], weights [T, k] (fp32), idx [T, k] (global expert ids) -> [T, H] in x.dtype.

    out[t] = sum_j weights[t, j] * expert_{idx[t, j]}(x[t]) over the pairs whose expert lies in
    `expert_range` (all experts when None); pairs routed elsewhere contribute zero, so summing the outputs
    of disjoint ranges that cover all experts gives the full result. Each expert's output is rounded to
    x.dtype, then weighted and summed in fp32."""
    w13, w2, e0 = local_experts(gate_up_proj, down_proj, expert_range)
    e = w13.shape[0]
    if e == 0:
        return torch.zeros_like(x)
    local = idx - e0
    mine = (local >= 0) & (local < e)
    combine = torch.zeros(x.shape[0], e, dtype=torch.float32, device=x.device)  # [T, E_local]
    # scatter_add: an out-of-range pair is clamped onto some column but adds an exact zero there.
    combine.scatter_add_(1, local.clamp(0, e - 1), torch.where(mine, weights.float(), 0.0))
    h = torch.einsum("th,eih->eti", x, w13)  # [E_local, T, 2I]
    h = swiglu_oai(h, alpha, limit)
    out = torch.einsum("eti,ehi->eth", h, w2)  # [E_local, T, H]
    return torch.einsum("eth,te->th", out.float(), combine).to(x.dtype)
