"""Routed experts for a handful of tokens, without sorting: each (token, k) pair reads its expert directly.

Two launches (`direct_experts`, MoEConfig.direct = 1), after the router's own launch:

    idx [T, k] ──_direct_gate_up_kernel──► act [T*k (+T), I]   grid (pairs, I-tiles): one GEMV per pair,
                                                              SwiGLU-OAI in registers
    act ──_direct_down_kernel──► out [T, H]                    grid (T, H-tiles): the token's k experts
                                                              (+ the shared one) and their weighted sum

One launch for the whole MoE layer (`direct_layer`, MoEConfig.direct = 2): router, gate_up and down are
three roles of one grid (`_layer_kernel`), chained by counters in device memory instead of kernel
boundaries -- see "One launch" below.

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

One launch. Even two launches leave the memory pipe idle at each kernel boundary (the last programs'
tail, then the next grid's launch and ramp-up: ~2-3 us each on an H200, against ~21 us of weight reads
for a whole m3-mini layer), and the router (~4 us, latency-bound) idles it completely. `_layer_kernel`
runs the router's programs, the shared expert's gate_up (it needs no routing, so it streams while the
router finishes), the routed gate_up and the down programs in one grid. A role waits for the one before
it by polling a counter that the producers raise after their stores (release / acquire at GPU scope,
the pattern of the router's last-program counter). Waiting on other programs of the same grid is safe
only if those have started; CUDA does not promise that blocks start in index order, so each program takes
its role from a ticket (an atomic counter at its start): a program waits only on roles of smaller
tickets, which belong to programs that are already running. The last down program leaves every counter
at zero for the next launch. Routing is `fused.triton_fused`'s (the same jit helpers, compiled with the
same precise-math options), so the chosen experts and their weights are bit-equal to `route_tokens`.

Rounding is the sorted path's: act is stored in the activation dtype; each expert's output is rounded to
it, weighted in fp32 (routing weight * routed_scale; 1 for the shared expert), rounded again, and the
k (+1) rows are summed in fp32 in a fixed order (one compiled reduction), so equal inputs give bit-equal
outputs run to run. The order of the K sums differs from the tl.dot path, so the two paths agree to
rounding, not bit for bit: a step size uses one path or the other by its tuning-table entry
(`MoEConfig.direct`), never both.

Expert subset (two-launch path only): pairs routed outside [e0, e0 + num_local) are skipped (no read, no
contribution). No host sync, static shapes: both paths can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import pdl
from ..fused import triton_fused as _tf  # the router's jit helpers and compile options (one routing rule)
from ..fused.gemv import SplitCounters
from ..pdl import pdl_wait
from .tuning import MoEConfig

# ---- shared jit helpers: one pair's gate_up tile, one token's down tile --------------------------------


@triton.jit
def _gate_up_tile(x_row_ptr, base, act_row_ptr, pid_n, hidden, inter, stride_wn, alpha, limit,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """act_row[n-tile] = swiglu_oai(x_row @ [gate_n; up_n]) with the expert's w13 at `base` ([2I, H], gate
    rows then up rows, unit stride along H)."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    rows = tl.minimum(offs_n, inter - 1)  # clamped, not masked: the weight stream carries no row predicate
    offs_k = tl.arange(0, BLOCK_K)  # [BK]
    g_ptrs = base + rows.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]  # [BN, BK]
    u_ptrs = g_ptrs + inter * stride_wn
    x_ptrs = x_row_ptr + offs_k[None, :] + 0 * rows[:, None]  # [BN, BK], one row
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
    tl.store(act_row_ptr + offs_n, act.to(act_row_ptr.dtype.element_ty), mask=offs_n < inter)


