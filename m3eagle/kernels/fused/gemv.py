"""Skinny GEMM for decode: y [T, N] = x [T, K] @ w[N, K]^T for T = 1..32 rows, as one memory-bound Triton kernel.

Why. At batch-1 decode every dense projection (the packed q/k/v(+index) projection, o_proj, the dense and
shared-expert MLPs, lm_head, the Eagle3 head's fc and MLP) multiplies a handful of rows by a weight read once
per step. The work is 2*T*N*K flops over 2*N*K weight bytes: T flop/byte, far below the H200's ~200 flop/byte
ridge, so the floor is the weight's read time at HBM bandwidth (8 MB at ~4.3 TB/s: ~2 us). cuBLAS picks
`nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT` for these shapes and reaches ~1.7 TB/s (5.8 us for ~10 MB); this
kernel is built to stream w at close to the copy bandwidth.

Math. Program (n, s) of the grid (cdiv(N, BLOCK_N), S) owns output columns n*BLOCK_N .. +BLOCK_N and the K
range s*k_split .. +k_split (k_split a whole number of BLOCK_K steps, S = cdiv(K, k_split) splits):

    part[s, t, j] = sum_{k in split s} x[t, k] * w[j, k]        (fp32 products and sums, any input dtype)
    y[t, j]       = to_x_dtype(part[0, t, j] + part[1, t, j] + ... + part[S-1, t, j])   (S = 1: no part)

Design.
  * Two inner products, a constexpr (USE_DOT) picked per T:
    - GEMV (T <= 4): one fp32 accumulator [BLOCK_N, BLOCK_K] per row, acc_t += fp32(w) * fp32(x[t]), and one
      tl.sum over K after the loop. CUDA-core FMAs: T per weight element, which keeps up with HBM only for
      small T (4.3 TB/s of bf16 is 2.15 G elements/us; x16 rows would be the H200's whole fp32 FMA rate).
      Exact fp32 math for fp32 inputs. x is loaded as a [BLOCK_N, BLOCK_K] tile of one repeated row (L1
      hits) so that it has the weight tile's layout: a [BLOCK_K] row, or a 3-D [T, BLOCK_N, BLOCK_K]
      product, made the compiler move a tile through shared memory (convert_layout + barrier) every K step.
      The weight loads are 16-byte vectors (checked in the PTX). num_stages=2 prefetches the next weight
      tile into registers (PREFETCH): Triton's software pipeliner only stages loads that feed a tl.dot.
    - dot (any T; picked above GEMV_MAX_T): acc [BLOCK_N, BLOCK_T] = tl.dot(w [BLOCK_N, BLOCK_K], x^T
      [BLOCK_K, BLOCK_T]): the weight is the MMA's M side (BLOCK_N=64 with 4 warps is one Hopper wgmma;
      smaller tiles use mma.sync), T padded to BLOCK_T >= 16 (tl.dot's minimum), the K loop pipelined
      through shared memory by cp.async (num_stages). fp32 inputs use input_precision="ieee" (no tf32).
  * Rows past N and T are clamped, not masked: they re-read row N-1 / T-1 (cached) and the stores drop
    them, so the weight stream carries no row predicate. K is masked only when K % BLOCK_K != 0 (EVEN_K).
  * Split-K (config split_k > 1) for small N, where cdiv(N, BLOCK_N) programs are too few to keep 132 SMs'
    loads in flight: each program stores its fp32 partial, then the last program of its output tile to
    finish sums all S partials in split order and stores y. No float atomics: the order of the sum is fixed,
    so the result is bit-equal from call to call whichever program finishes last. "Last" is found with a
    per-tile int32 counter: CTA barrier (all of this program's partial stores issued), then
    atomic_add(acq_rel, gpu scope); the program that reads S - 1 loads the partials from L2 (.cg) and
    resets the counter to 0 for the next call / graph replay. The counters are the caller's
    (`SplitCounters`: an engine's fused ops own one, so two engines never share them), one zeroed int32
    buffer per device allocated on the first eager call; a call without counters, or captured in a CUDA
    graph before they exist, runs unsplit (a zero-fill recorded in a graph would only run at replay).
    Calls sharing counters must be ordered (one stream at a time), as an engine step's are.
    SPLIT is a constexpr, the split count a runtime value: one compile serves every split count.
  * Folded neighbours (the unsplit GEMV, T <= 4; constexpr branches beside the plain path, each held bit-equal
    or to the norm's sum order against its separate launches by tests/kernels/test_gemv.py): an activation epilogue
    on a packed gate / up weight (`linear_act`), a residual-add epilogue (`linear_add`), an RMSNorm prologue
    (`norm_linear`), and the greedy pick (`linear_argmax`: one argmax key per tile and row, reduced by the
    launch's last program with the split-K counter pattern). Design notes 50-52 say which the engine takes.
  * Config: `pick_config(t, n, k, dtype, device)` -> GemvConfig (BLOCK_N, BLOCK_K, warps, stages, split_k,
    GEMV or dot): the measured TUNED table first, else rules (at pick_config). `benchmarks/gemv.py --tune`
    sweeps the space on a GPU and prints TUNED lines.

No host sync, no data-dependent shapes; the only allocations are torch.empty (the output, and the fp32
partials when split), so a call can be captured in a CUDA graph. Inference only: no autograd. Under the
CPU interpreter a bf16 tl.dot multiplies raw int16 bits, so the operands are upcast there (UPCAST_DOT).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from m3eagle.kernels import pdl
from m3eagle.kernels.fused.activation import ACTS, act_of_sums
from m3eagle.kernels.fused.argmax import argmax_outputs
from m3eagle.kernels.fused.norm import rms_rstd, rms_scale
from m3eagle.kernels.pdl import pdl_wait
from m3eagle.kernels.split_counters import DEFAULT_TILES, SplitCounters  # noqa: F401  (re-exported: gemv.SplitCounters)

MAX_T = 32  # rows; past this a GEMM with weight-tile reuse (cuBLAS) is the right tool
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_TILES = DEFAULT_TILES  # output tiles with a split-K counter (split_counters.SplitCounters' default size)


@dataclass(frozen=True)
class GemvConfig:
    """Launch parameters of `_linear_kernel` (BLOCK_T follows from T and use_dot)."""

    block_n: int  # output features per program (>= 16 with use_dot)
    block_k: int  # K elements per loop step (>= 16 with use_dot)
    num_warps: int = 4
    num_stages: int = 1  # dot: cp.async pipeline depth; GEMV: 1, or 2 = prefetch the next K tile into registers
    split_k: int = 1  # programs per output tile along K (> 1: partials + last-program reduction)
    use_dot: bool = False  # tl.dot instead of the elementwise GEMV

    def block_t(self, t: int) -> int:
        """Rows per program: all T rows, padded to a power of two (>= 16 for tl.dot; the GEMV takes <= 4)."""
        b = triton.next_power_of_2(max(t, 1))
        return max(b, 16) if self.use_dot else b


@triton.jit
def _load_k(ptrs, k_ok, EVEN_K: tl.constexpr):
    """Load a K tile; masked (zeros past the split's end) only when K is not a multiple of BLOCK_K."""
    if EVEN_K:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=k_ok, other=0.0)


