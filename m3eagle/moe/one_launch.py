"""The whole decode MoE layer in one launch: router, shared expert, routed gate_up, down and the weighted sum.

    x [T, H] ── one grid; each program takes a ticket, and the ticket gives its role ──► out [T, H]
      router   tickets [0, T*n_prog)        `_router_topk_program`: E logits in blocks; the token's last
                                            program routes it (idx, weights), then marks the token routed
      shared   T * n_s tiles                the shared expert's gate_up (needs no routing) ─┐ act [T*k + T, I']
      routed   T * k * n_r tiles            wait: token routed; the pair's expert's gate_up ─┘ (each tile counts
                                            itself done for its token)
      down     T * n_d tiles (rows of H)    shared down weights -> wait: routed -> the k experts' down weights
                                            -> wait: every act tile of the token -> products and the weighted
                                            sum (`direct._down_sum`)

Why. The three-launch direct path (`direct.route_direct_experts`: router + shared gate_up, routed gate_up,
down) reads m3-mini's 63 MB per layer at 58% of the H200's copy bandwidth at T = 1 (design note 43): each
launch pays a ramp and a drain of a few microseconds, and down's weight stream can only start at its own
launch. In one launch the phases overlap inside the grid: the shared expert's 12.6 MB stream while the
router's latency chain runs, and a down program loads its weight tiles as soon as its token is routed,
waiting only for the act rows (L2) before the products.

Synchronisation (int32 counters in `sync`, zero between launches; each launch leaves them zero): ticket
sync[0]; per token t: routed sync[1 + t], act tiles done sync[1 + T + t], down tiles done sync[1 + 2T + t].
A producer stores its results, waits for all its threads (CTA barrier), then adds 1 with release semantics
at GPU scope; a consumer spins on a volatile load until the count is reached, acquires it, and reads the
results from L2 (`.cg`: an SM's L1 is not coherent with other SMs' stores). The last program to take a
ticket resets the ticket; a token's last down program resets its three counters (every wait on them has
passed by then: each counted program waited before counting).

Deadlock freedom. A program waits only on programs of lower tickets, and tickets are taken in the order
programs start, so everything it waits on is already resident and running -- whatever order the hardware
schedules programs in, and however few fit on the GPU at once (the lowest unfinished ticket never waits).
With programmatic dependent launch the next kernel's programs are scheduled only once every program here
has started. Under the CPU interpreter programs run one after another in ticket order, so no wait ever
spins.

Rounding. The router and gate_up are the direct path's own programs (bit-equal routing and act); down's
products and sums are `direct._down_sum`'s. The launch compiles without FMA contraction (the router needs
that), so on the GPU its down products may round differently from the two-launch path's contracted ones: the
two agree to rounding, and a step size uses one path or the other by its tuning-table entry
(`MoEConfig.one_launch`), never both. Under the interpreter the two are bit-equal.

Limits (`fits`): one down K tile spans max(I, I_s) (down loads its whole row segment at once); the router's
warp count equals gate_up's (one launch has one); every expert on this rank; T <= MAX_T.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import pdl
from ..fused import triton_fused
from ..fused.triton_fused import _router_topk_program
from ..pdl import pdl_wait
from .direct import _down_sum, _gate_up_rows, _load_k
from .tuning import MoEConfig

MAX_T = triton_fused.ROUTER_GEMV_MAX_T  # the decode router's step size
SYNC_SLOTS = 1 + 3 * MAX_T  # int32 counters a launch needs (a SplitCounters buffer has more)
# Nanoseconds a waiting program sleeps between polls (0: it polls back to back). Each poll is an L2 read of
# one address, so thousands of waiting programs would otherwise crowd that address's L2 slice.
SLEEP_NS = 100


@triton.jit
def _nanosleep(NS: tl.constexpr):
    """Suspend this thread for about NS ns (PTX nanosleep; the GPU only)."""
    tl.inline_asm_elementwise("nanosleep.u32 $1;\n\tmov.u32 $0, $1;", "=r,r", [tl.full([1], NS, tl.int32)],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _wait_at_least(ptr, target, SLEEP: tl.constexpr):
    """Spin until the int32 counter at ptr reaches target, and acquire it (GPU scope): what its producers
    released before counting is visible to this program's later `.cg` loads. The count is read with an
    acquiring atomic (its value used: an unused `atomic_add(ptr, 0)` is compiled away), and between such
    reads polled with plain volatile loads, which do not queue at the L2's atomic unit."""
    while tl.atomic_add(ptr, 0, sem="acquire", scope="gpu") < target:
        while tl.load(ptr, volatile=True) < target:
            if SLEEP > 0:
                _nanosleep(SLEEP)