@triton.jit
def _down_tile(act_ptr, idx_ptr, wts_ptr, w_ptr, ws_ptr, out_ptr, t, pid_n, T, e_start, num_local, hidden, inter,
               routed_scale, stride_at, stride_we, stride_wh, stride_ot, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
               HAS_SHARED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
               CACHE: tl.constexpr):
    """out[t, n-tile] = sum_j round(round(act[t*k+j] @ down[e_j]^T) * w[t, j] * routed_scale)
    (+ round(act[T*k+t] @ shared_down^T)), fp32 sum in one fixed order. w [E_local, H, I] (unit stride
    along I). The k experts' tiles are one [K_PAD, BN, BK] load per K step (slots past TOP_K and other
    ranks' experts masked: never read). CACHE: the load cache modifier of what this launch wrote itself
    (idx, weights, act; ".cg": from L2, not a stale L1 line)."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    rows = tl.minimum(offs_n, hidden - 1)
    offs_k = tl.arange(0, BLOCK_K)  # [BK]
    slots = tl.arange(0, K_PAD)  # [KP]
    pair = t * TOP_K + slots  # [KP]
    e = tl.load(idx_ptr + pair, mask=slots < TOP_K, other=0, cache_modifier=CACHE).to(tl.int64) - e_start
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
        a = tl.load(a_ptrs, mask=m3, other=0.0, cache_modifier=CACHE).to(tl.float32)
        acc += tl.load(w_ptrs, mask=m3, other=0.0).to(tl.float32) * a
        w_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        if HAS_SHARED:
            if EVEN_K:
                sv = tl.load(s_ptrs).to(tl.float32) * tl.load(sa_ptrs, cache_modifier=CACHE).to(tl.float32)
            else:
                k_ok = (k0 + offs_k < inter)[None, :]
                sv = (tl.load(s_ptrs, mask=k_ok, other=0.0).to(tl.float32)
                      * tl.load(sa_ptrs, mask=k_ok, other=0.0, cache_modifier=CACHE).to(tl.float32))
            acc_s += sv
            s_ptrs += BLOCK_K
            sa_ptrs += BLOCK_K
    out_ty = out_ptr.dtype.element_ty
    y = tl.sum(acc, axis=2).to(out_ty).to(tl.float32)  # [KP, BN]: each expert's output, rounded
    route_w = tl.load(wts_ptr + pair, mask=live, other=0.0, cache_modifier=CACHE).to(tl.float32) * routed_scale
    y = (y * route_w[:, None]).to(out_ty).to(tl.float32)  # dead slots: 0 * 0
    total = tl.sum(y, axis=0)  # [BN]
    if HAS_SHARED:
        total += tl.sum(acc_s, axis=1).to(out_ty).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs_n, total.to(out_ty), mask=offs_n < hidden)


# ---- two launches ----------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["T", "e_start"])
def _direct_gate_up_kernel(x_ptr, idx_ptr, w_ptr, ws_ptr, act_ptr, T, e_start, num_local, hidden, inter,
                           stride_xt, stride_we, stride_wn, stride_at, alpha, limit,
                           TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr):
    """act[p, n-tile] for pair p = program_id(0) (`_gate_up_tile`). w [E_local, 2I, H]; pairs p >= T*TOP_K
    are the shared expert's (ws [2I, H], same strides), token p - T*TOP_K. A pair of another rank's expert
    stores nothing."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/pdl.py): before any memory access
    p = tl.program_id(0)
    routed = p < T * TOP_K
    token = tl.where(routed, p // TOP_K, p - T * TOP_K)
    e = tl.load(idx_ptr + p, mask=routed, other=0).to(tl.int64) - e_start
    if routed & ((e < 0) | (e >= num_local)):
        return
    base = w_ptr + tl.where(routed, e, 0) * stride_we
    if HAS_SHARED:
        if not routed:
            base = ws_ptr
    _gate_up_tile(x_ptr + token.to(tl.int64) * stride_xt, base, act_ptr + p.to(tl.int64) * stride_at,
                  tl.program_id(1), hidden, inter, stride_wn, alpha, limit, BLOCK_N, BLOCK_K, EVEN_K)


@triton.jit(do_not_specialize=["T", "e_start"])
def _direct_down_kernel(act_ptr, idx_ptr, wts_ptr, w_ptr, ws_ptr, out_ptr, T, e_start, num_local, hidden, inter,
                        routed_scale, stride_at, stride_we, stride_wh, stride_ot,
                        TOP_K: tl.constexpr, K_PAD: tl.constexpr, HAS_SHARED: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr):
    """out[t, n-tile] for t = program_id(0) (`_down_tile`)."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/pdl.py): before any memory access
    _down_tile(act_ptr, idx_ptr, wts_ptr, w_ptr, ws_ptr, out_ptr, tl.program_id(0), tl.program_id(1), T, e_start,
               num_local, hidden, inter, routed_scale, stride_at, stride_we, stride_wh, stride_ot, TOP_K, K_PAD,
               HAS_SHARED, BLOCK_N, BLOCK_K, EVEN_K, "")


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


# ---- one launch: router + gate_up + down ---------------------------------------------------------------

# The layer kernel's counters ([COUNTERS] int32, zero between launches): the ticket, tokens routed, gate_up
# programs done, down programs done, then one router counter per token.
# (constexpr globals: the only module globals a jit function may read)
_TICKET, _ROUTED, _ACT, _DONE, _ROUTE = (tl.constexpr(i) for i in range(5))
LAYER_MAX_T = 4  # tokens per step the one-launch layer takes (decode, batch-1 verify)
COUNTERS = 5 + LAYER_MAX_T


@triton.jit
def _load_acquire(ptr, ON_GPU: tl.constexpr, SLEEP: tl.constexpr):
    """The int32 at ptr, read with acquire semantics at GPU scope: what was stored before a release that
    this read observes is visible to the program's later loads. A plain load, not an atomic: many programs
    poll one address, and atomics would queue behind each other at L2 (tl.atomic_add(ptr, 0) with an
    unused result is also dropped by the compiler). SLEEP: back off ~100 ns first. Under the interpreter
    (programs run one at a time) a volatile load."""
    if ON_GPU:
        if SLEEP:
            asm: tl.constexpr = "{ nanosleep.u32 100; ld.acquire.gpu.global.b32 $0, [$1]; }"
        else:
            asm: tl.constexpr = "ld.acquire.gpu.global.b32 $0, [$1];"
        return tl.inline_asm_elementwise(asm, "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1)
    else:
        return tl.load(ptr, volatile=True)


@triton.jit
def _wait_for(ptr, target, ON_GPU: tl.constexpr):
    """Poll the counter at ptr until it reaches target (acquire loads), then hold every thread of the
    program until then."""
    seen = _load_acquire(ptr, ON_GPU, False)
    while seen < target:
        seen = _load_acquire(ptr, ON_GPU, True)
    tl.debug_barrier()


@triton.jit(do_not_specialize=["T"])
def _layer_kernel(x_ptr, rw_ptr, bias_ptr, lg_ptr, wts_ptr, idx_ptr, cnt_ptr, w13_ptr, s13_ptr, w2_ptr, s2_ptr,
                  act_ptr, out_ptr, T, n_exp, hidden, inter, stride_xt, stride_rw, stride_we13, stride_wn,
                  stride_we2, stride_wh, stride_at, stride_ot, alpha, limit, routed_scale,
                  TOP_K: tl.constexpr, K_PAD: tl.constexpr, PRECISE: tl.constexpr, ROUTE_H: tl.constexpr,
                  E_ALL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                  DOWN_N: tl.constexpr, DOWN_K: tl.constexpr, DOWN_EVEN_K: tl.constexpr, ON_GPU: tl.constexpr,
                  PDL: tl.constexpr):
    """The whole MoE layer for T <= LAYER_MAX_T tokens (module docstring, "One launch"). By ticket v:
    [0, T*E) router (one expert row of one token each; a token's last program routes it), then T*n_gu
    shared-expert gate_up tiles, T*k*n_gu routed gate_up tiles (after all tokens are routed), then
    T*n_dn down tiles (after every gate_up tile)."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/pdl.py): before any memory access
    v = tl.atomic_add(cnt_ptr + _TICKET, 1, sem="relaxed", scope="gpu")
    n_gu = tl.cdiv(inter, BLOCK_N)
    n_route = T * n_exp
    n_shared = T * n_gu
    n_gate = n_shared + T * TOP_K * n_gu
    if v < n_route:
        t = v // n_exp
        offs_e = v % n_exp + tl.arange(0, 1)  # [1]: one expert row
        logit = _tf._router_gemv_rows(x_ptr, rw_ptr, t.to(tl.int64), offs_e, offs_e < n_exp, hidden, stride_xt,
                                      stride_rw, 1, ROUTE_H)
        tl.store(lg_ptr + t * n_exp + offs_e, logit)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + _ROUTE + t, 1, sem="acq_rel", scope="gpu")
        if done == n_exp - 1:  # the token's last router program: every logit of the row is in L2
            tl.store(cnt_ptr + _ROUTE + t, 0)
            _tf._route_row(lg_ptr + t * n_exp, bias_ptr, wts_ptr + t * TOP_K, idx_ptr + t * TOP_K, n_exp, TOP_K,
                           PRECISE, E_ALL, K_PAD, ".cg")
            tl.debug_barrier()
            tl.atomic_add(cnt_ptr + _ROUTED, 1, sem="release", scope="gpu")
    elif v < n_route + n_gate:
        g = v - n_route
        if g < n_shared:  # the shared expert needs no routing: it streams while the router finishes
            token = g % T
            pair = T * TOP_K + token
            pid_n = g // T
            base = s13_ptr
        else:
            g = g - n_shared
            pair = g % (T * TOP_K)  # pairs vary fastest: tokens sharing an expert read its tiles together
            pid_n = g // (T * TOP_K)
            token = pair // TOP_K
            _wait_for(cnt_ptr + _ROUTED, T, ON_GPU)
            e = tl.load(idx_ptr + pair, cache_modifier=".cg").to(tl.int64)
            base = w13_ptr + e * stride_we13
        _gate_up_tile(x_ptr + token.to(tl.int64) * stride_xt, base, act_ptr + pair.to(tl.int64) * stride_at, pid_n,
                      hidden, inter, stride_wn, alpha, limit, BLOCK_N, BLOCK_K, EVEN_K)
        tl.debug_barrier()
        tl.atomic_add(cnt_ptr + _ACT, 1, sem="release", scope="gpu")
    else:
        d = v - n_route - n_gate
        _wait_for(cnt_ptr + _ACT, n_gate, ON_GPU)
        _down_tile(act_ptr, idx_ptr, wts_ptr, w2_ptr, s2_ptr, out_ptr, d % T, d // T, T, 0, n_exp, hidden, inter,
                   routed_scale, stride_at, stride_we2, stride_wh, stride_ot, TOP_K, K_PAD, True, DOWN_N, DOWN_K,
                   DOWN_EVEN_K, ".cg")
        n_down = T * tl.cdiv(hidden, DOWN_N)
        if tl.atomic_add(cnt_ptr + _DONE, 1, sem="acq_rel", scope="gpu") == n_down - 1:
            # the last program of the launch: every other one is past its waits; zero for the next launch
            tl.store(cnt_ptr + _TICKET, 0)
            tl.store(cnt_ptr + _ROUTED, 0)
            tl.store(cnt_ptr + _ACT, 0)
            tl.store(cnt_ptr + _DONE, 0)


def layer_usable(x: torch.Tensor, router_w: torch.Tensor, top_k: int, w13: torch.Tensor, w2: torch.Tensor,
                 shared: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """What `direct_layer` takes: 1..LAYER_MAX_T tokens, the fused router's limits (fp32 router weights,
    unit strides, k <= MAX_TOP_K, E <= MAX_EXPERTS) and the direct kernels' layouts."""
    n_exp = router_w.shape[0]
    return (1 <= x.shape[0] <= LAYER_MAX_T and x.stride(1) == 1 and router_w.dtype == torch.float32
            and router_w.stride(1) == 1 and 1 <= top_k <= min(n_exp, _tf.MAX_TOP_K) and n_exp <= _tf.MAX_EXPERTS
            and w13.shape[0] == n_exp and usable(w13, w2, shared))


def direct_layer(x: torch.Tensor, router_w: torch.Tensor, bias: torch.Tensor, top_k: int, w13: torch.Tensor,
                 w2: torch.Tensor, shared: tuple[torch.Tensor, torch.Tensor], alpha: float, limit: float,
                 routed_scale: float, cfg: MoEConfig, counters: SplitCounters) -> torch.Tensor | None:
    """The whole MoE layer in one launch: x [T, H] (T <= LAYER_MAX_T), router_w [E, H] fp32, bias [E] fp32,
    all E experts w13 [E, 2I, H] / w2 [E, H, I] and the shared expert (s13 [2I, H], s2 [H, I]) -> [T, H] in
    x.dtype = routed_scale * routed + shared, routed as `route_tokens` routes. `counters` is the caller's
    (one stream at a time); None while a CUDA graph is captured before they exist (the caller then takes
    the router + `direct_experts`), as the router's own counters."""
    cnt = counters.get(x.device)
    if cnt is None:
        return None
    t, hidden = x.shape
    n_exp, inter = router_w.shape[0], w2.shape[2]
    s13, s2 = shared
    lg = torch.empty(t, n_exp, dtype=torch.float32, device=x.device)  # [T, E]
    wts = torch.empty(t, top_k, dtype=torch.float32, device=x.device)  # [T, k]
    idx = torch.empty(t, top_k, dtype=torch.int64, device=x.device)  # [T, k]
    act = torch.empty(t * (top_k + 1), inter, dtype=x.dtype, device=x.device)  # [T*k + T, I]
    out = torch.empty(t, hidden, dtype=x.dtype, device=x.device)  # [T, H]
    dcfg = cfg.down()
    bn, bk, dbn, dbk = cfg.block_n, cfg.block_k, dcfg.block_n, dcfg.block_k
    grid = t * n_exp + t * (top_k + 1) * triton.cdiv(inter, bn) + t * triton.cdiv(hidden, dbn)
    _layer_kernel[(grid,)](
        x, router_w, bias, lg, wts, idx, cnt, w13, s13, w2, s2, act, out, t, n_exp, hidden, inter,
        x.stride(0), router_w.stride(0), w13.stride(0), w13.stride(1), w2.stride(0), w2.stride(1), act.stride(0),
        out.stride(0), float(alpha), float(limit), float(routed_scale),
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), PRECISE=_tf._precise(),
        ROUTE_H=min(4096, triton.next_power_of_2(hidden)), E_ALL=triton.next_power_of_2(n_exp), BLOCK_N=bn,
        BLOCK_K=bk, EVEN_K=hidden % bk == 0, DOWN_N=dbn, DOWN_K=dbk, DOWN_EVEN_K=inter % dbk == 0,
        ON_GPU=_tf._precise(), num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_tf._opts(),
        **pdl.args(x))
    return out
