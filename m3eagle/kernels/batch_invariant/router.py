"""The MoE router with one launch shape for every step: its fp32 GEMM and the route in one row-local launch.

`TritonFused.route_tokens` picks its router by the step (the one-launch GEMV + route up to 64 tokens with
blocks from T x E, the tiled bf16-MMA router above, cuBLAS otherwise): a token's logits then sum in another order
as the batch changes. Here every step, decode to an 8,192-token prompt chunk, runs `_router_topk_kernel`
(moe/router.py) under `router_config(n_exp, hidden)` -- the decode router's own T = 1 blocks, fixed:

    x [T, H] ──_router_topk_kernel──► (weights [T, k] fp32, experts [T, k])   grid (T / TOKENS, E / BLOCK_E)

For each of its TOKENS tokens in turn, program (t, e) sums fp32(x[t]) * w[e] for its experts, each lane its own
columns over H in BLOCK_H steps, the lanes summed once (one token's code and layout for every T and TOKENS); the
token's last program to arrive, counted in a per-token int32 counter, routes it from the logits row (sigmoid,
+ bias, top-k, renormalise). A token's logits and route read only its own row, so its bits do not depend on T,
the other tokens, their order or how many share a program. TOKENS (`tokens_per_program`) follows T for speed
only: wider steps give each program several tokens, which read its expert rows from L1 instead of each token's
program fetching them again. The counters
are the batch-invariant GEMM's (`matmul.tile_counters`: every launch leaves those it touched zero, and the
calls on a device are stream-ordered); a call without them (a CUDA graph captured before any eager call, or
more than `matmul.MAX_TILES` tokens) counts in a zeroed buffer of its own, with the same kernel and bits.
`route(router_logits(...))` is the two-launch form of the same arithmetic (`_router_gemv_kernel`, then
`_route_kernel`), the reference the tests hold it to.

At prompt sizes a program still makes one GEMV pass per token where the triton backend's tiled router runs MMAs
over 16-64 tokens: slower there than that router, with the same bits as decode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from m3eagle.kernels import pdl
from m3eagle.kernels.batch_invariant import matmul
from m3eagle.kernels.moe import router as moe_router
from m3eagle.kernels.triton_utils import launch_opts, precise


@dataclass(frozen=True)
class RouterConfig:
    """Launch shape of the router programs; `router_config` makes it from (E, H) only."""

    block_e: int  # experts per program
    block_h: int  # H columns per step: the lanes each accumulate their own columns
    num_warps: int


def router_config(n_exp: int, hidden: int) -> RouterConfig:
    """The decode router's blocks for one token (`router_gemv_blocks(1, E, H)`): one expert row per program,
    read in one or two wide loads -- what the triton backend runs at batch 1 -- taken at every T."""
    return RouterConfig(*moe_router.router_gemv_blocks(1, n_exp, hidden))


# Tokens per program: at least MIN_PROGRAM_ROWS token rows per program column before tokens share programs, at
# most MAX_TOKENS per program (a batch-32 K = 3 verify step, 128 tokens, runs 8 per program).
MIN_PROGRAM_ROWS, MAX_TOKENS = 16, 8


def tokens_per_program(t: int) -> int:
    """How many consecutive tokens one router program takes in a T-token step (speed only: never the bits)."""
    return max(1, min(MAX_TOKENS, t // MIN_PROGRAM_ROWS))


def supports(x: torch.Tensor, weight: torch.Tensor, k: int) -> bool:
    """An fp32 router weight [E, H] (the checkpoint's; another dtype rounds its logits, which this does not),
    2-D x of width H, 1 <= k <= min(E, MAX_TOP_K) and E <= MAX_EXPERTS."""
    return (weight.dtype == torch.float32 and x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1]
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and 1 <= k <= min(weight.shape[0], moe_router.MAX_TOP_K) and weight.shape[0] <= moe_router.MAX_EXPERTS)


def _rows(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (x if x.stride(-1) == 1 else x.contiguous()), (weight if weight.stride(-1) == 1 else weight.contiguous())


def route_tokens(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int,
                 config: RouterConfig | None = None, tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """route(router_logits(x, weight), bias, k) in one launch: x [T, H], weight [E, H] fp32, bias [E] ->
    (weights [T, k] fp32, experts [T, k] int64). The caller checks `supports`. `config` and `tokens` (per
    program; default `tokens_per_program(T)`) exist for tests."""
    x, weight = _rows(x, weight)
    t, hidden = x.shape
    n_exp = weight.shape[0]
    cfg = config or router_config(n_exp, hidden)
    w = torch.empty(t, k, dtype=torch.float32, device=x.device)  # [T, k]
    idx = torch.empty(t, k, dtype=torch.int64, device=x.device)  # [T, k]
    if t == 0:
        return w, idx
    logits = torch.empty(t, n_exp, dtype=torch.float32, device=x.device)  # [T, E]: the route reads it back
    cnt = matmul.tile_counters(x.device) if t <= matmul.MAX_TILES else None  # one int32 per token, zero
    if cnt is None:  # inside a capture this zero-fill is a node of the graph: it runs before every replay
        cnt = torch.zeros(t, dtype=torch.int32, device=x.device)
    n_prog = triton.cdiv(n_exp, cfg.block_e)
    launch = pdl.args(x)
    # PRELOAD (one H step, under PDL) only reads the expert rows before the PDL wait: the same products and sum
    per = tokens or tokens_per_program(t)
    moe_router._router_topk_kernel[(triton.cdiv(t, per), n_prog)](
        x, weight, logits, cnt, bias, w, idx, hidden, n_exp, x.stride(0), weight.stride(0), n_prog, t,
        TOP_K=k, PRECISE=precise(), BLOCK_E=cfg.block_e, BLOCK_H=cfg.block_h,
        BLOCK_ALL=triton.next_power_of_2(n_exp), BLOCK_K=triton.next_power_of_2(k),
        PRELOAD=moe_router.router_preload(launch, cfg.block_h, hidden), TOKENS=per, num_warps=cfg.num_warps,
        **launch_opts(), **launch)
    return w, idx


def router_logits(x: torch.Tensor, weight: torch.Tensor, config: RouterConfig | None = None) -> torch.Tensor:
    """x [T, H] -> logits [T, E] fp32 with `route_tokens`' programs and sums (`_router_gemv_kernel`, compiled as
    that launch is: no FMA contraction), so route(router_logits(x, w), bias, k) is its two-launch form."""
    x, weight = _rows(x, weight)
    t, hidden = x.shape
    n_exp = weight.shape[0]
    cfg = config or router_config(n_exp, hidden)
    out = torch.empty(t, n_exp, dtype=torch.float32, device=x.device)  # [T, E]
    if t:
        moe_router._router_gemv_kernel[(t, triton.cdiv(n_exp, cfg.block_e))](
            x, weight, out, hidden, n_exp, x.stride(0), weight.stride(0), out.stride(0), BLOCK_E=cfg.block_e,
            BLOCK_H=cfg.block_h, num_warps=cfg.num_warps, **launch_opts(), **pdl.args(x))
    return out


def route_tokens_two_launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int,
                            config: RouterConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfolded form `route_tokens` is held to: `router_logits`, then `router.route`'s launch."""
    return moe_router.route(router_logits(x, weight, config), bias, k)