@triton.jit
def _signal(ptr):
    """Count this program's results done: its threads' stores first (CTA barrier), then a release add."""
    tl.debug_barrier()
    tl.atomic_add(ptr, 1, sem="release", scope="gpu")


@triton.jit
def _down_tile(act_ptr, idx_ptr, wts_ptr, w_ptr, ws_ptr, out_ptr, routed_ptr, ready_ptr, ready_target, t, pid_n, T,
               hidden, inter, s_inter, routed_scale, stride_at, stride_we, stride_wh, stride_swh, stride_ot,
               TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               EVEN_K: tl.constexpr, S_EVEN_K: tl.constexpr, SLEEP: tl.constexpr):
    """out[t, n-tile]: direct down's math with one K tile over all of I (and I_s), its loads spread over the
    waits -- the shared expert's weights at once, the routed experts' once t is routed, act once complete."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    rows = tl.minimum(offs_n, hidden - 1)  # clamped, not masked, as in direct down
    offs_k = tl.arange(0, BLOCK_K)  # [BK]
    s_ok = (offs_k < s_inter)[None, :]  # [1, BK]
    sw = _load_k(ws_ptr + rows.to(tl.int64)[:, None] * stride_swh + offs_k[None, :], s_ok, S_EVEN_K)  # [BN, BK]
    _wait_at_least(routed_ptr, 1, SLEEP)
    slots = tl.arange(0, K_PAD)  # [KP]
    pair = t * TOP_K + slots  # [KP]
    live = slots < TOP_K
    e = tl.load(idx_ptr + pair, mask=live, other=0, cache_modifier=".cg").to(tl.int64)  # [KP]
    m3 = live[:, None, None] & (rows >= 0)[None, :, None]  # [KP, BN, 1]
    if not EVEN_K:
        m3 = m3 & (offs_k < inter)[None, None, :]
    w_ptrs = (w_ptr + e[:, None, None] * stride_we + rows.to(tl.int64)[None, :, None] * stride_wh
              + offs_k[None, None, :])  # [KP, BN, BK]
    wv = tl.load(w_ptrs, mask=m3, other=0.0)  # the k experts' whole K range
    _wait_at_least(ready_ptr, ready_target, SLEEP)
    a = tl.load(act_ptr + pair.to(tl.int64)[:, None, None] * stride_at + offs_k[None, None, :], mask=m3, other=0.0,
                cache_modifier=".cg")  # [KP, BN, BK]
    sa = tl.load(act_ptr + (T * TOP_K + t).to(tl.int64) * stride_at + offs_k[None, :] + 0 * rows[:, None],
                 mask=s_ok & (rows >= 0)[:, None], other=0.0, cache_modifier=".cg")  # [BN, BK], one row
    acc = wv.to(tl.float32) * a.to(tl.float32)
    acc_s = sw.to(tl.float32) * sa.to(tl.float32)
    _down_sum(acc, acc_s, pair, live, wts_ptr, out_ptr + t.to(tl.int64) * stride_ot, offs_n, hidden, routed_scale,
              True, ".cg")


@triton.jit(do_not_specialize=["T"])
def _moe_layer_kernel(x_ptr, rw_ptr, bias_ptr, lg_ptr, cnt_ptr, wts_ptr, idx_ptr, w13_ptr, w2_ptr, s13_ptr, s2_ptr,
                      act_ptr, out_ptr, sync_ptr, T, hidden, n_exp, inter, s_inter, routed_scale, alpha, limit,
                      stride_xt, stride_rw, stride_w13e, stride_w13n, stride_s13n, stride_w2e, stride_w2h, stride_s2h,
                      stride_at, stride_ot, n_prog, n_r, n_s, n_d,
                      TOP_K: tl.constexpr, K_PAD: tl.constexpr, PRECISE: tl.constexpr, BLOCK_E: tl.constexpr,
                      BLOCK_H: tl.constexpr, BLOCK_ALL: tl.constexpr, BLOCK_KK: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOWN_N: tl.constexpr, DOWN_K: tl.constexpr,
                      D_EVEN_K: tl.constexpr, DS_EVEN_K: tl.constexpr, SLEEP: tl.constexpr, PDL: tl.constexpr):
    """SparseMoE's output for T tokens (module docstring): x [T, H], router rw [E, H] fp32 + bias [E], experts
    w13 [E, 2I, H] / w2 [E, H, I], shared s13 [2I_s, H] / s2 [H, I_s]; scratch logits lg [T, E], router
    counters cnt [T], weights wts [T, k], idx [T, k], act [T*k + T, max(I, I_s)]; sync as described."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/pdl.py): before any memory access
    n_router = T * n_prog
    n_shared = T * n_s
    n_routed = T * TOP_K * n_r
    q = tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")  # this program's ticket
    if q == n_router + n_shared + n_routed + T * n_d - 1:
        tl.store(sync_ptr, 0)  # every program has its ticket: the next launch counts from 0
    routed_ptr = sync_ptr + 1  # [T]: 1 once the token is routed
    ready_ptr = routed_ptr + T  # [T]: act tiles done
    done_ptr = ready_ptr + T  # [T]: down tiles done
    if q < n_router:
        t = q // n_prog
        if _router_topk_program(x_ptr, rw_ptr, lg_ptr, cnt_ptr, bias_ptr, wts_ptr, idx_ptr, t.to(tl.int64),
                                q % n_prog, hidden, n_exp, stride_xt, stride_rw, n_prog, TOP_K, PRECISE, BLOCK_E,
                                BLOCK_H, BLOCK_ALL, BLOCK_KK):
            _signal(routed_ptr + t)
    elif q < n_router + n_shared:
        r = q - n_router
        t = r // n_s
        _gate_up_rows(x_ptr, s13_ptr, act_ptr, t, T * TOP_K + t, r % n_s, hidden, s_inter, stride_xt, stride_s13n,
                      stride_at, alpha, limit, BLOCK_N, BLOCK_K, EVEN_K)
        _signal(ready_ptr + t)
    elif q < n_router + n_shared + n_routed:
        r = q - n_router - n_shared
        p = r // n_r  # the pair t * TOP_K + j
        t = p // TOP_K
        _wait_at_least(routed_ptr + t, 1, SLEEP)
        e = tl.load(idx_ptr + p, cache_modifier=".cg").to(tl.int64)
        _gate_up_rows(x_ptr, w13_ptr + e * stride_w13e, act_ptr, t, p, r % n_r, hidden, inter, stride_xt,
                      stride_w13n, stride_at, alpha, limit, BLOCK_N, BLOCK_K, EVEN_K)
        _signal(ready_ptr + t)
    else:
        r = q - n_router - n_shared - n_routed
        t = r // n_d
        _down_tile(act_ptr, idx_ptr, wts_ptr, w2_ptr, s2_ptr, out_ptr, routed_ptr + t, ready_ptr + t,
                   TOP_K * n_r + n_s, t, r % n_d, T, hidden, inter, s_inter, routed_scale, stride_at, stride_w2e,
                   stride_w2h, stride_s2h, stride_ot, TOP_K, K_PAD, DOWN_N, DOWN_K, D_EVEN_K, DS_EVEN_K, SLEEP)
        if tl.atomic_add(done_ptr + t, 1, sem="acq_rel", scope="gpu") == n_d - 1:
            # the token's last down tile: every program that read its counters has counted itself
            tl.store(routed_ptr + t, 0)
            tl.store(ready_ptr + t, 0)
            tl.store(done_ptr + t, 0)