@triton.jit
def _store_row(ptr, row, vals, offs_n, T, N, stride):
    """vals [BN] -> ptr[row * stride + offs_n] (dtype of ptr), dropping padding rows (row >= T) and columns."""
    ok = (offs_n < N) & (tl.zeros_like(offs_n) + row < T)  # [BN]
    tl.store(ptr + row * stride + offs_n, vals.to(ptr.dtype.element_ty), mask=ok)


@triton.jit
def _store_act_row(ptr, row, vals, pid_n, T, n_act, stride, alpha, limit, ACT: tl.constexpr, HALF: tl.constexpr,
                   PRECISE: tl.constexpr):
    """ACT's store: vals [2 * HALF] holds interleaved (gate, up) columns of output columns pid_n * HALF + i;
    each is rounded to ptr's dtype as the GEMV's own store would round it, then the activation is stored
    as its own launch computes it (`activation.act_of_sums`)."""
    dt = ptr.dtype.element_ty
    g, u = tl.split(tl.reshape(vals, [HALF, 2]))  # [HALF] each
    out = act_of_sums(g, u, alpha, limit, dt, ACT, PRECISE)
    offs = pid_n * HALF + tl.arange(0, HALF)
    ok = (offs < n_act) & (tl.zeros_like(offs) + row < T)
    tl.store(ptr + row * stride + offs, out.to(dt), mask=ok)


@triton.jit
def _res_store_row(ptr, res_ptr, row, vals, offs_n, T, N, stride, stride_r):
    """RES's store: ptr[row] = res[row] + vals, the GEMV's output rounded to ptr's dtype first and the sum
    rounded again, as `reference.add_residual(linear(x, w), res)` rounds its two torch ops."""
    dt = ptr.dtype.element_ty
    ok = (offs_n < N) & (tl.zeros_like(offs_n) + row < T)  # [BN]
    res = tl.load(res_ptr + row * stride_r + offs_n, mask=ok, other=0.0).to(tl.float32)
    tl.store(ptr + row * stride + offs_n, (res + vals.to(dt).to(tl.float32)).to(dt), mask=ok)


INT64_MIN = tl.constexpr(-(2**63))  # a constexpr: jit code reads no plain globals


@triton.jit
def _argmax_key(vals, offs_n, N, dt: tl.constexpr):
    """ARGMAX: the best of one row's tile as an int64 key whose signed order is argmax's -- the value as
    stored (rounded to dt) in the high 32 bits, its bits made monotone (negatives' magnitude bits flipped,
    -0 taken as +0, every NaN above +inf), and 2^31 - 1 - column in the low 32 bits (a tie goes to the
    lower column; the first NaN wins, as torch.argmax). Columns past N: INT64_MIN."""
    v = vals.to(dt).to(tl.float32)
    v = tl.where(v == 0.0, 0.0, v)
    bits = v.to(tl.int32, bitcast=True)
    hi = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    hi = tl.where(v != v, 0x7FFFFFFF, hi)
    key = (hi.to(tl.int64) << 32) | (2147483647 - offs_n).to(tl.int64)
    key = tl.where(offs_n < N, key, INT64_MIN)
    return tl.max(key, axis=0)


@triton.jit
def _store_row_key(ptr, row, vals, offs_n, T, N, stride, key_ptr, pid_n, BLOCK_T: tl.constexpr,
                   ARGMAX: tl.constexpr):
    """`_store_row`, and with ARGMAX the tile's argmax key of the row at key_ptr[pid_n * BLOCK_T + row]."""
    _store_row(ptr, row, vals, offs_n, T, N, stride)
    if ARGMAX:
        tl.store(key_ptr + pid_n * BLOCK_T + row, _argmax_key(vals, offs_n, N, ptr.dtype.element_ty))


@triton.jit
def _argmax_finish(key_ptr, off_ptr, am_ptr, sc_ptr, sc_rows_ptr, stride_am, stride_sc, col, T, n_prog,
                   BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, HAS_OFF: tl.constexpr, SCATTER: tl.constexpr):
    """ARGMAX's last program: each row's best key over every program's tile -> the column (+ off[column]),
    stored as `argmax.argmax` stores it (am[row * stride_am], and sc[rows[row], col] with SCATTER)."""
    offs_p = tl.arange(0, BLOCK_P)
    for t in tl.static_range(BLOCK_T):
        if t < T:
            keys = tl.load(key_ptr + offs_p * BLOCK_T + t, mask=offs_p < n_prog, other=INT64_MIN,
                           cache_modifier=".cg")
            best = tl.max(keys, axis=0)
            i = (2147483647 - (best & 0xFFFFFFFF)).to(tl.int64)
            if HAS_OFF:
                i += tl.load(off_ptr + i)
            tl.store(am_ptr + t * stride_am, i)
            if SCATTER:
                tl.store(sc_ptr + tl.load(sc_rows_ptr + t) * stride_sc + col, i)


