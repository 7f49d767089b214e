"""Routed experts for a handful of tokens, without sorting: each (token, k) pair reads its expert directly.

    idx [T, k] ──_direct_gate_up_kernel──► act [T*k (+T), I]   grid (pairs, I-tiles): one GEMV per pair,
                                                              SwiGLU-OAI in registers
    act ──_direct_down_kernel──► out [T, H]                    grid (T, H-tiles): the token's k experts
                                                              (+ the shared one) and their weighted sum

Why. At decode (T = 1..4) the sorted path (`align.py` + the grouped GEMMs + the combine) spends two of its
four launches on bookkeeping: placing 4 pairs into padded segments and summing 4 rows per token, ~4 us of
a ~33 us m3-mini layer on an H200 where the weight reads at copy bandwidth take ~15 us. Here the pair
list *is* idx (pair p = t*k + j reads expert idx[t, j]; with a shared expert, pair T*k + t reads it), and
the down kernel owns whole output rows, so it sums a token's experts itself: two launches, no alignment,
no [T*k, H] buffer round trip. The inner products are elementwise GEMVs (fp32 FMAs on a [BLOCK_N, BLOCK_K]
tile, one reduction over K at the end), memory-bound like `fused/gemv.py`'s; the down kernel loads the
tiles of all k experts in one 3-D block per K step, so each program keeps k loads in flight. Pairs that
share an expert (T > 1) read the same tiles from neighbouring programs (pairs vary fastest in the grid),
which L2 mostly serves.

Rounding is the sorted path's: act is stored in the activation dtype; each expert's output is rounded to
it, weighted in fp32 (routing weight * routed_scale; 1 for the shared expert), rounded again, and the
k (+1) rows are summed in fp32 in a fixed order (one compiled reduction), so equal inputs give bit-equal
outputs run to run. The order of the K sums differs from the tl.dot path, so the two paths agree to
rounding, not bit for bit: a step size uses one path or the other by its tuning-table entry
(`MoEConfig.direct`), never both.

Expert subset: pairs routed outside [e0, e0 + num_local) are skipped (no read, no contribution).
No host sync, static shapes: capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import pdl
from ..pdl import pdl_wait
from .tuning import MoEConfig


@triton.jit(do_not_specialize=["T", "e_start"])
def _direct_gate_up_kernel(x_ptr, idx_ptr, w_ptr, ws_ptr, act_ptr, T, e_start, num_local, hidden, inter,
                           stride_xt, stride_we, stride_wn, stride_at, alpha, limit,
                           TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr):
    """act[p, n-tile] = swiglu_oai(x[token(p)] @ [gate_n; up_n]) for pair p = program_id(0).

    w [E_local, 2I, H] (gate rows then up rows, unit stride along H); pairs p >= T*TOP_K are the shared
    expert's (ws [2I, H], same strides), token p - T*TOP_K. A pair of another rank's expert stores nothing."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/pdl.py): before any memory access
    p = tl.program_id(0)
    pid_n = tl.program_id(1)
    routed = p < T * TOP_K
    token = tl.where(routed, p // TOP_K, p - T * TOP_K)
    e = tl.load(idx_ptr + p, mask=routed, other=0).to(tl.int64) - e_start
    if routed & ((e < 0) | (e >= num_local)):
        return
    base = w_ptr + tl.where(routed, e, 0) * stride_we
    if HAS_SHARED:
        if not routed:
            base = ws_ptr
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    rows = tl.minimum(offs_n, inter - 1)  # clamped, not masked: the weight stream carries no row predicate
    offs_k = tl.arange(0, BLOCK_K)  # [BK]
    g_ptrs = base + rows.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]  # [BN, BK]
    u_ptrs = g_ptrs + inter * stride_wn
    x_ptrs = x_ptr + token.to(tl.int64) * stride_xt + offs_k[None, :] + 0 * rows[:, None]  # [BN, BK], one row
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        if EVEN_K:
            xv = tl.load(x_ptrs).to(tl.float32)
            g = tl.load(g_ptrs).to(tl.float32)
            u = tl.load(u_ptrs).to(tl.float32)
        else:
            k_ok = (k0 + offs_k < hidden)[None, :]
            xv = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)
            g = tl.load(g_ptrs, mask=k_ok, other=0.0).to(tl.float32)
            u = tl.load(u_ptrs, mask=k_ok, other=0.0).to(tl.float32)
        acc_g += g * xv
        acc_u += u * xv
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    # SwiGLU-OAI exactly as layers.swiglu_oai: gate clamped above only, up on both sides.
    gate = tl.minimum(tl.sum(acc_g, axis=1), limit)
    up = tl.minimum(tl.maximum(tl.sum(acc_u, axis=1), -limit), limit)
    act = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
    tl.store(act_ptr + p.to(tl.int64) * stride_at + offs_n, act.to(act_ptr.dtype.element_ty), mask=offs_n < inter)