def fits(cfg: MoEConfig, t: int, inter: int, s_inter: int) -> bool:
    """Whether `moe_layer` can run this step with cfg: asked for (`one_launch`), a decode-router step, and
    one down K tile over I and the shared width."""
    return bool(cfg.one_launch) and 1 <= t <= MAX_T and cfg.down().block_k >= max(inter, s_inter)


def moe_layer(x: torch.Tensor, router_w: torch.Tensor, bias: torch.Tensor, k: int, counters: torch.Tensor,
              sync: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, alpha: float, limit: float, cfg: MoEConfig,
              shared: tuple[torch.Tensor, torch.Tensor], routed_scale: float) -> torch.Tensor:
    """SparseMoE's whole output in one launch (module docstring). x [T, H] (T <= MAX_T), router_w [E, H] fp32,
    bias [E] fp32, counters [>= T] int32 (the router's, left zero), sync [>= SYNC_SLOTS] int32 zero (left
    zero), w13 [E, 2I, H] / w2 [E, H, I] every expert, shared (gate_up [2I_s, H], down [H, I_s]) -> [T, H] in
    x.dtype. The caller checks `fits(cfg, ...)` and `direct.can_route` (the router's warps are cfg's)."""
    t, hidden = x.shape
    n_exp, inter = router_w.shape[0], w2.shape[2]
    s13, s2 = shared
    s_inter = s2.shape[1]
    x = x if x.stride(1) == 1 else x.contiguous()
    logits = torch.empty(t, n_exp, dtype=torch.float32, device=x.device)
    weights = torch.empty(t, k, dtype=torch.float32, device=x.device)
    idx = torch.empty(t, k, dtype=torch.int64, device=x.device)
    act = torch.empty(t * k + t, max(inter, s_inter), dtype=x.dtype, device=x.device)  # the shared rows last
    out = torch.empty(t, hidden, dtype=x.dtype, device=x.device)
    block_e, block_h, _ = triton_fused._gemv_blocks(t, n_exp, hidden)
    n_prog = triton.cdiv(n_exp, block_e)
    bn, bk = cfg.block_n, cfg.block_k
    dcfg = cfg.down()
    n_r, n_s, n_d = triton.cdiv(inter, bn), triton.cdiv(s_inter, bn), triton.cdiv(hidden, dcfg.block_n)
    sleep = SLEEP_NS if x.device.type == "cuda" else 0  # the interpreter never waits (and has no PTX)
    _moe_layer_kernel[(t * (n_prog + n_s + k * n_r + n_d),)](
        x, router_w, bias, logits, counters, weights, idx, w13, w2, s13, s2, act, out, sync, t, hidden, n_exp, inter,
        s_inter, float(routed_scale), float(alpha), float(limit), x.stride(0), router_w.stride(0), w13.stride(0),
        w13.stride(1), s13.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), act.stride(0), out.stride(0),
        n_prog, n_r, n_s, n_d,
        TOP_K=k, K_PAD=triton.next_power_of_2(k), PRECISE=triton_fused._precise(), BLOCK_E=block_e, BLOCK_H=block_h,
        BLOCK_ALL=triton.next_power_of_2(n_exp), BLOCK_KK=triton.next_power_of_2(k), BLOCK_N=bn, BLOCK_K=bk,
        EVEN_K=hidden % bk == 0, DOWN_N=dcfg.block_n, DOWN_K=dcfg.block_k, D_EVEN_K=inter % dcfg.block_k == 0,
        DS_EVEN_K=s_inter % dcfg.block_k == 0, SLEEP=sleep, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **triton_fused._opts(), **pdl.args(x))
    return out
