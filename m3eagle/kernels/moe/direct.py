"""Routed experts for a handful of tokens, without sorting: each (token, k) pair reads its expert directly.

    idx [T, k] ──_direct_gate_up_kernel──► act [T*k (+T), I']  grid (pairs, I'-tiles): one GEMV per pair,
                                                              SwiGLU-OAI in registers (I' = max(I, I_s):
                                                              a shared expert may be of another width)
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

Two variants from the tuning table, both bit-equal to the above:
- `down_preload`: when one down tile spans all of I, down loads idx and its weight tiles *before* its PDL
  wait, so under programmatic dependent launch its 4-5 weight rows per program stream during gate_up's
  last wave (the one exception to pdl.py's wait-first rule; tests/kernels/test_pdl.py checks it loads nothing else).
- `route_shared` (`route_direct_experts`): the router's programs and the shared expert's gate_up tiles in
  one launch (the shared expert needs no routing, so its stream overlaps the router's latency), then
  gate_up over the routed pairs and down as above: three launches for the whole layer, routing included.

And two more, bit-equal too: `down_rows` / `gate_rows` > 1 give each program that many
consecutive column tiles, the next tile's (or K step's) weights loaded before this one's math runs (a
register double buffer: Triton's pipeliner stages only loads that feed a tl.dot), so a program's slot moves
more bytes per load latency; down also reads act and the routing once per program
(`_direct_down_rows_kernel`, `_direct_gate_up_rows_kernel`).

And `shared_down`, bit-equal too: after the route + shared launch, the shared expert's down
runs as extra programs of the routed gate_up launch, its weights loaded before the PDL wait (they stream during
the router's latency), its rounded output rows added by down (`shared_down_tiles`).

Expert subset: pairs routed outside [e0, e0 + num_local) are skipped (no read, no contribution).
No host sync, static shapes: capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3eagle.kernels import pdl
from m3eagle.kernels.moe import router
from m3eagle.kernels.moe.router import router_topk_program
from m3eagle.kernels.moe.tuning import MoEConfig
from m3eagle.kernels.pdl import pdl_wait
from m3eagle.kernels.triton_utils import launch_opts, precise


@triton.jit
def _load_k(ptrs, k_ok, EVEN: tl.constexpr):
    """A [.., BK] tile: whole when EVEN (K a multiple of the tile), else masked to the columns k_ok."""
    if EVEN:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=k_ok, other=0.0)


@triton.jit
def _gate_up_rows(x_ptr, base, act_ptr, token, p, pid_n, hidden, inter, stride_xt, stride_wn, stride_at, alpha,
                  limit, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                  PRELOAD: tl.constexpr = False, PDL: tl.constexpr = False):
    """act[p, n-tile] = swiglu_oai(x[token] @ [gate_n; up_n]) from the expert whose [2I, H] weight starts at
    base. The products accumulate with explicit FMAs, so the bits do not depend on the launch's
    enable_fp_fusion (the route + shared launch turns contraction off for its router programs).

    PRELOAD (the shared expert's tiles in the route launch; the kernel has not waited): the first K step's
    gate and up tiles -- a weight, which no kernel writes -- are loaded before the PDL wait, x after it
    (pdl.py's exception); that step is peeled off the loop, with the same FMAs."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    rows = tl.minimum(offs_n, inter - 1)  # clamped, not masked: the weight stream carries no row predicate
    offs_k = tl.arange(0, BLOCK_K)  # [BK]
    g_ptrs = base + rows.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]  # [BN, BK]
    u_ptrs = g_ptrs + inter * stride_wn
    x_ptrs = x_ptr + token.to(tl.int64) * stride_xt + offs_k[None, :] + 0 * rows[:, None]  # [BN, BK], one row
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    k_start = 0
    if PRELOAD:  # the first step: its weights before the wait, x after it
        k_ok = (offs_k < hidden)[None, :]  # unused (compiled away) when EVEN_K
        g = _load_k(g_ptrs, k_ok, EVEN_K).to(tl.float32)
        u = _load_k(u_ptrs, k_ok, EVEN_K).to(tl.float32)
        pdl_wait(PDL)
        xv = _load_k(x_ptrs, k_ok, EVEN_K).to(tl.float32)
        acc_g = tl.fma(g, xv, acc_g)
        acc_u = tl.fma(u, xv, acc_u)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
        k_start = BLOCK_K
    for k0 in range(k_start, hidden, BLOCK_K):
        k_ok = (k0 + offs_k < hidden)[None, :]  # unused (compiled away) when EVEN_K
        xv = _load_k(x_ptrs, k_ok, EVEN_K).to(tl.float32)
        g = _load_k(g_ptrs, k_ok, EVEN_K).to(tl.float32)
        u = _load_k(u_ptrs, k_ok, EVEN_K).to(tl.float32)
        acc_g = tl.fma(g, xv, acc_g)
        acc_u = tl.fma(u, xv, acc_u)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    # SwiGLU-OAI exactly as layers.swiglu_oai: gate clamped above only, up on both sides.
    gate = tl.minimum(tl.sum(acc_g, axis=1), limit)
    up = tl.minimum(tl.maximum(tl.sum(acc_u, axis=1), -limit), limit)
    act = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
    tl.store(act_ptr + p.to(tl.int64) * stride_at + offs_n, act.to(act_ptr.dtype.element_ty), mask=offs_n < inter)


@triton.jit
def _pair_weights(p, idx_ptr, w_ptr, ws_ptr, T, e_start, num_local, inter, s_inter, stride_we, stride_wn, stride_swn,
                  TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr):
    """Pair p's (token, gate_up weight base, width, row stride, local): pairs p < T*TOP_K read expert idx[p]
    (local: of this rank, [e_start, e_start + num_local)), the rest the shared expert (ws: its own width and
    row stride), token p - T*TOP_K. The prologue of both direct gate_up kernels; a pair not local stores
    nothing."""
    routed = p < T * TOP_K
    token = tl.where(routed, p // TOP_K, p - T * TOP_K)
    e = tl.load(idx_ptr + p, mask=routed, other=0).to(tl.int64) - e_start
    local = ~(routed & ((e < 0) | (e >= num_local)))
    base = w_ptr + tl.where(routed, e, 0) * stride_we
    width = inter
    stride = stride_wn
    if HAS_SHARED:
        if not routed:
            base = ws_ptr
            width = s_inter
            stride = stride_swn
    return token, base, width, stride, local


@triton.jit(do_not_specialize=["T", "e_start"])
def _direct_gate_up_kernel(x_ptr, idx_ptr, w_ptr, ws_ptr, act_ptr, T, e_start, num_local, hidden, inter,
                           s_inter, stride_xt, stride_we, stride_wn, stride_swn, stride_at, alpha, limit,
                           TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr):
    """act[p, n-tile] = swiglu_oai(x[token(p)] @ [gate_n; up_n]) for pair p = program_id(0).

    w [E_local, 2I, H] (gate rows then up rows, unit stride along H); pairs p >= T*TOP_K are the shared
    expert's (ws [2 * s_inter, H], row stride stride_swn: its width may differ), token p - T*TOP_K; column
    tiles past a pair's width store nothing. A pair of another rank's expert stores nothing."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    p = tl.program_id(0)
    pid_n = tl.program_id(1)
    token, base, width, stride, local = _pair_weights(p, idx_ptr, w_ptr, ws_ptr, T, e_start, num_local, inter, s_inter,
                                                      stride_we, stride_wn, stride_swn, TOP_K, HAS_SHARED)
    if not local:
        return
    if pid_n * BLOCK_N >= width:
        return
    _gate_up_rows(x_ptr, base, act_ptr, token, p, pid_n, hidden, width, stride_xt, stride, stride_at,
                  alpha, limit, BLOCK_N, BLOCK_K, EVEN_K)


@triton.jit
def _shared_down_tile(w, a, out_ptr, offs_n, hidden):
    """One [BN] tile of the shared expert's down output, rounded to out's dtype: w [BN, BK] its weight rows,
    a [1, BK] fp32 its act row -- the products and the sum `_down_sum` takes of acc_s, so the value is the
    one down would have added."""
    y = tl.sum(w.to(tl.float32) * a, axis=1)
    tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=offs_n < hidden)


@triton.jit
def _shared_down_program(sw_ptr, act_ptr, sd_ptr, token, n0, hidden, s_inter, stride_swh, stride_at,
                         SD_TILES: tl.constexpr, SD_BN: tl.constexpr, SD_BK: tl.constexpr, SD_EVEN_K: tl.constexpr,
                         PDL: tl.constexpr):
    """A program of the shared expert's down in the routed gate_up launch (`MoEConfig.shared_down`): its
    SD_TILES (<= 4) tiles of SD_BN output rows of token `token`, from n0, over all of s_inter (one K tile).
    The weights are loaded before the PDL wait -- never written by a kernel, so under PDL they stream while
    the route + shared launch (the router's latency) still runs -- then the shared act row (written by that
    launch) after it. Stores the rounded outputs to sd[token] for down to add (SHARED_ROUNDED)."""
    offs_k = tl.arange(0, SD_BK)
    k_ok = (offs_k < s_inter)[None, :]
    offs_n = n0 + tl.arange(0, SD_BN)
    base = sw_ptr + offs_k[None, :]
    w0 = _load_k(base + tl.minimum(offs_n, hidden - 1).to(tl.int64)[:, None] * stride_swh, k_ok, SD_EVEN_K)
    if SD_TILES > 1:
        w1 = _load_k(base + tl.minimum(offs_n + SD_BN, hidden - 1).to(tl.int64)[:, None] * stride_swh, k_ok,
                     SD_EVEN_K)
    if SD_TILES > 2:
        w2 = _load_k(base + tl.minimum(offs_n + 2 * SD_BN, hidden - 1).to(tl.int64)[:, None] * stride_swh, k_ok,
                     SD_EVEN_K)
        w3 = _load_k(base + tl.minimum(offs_n + 3 * SD_BN, hidden - 1).to(tl.int64)[:, None] * stride_swh, k_ok,
                     SD_EVEN_K)
    pdl_wait(PDL)
    a = _load_k(act_ptr + token.to(tl.int64) * stride_at + offs_k[None, :], k_ok, SD_EVEN_K).to(tl.float32)
    out = sd_ptr + token.to(tl.int64) * hidden
    _shared_down_tile(w0, a, out, offs_n, hidden)
    if SD_TILES > 1:
        _shared_down_tile(w1, a, out, offs_n + SD_BN, hidden)
    if SD_TILES > 2:
        _shared_down_tile(w2, a, out, offs_n + 2 * SD_BN, hidden)
        _shared_down_tile(w3, a, out, offs_n + 3 * SD_BN, hidden)


@triton.jit(do_not_specialize=["T", "e_start"])
def _direct_gate_up_rows_kernel(x_ptr, idx_ptr, w_ptr, ws_ptr, act_ptr, T, e_start, num_local, hidden, inter,
                                s_inter, stride_xt, stride_we, stride_wn, stride_swn, stride_at, alpha, limit,
                                sdw_ptr, sd_ptr, stride_sdh, sd_rows, TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_K: tl.constexpr,
                                EVEN_K: tl.constexpr, ROWS: tl.constexpr, SD: tl.constexpr, SD_TILES: tl.constexpr,
                                SD_BN: tl.constexpr, SD_BK: tl.constexpr, SD_EVEN_K: tl.constexpr,
                                PDL: tl.constexpr):
    """`_direct_gate_up_kernel` with ROWS column tiles per program, grid (pairs, cdiv(I', ROWS * BLOCK_N)):
    the tiles' NUM_K = cdiv(H, BLOCK_K) weight steps run as one unrolled sequence in which the next step's
    gate / up tiles are loaded before this step's FMAs (a register double buffer across K steps and tiles:
    Triton's pipeliner stages only loads that feed a tl.dot). Per tile the same FMAs in the same order as
    `_gate_up_rows`: bit-equal to one tile per program. Tiles past the pair's width store nothing.

    SD (`MoEConfig.shared_down`, after the route + shared launch): programs p >= T * TOP_K are the shared
    expert's down (`_shared_down_program`), sd_rows of them per token along axis 0, each owning SD_TILES
    tiles of SD_BN of the H output rows: token (p - T*TOP_K) // sd_rows, rows from ((p - T*TOP_K) % sd_rows *
    n_blocks + program_id(1)) * SD_TILES * SD_BN."""
    if not SD:
        pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    p = tl.program_id(0)
    n0 = tl.program_id(1) * (ROWS * BLOCK_N)
    if SD:
        if p >= T * TOP_K:
            j = p - T * TOP_K
            blk = (j % sd_rows) * tl.num_programs(1) + tl.program_id(1)
            _shared_down_program(sdw_ptr, act_ptr + T * TOP_K * stride_at, sd_ptr, j // sd_rows,
                                 blk * (SD_TILES * SD_BN), hidden, s_inter, stride_sdh, stride_at, SD_TILES, SD_BN,
                                 SD_BK, SD_EVEN_K, PDL)
            return
        pdl_wait(PDL)
    token, base, width, stride, local = _pair_weights(p, idx_ptr, w_ptr, ws_ptr, T, e_start, num_local, inter, s_inter,
                                                      stride_we, stride_wn, stride_swn, TOP_K, HAS_SHARED)
    if not local:
        return
    if n0 >= width:
        return
    offs_k = tl.arange(0, BLOCK_K)  # [BK]
    offs_n = n0 + tl.arange(0, BLOCK_N)  # [BN], the first tile
    x_row = x_ptr + token.to(tl.int64) * stride_xt + offs_k[None, :] + 0 * offs_n[:, None]  # [BN, BK], one row
    g_ptrs = base + tl.minimum(offs_n, width - 1).to(tl.int64)[:, None] * stride + offs_k[None, :]  # [BN, BK]
    g_next = _load_k(g_ptrs, (offs_k < hidden)[None, :], EVEN_K)  # the first step's tiles
    u_next = _load_k(g_ptrs + width * stride, (offs_k < hidden)[None, :], EVEN_K)
    for i in tl.static_range(ROWS):
        acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for kk in tl.static_range(NUM_K):
            g = g_next.to(tl.float32)
            u = u_next.to(tl.float32)
            if kk + 1 < NUM_K:  # this tile's next K step
                g_ptrs += BLOCK_K
                k_ok = ((kk + 1) * BLOCK_K + offs_k < hidden)[None, :]
                g_next = _load_k(g_ptrs, k_ok, EVEN_K)
                u_next = _load_k(g_ptrs + width * stride, k_ok, EVEN_K)
            elif i + 1 < ROWS:  # the next tile's first K step
                g_ptrs = (base + tl.minimum(offs_n + BLOCK_N, width - 1).to(tl.int64)[:, None] * stride
                          + offs_k[None, :])
                g_next = _load_k(g_ptrs, (offs_k < hidden)[None, :], EVEN_K)
                u_next = _load_k(g_ptrs + width * stride, (offs_k < hidden)[None, :], EVEN_K)
            k_ok = (kk * BLOCK_K + offs_k < hidden)[None, :]
            xv = _load_k(x_row + kk * BLOCK_K, k_ok, EVEN_K).to(tl.float32)
            acc_g = tl.fma(g, xv, acc_g)
            acc_u = tl.fma(u, xv, acc_u)
        # SwiGLU-OAI exactly as _gate_up_rows
        gate = tl.minimum(tl.sum(acc_g, axis=1), limit)
        up = tl.minimum(tl.maximum(tl.sum(acc_u, axis=1), -limit), limit)
        act = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
        tl.store(act_ptr + p.to(tl.int64) * stride_at + offs_n, act.to(act_ptr.dtype.element_ty), mask=offs_n < width)
        offs_n += BLOCK_N


@triton.jit(do_not_specialize=["T"])
def _route_shared_kernel(x_ptr, rw_ptr, lg_ptr, cnt_ptr, bias_ptr, wout_ptr, idx_ptr, ws_ptr, act_ptr, T, hidden,
                         n_exp, s_inter, stride_xt, stride_rw, stride_swn, stride_at, n_prog, n_tiles, alpha, limit,
                         TOP_K: tl.constexpr, PRECISE: tl.constexpr, BLOCK_E: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_ALL: tl.constexpr, BLOCK_KK: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                         PRELOAD: tl.constexpr, PDL: tl.constexpr):
    """The router and the shared expert's gate_up in one launch: programs [0, T * n_prog) are the fused
    router's (`router_topk_program`, bit-equal to its own launch), the rest the shared expert's gate_up
    tiles (`_gate_up_rows`: token q // n_tiles, column tile q % n_tiles of its s_inter columns, act row
    T*TOP_K + token). The shared expert needs no routing, so its weight stream overlaps the router's
    latency. PRELOAD: the router programs read their expert rows, the shared programs their first K step's
    weight tiles, before the PDL wait (pdl.py's exception)."""
    if not PRELOAD:
        pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    pid = tl.program_id(0)
    n_router = T * n_prog
    if pid < n_router:
        router_topk_program(x_ptr, rw_ptr, lg_ptr, cnt_ptr, bias_ptr, wout_ptr, idx_ptr, (pid // n_prog).to(tl.int64),
                             pid % n_prog, hidden, n_exp, stride_xt, stride_rw, n_prog, TOP_K, PRECISE, BLOCK_E,
                             BLOCK_H, BLOCK_ALL, BLOCK_KK, PRELOAD, PDL)
    else:
        q = pid - n_router
        token = q // n_tiles
        _gate_up_rows(x_ptr, ws_ptr, act_ptr, token, T * TOP_K + token, q % n_tiles, hidden, s_inter, stride_xt,
                      stride_swn, stride_at, alpha, limit, BLOCK_N, BLOCK_K, EVEN_K, PRELOAD, PDL)


@triton.jit(do_not_specialize=["T", "e_start"])
def _direct_down_kernel(act_ptr, idx_ptr, wts_ptr, w_ptr, ws_ptr, out_ptr, T, e_start, num_local, hidden, inter,
                        s_inter, routed_scale, stride_at, stride_we, stride_wh, stride_swh, stride_ot,
                        TOP_K: tl.constexpr, K_PAD: tl.constexpr, HAS_SHARED: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, S_EVEN_K: tl.constexpr,
                        PRELOAD: tl.constexpr, PDL: tl.constexpr):
    """out[t, n-tile] = sum_j round(round(act[t*k+j] @ down[e_j]^T) * w[t, j] * routed_scale)
    (+ round(act[T*k+t] @ shared_down^T)), fp32 sum in one fixed order, for t = program_id(0).

    w [E_local, H, I] (unit stride along I). The k experts' tiles are one [K_PAD, BN, BK] load per K step
    (slots past TOP_K and other ranks' experts masked: never read). The shared expert's down (ws [H, s_inter],
    row stride stride_swh: its width may differ) runs its own K loop.

    PRELOAD (BLOCK_K >= I: the whole K range is one tile): the routing and the weight tiles are loaded
    *before* the programmatic-dependent-launch wait, so under PDL this launch's programs stream their weights
    while gate_up's last programs still run, and only act (L2) is read after it. The one exception to
    pdl.py's "no memory before the wait" contract, and safe: the weights are never written by a kernel, and
    idx was written by the router, two launches back, which had completed (and flushed) before gate_up's
    programs passed their own wait -- and this launch starts only after all of them did. idx is read with
    `.cg` (from L2: an SM's L1 may hold a line of an earlier replay). Same products and sums as the loop: the
    bits do not change."""
    if not PRELOAD:
        pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    rows = tl.minimum(offs_n, hidden - 1)
    offs_k = tl.arange(0, BLOCK_K)  # [BK]
    slots = tl.arange(0, K_PAD)  # [KP]
    pair = t * TOP_K + slots  # [KP]
    e = tl.load(idx_ptr + pair, mask=slots < TOP_K, other=0, cache_modifier=".cg").to(tl.int64) - e_start
    live = (slots < TOP_K) & (e >= 0) & (e < num_local)  # [KP]
    e = tl.where(live, e, 0)
    live3 = live[:, None, None] & (rows >= 0)[None, :, None]  # [KP, BN, 1]
    w_ptrs = (w_ptr + e[:, None, None] * stride_we + rows.to(tl.int64)[None, :, None] * stride_wh
              + offs_k[None, None, :])  # [KP, BN, BK]
    a_ptrs = act_ptr + pair.to(tl.int64)[:, None, None] * stride_at + offs_k[None, None, :]  # [KP, 1, BK]
    if HAS_SHARED:
        s_pair = (T * TOP_K + t).to(tl.int64)
        s_ptrs = ws_ptr + rows.to(tl.int64)[:, None] * stride_swh + offs_k[None, :]  # [BN, BK]
        sa_ptrs = act_ptr + s_pair * stride_at + offs_k[None, :] + 0 * rows[:, None]  # [BN, BK], one row
    if PRELOAD:  # one K tile spans I (and s_inter)
        if EVEN_K:
            m3 = live3
        else:
            m3 = live3 & (offs_k < inter)[None, None, :]
        s_ok = (offs_k < s_inter)[None, :]  # [1, BK]; unused (compiled away) when S_EVEN_K
        wv = tl.load(w_ptrs, mask=m3, other=0.0)  # [KP, BN, BK]: the whole K range
        if HAS_SHARED:
            sw = _load_k(s_ptrs, s_ok, S_EVEN_K)  # [BN, BK]
        pdl_wait(PDL)
        acc = wv.to(tl.float32) * tl.load(a_ptrs, mask=m3, other=0.0).to(tl.float32)
        if HAS_SHARED:
            acc_s = sw.to(tl.float32) * _load_k(sa_ptrs, s_ok, S_EVEN_K).to(tl.float32)
    else:
        acc = tl.zeros([K_PAD, BLOCK_N, BLOCK_K], dtype=tl.float32)
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
            acc_s = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            for k0 in range(0, s_inter, BLOCK_K):
                s_ok = (k0 + offs_k < s_inter)[None, :]  # unused (compiled away) when S_EVEN_K
                acc_s += _load_k(s_ptrs, s_ok, S_EVEN_K).to(tl.float32) * _load_k(sa_ptrs, s_ok, S_EVEN_K).to(tl.float32)
                s_ptrs += BLOCK_K
                sa_ptrs += BLOCK_K
    if not HAS_SHARED:
        acc_s = acc  # a placeholder: _down_sum reads it only with a shared expert
    _down_sum(acc, acc_s, pair, live, wts_ptr, out_ptr + t.to(tl.int64) * stride_ot, offs_n, hidden, routed_scale,
              HAS_SHARED, False)


@triton.jit
def _down_sum(acc, acc_s, pair, live, wts_ptr, out_row, offs_n, hidden, routed_scale, HAS_SHARED: tl.constexpr,
              SHARED_ROUNDED: tl.constexpr):
    """out_row[n-tile] from down's products: acc [KP, BN, BK] (the k experts') and acc_s [BN, BK] (the shared
    expert's, with HAS_SHARED; with SHARED_ROUNDED its output [BN], already summed and rounded by the gate_up
    launch's `_shared_down_tile`). Each expert's output rounded to out's dtype, weighted in fp32 (routing
    weight * routed_scale), rounded again, and the rows summed in fp32 in one fixed order."""
    out_ty = out_row.dtype.element_ty
    y = tl.sum(acc, axis=2).to(out_ty).to(tl.float32)  # [KP, BN]: each expert's output, rounded
    route_w = tl.load(wts_ptr + pair, mask=live, other=0.0).to(tl.float32) * routed_scale  # [KP]
    y = (y * route_w[:, None]).to(out_ty).to(tl.float32)  # dead slots: 0 * 0
    total = tl.sum(y, axis=0)  # [BN]
    if HAS_SHARED:
        if SHARED_ROUNDED:
            total += acc_s.to(tl.float32)
        else:
            total += tl.sum(acc_s, axis=1).to(out_ty).to(tl.float32)
    tl.store(out_row + offs_n, total.to(out_ty), mask=offs_n < hidden)


@triton.jit(do_not_specialize=["T", "e_start"])
def _direct_down_rows_kernel(act_ptr, idx_ptr, wts_ptr, w_ptr, ws_ptr, out_ptr, T, e_start, num_local, hidden,
                             inter, s_inter, routed_scale, stride_at, stride_we, stride_wh, stride_swh, stride_ot,
                             sd_ptr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, HAS_SHARED: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                             S_EVEN_K: tl.constexpr, ROWS: tl.constexpr, PRELOAD: tl.constexpr, SD_DONE: tl.constexpr,
                             PDL: tl.constexpr):
    """`_direct_down_kernel` with one K tile over I (and s_inter) and ROWS column tiles per program, grid (T,
    cdiv(H, ROWS * BLOCK_N)): the next tile's weights are loaded before this tile's products and sums run (a
    register double buffer; Triton's pipeliner stages only loads that feed a tl.dot), and the routing, act
    and the routing weights are read once per program instead of once per tile. Why: a one-tile program
    holds its slot for a load's latency plus a cross-warp reduction while moving ~10 KB (m3-mini), so the
    down launch streamed at ~55% of copy bandwidth where gate_up reached 65-78%.
    PRELOAD: the routing and the first tile's weights are loaded before the PDL wait, as in
    `_direct_down_kernel` (the same exception, the same argument). Per tile the same products and sums:
    bit-equal to `_direct_down_kernel`. SD_DONE (with HAS_SHARED): the shared expert's
    output rows were computed by the gate_up launch (`_shared_down_program`) into sd [T, H]; they are read
    after the wait and added where the shared products' sum was."""
    if not PRELOAD:
        pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    t = tl.program_id(0)
    n0 = tl.program_id(1) * (ROWS * BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)  # [BK]
    slots = tl.arange(0, K_PAD)  # [KP]
    pair = t * TOP_K + slots  # [KP]
    e = tl.load(idx_ptr + pair, mask=slots < TOP_K, other=0, cache_modifier=".cg").to(tl.int64) - e_start
    live = (slots < TOP_K) & (e >= 0) & (e < num_local)  # [KP]
    e = tl.where(live, e, 0)
    k_ok = offs_k < inter  # [BK]
    if EVEN_K:
        k_ok = offs_k >= 0
    s_ok = (offs_k < s_inter)[None, :]  # [1, BK]; unused (compiled away) when S_EVEN_K
    offs_n = n0 + tl.arange(0, BLOCK_N)  # [BN], the first tile
    rows = tl.minimum(offs_n, hidden - 1)  # clamped, not masked, as in _direct_down_kernel
    m3 = live[:, None, None] & (rows >= 0)[None, :, None] & k_ok[None, None, :]  # [KP, BN, BK]
    w_base = w_ptr + e[:, None, None] * stride_we + offs_k[None, None, :]  # [KP, 1, BK]
    s_base = ws_ptr + offs_k[None, :]  # [1, BK]
    if PRELOAD:
        wv = tl.load(w_base + rows.to(tl.int64)[None, :, None] * stride_wh, mask=m3, other=0.0)  # [KP, BN, BK]
        if HAS_SHARED and not SD_DONE:
            sw = _load_k(s_base + rows.to(tl.int64)[:, None] * stride_swh, s_ok, S_EVEN_K)  # [BN, BK]
        pdl_wait(PDL)
    else:
        wv = tl.load(w_base + rows.to(tl.int64)[None, :, None] * stride_wh, mask=m3, other=0.0)
        if HAS_SHARED and not SD_DONE:
            sw = _load_k(s_base + rows.to(tl.int64)[:, None] * stride_swh, s_ok, S_EVEN_K)
    a = tl.load(act_ptr + pair.to(tl.int64)[:, None, None] * stride_at + offs_k[None, None, :],
                mask=live[:, None, None] & k_ok[None, None, :], other=0.0).to(tl.float32)  # [KP, 1, BK], once
    if HAS_SHARED and not SD_DONE:
        sa = _load_k(act_ptr + (T * TOP_K + t).to(tl.int64) * stride_at + offs_k[None, :], s_ok,
                     S_EVEN_K).to(tl.float32)  # [1, BK], once
    out_row = out_ptr + t.to(tl.int64) * stride_ot
    for i in tl.static_range(ROWS):
        w_cur = wv
        if HAS_SHARED and not SD_DONE:
            s_cur = sw
        if i + 1 < ROWS:  # the next tile's loads go out before this tile's sums
            nxt = tl.minimum(offs_n + BLOCK_N, hidden - 1)
            wv = tl.load(w_base + nxt.to(tl.int64)[None, :, None] * stride_wh, mask=m3, other=0.0)
            if HAS_SHARED and not SD_DONE:
                sw = _load_k(s_base + nxt.to(tl.int64)[:, None] * stride_swh, s_ok, S_EVEN_K)
        acc = w_cur.to(tl.float32) * a  # [KP, BN, BK]
        if HAS_SHARED:
            if SD_DONE:  # the shared expert's rounded output rows, from the gate_up launch
                acc_s = tl.load(sd_ptr + t.to(tl.int64) * hidden + offs_n, mask=offs_n < hidden, other=0.0)
            else:
                acc_s = s_cur.to(tl.float32) * sa  # [BN, BK]
        else:
            acc_s = acc  # a placeholder: _down_sum reads it only with a shared expert
        _down_sum(acc, acc_s, pair, live, wts_ptr, out_row, offs_n, hidden, routed_scale, HAS_SHARED, SD_DONE)
        offs_n += BLOCK_N


def usable(w13: torch.Tensor, w2: torch.Tensor, shared: tuple[torch.Tensor, torch.Tensor] | None) -> bool:
    """The direct kernels step along H / I with unit stride (the stacks' natural layout); a shared expert
    needs the same hidden size and dtype (gate_up [2 * I_s, H], down [H, I_s]), any width I_s."""
    ok = w13.stride(2) == 1 and w2.stride(2) == 1
    if shared is not None:
        s13, s2 = shared
        ok = (ok and s13.dim() == 2 and s2.dim() == 2 and s13.stride(1) == 1 and s2.stride(1) == 1
              and s13.shape[1] == w13.shape[2] and s2.shape[0] == w2.shape[1] and s13.shape[0] == 2 * s2.shape[1]
              and s13.dtype == w13.dtype and s2.dtype == w2.dtype)
    return ok


def preloads(cfg: MoEConfig, inter: int, s_inter: int) -> bool:
    """Whether down runs its preload variant: asked for, and one down K tile spans I and the shared width."""
    return bool(cfg.down_preload) and cfg.down().block_k >= max(inter, s_inter)


def down_rows(cfg: MoEConfig, inter: int, s_inter: int) -> int:
    """Column tiles per down program: cfg.down_rows where one down K tile spans I and the shared width
    (`_direct_down_rows_kernel`), else 1 (`_direct_down_kernel`)."""
    return cfg.down_rows if cfg.down_rows > 1 and cfg.down().block_k >= max(inter, s_inter) else 1


def shared_down_tiles(cfg: MoEConfig, inter: int, s_inter: int) -> int:
    """Tiles per shared-down program in the routed gate_up launch (`MoEConfig.shared_down`: 1, 2 or 4), or 0
    where it does not run: not asked for, or one down K tile does not span I and the shared width (its
    tiles must be down's own, so the rounded rows are the ones down would have summed). Only after the route
    + shared launch (whose act holds the shared rows)."""
    if cfg.shared_down not in (0, 1, 2, 4):
        raise ValueError(f"MoEConfig.shared_down={cfg.shared_down}: use 0 (off), 1, 2 or 4 tiles per program")
    return cfg.shared_down if cfg.down().block_k >= max(inter, s_inter) else 0


def direct_experts(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   e_start: int, alpha: float, limit: float, cfg: MoEConfig,
                   shared: tuple[torch.Tensor, torch.Tensor] | None = None, routed_scale: float = 1.0,
                   act: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H], weights [T, k] fp32, idx [T, k] global ids, w13 [E_local, 2I, H], w2 [E_local, H, I] (experts
    e_start..) -> [T, H] in x.dtype: routed_scale * sum of the local pairs (+ the shared expert's output;
    shared = (gate_up [2 * I_s, H], down [H, I_s]), any width I_s). cfg.block_n / block_k tile gate_up;
    cfg.down_block_n / down_block_k tile down (0: the same); cfg.down_preload loads down's weights before
    its PDL wait (`preloads`). `act` [T*k + T, max(I, I_s)] with the shared expert's rows already computed
    (`route_direct_experts`): gate_up runs the routed pairs only (and, with cfg.shared_down, the shared
    expert's down: `shared_down_tiles`)."""
    t, k = idx.shape
    hidden, inter = x.shape[1], w2.shape[2]
    idx = idx.contiguous()  # the kernels read idx[t, j] at t * k + j
    x = x if x.stride(1) == 1 else x.contiguous()
    weights = weights.reshape(-1).float().contiguous()  # [T*k] fp32; no copy when it already is
    if shared is not None:
        s13, s2 = shared
        s_inter, s_row13, s_row2 = s2.shape[1], s13.stride(0), s2.stride(0)
    else:  # placeholders, never read
        s13, s2, s_inter, s_row13, s_row2 = w13, w2, inter, w13.stride(1), w2.stride(1)
    pairs = t * k + (t if shared is not None else 0)
    shared_done = act is not None
    if act is None:
        act = torch.empty(pairs, max(inter, s_inter), dtype=x.dtype, device=x.device)  # [pairs, max(I, I_s)]
    bn, bk = cfg.block_n, cfg.block_k
    gate_pairs = t * k if shared_done else pairs
    dcfg = cfg.down()
    dbn, dbk = dcfg.block_n, dcfg.block_k
    sd = shared_down_tiles(cfg, inter, s_inter) if shared_done else 0
    sd_out = torch.empty(t, hidden, dtype=x.dtype, device=x.device) if sd else act  # [T, H]: shared down's rows
    if cfg.gate_rows > 1 or sd:
        rows = max(cfg.gate_rows, 1)
        n_blocks = triton.cdiv(max(inter, s_inter), bn * rows)
        sd_rows = triton.cdiv(triton.cdiv(hidden, sd * dbn), n_blocks) if sd else 0
        _direct_gate_up_rows_kernel[(gate_pairs + t * sd_rows, n_blocks)](
            x, idx, w13, s13, act, t, e_start, w13.shape[0], hidden, inter, s_inter,
            x.stride(0), w13.stride(0), w13.stride(1), s_row13, act.stride(0), float(alpha), float(limit),
            s2, sd_out, s_row2, sd_rows, TOP_K=k,
            HAS_SHARED=shared is not None and not shared_done, BLOCK_N=bn, BLOCK_K=bk, NUM_K=triton.cdiv(hidden, bk),
            EVEN_K=hidden % bk == 0, ROWS=rows, SD=bool(sd),
            SD_TILES=max(sd, 1), SD_BN=dbn, SD_BK=dbk, SD_EVEN_K=s_inter % dbk == 0, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, **pdl.args(x))
    else:
        _direct_gate_up_kernel[(gate_pairs, triton.cdiv(max(inter, s_inter), bn))](
            x, idx, w13, s13, act, t, e_start, w13.shape[0], hidden, inter, s_inter,
            x.stride(0), w13.stride(0), w13.stride(1), s_row13, act.stride(0), float(alpha), float(limit),
            TOP_K=k, HAS_SHARED=shared is not None and not shared_done, BLOCK_N=bn, BLOCK_K=bk,
            EVEN_K=hidden % bk == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.args(x))
    out = torch.empty(t, hidden, dtype=x.dtype, device=x.device)
    if down_rows(cfg, inter, s_inter) > 1 or sd:
        rows = max(cfg.down_rows, 1)
        _direct_down_rows_kernel[(t, triton.cdiv(hidden, dbn * rows))](
            act, idx, weights, w2, s2, out, t, e_start, w2.shape[0], hidden, inter, s_inter, float(routed_scale),
            act.stride(0), w2.stride(0), w2.stride(1), s_row2, out.stride(0), sd_out,
            TOP_K=k, K_PAD=triton.next_power_of_2(k), HAS_SHARED=shared is not None, BLOCK_N=dbn, BLOCK_K=dbk,
            EVEN_K=inter % dbk == 0, S_EVEN_K=s_inter % dbk == 0, ROWS=rows, PRELOAD=bool(cfg.down_preload),
            SD_DONE=bool(sd), num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.args(act))
        return out
    _direct_down_kernel[(t, triton.cdiv(hidden, dbn))](
        act, idx, weights, w2, s2, out, t, e_start, w2.shape[0], hidden, inter, s_inter, float(routed_scale),
        act.stride(0), w2.stride(0), w2.stride(1), s_row2, out.stride(0),
        TOP_K=k, K_PAD=triton.next_power_of_2(k), HAS_SHARED=shared is not None, BLOCK_N=dbn, BLOCK_K=dbk,
        EVEN_K=inter % dbk == 0, S_EVEN_K=s_inter % dbk == 0, PRELOAD=preloads(cfg, inter, s_inter),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.args(act))
    return out


def can_route(x: torch.Tensor, router_w: torch.Tensor, k: int, cfg: MoEConfig) -> bool:
    """Whether `route_direct_experts` can run this step bit-equal to the separate launches: the fused
    router's decode GEMV conditions, and the router's warp count equal to gate_up's (a reduction's order
    follows the warps, and one launch has one count)."""
    t, hidden = x.shape
    n_exp = router_w.shape[0]
    return (router.router_gemv_ok(x, router_w) and 1 <= k <= min(n_exp, router.MAX_TOP_K)
            and n_exp <= router.MAX_EXPERTS and t >= 1
            and router.router_gemv_blocks(t, n_exp, hidden)[2] == cfg.num_warps)


def route_direct_experts(x: torch.Tensor, router_w: torch.Tensor, bias: torch.Tensor, k: int, counters: torch.Tensor,
                         w13: torch.Tensor, w2: torch.Tensor, alpha: float, limit: float, cfg: MoEConfig,
                         shared: tuple[torch.Tensor, torch.Tensor], routed_scale: float) -> torch.Tensor:
    """SparseMoE's whole output for a decode-sized step in three launches, routing included: (1) the router
    (`router.route_tokens`' decode programs, bit-equal) *and* the shared expert's gate_up, which needs
    no routing, in one launch; (2) the routed pairs' gate_up; (3) down + the weighted sum. Equal, bit for
    bit, to `route_tokens` then `direct_experts` (the same programs, in other launches). x [T, H] (T <=
    ROUTER_GEMV_MAX_T), router_w [E, H] fp32, bias [E] fp32, counters [>= T] int32 zero between launches
    (left zero), w13 / w2 all E experts, shared (gate_up [2 * I_s, H], down [H, I_s]) -> [T, H] in x.dtype."""
    t, hidden = x.shape
    n_exp, inter = router_w.shape[0], w2.shape[2]
    s13, s2 = shared
    s_inter = s2.shape[1]
    x = x if x.stride(1) == 1 else x.contiguous()
    logits = torch.empty(t, n_exp, dtype=torch.float32, device=x.device)
    weights = torch.empty(t, k, dtype=torch.float32, device=x.device)
    idx = torch.empty(t, k, dtype=torch.int64, device=x.device)
    act = torch.empty(t * k + t, max(inter, s_inter), dtype=x.dtype, device=x.device)  # the shared rows last
    block_e, block_h, _ = router.router_gemv_blocks(t, n_exp, hidden)
    n_prog = triton.cdiv(n_exp, block_e)
    bn, bk = cfg.block_n, cfg.block_k
    n_tiles = triton.cdiv(s_inter, bn)
    launch = pdl.args(x)
    _route_shared_kernel[(t * n_prog + t * n_tiles,)](
        x, router_w, logits, counters, bias, weights, idx, s13, act, t, hidden, n_exp, s_inter, x.stride(0),
        router_w.stride(0), s13.stride(0), act.stride(0), n_prog, n_tiles, float(alpha), float(limit),
        TOP_K=k, PRECISE=precise(), BLOCK_E=block_e, BLOCK_H=block_h,
        BLOCK_ALL=triton.next_power_of_2(n_exp), BLOCK_KK=triton.next_power_of_2(k), BLOCK_N=bn, BLOCK_K=bk,
        EVEN_K=hidden % bk == 0, PRELOAD=router.router_preload(launch, block_h, hidden),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_opts(), **launch)
    return direct_experts(x, weights, idx, w13, w2, 0, alpha, limit, cfg, (s13, s2), routed_scale, act=act)