@triton.jit(do_not_specialize=["T", "e_start"])
def _direct_down_kernel(act_ptr, idx_ptr, wts_ptr, w_ptr, ws_ptr, out_ptr, T, e_start, num_local, hidden, inter,
                        routed_scale, stride_at, stride_we, stride_wh, stride_ot,
                        TOP_K: tl.constexpr, K_PAD: tl.constexpr, HAS_SHARED: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr):
    """out[t, n-tile] = sum_j round(round(act[t*k+j] @ down[e_j]^T) * w[t, j] * routed_scale)
    (+ round(act[T*k+t] @ shared_down^T)), fp32 sum in one fixed order, for t = program_id(0).

    w [E_local, H, I] (unit stride along I). The k experts' tiles are one [K_PAD, BN, BK] load per K step
    (slots past TOP_K and other ranks' experts masked: never read)."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/pdl.py): before any memory access
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    rows = tl.minimum(offs_n, hidden - 1)
    offs_k = tl.arange(0, BLOCK_K)  # [BK]
    slots = tl.arange(0, K_PAD)  # [KP]
    pair = t * TOP_K + slots  # [KP]
    e = tl.load(idx_ptr + pair, mask=slots < TOP_K, other=0).to(tl.int64) - e_start
    live = (slots < TOP_K) & (e >= 0) & (e < num_local)  # [KP]
    e = tl.where(live, e, 0)
    live3 = live[:, None, None] & (rows >= 0)[None, :, None]  # [KP, BN, 1]
    w_ptrs = (w_ptr + e[:, None, None] * stride_we + rows.to(tl.int64)[None, :, None] * stride_wh
              + offs_k[None, None, :])  # [KP, BN, BK]
    a_ptrs = act_ptr + pair.to(tl.int64)[:, None, None] * stride_at + offs_k[None, None, :]  # [KP, 1, BK]
    acc = tl.zeros([K_PAD, BLOCK_N, BLOCK_K], dtype=tl.float32)
    if HAS_SHARED:
        s_pair = (T * TOP_K + t).to(tl.int64)
        s_ptrs = ws_ptr + rows.to(tl.int64)[:, None] * stride_wh + offs_k[None, :]  # [BN, BK]
        sa_ptrs = act_ptr + s_pair * stride_at + offs_k[None, :] + 0 * rows[:, None]  # [BN, BK], one row
        acc_s = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        if EVEN_K:
            m3 = live3
        else:
            m3 = live3 & (k0 + offs_k < inter)[None, None, :]
        a = tl.load(a_ptrs, mask=m3, other=0.0).to(tl.float32)
        acc += tl.load(w_ptrs, mask=m3, other=0.0).to(tl.float32) * a
        w_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        if HAS_SHARED:
            if EVEN_K:
                sv = tl.load(s_ptrs).to(tl.float32) * tl.load(sa_ptrs).to(tl.float32)
            else:
                k_ok = (k0 + offs_k < inter)[None, :]
                sv = (tl.load(s_ptrs, mask=k_ok, other=0.0).to(tl.float32)
                      * tl.load(sa_ptrs, mask=k_ok, other=0.0).to(tl.float32))
            acc_s += sv
            s_ptrs += BLOCK_K
            sa_ptrs += BLOCK_K
    out_ty = out_ptr.dtype.element_ty
    y = tl.sum(acc, axis=2).to(out_ty).to(tl.float32)  # [KP, BN]: each expert's output, rounded
    route_w = tl.load(wts_ptr + pair, mask=live, other=0.0).to(tl.float32) * routed_scale  # [KP]
    y = (y * route_w[:, None]).to(out_ty).to(tl.float32)  # dead slots: 0 * 0
    total = tl.sum(y, axis=0)  # [BN]
    if HAS_SHARED:
        total += tl.sum(acc_s, axis=1).to(out_ty).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs_n, total.to(out_ty), mask=offs_n < hidden)


def usable(w13: torch.Tensor, w2: torch.Tensor, shared: tuple[torch.Tensor, torch.Tensor] | None) -> bool:
    """The direct kernels step along H / I with unit stride (the stacks' natural layout)."""
    ok = w13.stride(2) == 1 and w2.stride(2) == 1
    if shared is not None:
        ok = ok and shared[0].stride(1) == 1 and shared[1].stride(1) == 1
    return ok


def direct_experts(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   e_start: int, alpha: float, limit: float, cfg: MoEConfig,
                   shared: tuple[torch.Tensor, torch.Tensor] | None = None, routed_scale: float = 1.0,
                   ) -> torch.Tensor:
    """x [T, H], weights [T, k] fp32, idx [T, k] global ids, w13 [E_local, 2I, H], w2 [E_local, H, I] (experts
    e_start..) -> [T, H] in x.dtype: routed_scale * sum of the local pairs (+ the shared expert's output).
    cfg.block_n / block_k tile gate_up; cfg.down_block_n / down_block_k tile down (0: the same)."""
    t, k = idx.shape
    hidden, inter = x.shape[1], w2.shape[2]
    idx = idx.contiguous()  # the kernels read idx[t, j] at t * k + j
    x = x if x.stride(1) == 1 else x.contiguous()
    weights = weights.reshape(-1).float().contiguous()  # [T*k] fp32; no copy when it already is
    s13, s2 = shared if shared is not None else (w13, w2)
    pairs = t * k + (t if shared is not None else 0)
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)  # [pairs, I]
    bn, bk = cfg.block_n, cfg.block_k
    _direct_gate_up_kernel[(pairs, triton.cdiv(inter, bn))](
        x, idx, w13, s13, act, t, e_start, w13.shape[0], hidden, inter,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0), float(alpha), float(limit),
        TOP_K=k, HAS_SHARED=shared is not None, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=hidden % bk == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.args(x))
    out = torch.empty(t, hidden, dtype=x.dtype, device=x.device)
    dcfg = cfg.down()
    dbn, dbk = dcfg.block_n, dcfg.block_k
    _direct_down_kernel[(t, triton.cdiv(hidden, dbn))](
        act, idx, weights, w2, s2, out, t, e_start, w2.shape[0], hidden, inter, float(routed_scale),
        act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        TOP_K=k, K_PAD=triton.next_power_of_2(k), HAS_SHARED=shared is not None, BLOCK_N=dbn, BLOCK_K=dbk,
        EVEN_K=inter % dbk == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.args(act))
    return out