@triton.jit
def _norm_rstd(row_ptr, k, eps, K_BLOCK: tl.constexpr, PRECISE: tl.constexpr):
    """`rms_rstd` of one input row row_ptr[0:k] (the norm launches' formula; this launch's sum order)."""
    offs = tl.arange(0, K_BLOCK)
    return rms_rstd(tl.load(row_ptr + offs, mask=offs < k, other=0.0).to(tl.float32), k, eps, PRECISE)


@triton.jit
def _norm_tile(row_ptr, nw_ptr, kk, k_ok, rstd, dt: tl.constexpr, GEMMA: tl.constexpr):
    """NORM's x tile [BN, BK] (fp32) at K indices kk of the row at row_ptr: rms_norm(x; nw) there, scaled and
    rounded to dt as the norm's own launch stores it (`rms_scale`, `_norm_store`'s)."""
    y = tl.load(row_ptr + kk, mask=k_ok, other=0.0).to(tl.float32) * rstd
    w = tl.load(nw_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
    return rms_scale(y, w, dt, GEMMA).to(dt).to(tl.float32)


# one compile for every T of a BLOCK_T, every split, and every draft step's slot-buffer column
@triton.jit(do_not_specialize=["T", "n_split", "stride_am", "stride_sc", "col"])
def _linear_kernel(x_ptr, w_ptr, y_ptr, part_ptr, cnt_ptr, T, N, K, stride_xt, stride_wn, stride_yt, k_split, n_split,
                   n_act, alpha, limit, nw_ptr, res_ptr, eps, stride_r, off_ptr, am_ptr, sc_ptr, sc_rows_ptr,
                   stride_am, stride_sc, col,
                   BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SPLIT: tl.constexpr, USE_DOT: tl.constexpr, EVEN_K: tl.constexpr, PREFETCH: tl.constexpr,
                   IEEE: tl.constexpr, UPCAST_DOT: tl.constexpr, PRELOAD: tl.constexpr, ACT: tl.constexpr,
                   NORM: tl.constexpr, GEMMA: tl.constexpr, K_BLOCK: tl.constexpr, RES: tl.constexpr,
                   ARGMAX: tl.constexpr, HAS_OFF: tl.constexpr, SCATTER: tl.constexpr, BLOCK_P: tl.constexpr,
                   PRECISE: tl.constexpr, PDL: tl.constexpr):
    """Grid (cdiv(N, BLOCK_N), n_split): y[:, n-tile] (or its split-s partial) from K range [s*k_split, +k_split).

    x [T, K] (row stride stride_xt, unit column stride), w [N, K] (row stride stride_wn), y [T, N] (row stride
    stride_yt), part [n_split, T, N] fp32, cnt [>= cdiv(N, BLOCK_N)] int32 zero between launches. SPLIT
    (n_split > 1) is a constexpr and n_split a runtime value: one compile serves every split count.
    GEMV (not USE_DOT) takes BLOCK_T <= 4.

    PRELOAD (GEMV with PREFETCH, under PDL): the program's first weight tile is loaded *before* the
    programmatic-dependent-launch wait, so its HBM latency overlaps the predecessor's tail (at batch 1 a
    latency-bound norm or attention launch); x and everything else are read after it. An exception to
    pdl.py's "no memory before the wait" contract, safe because w is a weight that no kernel writes
    (`linear`'s contract). Same products and sums: the bits do not change.

    ACT (GEMV, unsplit; 1 silu, 2 swiglu-oai with alpha / limit): w is a packed [2 * n_act, K] gate / up
    weight and y [T, n_act] receives act(x @ gate^T, x @ up^T) (`_store_act_row`): the program's BLOCK_N
    weight rows are BLOCK_N / 2 gate rows and the up rows of the same columns, interleaved, so each
    activation is computed once, by the program that owns both of its inputs. The accumulation is an
    explicit FMA (what contraction makes of `acc += w * x`), so ACT, compiled without contraction for the
    activation's sake, sums the same bits.

    NORM (GEMV, unsplit): x is rms_norm(x; nw, eps) (GEMMA: the (1 + w) scale), computed here -- each
    program reduces its rows' mean squares itself (a row is one load of K_BLOCK >= K), then normalises
    every K tile it multiplies -- instead of by a norm launch before it. The norm rounds as `_norm_store`
    does; its sum of squares runs in this launch's order, so the result equals the two launches to within
    the fp32 sum's rounding. RES (GEMV, unsplit, no ACT): y = res + x @ w^T, rounded as the GEMV's output
    and then as the residual add (`_res_store_row`). NORM compiles without FMA contraction (as the norm
    launch does); the GEMV's own FMAs are explicit.

    ARGMAX (GEMV, unsplit, no ACT / RES): y as always, and the argmax of each row of y (`_argmax_key`'s
    order: torch.argmax's on the stored values) in the same launch, for the greedy picks that read only it:
    each program stores its tile's best key per row to part [grid, BLOCK_T] int64, then (CTA barrier,
    acq_rel counter cnt[0], the split-K reduction's pattern) the last program to finish reduces the keys and
    stores the column, + off[column] with HAS_OFF, to am[t * stride_am] and with SCATTER also to
    sc[sc_rows[t] * stride_sc + col]; it zeroes cnt[0] again. The argmax launch after the GEMV is gone."""
    if not PRELOAD:
        pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    tl.static_assert(not (PRELOAD and (USE_DOT or not PREFETCH)), "PRELOAD is the GEMV's PREFETCH path")
    tl.static_assert(not (ACT and (USE_DOT or SPLIT or BLOCK_N < 2)), "ACT is the unsplit GEMV's, BLOCK_N >= 2")
    tl.static_assert(not ((NORM or RES) and (USE_DOT or SPLIT)), "NORM / RES are the unsplit GEMV's")
    tl.static_assert(not (RES and ACT), "RES stores the GEMV's own columns")
    tl.static_assert(not (ARGMAX and (USE_DOT or SPLIT or ACT or RES)), "ARGMAX is the plain unsplit GEMV's")
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output features
    # Clamp instead of masking the loads: padding rows re-read the last valid row (a cache hit) and the
    # stores drop them, so the weight stream has no row predicate.
    rows_n = tl.minimum(offs_n, N - 1)
    if ACT:  # lane 2i: gate row of column pid_n * BN/2 + i; lane 2i + 1: its up row (n_act rows further)
        lane = tl.arange(0, BLOCK_N)
        rows_n = tl.minimum(pid_n * (BLOCK_N // 2) + lane // 2, n_act - 1) + (lane % 2) * n_act
    k0 = pid_s * k_split
    k_end = tl.minimum(k0 + k_split, K)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows_n[:, None].to(tl.int64) * stride_wn + (k0 + offs_k)[None, :]  # [BN, BK]
    if PRELOAD:  # the first tile (never empty) in flight before the wait: a weight, which no kernel writes
        w_next = _load_k(w_ptrs, ((k0 + offs_k) < k_end)[None, :], EVEN_K)
        pdl_wait(PDL)
    if USE_DOT:
        offs_t = tl.arange(0, BLOCK_T)  # [BT]
        x_ptrs = x_ptr + tl.minimum(offs_t, T - 1)[:, None].to(tl.int64) * stride_xt + (k0 + offs_k)[None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
        for k in range(k0, k_end, BLOCK_K):
            k_ok = (k + offs_k) < k_end  # [BK]; unused (compiled away) when EVEN_K
            w = _load_k(w_ptrs, k_ok[None, :], EVEN_K)  # [BN, BK]
            x = _load_k(x_ptrs, k_ok[None, :], EVEN_K)  # [BT, BK]
            if IEEE:  # fp32 inputs: exact fp32 products (no tf32)
                acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
            elif UPCAST_DOT:  # the CPU interpreter multiplies bf16's raw int16 bits: give it fp32 (same sums)
                acc = tl.dot(w.to(tl.float32), tl.trans(x).to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(w, tl.trans(x), acc)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        out = tl.trans(acc)  # [BT, BN]
        mask = (offs_t < T)[:, None] & (offs_n < N)[None, :]
        if SPLIT:
            tl.store(part_ptr + (pid_s * T + offs_t[:, None]) * N + offs_n[None, :], out, mask=mask)
        else:
            tl.store(y_ptr + offs_t[:, None] * stride_yt + offs_n[None, :], out.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        # One 2-D accumulator [BN, BK] per row, summed over K once after the loop. Each x row is loaded as a
        # [BN, BK] tile of one repeated row (L1 hits) so that it gets the weight tile's layout: loaded as a
        # [BK] row (or in a 3-D [BT, BN, BK] product) it went through shared memory + a barrier every K step.
        x_row = x_ptr + k0 + offs_k[None, :] + 0 * rows_n[:, None]  # [BN, BK] row 0 on every row
        r1 = tl.minimum(1, T - 1).to(tl.int64) * stride_xt
        r2 = tl.minimum(2, T - 1).to(tl.int64) * stride_xt
        r3 = tl.minimum(3, T - 1).to(tl.int64) * stride_xt
        acc0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc1 = acc0
        acc2 = acc0
        acc3 = acc0
        if PREFETCH and not PRELOAD:
            w_next = _load_k(w_ptrs, ((k0 + offs_k) < k_end)[None, :], EVEN_K)  # the first tile (never empty)
        if NORM:  # each row's mean square (rows past T re-read row T - 1; their stores drop)
            dt: tl.constexpr = y_ptr.dtype.element_ty
            rstd0 = _norm_rstd(x_ptr, K, eps, K_BLOCK, PRECISE)
            rstd1 = rstd0
            rstd2 = rstd0
            rstd3 = rstd0
            if BLOCK_T > 1:
                rstd1 = _norm_rstd(x_ptr + r1, K, eps, K_BLOCK, PRECISE)
            if BLOCK_T > 2:
                rstd2 = _norm_rstd(x_ptr + r2, K, eps, K_BLOCK, PRECISE)
                rstd3 = _norm_rstd(x_ptr + r3, K, eps, K_BLOCK, PRECISE)
        for k in range(k0, k_end, BLOCK_K):
            k_ok = (k + offs_k) < k_end  # [BK]; unused (compiled away) when EVEN_K
            if PREFETCH:
                # register double buffer: the next tile's loads are issued before this tile's FMAs finish
                # (Triton's pipeliner only stages loads that feed a tl.dot). ptxas interleaves them with the
                # later FMAs rather than hoisting them all; whether it pays is for --tune to say.
                w = w_next.to(tl.float32)  # [BN, BK]
                w_ptrs += BLOCK_K
                if EVEN_K:  # a whole tile or nothing: a uniform predicate keeps the 16-byte loads
                    more = tl.full([BLOCK_N, BLOCK_K], 1, tl.int1) & (k + BLOCK_K < k_end)  # uniform
                    w_next = tl.load(w_ptrs, mask=more, other=0.0)
                else:
                    w_next = tl.load(w_ptrs, mask=((k + BLOCK_K + offs_k) < k_end)[None, :], other=0.0)
            else:
                w = _load_k(w_ptrs, k_ok[None, :], EVEN_K).to(tl.float32)  # [BN, BK]
                w_ptrs += BLOCK_K
            # explicit FMAs: what contraction makes of acc += w * x, and the same without it (ACT, NORM)
            if NORM:
                kk = k + offs_k[None, :] + 0 * rows_n[:, None]  # [BN, BK] K indices
                kok = kk < k_end
                acc0 = tl.fma(w, _norm_tile(x_ptr, nw_ptr, kk, kok, rstd0, dt, GEMMA), acc0)
                if BLOCK_T > 1:
                    acc1 = tl.fma(w, _norm_tile(x_ptr + r1, nw_ptr, kk, kok, rstd1, dt, GEMMA), acc1)
                if BLOCK_T > 2:
                    acc2 = tl.fma(w, _norm_tile(x_ptr + r2, nw_ptr, kk, kok, rstd2, dt, GEMMA), acc2)
                    acc3 = tl.fma(w, _norm_tile(x_ptr + r3, nw_ptr, kk, kok, rstd3, dt, GEMMA), acc3)
            else:
                acc0 = tl.fma(w, _load_k(x_row, k_ok[None, :], EVEN_K).to(tl.float32), acc0)
                if BLOCK_T > 1:
                    acc1 = tl.fma(w, _load_k(x_row + r1, k_ok[None, :], EVEN_K).to(tl.float32), acc1)
                if BLOCK_T > 2:
                    acc2 = tl.fma(w, _load_k(x_row + r2, k_ok[None, :], EVEN_K).to(tl.float32), acc2)
                    acc3 = tl.fma(w, _load_k(x_row + r3, k_ok[None, :], EVEN_K).to(tl.float32), acc3)
            x_row += BLOCK_K
        if ACT:
            half: tl.constexpr = BLOCK_N // 2
            _store_act_row(y_ptr, 0, tl.sum(acc0, axis=1), pid_n, T, n_act, stride_yt, alpha, limit, ACT, half, PRECISE)
            if BLOCK_T > 1:
                _store_act_row(y_ptr, 1, tl.sum(acc1, axis=1), pid_n, T, n_act, stride_yt, alpha, limit, ACT, half,
                               PRECISE)
            if BLOCK_T > 2:
                _store_act_row(y_ptr, 2, tl.sum(acc2, axis=1), pid_n, T, n_act, stride_yt, alpha, limit, ACT, half,
                               PRECISE)
                _store_act_row(y_ptr, 3, tl.sum(acc3, axis=1), pid_n, T, n_act, stride_yt, alpha, limit, ACT, half,
                               PRECISE)
        else:
            if SPLIT:  # rows of this split's partial [T, N]
                dst = part_ptr + pid_s * T * N
                stride_d = N
            else:
                dst = y_ptr
                stride_d = stride_yt
            if RES:
                _res_store_row(dst, res_ptr, 0, tl.sum(acc0, axis=1), offs_n, T, N, stride_d, stride_r)
                if BLOCK_T > 1:
                    _res_store_row(dst, res_ptr, 1, tl.sum(acc1, axis=1), offs_n, T, N, stride_d, stride_r)
                if BLOCK_T > 2:
                    _res_store_row(dst, res_ptr, 2, tl.sum(acc2, axis=1), offs_n, T, N, stride_d, stride_r)
                    _res_store_row(dst, res_ptr, 3, tl.sum(acc3, axis=1), offs_n, T, N, stride_d, stride_r)
            else:
                _store_row_key(dst, 0, tl.sum(acc0, axis=1), offs_n, T, N, stride_d, part_ptr, pid_n, BLOCK_T, ARGMAX)
                if BLOCK_T > 1:
                    _store_row_key(dst, 1, tl.sum(acc1, axis=1), offs_n, T, N, stride_d, part_ptr, pid_n, BLOCK_T,
                                   ARGMAX)
                if BLOCK_T > 2:
                    _store_row_key(dst, 2, tl.sum(acc2, axis=1), offs_n, T, N, stride_d, part_ptr, pid_n, BLOCK_T,
                                   ARGMAX)
                    _store_row_key(dst, 3, tl.sum(acc3, axis=1), offs_n, T, N, stride_d, part_ptr, pid_n, BLOCK_T,
                                   ARGMAX)
    if SPLIT:
        # the tile's last program to finish (by its counter) sums the partials in split order
        tl.debug_barrier()  # every thread's partial store is issued before the release below
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == n_split - 1:
            offs_r = tl.arange(0, BLOCK_T)
            mask_r = (offs_r < T)[:, None] & (offs_n < N)[None, :]
            p_ptrs = part_ptr + offs_r[:, None] * N + offs_n[None, :]  # [BT, BN] in split 0
            total = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
            for s in range(n_split):
                total += tl.load(p_ptrs + s * T * N, mask=mask_r, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + offs_r[:, None] * stride_yt + offs_n[None, :], total.to(y_ptr.dtype.element_ty),
                     mask=mask_r)
            tl.store(cnt_ptr + pid_n, 0)  # zero again for the next launch / graph replay
    if ARGMAX:
        # the last program to finish (by cnt[0]) reduces every tile's keys: as the split-K reduction above
        tl.debug_barrier()  # every thread's key store is issued before the release below
        n_prog = tl.num_programs(0)
        done = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
        if done == n_prog - 1:
            _argmax_finish(part_ptr, off_ptr, am_ptr, sc_ptr, sc_rows_ptr, stride_am, stride_sc, col, T, n_prog,
                           BLOCK_T, BLOCK_P, HAS_OFF, SCATTER)
            tl.store(cnt_ptr, 0)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def supports(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `linear(x, w)` runs: x [T, K] with 1 <= T <= MAX_T, w [N, K], both with unit column stride,
    one dtype out of bf16 / fp16 / fp32, on one CUDA device (or any device under the Triton interpreter)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or not 1 <= x.shape[0] <= MAX_T:
        return False
    if x.dtype != w.dtype or x.dtype not in DTYPES or x.device != w.device:
        return False
    if w.shape[0] == 0 or w.shape[1] == 0 or x.stride(1) != 1 or w.stride(1) != 1:
        return False
    return x.device.type == "cuda" or _interpreting()


# Tuned configs, (N, K, next_pow2(T)) -> GemvConfig, for 2-byte dtypes, from `gemv_configs.json` (beside this
# file): `benchmarks/gemv.py --tune` measures them on a GPU. A shape missing there takes the rules in `pick_config`.
CONFIGS_PATH = Path(__file__).with_name("gemv_configs.json")


def load_configs(path: Path = CONFIGS_PATH) -> tuple[dict[tuple[int, int, int], GemvConfig], dict[tuple[int, int], int]]:
    """(tuned, preferred) from the JSON table: tuned (N, K, next_pow2(T)) -> GemvConfig and preferred (N, K) -> the
    most rows for which the GEMV beat cuBLAS."""
    raw = json.loads(path.read_text())
    tuned = {(e["n"], e["k"], e["t"]): GemvConfig(**e["config"]) for e in raw["tuned"]}
    preferred = {(e["n"], e["k"]): e["max_t"] for e in raw["preferred"]}
    return tuned, preferred


def write_configs(entries: list[dict], path: Path = CONFIGS_PATH) -> None:
    """Merge measured winners into the JSON table: each entry {"n", "k", "t" (next_pow2 of the rows), "config": a
    GemvConfig's fields, and optionally "us", "vs_cublas", "vs_pick_config", "model"} replaces the one of its
    (n, k, t). One entry per line, so a re-tune shows as a readable diff."""
    raw = json.loads(path.read_text())
    by_key = {(e["n"], e["k"], e["t"]): e for e in raw["tuned"]}
    for e in entries:
        GemvConfig(**e["config"])  # refuse a config the kernel cannot take before anything is written
        by_key[(e["n"], e["k"], e["t"])] = e
    lines = ["{", f' "_note": {json.dumps(raw["_note"])},', ' "tuned": [']
    rows = list(by_key.values())
    lines += [f"  {json.dumps(e)}{',' if i < len(rows) - 1 else ''}" for i, e in enumerate(rows)]
    lines += [" ],", ' "preferred": [']
    pref = raw["preferred"]
    lines += [f"  {json.dumps(e)}{',' if i < len(pref) - 1 else ''}" for i, e in enumerate(pref)]
    path.write_text("\n".join(lines + [" ]", "}"]) + "\n")


TUNED, PREFERRED = load_configs()

GEMV_MAX_T = 2  # rows up to which the elementwise GEMV is picked; tl.dot above (see pick_config)

# The engine's policy (triton_backend.TritonFused.linear), measured on an H200 against cuBLAS (`benchmarks/gemv.py`):
# every embedded-sized weight (<= 3 MB) runs 1.2-1.8x faster here at T = 1 and 2; m3-mini's 8-17 MB projections
# 1.3-1.5x at T = 1 (tuned), fading to ~1.0x by T = 4-8; m3-8b's 34-200 MB weights lose untuned (0.84-0.95x:
# cuBLAS's wide tiles already stream at 3.2-4.2 TB/s there) and win 1.03-1.32x tuned. So: the measured shapes by
# PREFERRED, others up to DEFAULT_MAX_T rows when the weight is at most SMALL_WEIGHT elements.
DEFAULT_MAX_T = 2
SMALL_WEIGHT = 8 * 2**20  # elements (16 MB of bf16)


def prefers(t: int, n: int, k: int) -> bool:
    """Whether an engine should run y [t, n] = x @ w[n, k]^T here rather than in cuBLAS."""
    most = PREFERRED.get((n, k))
    if most is None:
        most = DEFAULT_MAX_T if n * k <= SMALL_WEIGHT else 0
    return t <= most
_SMS: dict[torch.device, int] = {}


def _sm_count(device: torch.device | str | None) -> int:
    """Multiprocessors of a CUDA device (132 on an H200), cached; 132 off the GPU (the interpreter)."""
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda":
        return 132
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


def pick_config(t: int, n: int, k: int, dtype: torch.dtype, device: torch.device | str | None = None,
                ) -> GemvConfig:
    """Block sizes for y [t, n] = x [t, k] @ w[n, k]^T: TUNED's entry, else the rules below.

    The rules aim at the two things a weight stream needs: bytes in flight (each SM must keep ~26 KB of
    loads outstanding to draw its 1/132 of ~4.3 TB/s at ~0.8 us latency) and enough programs to spread
    them (>= 4 per SM, or split-K). Register counts are ptxas's for sm_90 (Triton 3.9, bf16):

    * T <= GEMV_MAX_T: elementwise GEMV, 4 warps, BLOCK_K = min(1024, K) (a warp's 32 x 8 lanes then
      cover a whole row segment, no K-step is masked for K % 1024 == 0), BLOCK_N up to 8192 / (T * BLOCK_K)
      (fp32 accumulators <= 64 registers per thread: T=1 8 x 1024 with the prefetch below is 128
      registers, 4 programs per SM), halved while that leaves < 4 programs per SM. num_stages=2 (register
      prefetch of the next tile: two tiles per warp in flight) when a program has >= 2 K steps.
      T=4 as a GEMV needs 217 registers for 4 x 1024 (2 programs per SM) or 118 for 4 x 512 without
      prefetch (16 KB in flight per SM), hence tl.dot from T=3.
    * T > GEMV_MAX_T: tl.dot, BLOCK_T = 16 or 32, 4 warps, BLOCK_K=128, 4 cp.async stages (3 tiles in
      flight); BLOCK_N=64 (one wgmma M, 80 KB of shared memory: 2 programs per SM, 96 KB in flight) when
      N gives >= 2 tiles per SM, else 32 (mma.sync, 36 KB: 6 programs per SM).
    * Split-K when there are fewer than 2 tiles per SM: up to 4 programs per SM, <= 8 splits, >= 1 K step
      (GEMV) or 2 K steps (dot, so the cp.async pipeline has something to overlap) per split.

    NOTE: these rules are first-principles, not yet measured: `benchmarks/gemv.py --tune` on an H200 is
    what fills TUNED and should revise them."""
    bt = triton.next_power_of_2(max(t, 1))
    hit = TUNED.get((n, k, bt)) if torch.finfo(dtype).bits == 16 else None
    if hit is not None:
        return hit
    sms = _sm_count(device)
    want = 4 * sms  # programs
    if t <= GEMV_MAX_T:
        bk = min(1024, triton.next_power_of_2(k))
        bn = max(1, min(16, 8192 // (bt * bk)))
        while bn > 1 and triton.cdiv(n, bn) < want:
            bn //= 2
        cfg = GemvConfig(block_n=bn, block_k=bk, num_warps=4, num_stages=1)
        min_steps = 1
    else:
        bn = 64 if triton.cdiv(n, 64) >= 2 * sms else 32
        cfg = GemvConfig(block_n=bn, block_k=128, num_warps=4, num_stages=4, use_dot=True)
        min_steps = 2
    tiles = triton.cdiv(n, cfg.block_n)
    split = 1
    if tiles < 2 * sms:
        split = max(1, min(8, triton.cdiv(want, tiles), k // (min_steps * cfg.block_k)))
    steps = triton.cdiv(triton.cdiv(k, split), cfg.block_k)  # K steps per program
    stages = cfg.num_stages if cfg.use_dot else (2 if steps >= 2 else 1)
    return GemvConfig(cfg.block_n, cfg.block_k, cfg.num_warps, stages, split, cfg.use_dot)


def linear(x: torch.Tensor, w: torch.Tensor, config: GemvConfig | None = None,
           counters: SplitCounters | None = None) -> torch.Tensor:
    """x [T, K] @ w [N, K]^T -> y [T, N] in x.dtype, fp32 accumulation (F.linear without bias).

    The caller checks `supports(x, w)` first. `config` overrides `pick_config` (tuning, tests). A split-K
    config splits only with the caller's `counters` (without, it runs unsplit: same math, one program per
    tile)."""
    t, k = x.shape
    n = w.shape[0]
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)  # [T, N]
    if t == 0:
        return y
    cfg = config if config is not None else pick_config(t, n, k, x.dtype, x.device)
    if cfg.use_dot and min(cfg.block_n, cfg.block_k) < 16:
        raise ValueError(f"{cfg}: tl.dot needs BLOCK_N, BLOCK_K >= 16")
    if not cfg.use_dot and t > 4:
        raise ValueError(f"{cfg}: the elementwise GEMV takes T <= 4 rows, got {t}; use use_dot=True")
    tiles = triton.cdiv(n, cfg.block_n)
    split = max(1, min(cfg.split_k, triton.cdiv(k, cfg.block_k)))  # no split without a K step of its own
    cnt = counters.get(x.device) if counters is not None and split > 1 and tiles <= MAX_TILES else None
    if cnt is None:
        split = 1
    k_split = triton.cdiv(triton.cdiv(k, split), cfg.block_k) * cfg.block_k  # a whole number of K steps
    split = triton.cdiv(k, k_split)  # e.g. K=200, BLOCK_K=64, 3 splits: 2 of 128 (no empty third)
    part = torch.empty(split, t, n, dtype=torch.float32, device=x.device) if split > 1 else y  # [S, T, N]
    _launch(x, w, y, part, cnt, cfg, (tiles, split), k_split)
    return y


def _launch(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, part: torch.Tensor, cnt: torch.Tensor | None,
            cfg: GemvConfig, grid: tuple[int, int], k_split: int, n_act: int = 0, act: int = 0,
            alpha: float = 0.0, limit: float = 0.0, norm: tuple[torch.Tensor, float, bool] | None = None,
            residual: torch.Tensor | None = None, argmax: tuple | None = None) -> None:
    """`norm`: (nw, eps, gemma) of NORM; `residual`: RES's; `argmax`: ARGMAX's (offsets or None, out, scatter
    buffer, scatter rows, column, scatter or not) -- `part` then holds its keys and `cnt` its counters."""
    t, k = x.shape
    launch = pdl.args(x)
    # Under PDL the GEMV's first weight tile is read before the wait (w is a weight: see the docstring);
    # that takes the register double buffer (PREFETCH), whose first load it is.
    preload = pdl.preload_weights(launch) and not cfg.use_dot
    if act or norm is not None:  # as the activation / norm launches compile it (no contraction); FMAs explicit
        launch = {**launch, "enable_fp_fusion": False}
    nw, eps, gemma = norm if norm is not None else (x, 0.0, False)
    res = residual if residual is not None else y
    off, am, sc, sc_rows, col, scatter = argmax if argmax is not None else (None, y, y, y, 0, False)
    _linear_kernel[grid](
        x, w, y, part, cnt if cnt is not None else y, t, w.shape[0], k, x.stride(0), w.stride(0), y.stride(0),
        k_split, grid[1], n_act, float(alpha), float(limit), nw, res, float(eps), res.stride(0),
        off if off is not None else am, am, sc, sc_rows, am.stride(0), sc.stride(0), col, BLOCK_T=cfg.block_t(t),
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SPLIT=grid[1] > 1, USE_DOT=cfg.use_dot, EVEN_K=k % cfg.block_k == 0,
        PREFETCH=not cfg.use_dot and (cfg.num_stages > 1 or preload), IEEE=x.dtype == torch.float32,
        UPCAST_DOT=_interpreting() and x.dtype != torch.float32, PRELOAD=preload, ACT=act, NORM=norm is not None,
        GEMMA=gemma, K_BLOCK=triton.next_power_of_2(k) if norm is not None else 1, RES=residual is not None,
        ARGMAX=argmax is not None, HAS_OFF=off is not None, SCATTER=scatter,
        BLOCK_P=triton.next_power_of_2(grid[0]) if argmax is not None else 1, PRECISE=not _interpreting(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages if cfg.use_dot else 1,
        **launch)


def act_config(t: int, w: torch.Tensor, dtype: torch.dtype, device: torch.device | str | None = None,
               ) -> GemvConfig | None:
    """The config `linear_act` runs for x [t, K] and the packed gate / up weight w [2I, K]: the GEMV's
    own pick for that shape, unsplit and with an even BLOCK_N >= 2 -- or None where that pick is tl.dot (the
    activation then stays a launch of its own). `norm_linear` / `linear_add` take the same (their prologue
    and epilogue are the unsplit GEMV's too)."""
    cfg = pick_config(t, w.shape[0], w.shape[1], dtype, device)
    if cfg.use_dot or t > 4:
        return None
    bn = max(2, cfg.block_n + cfg.block_n % 2)
    return GemvConfig(bn, cfg.block_k, cfg.num_warps, cfg.num_stages, 1, False)


def _check_fold(cfg: GemvConfig | None, t: int, what: str) -> None:
    if cfg is None or cfg.use_dot or cfg.split_k != 1 or t > 4:
        raise ValueError(f"{what}: {cfg} for T = {t}: the fold needs the unsplit GEMV (T <= 4)")


def norm_linear(x: torch.Tensor, nw: torch.Tensor, eps: float, w: torch.Tensor, gemma: bool = False,
                act: str | None = None, config: GemvConfig | None = None) -> torch.Tensor:
    """linear(rms_norm(x, nw, eps, gemma), w) -> [T, N] (with `act` "silu" the packed gate / up weight's
    silu(gate) * up, [T, N / 2]) in one launch: the norm is the GEMV's prologue. x [T, K] and nw [K] in w's
    dtype. Equal to the two launches to within the norm's fp32 sum (its order is this launch's). The
    caller checks `supports(x, w)` and that `act_config` is not None."""
    t, k = x.shape
    if nw.shape != (k,) or nw.dtype != w.dtype or not nw.is_contiguous() or x.dtype != w.dtype:
        raise ValueError(f"norm_linear: x {tuple(x.shape)} {x.dtype}, norm weight {tuple(nw.shape)} {nw.dtype}, w "
                         f"{tuple(w.shape)} {w.dtype}: one dtype, a contiguous [{k}] norm weight")
    cfg = config if config is not None else act_config(t, w, w.dtype, w.device)
    if act is not None:
        return linear_act(x, w, act, config=cfg, norm=(nw, eps, gemma))
    _check_fold(cfg, t, "norm_linear")
    n = w.shape[0]
    y = torch.empty(t, n, dtype=w.dtype, device=w.device)  # [T, N]
    if t:
        _launch(x, w, y, y, None, cfg, (triton.cdiv(n, cfg.block_n), 1), k, norm=(nw, eps, gemma))
    return y


def linear_add(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, config: GemvConfig | None = None,
               ) -> torch.Tensor:
    """residual + x @ w^T -> [T, N] in x.dtype, rounded as the two torch ops round (the GEMV's output, then
    the sum): a projection and the residual add after it in one launch. residual [T, N], x's dtype. The
    caller checks `supports(x, w)` and that `act_config` is not None."""
    t, n = x.shape[0], w.shape[0]
    if residual.shape != (t, n) or residual.dtype != x.dtype or residual.stride(1) != 1:
        raise ValueError(f"linear_add: residual {tuple(residual.shape)} {residual.dtype} must be [{t}, {n}] "
                         f"{x.dtype} with unit column stride")
    cfg = config if config is not None else act_config(t, w, x.dtype, x.device)
    _check_fold(cfg, t, "linear_add")
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)  # [T, N]
    if t:
        _launch(x, w, y, y, None, cfg, (triton.cdiv(n, cfg.block_n), 1), w.shape[1], residual=residual)
    return y


def linear_argmax(x: torch.Tensor, w: torch.Tensor, counters: torch.Tensor, offsets: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, scatter: tuple[torch.Tensor, torch.Tensor, int] | None = None,
                  config: GemvConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, ids): y = x @ w^T [T, N] in x.dtype and ids = `argmax.argmax(y, offsets, out, scatter)`, in
    one launch (ARGMAX: the last program to finish picks each row's column). counters: a `SplitCounters`
    buffer (its first counter is taken, and left zero). The caller checks `supports(x, w)` and that
    `act_config` is not None (the unsplit GEMV); bit-equal to `linear` + `argmax` under that config."""
    t, n = x.shape[0], w.shape[0]
    cfg = config if config is not None else act_config(t, w, x.dtype, x.device)
    _check_fold(cfg, t, "linear_argmax")
    out, buf, rows, col = argmax_outputs(t, x.device, out, scatter)
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)  # [T, N]
    if t:
        tiles = triton.cdiv(n, cfg.block_n)
        keys = torch.empty(tiles, cfg.block_t(t), dtype=torch.int64, device=x.device)  # [grid, BLOCK_T]
        _launch(x, w, y, keys, counters, cfg, (tiles, 1), w.shape[1],
                argmax=(offsets, out, buf, rows, col, scatter is not None))
    return y, out


def linear_act(x: torch.Tensor, w: torch.Tensor, act: str, alpha: float = 0.0, limit: float = 0.0,
               config: GemvConfig | None = None, norm: tuple[torch.Tensor, float, bool] | None = None,
               ) -> torch.Tensor:
    """act(x @ w[:I]^T, x @ w[I:]^T) -> [T, I] in x.dtype for a packed gate / up weight w [2I, K]: an MLP's
    gate_up GEMV with its activation in the epilogue (one launch instead of two). act "silu": silu(gate) *
    up (the Llama MLP); "swiglu_oai": M3's clamped (up + 1) * gate * sigmoid(alpha * gate). Bit-equal to
    `linear` followed by `activation.silu_mul` / `swiglu_oai` (the same sums, rounded to x.dtype, then the
    same activation code). `norm` (nw, eps, gemma): x is normed in the prologue first (`norm_linear`). The
    caller checks `supports(x, w)` and that `act_config` is not None."""
    t, k = x.shape
    if act not in ACTS:
        raise ValueError(f"linear_act: act={act!r}; choose one of {sorted(ACTS)}")
    if w.shape[0] % 2:
        raise ValueError(f"linear_act: w [{w.shape[0]}, {k}] must be a packed [2I, K] gate / up weight")
    cfg = config if config is not None else act_config(t, w, x.dtype, x.device)
    if cfg is None or cfg.use_dot or cfg.split_k != 1 or cfg.block_n < 2 or cfg.block_n % 2 or t > 4:
        raise ValueError(f"linear_act: {cfg} for T = {t}: the epilogue needs the unsplit GEMV (T <= 4, an even "
                         "BLOCK_N)")
    inter = w.shape[0] // 2
    y = torch.empty(t, inter, dtype=x.dtype, device=x.device)  # [T, I]
    if t:
        _launch(x, w, y, y, None, cfg, (triton.cdiv(inter, cfg.block_n // 2), 1), k, inter, ACTS[act], alpha, limit,
                norm)
    return y
