"""Triton kernels for the models' elementwise chains, one launch per chain, and the `TritonFused` backend.

    kernel              replaces (reference.py)                        bf16 launches before -> after
    _add_norm_kernel    residual add(s) + RMSNorm (Gemma or Llama)      10-13 -> 1 (+ a row gather: the
                        embedding lookup, the sampled / last-accepted rows -> 0)
    _norm_cat_kernel    2-3 RMSNorms into one row (+ embedding lookup)  2-3 fused launches (+ a gather) -> 1
    _rope_table_kernel  rope_cos_sin (positions -> cos, sin)            12 -> 1 (inv_freq cached)
    _qkv_rope_kernel    q/k norm + partial NeoX RoPE + K/V cache writes 34 -> 1 (indexer: 33 -> 1; the
                        table computed in it for a layer that is its only reader: + the table's 1 -> 0)
    _swiglu_kernel      swiglu_oai (clamps, sigmoid, muls)              7 -> 1 (-> 0 in the decode GEMV's
    _silu_mul_kernel    silu(gate) * up                                 2 -> 1  epilogue, fused/gemv.py)
    _router_gemv_kernel router_logits (fp32 cast + GEMV, T <= 64)       3 -> 1 (cuBLAS: cast, dot, reduce)
    _route_kernel       sigmoid, + bias, top-k, gather, renormalise     6 -> 1 (after the router GEMM)
    _router_topk_kernel the two above in one launch (T <= 64): the last program of a token routes it
    _router_tile_kernel the cast, the router GEMM and the route (T > 64)  3-4 -> 1 (bf16 MMAs, exact fp32
                        products: the fp32 weight as three bf16 parts; no fp32 copy of x)
    _step_inputs_kernel overlap_ids_kv + derive_positions_and_slots     25 (K=0) / 46 (K=3) -> 1 (int64, exact)
                        (or the positions and slots alone)              9 -> 1
    _sample_pos_kernel  sample_positions (sampled tokens, positions, drafts)  8 (K=0) / 13 (K>0) -> 1
    _commit_kernel      commit_outputs (slot writes; the drafter's inputs)  6 (no draft) / 18 (draft) -> 1
                        (+ the draft steps' cache slots: K-1 positions_slots launches -> 0)
    _accept_kernel      greedy_accept (after the argmax)                   3 (K=0) / 8 (K=3) -> 1
    _argmax_kernel      argmax (+ the draft -> target id map)             1-4 -> 1 (no fp32 copy of bf16 logits;
                        a draft step's stack + index_copy into the slot buffer -> 0)

Exactness. Each kernel computes in fp32 and rounds to the activation dtype exactly where the reference's
torch ops round (an op on bf16 tensors returns bf16), so that elementwise results can be bit-equal to the
reference on CUDA (benchmarks/fused_ops.py measures the bit-equal fraction): PyTorch's CUDA kernels compute
exp / cos / sin / rsqrt with CUDA's libm and divide with IEEE division; with PRECISE the kernels call the
same libdevice functions and `div_rn`, and `enable_fp_fusion=False` keeps the compiler from contracting
a*b + c into an FMA that the separate torch kernels cannot form. What cannot match bit for bit is a
reduction's summation order: the RMSNorm mean square (hence rstd) and the router's renormalising sum may
differ in the last fp32 bit.
Under the CPU interpreter (PRECISE off) the math runs in numpy, whose exp/cos differ from torch's CPU
ones by an ulp; NOTE: the interpreter also truncates fp32 -> bf16 instead of rounding to nearest, so the
CPU tests compare in fp32 and the bf16 check runs on the GPU (benchmarks/fused_ops.py).

Router ties: experts are chosen one at a time, the highest biased score first and, among equal scores,
the lowest expert id -- `reference.route`'s rule, and the set CUDA's torch.topk picks.

Every launcher reads shapes and strides only (no host sync), so a step using them can be captured in a
CUDA graph. Inference only: no autograd.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import replace
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from m3eagle.kernels import pdl
from m3eagle.kernels.fused import reference as _ref
from m3eagle.kernels.pdl import pdl_wait

# ---- precise math helpers -----------------------------------------------------------------------------
# PRECISE (a constexpr) picks libdevice on the GPU: the functions PyTorch's CUDA kernels call, so results
# are identical. The interpreter has no libdevice; there tl.* maps to numpy.


@triton.jit
def _exp(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _rsqrt(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.rsqrt(x)
    else:
        return tl.rsqrt(x)


@triton.jit
def _cos(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.cos(x)
    else:
        return tl.cos(x)


@triton.jit
def _sin(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.sin(x)
    else:
        return tl.sin(x)


# ---- residual add + RMSNorm ---------------------------------------------------------------------------


@triton.jit
def _add_norm_kernel(x_ptr, x2_ptr, res_ptr, w_ptr, y_ptr, r_ptr, rows_ptr, n, x_scale, eps,
                     stride_x, stride_x2, stride_res, stride_y, stride_r,
                     HAS_SCALE: tl.constexpr, HAS_X2: tl.constexpr, HAS_RES: tl.constexpr,
                     WRITE_R: tl.constexpr, NORM: tl.constexpr, GEMMA: tl.constexpr, ROWS: tl.constexpr,
                     PRECISE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One row: r = res + (x * x_scale + x2) (absent terms skipped), each step rounded to x's dtype as
    reference.add_residual rounds; store r (WRITE_R); y = rms_norm(r) (NORM). ROWS: output row i reads the
    inputs' row rows[i] (a gather folded in)."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    row = tl.program_id(0).to(tl.int64)
    src = row
    if ROWS:
        src = tl.load(rows_ptr + row).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < n
    dt = x_ptr.dtype.element_ty
    r = tl.load(x_ptr + src * stride_x + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_SCALE:
        r = (r * x_scale).to(dt).to(tl.float32)  # .to(dt).to(fp32): round where a torch op on dt would
    if HAS_X2:
        x2 = tl.load(x2_ptr + src * stride_x2 + offs, mask=m, other=0.0).to(tl.float32)
        r = (r + x2).to(dt).to(tl.float32)
    if HAS_RES:
        res = tl.load(res_ptr + src * stride_res + offs, mask=m, other=0.0).to(tl.float32)
        r = (res + r).to(dt).to(tl.float32)
    if WRITE_R:
        tl.store(r_ptr + row * stride_r + offs, r.to(r_ptr.dtype.element_ty), mask=m)
    if NORM:
        _norm_store(r, w_ptr, y_ptr + row * stride_y, offs, m, n, eps, dt, GEMMA, PRECISE)


@triton.jit
def rms_rstd(r, n, eps, PRECISE: tl.constexpr):
    """1 / sqrt(mean(r^2) + eps) of a row r [BLOCK] fp32 whose lanes past n are zero (the sum is then over
    the n real channels)."""
    return _rsqrt(tl.sum(r * r, axis=0) / n + eps, PRECISE)


@triton.jit
def rms_scale(y, w, dt: tl.constexpr, GEMMA: tl.constexpr):
    """The normalised row y = x * rstd (fp32) scaled by the norm weight w (fp32), before the store's rounding
    to dt: Gemma (x * rstd) * (1 + w) in fp32; Llama rounds to x's dtype, then scales (w * y in torch)."""
    if GEMMA:
        return y * (1.0 + w)
    return y.to(dt).to(tl.float32) * w


@triton.jit
def _norm_store(r, w_ptr, y_row, offs, m, n, eps, dt: tl.constexpr, GEMMA: tl.constexpr, PRECISE: tl.constexpr):
    """y_row[offs] = rms_norm(r) for one row r [BLOCK] fp32 (lanes past n zero) of dtype dt: the RMSNorm of
    `_add_norm_kernel` and `_norm_cat_kernel`, so the two are bit-equal at equal BLOCK and warps."""
    y = r * rms_rstd(r, n, eps, PRECISE)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(y_row + offs, rms_scale(y, w, dt, GEMMA).to(y_row.dtype.element_ty), mask=m)


@triton.jit
def _norm_cat_kernel(x0_ptr, x1_ptr, x2_ptr, w0_ptr, w1_ptr, w2_ptr, ids_ptr, y_ptr, n, eps, stride_0, stride_1,
                     stride_2, stride_y, GATHER: tl.constexpr, GEMMA: tl.constexpr, PRECISE: tl.constexpr,
                     BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Grid (rows, groups <= 3): y[row, g*n : (g+1)*n] = rms_norm(x_g[row]) with weight w_g -- several norms
    whose outputs are one row's consecutive column blocks (the Eagle3 head's projection input [norm(emb),
    norm(h)], its fc input [norm(aux_0), norm(aux_1), norm(aux_2)]) in one launch. GATHER: x_0 is a table
    and its row ids[row] is normed (the embedding lookup folded in). Per row `_add_norm_kernel`'s norm."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    m = offs < n
    dt = x0_ptr.dtype.element_ty
    y_row = y_ptr + row * stride_y + g * n
    if g == 0:
        src = row
        if GATHER:
            src = tl.load(ids_ptr + row).to(tl.int64)
        r = tl.load(x0_ptr + src * stride_0 + offs, mask=m, other=0.0).to(tl.float32)
        _norm_store(r, w0_ptr, y_row, offs, m, n, eps, dt, GEMMA, PRECISE)
    elif g == 1:
        r = tl.load(x1_ptr + row * stride_1 + offs, mask=m, other=0.0).to(tl.float32)
        _norm_store(r, w1_ptr, y_row, offs, m, n, eps, dt, GEMMA, PRECISE)
    else:
        r = tl.load(x2_ptr + row * stride_2 + offs, mask=m, other=0.0).to(tl.float32)
        _norm_store(r, w2_ptr, y_row, offs, m, n, eps, dt, GEMMA, PRECISE)


# ---- RoPE tables --------------------------------------------------------------------------------------


@triton.jit
def _rope_table_kernel(pos_ptr, inv_ptr, cos_ptr, sin_ptr, rdim, mscale,
                       HAS_MSCALE: tl.constexpr, PRECISE: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    """cos/sin [T, R] of one token: angle pos * inv_freq[i mod R/2] (NeoX: the halves repeat)."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_R)
    m = offs < rdim
    half = rdim // 2
    inv = tl.load(inv_ptr + tl.where(offs < half, offs, offs - half), mask=m, other=0.0)
    ang = tl.load(pos_ptr + t).to(tl.float32) * inv
    c = _cos(ang, PRECISE)
    s = _sin(ang, PRECISE)
    if HAS_MSCALE:
        c = c * mscale
        s = s * mscale
    tl.store(cos_ptr + t * rdim + offs, c.to(cos_ptr.dtype.element_ty), mask=m)
    tl.store(sin_ptr + t * rdim + offs, s.to(sin_ptr.dtype.element_ty), mask=m)


# ---- per-head norm + partial RoPE + cache writes ------------------------------------------------------


@triton.jit
def _rope_cs(cos_row, sin_row, pos, inv_ptr, mscale, ds, rdim, dt: tl.constexpr, TABLE: tl.constexpr,
             HAS_MSCALE: tl.constexpr, PRECISE: tl.constexpr):
    """cos, sin [BLOCK_D] fp32 of one token's channels ds < rdim: loaded from its table rows (TABLE), or
    computed here from its position as `_rope_table_kernel` computes them and rounded to the table's
    dtype dt, so both are the same values."""
    rm = ds < rdim
    if TABLE:
        c = tl.load(cos_row + ds, mask=rm, other=0.0).to(tl.float32)
        s = tl.load(sin_row + ds, mask=rm, other=0.0).to(tl.float32)
    else:
        half = rdim // 2
        ang = pos.to(tl.float32) * tl.load(inv_ptr + tl.where(ds < half, ds, ds - half), mask=rm, other=0.0)
        c = _cos(ang, PRECISE)
        s = _sin(ang, PRECISE)
        if HAS_MSCALE:
            c = c * mscale
            s = s * mscale
        c = c.to(dt).to(tl.float32)
        s = s.to(dt).to(tl.float32)
    return c, s


@triton.jit
def _norm_rope_heads(src, stride_sh, dst, stride_dh, w_ptr, cos_row, sin_row, pos, inv_ptr, mscale, h0, nheads,
                     dim, rdim, eps, NORM: tl.constexpr, ROPE: tl.constexpr, TABLE: tl.constexpr,
                     HAS_MSCALE: tl.constexpr, PRECISE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Heads h0..h0+BLOCK_H of one token: src/dst point at the token's row. Gemma RMSNorm per head (NORM),
    then NeoX RoPE on channels [0, rdim) (ROPE), rounded as reference.qk_norm_rope rounds; cos/sin from
    the token's table rows or, without TABLE, from its position (`_rope_cs`)."""
    hs = h0 + tl.arange(0, BLOCK_H)
    ds = tl.arange(0, BLOCK_D)
    hm = hs < nheads
    m = hm[:, None] & (ds < dim)[None, :]
    dt = src.dtype.element_ty
    rows = src + hs.to(tl.int64)[:, None] * stride_sh
    x = tl.load(rows + ds[None, :], mask=m, other=0.0).to(tl.float32)  # [BH, BD]
    y = x
    if NORM:
        rstd = _rsqrt(tl.sum(x * x, axis=1) / dim + eps, PRECISE)[:, None]  # [BH, 1]
        w1 = 1.0 + tl.load(w_ptr + ds, mask=ds < dim, other=0.0).to(tl.float32)
        y = ((x * rstd) * w1[None, :]).to(dt).to(tl.float32)
    if ROPE:
        # out[i] = y[i] * cos[i] + rot[i] * sin[i], rot = (-y[half:], y[:half]) over the first rdim channels.
        # The partner channel is re-loaded and re-normalised (same fp32 ops, so the same value) rather than
        # permuted in registers.
        half = rdim // 2
        rm = ds < rdim
        first = ds < half
        partner = tl.where(first, ds + half, ds - half)
        xp = tl.load(rows + partner[None, :], mask=hm[:, None] & rm[None, :], other=0.0).to(tl.float32)
        yp = xp
        if NORM:
            wp = 1.0 + tl.load(w_ptr + partner, mask=rm, other=0.0).to(tl.float32)
            yp = ((xp * rstd) * wp[None, :]).to(dt).to(tl.float32)
        rot = tl.where(first[None, :], -yp, yp)
        c, s = _rope_cs(cos_row, sin_row, pos, inv_ptr, mscale, ds, rdim, dt, TABLE, HAS_MSCALE, PRECISE)
        a = (y * c[None, :]).to(dt).to(tl.float32)
        b = (rot * s[None, :]).to(dt).to(tl.float32)
        roped = (a + b).to(dt).to(tl.float32)
        y = tl.where(rm[None, :], roped, y)
    tl.store(dst + hs.to(tl.int64)[:, None] * stride_dh + ds[None, :], y.to(dst.dtype.element_ty), mask=m)


@triton.jit
def _qkv_rope_kernel(q_ptr, sq_t, sq_h, qo_ptr, sqo_t, sqo_h, qw_ptr, hq,
                     k_ptr, sk_t, sk_h, kp_ptr, skp_s, skp_h, kw_ptr, hk,
                     v_ptr, sv_t, sv_h, vp_ptr, svp_s, svp_h, hv,
                     slots_ptr, cos_ptr, sin_ptr, sc_t, ss_t, pos_ptr, inv_ptr, mscale, dim, rdim, eps, nbq, nbk, nbv,
                     iq_ptr, siq_t, siq_h, iqo_ptr, siqo_t, siqo_h, iqw_ptr, hiq,
                     ik_ptr, sik_t, ikp_ptr, sikp_s, ikw_ptr, dim_i, rdim_i, nbiq,
                     Q_NORM: tl.constexpr, K_NORM: tl.constexpr, INDEX: tl.constexpr, TABLE: tl.constexpr,
                     HAS_MSCALE: tl.constexpr, PRECISE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                     PDL: tl.constexpr):
    """Program (t, b): head block b of token t, over q's blocks, then k's (written to the K pool at
    slots[t]), then v's (copied to the V pool at slots[t]). nbk = 0 / hv = 0 when there is no k / v.
    INDEX: then the lightning indexer's q heads (normed, roped on their first rdim_i channels, to iqo) and
    its one k head (to the index-K pool at slots[t]) -- a sparse layer's five projections in one launch.
    TABLE: cos/sin rows t of the tables; else computed from pos[t], inv_freq and mscale (`_rope_cs`)."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    cos_row = cos_ptr + t * sc_t
    sin_row = sin_ptr + t * ss_t
    pos = 0
    if not TABLE:
        pos = tl.load(pos_ptr + t)
    if b < nbq:
        _norm_rope_heads(q_ptr + t * sq_t, sq_h, qo_ptr + t * sqo_t, sqo_h, qw_ptr, cos_row, sin_row, pos, inv_ptr,
                         mscale, b * BLOCK_H, hq, dim, rdim, eps, Q_NORM, True, TABLE, HAS_MSCALE, PRECISE, BLOCK_H,
                         BLOCK_D)
    elif b < nbq + nbk:
        slot = tl.load(slots_ptr + t).to(tl.int64)
        _norm_rope_heads(k_ptr + t * sk_t, sk_h, kp_ptr + slot * skp_s, skp_h, kw_ptr, cos_row, sin_row, pos,
                         inv_ptr, mscale, (b - nbq) * BLOCK_H, hk, dim, rdim, eps, K_NORM, True, TABLE, HAS_MSCALE,
                         PRECISE, BLOCK_H, BLOCK_D)
    elif b < nbq + nbk + nbv:
        slot = tl.load(slots_ptr + t).to(tl.int64)
        _norm_rope_heads(v_ptr + t * sv_t, sv_h, vp_ptr + slot * svp_s, svp_h, kw_ptr, cos_row, sin_row, pos,
                         inv_ptr, mscale, (b - nbq - nbk) * BLOCK_H, hv, dim, rdim, eps, False, False, TABLE,
                         HAS_MSCALE, PRECISE, BLOCK_H, BLOCK_D)
    elif INDEX:
        b0 = b - nbq - nbk - nbv
        if b0 < nbiq:
            _norm_rope_heads(iq_ptr + t * siq_t, siq_h, iqo_ptr + t * siqo_t, siqo_h, iqw_ptr, cos_row, sin_row,
                             pos, inv_ptr, mscale, b0 * BLOCK_H, hiq, dim_i, rdim_i, eps, True, True, TABLE,
                             HAS_MSCALE, PRECISE, BLOCK_H, BLOCK_D)
        else:
            slot = tl.load(slots_ptr + t).to(tl.int64)
            _norm_rope_heads(ik_ptr + t * sik_t, 0, ikp_ptr + slot * sikp_s, 0, ikw_ptr, cos_row, sin_row, pos,
                             inv_ptr, mscale, 0, 1, dim_i, rdim_i, eps, True, True, TABLE, HAS_MSCALE, PRECISE,
                             BLOCK_H, BLOCK_D)


# ---- MLP activations ----------------------------------------------------------------------------------


@triton.jit
def _swiglu_kernel(gu_ptr, out_ptr, inter, stride_g, stride_o, alpha, limit,
                   PRECISE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out[t, i] = (up + 1) * gate * sigmoid(alpha * gate), gate = gu[t, i], up = gu[t, I + i]; every
    intermediate rounded where reference.swiglu_oai's bf16 ops round."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < inter
    dt = gu_ptr.dtype.element_ty
    g = tl.load(gu_ptr + t * stride_g + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * stride_g + inter + offs, mask=m, other=0.0).to(tl.float32)
    out = swiglu_oai_f32(g, u, alpha, limit, dt, PRECISE)
    tl.store(out_ptr + t * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def swiglu_oai_f32(g, u, alpha, limit, dt: tl.constexpr, PRECISE: tl.constexpr):
    """(up + 1) * gate * sigmoid(alpha * gate) of clamped values of dtype dt held in fp32, rounded where
    reference.swiglu_oai's ops on dt round (fp32 result; its store rounds it). Shared by `_swiglu_kernel`
    and the decode GEMV's activation epilogue (fused/gemv.py), both compiled without FMA contraction."""
    # clamp keeps NaN, as torch.clamp does (the enum is spelled inline: triton 3.6 cannot bind it to a name)
    g = tl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL).to(dt).to(tl.float32)
    u = tl.minimum(tl.maximum(u, -limit, propagate_nan=tl.PropagateNan.ALL), limit,
                   propagate_nan=tl.PropagateNan.ALL).to(dt).to(tl.float32)
    ga = (g * alpha).to(dt).to(tl.float32)
    sig = tl.math.div_rn(1.0, 1.0 + _exp(-ga, PRECISE)).to(dt).to(tl.float32)  # torch: 1 / (1 + exp(-x))
    return (u + 1.0).to(dt).to(tl.float32) * (g * sig).to(dt).to(tl.float32)


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, inter, stride_g, stride_u, stride_o,
                     PRECISE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < inter
    dt = g_ptr.dtype.element_ty
    g = tl.load(g_ptr + t * stride_g + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + t * stride_u + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + offs, silu_mul_f32(g, u, dt, PRECISE).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def silu_mul_f32(g, u, dt: tl.constexpr, PRECISE: tl.constexpr):
    """silu(g) * u of values of dtype dt held in fp32, rounded where reference.silu_mul's ops on dt round (the
    product is returned in fp32; its store rounds it). Shared by `_silu_mul_kernel` and the decode GEMV's
    activation epilogue (fused/gemv.py), which compile it without FMA contraction: the same bits."""
    act = tl.math.div_rn(g, 1.0 + _exp(-g, PRECISE)).to(dt).to(tl.float32)  # torch's silu: x / (1 + exp(-x))
    return act * u


# ---- router -------------------------------------------------------------------------------------------


@triton.jit
def _route_row(lg_ptr, bias_ptr, w_ptr, idx_ptr, n_exp, TOP_K: tl.constexpr, PRECISE: tl.constexpr,
               BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, CACHE: tl.constexpr):
    """One token's routing from its logits row at lg_ptr: k rounds of "take the highest untaken biased
    score, lowest id among equals"; weights are the plain sigmoid scores of the taken experts over their
    sum, written to w_ptr / idx_ptr [k]. CACHE: the logits' load cache modifier."""
    offs = tl.arange(0, BLOCK_E)
    m = offs < n_exp
    logit = tl.load(lg_ptr + offs, mask=m, other=0.0, cache_modifier=CACHE).to(tl.float32)
    score = tl.math.div_rn(1.0, 1.0 + _exp(-logit, PRECISE))  # [E] torch's sigmoid
    biased = score + tl.load(bias_ptr + offs, mask=m, other=0.0).to(tl.float32)
    biased = tl.where(biased != biased, float("inf"), biased)  # NaN ranks first, as torch.sort puts it
    taken = offs >= n_exp  # padding lanes never compete
    ks = tl.arange(0, BLOCK_K)
    wv = tl.zeros([BLOCK_K], dtype=tl.float32)
    iv = tl.zeros([BLOCK_K], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        top = tl.max(tl.where(taken, float("-inf"), biased), axis=0)
        # `taken` rather than overwriting with -inf: an expert whose score is itself -inf must not be
        # taken twice. k <= E, so some untaken lane always equals `top`.
        pick = tl.min(tl.where((biased == top) & ~taken, offs, BLOCK_E), axis=0)
        hit = offs == pick
        taken = taken | hit
        wv = tl.where(ks == j, tl.sum(tl.where(hit, score, 0.0), axis=0), wv)
        iv = tl.where(ks == j, pick.to(tl.int64), iv)
    km = ks < TOP_K
    total = tl.sum(tl.where(km, wv, 0.0), axis=0)
    tl.store(w_ptr + ks, tl.math.div_rn(wv, total), mask=km)
    tl.store(idx_ptr + ks, iv, mask=km)


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, w_ptr, idx_ptr, n_exp, stride_l,
                  TOP_K: tl.constexpr, PRECISE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                  PDL: tl.constexpr):
    """One token per program (`_route_row`)."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    t = tl.program_id(0).to(tl.int64)
    _route_row(logits_ptr + t * stride_l, bias_ptr, w_ptr + t * TOP_K, idx_ptr + t * TOP_K, n_exp, TOP_K, PRECISE,
               BLOCK_E, BLOCK_K, "")


# ---- step inputs ---------------------------------------------------------------------------------------


@triton.jit
def _cache_slot(pt_ptr, row, pos, stride_pt, table_w, page_size, m):
    """Cache slot of (row, position) pairs (any matching shapes, int64): the page in column floor(pos /
    page_size) of the row's page table, clamped to the table (attention.metadata.slots_for_positions)."""
    pc = pos // page_size
    pc = tl.where((pc * page_size != pos) & (pos < 0), pc - 1, pc)  # floor, not truncation
    page = tl.load(pt_ptr + row * stride_pt + tl.minimum(tl.maximum(pc, 0), table_w - 1), mask=m, other=0)
    return page * page_size + (pos - pc * page_size)


@triton.jit(do_not_specialize=["n_tok", "n_rows"])  # per-step counts: one compiled variant (design note 17)
def _step_inputs_kernel(ids_ptr, kv_ptr, q_ptr, tok_row_ptr, tok_col_ptr, pt_ptr, stride_pt, table_w, page_size,
                        slot_ptr, gather_ptr, nd_ptr, correct_ptr, chained_ptr, st_ptr, stride_st, nn_ptr, dev_ptr,
                        sd_ptr, stride_sd, ids_out, kv_out, pos_out, slots_out, n_tok, n_rows,
                        K: tl.constexpr, OVERLAP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Programs [0, cdiv(T, BLOCK)) take BLOCK tokens each: the corrected kv_len of the token's row, its
    position (kv_len - q_len + col) and cache slot (floor division as torch's), and with OVERLAP its input
    id (slot's last token at col 0 of a gather row, its drafts at cols 1..num_drafts). The programs after
    them write kv_out for BLOCK rows each. All int64: bit-exact with the reference."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    pid = tl.program_id(0)
    n_tok_blocks = tl.cdiv(n_tok, BLOCK)
    offs = tl.arange(0, BLOCK)
    if pid < n_tok_blocks:
        t = pid * BLOCK + offs
        m = t < n_tok
        row = tl.load(tok_row_ptr + t, mask=m, other=0)
        col = tl.load(tok_col_ptr + t, mask=m, other=0)
        kv = tl.load(kv_ptr + row, mask=m, other=0)
        if OVERLAP:
            slot = tl.load(slot_ptr + row, mask=m, other=0)
            nn = tl.load(nn_ptr + slot, mask=m, other=1)
            correct = (tl.load(correct_ptr + row, mask=m, other=0) != 0) & (tl.load(chained_ptr + row, mask=m,
                                                                                    other=0) == 0)
            kv = kv + tl.where(correct, tl.load(dev_ptr + slot, mask=m & correct, other=0), 0)
        pos = kv - tl.load(q_ptr + row, mask=m, other=0) + col
        tl.store(pos_out + t, pos, mask=m)
        tl.store(slots_out + t, _cache_slot(pt_ptr, row, pos, stride_pt, table_w, page_size, m), mask=m)
        if OVERLAP:
            gather = tl.load(gather_ptr + row, mask=m, other=0) != 0
            nd = tl.load(nd_ptr + row, mask=m, other=0)
            last = tl.load(st_ptr + slot * stride_st + tl.maximum(nn - 1, 0), mask=m & gather & (col == 0), other=0)
            use_d = gather & (col >= 1) & (col <= nd) & (col <= K)
            draft = tl.load(sd_ptr + slot * stride_sd + tl.maximum(col - 1, 0), mask=m & use_d, other=0)
            tid = tl.load(ids_ptr + t, mask=m, other=0)
            tid = tl.where(gather & (col == 0), last, tl.where(use_d, draft, tid))
            tl.store(ids_out + t, tid, mask=m)
    else:
        r = (pid - n_tok_blocks) * BLOCK + offs
        m = r < n_rows
        kv = tl.load(kv_ptr + r, mask=m, other=0)
        if OVERLAP:
            slot = tl.load(slot_ptr + r, mask=m, other=0)
            correct = (tl.load(correct_ptr + r, mask=m, other=0) != 0) & (tl.load(chained_ptr + r, mask=m,
                                                                                  other=0) == 0)
            kv = kv + tl.where(correct, tl.load(dev_ptr + slot, mask=m & correct, other=0), 0)
        tl.store(kv_out + r, kv, mask=m)


@triton.jit(do_not_specialize=["n_rows"])
def _sample_pos_kernel(first_ptr, qlen_ptr, nd_ptr, pos_ptr, ids_ptr, idx_out, pos_out, drafts_out, n_rows,
                       K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_J: tl.constexpr, PDL: tl.constexpr):
    """BLOCK_R rows x (K + 1) columns: column j samples token min(last - num_drafts + j, last); draft j - 1
    is token min(first + j, last) when j <= num_drafts, else 0."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    j = tl.arange(0, BLOCK_J)
    rm = r < n_rows
    first = tl.load(first_ptr + r, mask=rm, other=0)
    last = first + tl.load(qlen_ptr + r, mask=rm, other=1) - 1
    nd = tl.load(nd_ptr + r, mask=rm, other=0)
    m = rm[:, None] & (j[None, :] <= K)
    idx = tl.minimum((last - nd)[:, None] + j[None, :], last[:, None])  # [BR, BJ]
    tl.store(idx_out + r[:, None] * (K + 1) + j[None, :], idx, mask=m)
    tl.store(pos_out + r[:, None] * (K + 1) + j[None, :], tl.load(pos_ptr + idx, mask=m, other=0), mask=m)
    if K > 0:
        dm = rm[:, None] & (j[None, :] >= 1) & (j[None, :] <= K)
        d_idx = tl.minimum(first[:, None] + j[None, :], last[:, None])
        tok = tl.load(ids_ptr + d_idx, mask=dm & (j[None, :] <= nd[:, None]), other=0)
        tl.store(drafts_out + r[:, None] * K + (j[None, :] - 1), tok, mask=dm)


def sample_positions(row_first: torch.Tensor, row_qlen: torch.Tensor, row_num_drafts: torch.Tensor,
                     positions: torch.Tensor, ids: torch.Tensor, k: int,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """reference.sample_positions in one launch (int64, exact)."""
    row_first, row_qlen, row_num_drafts, positions, ids = (
        x.contiguous() for x in (row_first, row_qlen, row_num_drafts, positions, ids))
    b, dev = row_first.shape[0], row_first.device
    idx = torch.empty(b, k + 1, dtype=torch.int64, device=dev)
    pos = torch.empty(b, k + 1, dtype=torch.int64, device=dev)
    drafts = torch.empty(b, k, dtype=ids.dtype, device=dev)
    if b:
        block_r = 32
        _sample_pos_kernel[(triton.cdiv(b, block_r),)](row_first, row_qlen, row_num_drafts, positions, ids, idx, pos,
                                                        drafts if k else idx, b, K=k, BLOCK_R=block_r,
                                                        BLOCK_J=triton.next_power_of_2(k + 1), num_warps=1, **pdl.args(ids))
    return idx, pos, drafts


@triton.jit(do_not_specialize=["n_rows", "n_tok"])
def _commit_kernel(new_ptr, nn_ptr, samples_ptr, slot_ptr, dump_slot, nd_ptr, first_ptr, qlen_ptr, next_ptr,
                   ids_ptr, pos_ptr, tok_row_ptr, st_ptr, stride_st, snn_ptr, sdev_ptr, chained_ptr, kv_ptr,
                   kv_out, chained_out, nn_out, s_out, last_out, shifted_out, at_out, pt_ptr, stride_pt, table_w,
                   page_size, at_slot_out, n_rows, n_tok,
                   K: tl.constexpr, DRAFT: tl.constexpr, CHAIN: tl.constexpr, SLOTS: tl.constexpr,
                   BLOCK: tl.constexpr, BLOCK_J: tl.constexpr, PDL: tl.constexpr):
    """Programs [0, cdiv(B, BLOCK)): BLOCK rows each -- masked count, slot writes (tokens, count, deviation),
    with CHAIN the advance of the step's kv_len / chained inputs, and with DRAFT the last accepted index
    and the at table (with SLOTS its cache slots, `_step_inputs_kernel`'s lookup). Programs after them
    (DRAFT only): BLOCK tokens of the shifted ids; a token that is
    its row's last accepted one takes the bonus (or next known) token. A row reads and writes only its own
    slot's deviation and its own input entries, so programs never race (the dump slot's writers aside)."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    pid = tl.program_id(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK)
    offs = tl.arange(0, BLOCK)
    if pid < n_row_blocks:
        r = pid * BLOCK + offs
        m = r < n_rows
        samples = tl.load(samples_ptr + r, mask=m, other=0) != 0
        nn = tl.where(samples, tl.load(nn_ptr + r, mask=m, other=0), 0)
        s = tl.where(samples, tl.load(slot_ptr + r, mask=m, other=0), dump_slot)
        nd = tl.load(nd_ptr + r, mask=m, other=0)
        tl.store(nn_out + r, nn, mask=m)
        tl.store(s_out + r, s, mask=m)
        j = tl.arange(0, BLOCK_J)
        jm = m[:, None] & (j[None, :] <= K)
        toks = tl.load(new_ptr + r[:, None] * (K + 1) + j[None, :], mask=jm, other=0)
        tl.store(st_ptr + s[:, None] * stride_st + j[None, :], toks, mask=jm)
        tl.store(snn_ptr + s, nn, mask=m)
        dev = nn - (nd + 1)
        if CHAIN:
            chained = tl.load(chained_ptr + r, mask=m, other=0) != 0
            slot = tl.load(slot_ptr + r, mask=m, other=0)
            dev += tl.load(sdev_ptr + slot, mask=m & chained, other=0)
            kv = tl.load(kv_ptr + r, mask=m, other=0)
            tl.store(kv_out + r, kv + nn, mask=m & samples)
            tl.store(chained_out + r, (chained | samples).to(tl.int1), mask=m)
        tl.store(sdev_ptr + s, dev, mask=m)
        if DRAFT:
            last = (tl.load(first_ptr + r, mask=m, other=0) + tl.load(qlen_ptr + r, mask=m, other=1) - 1 - nd
                    + tl.maximum(nn - 1, 0))
            tl.store(last_out + r, last, mask=m)
            pos = tl.load(pos_ptr + last, mask=m, other=0)
            at = pos[:, None] + j[None, :]  # [BLOCK, BLOCK_J]
            tl.store(at_out + j[None, :] * n_rows + r[:, None], at, mask=jm)
            if SLOTS:
                tl.store(at_slot_out + j[None, :] * n_rows + r[:, None],
                         _cache_slot(pt_ptr, r[:, None], at, stride_pt, table_w, page_size, jm), mask=jm)
    else:
        t = (pid - n_row_blocks) * BLOCK + offs
        m = t < n_tok
        tid = tl.load(ids_ptr + t + 1, mask=m & (t + 1 < n_tok), other=0)
        row = tl.load(tok_row_ptr + t, mask=m, other=0)
        samples = tl.load(samples_ptr + row, mask=m, other=0) != 0
        nn = tl.where(samples, tl.load(nn_ptr + row, mask=m, other=0), 0)
        acc = tl.maximum(nn - 1, 0)
        last = (tl.load(first_ptr + row, mask=m, other=0) + tl.load(qlen_ptr + row, mask=m, other=1) - 1
                - tl.load(nd_ptr + row, mask=m, other=0) + acc)
        hit = m & (t == last)
        bonus = tl.load(new_ptr + row * (K + 1) + acc, mask=hit & samples, other=0)
        nxt = tl.load(next_ptr + row, mask=hit & ~samples, other=0)
        tid = tl.where(hit, tl.where(samples, bonus, nxt), tid)
        tl.store(shifted_out + t, tid, mask=m)


def _unit_stride_error(x: torch.Tensor) -> torch.Tensor:
    # chain's tensors are written in place: a contiguous copy would take the writes away from the caller
    raise ValueError(f"commit_outputs(chain=...) needs unit-stride vectors, got stride {x.stride()}")


def commit_outputs(new_tokens: torch.Tensor, num_new: torch.Tensor, row_samples: torch.Tensor,
                   row_slot: torch.Tensor, dump_slot: int, row_num_drafts: torch.Tensor, row_first: torch.Tensor,
                   row_qlen: torch.Tensor, row_next_token: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
                   slot_tokens: torch.Tensor, slot_num_new: torch.Tensor, slot_dev: torch.Tensor, k: int,
                   draft: bool, tok_row: torch.Tensor | None = None, chain: tuple | None = None,
                   pages: tuple[torch.Tensor, int] | None = None) -> tuple[torch.Tensor, ...]:
    """reference.commit_outputs in one launch (int64, exact). `tok_row` [T] (the step's) is needed with
    `draft`. Slot buffers: [S+1, K+1] with unit inner stride, [S+1], [S+1]. `pages` = (page_table, page_size):
    the at table's cache slots too (the draft steps' slot mapping, in this launch instead of one per step)."""
    new_tokens, num_new, row_samples, row_slot, row_num_drafts, row_first, row_qlen, row_next_token = (
        x.contiguous() for x in (new_tokens, num_new, row_samples, row_slot, row_num_drafts, row_first, row_qlen,
                                 row_next_token))
    b, t, dev = num_new.shape[0], ids.shape[0], num_new.device
    nn_out, s_out = torch.empty_like(num_new), torch.empty_like(row_slot)
    if draft:
        if tok_row is None:
            raise ValueError("commit_outputs(draft=True) needs the step's tok_row")
        ids, positions, tok_row = ids.contiguous(), positions.contiguous(), tok_row.contiguous()
        last = torch.empty(b, dtype=torch.int64, device=dev)
        shifted = torch.empty_like(ids)
        at = torch.empty(k + 1, b, dtype=torch.int64, device=dev)
    else:
        last = shifted = at = None
        tok_row = num_new  # never read
    slots = draft and pages is not None
    at_slots = torch.empty_like(at) if slots else None
    pt = pages[0].contiguous() if slots else num_new  # num_new: never read (SLOTS=False)
    if chain is not None:  # (row_chained, kv_lens, kv_out, chained_out): the kernel steps them with unit stride
        chain_args = tuple(x if x.stride(0) == 1 else _unit_stride_error(x) for x in chain)
    else:
        chain_args = (num_new,) * 4  # never read (CHAIN=False)
    block = 64
    grid = triton.cdiv(b, block) + (triton.cdiv(t, block) if draft else 0)
    if b:
        _commit_kernel[(grid,)](new_tokens, num_new, row_samples, row_slot, dump_slot, row_num_drafts, row_first,
                                row_qlen, row_next_token, ids, positions, tok_row, slot_tokens, slot_tokens.stride(0),
                                slot_num_new, slot_dev, *chain_args, nn_out, s_out,
                                last if draft else nn_out, shifted if draft else nn_out, at if draft else nn_out,
                                pt, pt.stride(0), pt.shape[-1], pages[1] if slots else 1,
                                at_slots if slots else nn_out, b, t, K=k, DRAFT=draft, CHAIN=chain is not None,
                                SLOTS=slots, BLOCK=block, BLOCK_J=triton.next_power_of_2(k + 1),
                                num_warps=2, **pdl.args(new_tokens))
    return nn_out, s_out, last, shifted, at, at_slots


@triton.jit(do_not_specialize=["n_rows"])
def _accept_kernel(greedy_ptr, drafts_ptr, nd_ptr, out_ptr, n_rows, K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """BLOCK rows: 1 + the number of leading drafts equal to the argmax of the position before them."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = r < n_rows
    nd = tl.load(nd_ptr + r, mask=m, other=0)
    alive = m
    n = tl.full([BLOCK], 1, tl.int64)
    for j in tl.static_range(K):
        d = tl.load(drafts_ptr + r * K + j, mask=m, other=0)
        g = tl.load(greedy_ptr + r * (K + 1) + j, mask=m, other=0)
        alive = alive & (d == g) & (j < nd)
        n = n + alive.to(tl.int64)
    tl.store(out_ptr + r, n, mask=m)


def greedy_accept(greedy_tok: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """reference.greedy_accept in one launch (int64, exact)."""
    greedy_tok, drafts, num_drafts = (x.contiguous() for x in (greedy_tok, drafts, num_drafts))
    b, k = drafts.shape
    out = torch.empty(b, dtype=torch.int64, device=drafts.device)
    if b:
        block = 64
        _accept_kernel[(triton.cdiv(b, block),)](greedy_tok, drafts, num_drafts, out, b, K=k, BLOCK=block,
                                                  num_warps=1, **pdl.args(drafts))
    return out


@triton.jit(do_not_specialize=["n_cols", "stride_o", "col"])  # a draft step's column: one variant for all
def _argmax_kernel(x_ptr, off_ptr, out_ptr, sc_ptr, rows_ptr, n_cols, stride_x, stride_o, stride_sc, col,
                   HAS_OFF: tl.constexpr, SCATTER: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out[r] = the first index of row r's maximum (the first NaN if the row has one, as torch.argmax),
    + off[index] when HAS_OFF; with SCATTER also sc[rows[r], col]. One program per row; each lane keeps its
    own best (strict >, so the earlier column keeps a tie), then the lanes reduce to the max value and the
    least column holding it."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    row = x_ptr + r * stride_x
    best_v = tl.load(row + offs, mask=offs < n_cols, other=float("-inf")).to(tl.float32)  # [BLOCK]
    best_i = offs  # lanes past n_cols hold -inf at an index no real column undercuts
    first_nan = tl.where(best_v != best_v, offs, n_cols)
    for c0 in range(BLOCK, n_cols, BLOCK):
        cols = c0 + offs
        v = tl.load(row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        better = v > best_v
        best_v = tl.where(better, v, best_v)
        best_i = tl.where(better, cols, best_i)
        first_nan = tl.minimum(first_nan, tl.where(v != v, cols, n_cols))
    m = tl.max(tl.where(best_v != best_v, float("-inf"), best_v), axis=0)
    i = tl.min(tl.where(best_v == m, best_i, n_cols), axis=0)
    nan_i = tl.min(first_nan, axis=0)
    i = tl.where(nan_i < n_cols, nan_i, i).to(tl.int64)
    if HAS_OFF:
        i += tl.load(off_ptr + i)
    tl.store(out_ptr + r * stride_o, i)
    if SCATTER:
        tl.store(sc_ptr + tl.load(rows_ptr + r) * stride_sc + col, i)


def argmax_outputs(n: int, device: torch.device, out: torch.Tensor | None,
                   scatter: tuple[torch.Tensor, torch.Tensor, int] | None,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """`argmax`'s checked outputs for n rows: (out [n] int64, scatter buffer, its rows (contiguous), column);
    without `scatter` the last three are placeholders that a launch with SCATTER off never reads."""
    if out is None:
        out = torch.empty(n, dtype=torch.int64, device=device)
    elif out.shape != (n,) or out.dtype != torch.int64:
        raise ValueError(f"argmax: out must be [{n}] int64, got {tuple(out.shape)} {out.dtype}")
    if scatter is None:
        return out, out, out, 0
    buf, rows, col = scatter
    if buf.dtype != torch.int64 or buf.stride(-1) != 1 or rows.shape != (n,) or not 0 <= col < buf.shape[1]:
        raise ValueError(f"argmax: scatter needs buf [S, C] int64 with unit column stride, rows [{n}] and "
                         f"0 <= col < C; got buf {tuple(buf.shape)} {buf.dtype}, rows {tuple(rows.shape)}, col {col}")
    return out, buf, rows.contiguous(), col


def argmax(x: torch.Tensor, offsets: torch.Tensor | None = None, out: torch.Tensor | None = None,
           scatter: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> torch.Tensor:
    """reference.argmax in one launch: x [N, V] (unit column stride) -> [N] int64 (+ offsets[i]), written to
    `out` [N] (any stride) when given and, for `scatter` = (buf [S, C] int64, rows [N] int64, col), to
    buf[rows[n], col] as well (the draft loop's stack + index_copy into the slot buffer, folded in)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    n, v = x.shape
    out, buf, rows, col = argmax_outputs(n, x.device, out, scatter)
    if n:
        # One program per row walks the vocabulary; each step is a load's latency (no pipelining without a
        # tl.dot), so wide steps: 16K columns with 16 warps (32 per thread). m3-mini's 32,000-column rows took
        # 7.2 us in 4K steps on an H200; the embedded 8K rows fit one step.
        block = min(16384, triton.next_power_of_2(max(v, 1)))
        warps = 16 if block >= 8192 else (8 if block >= 2048 else 4)
        _argmax_kernel[(n,)](x, offsets if offsets is not None else out, out, buf, rows, v, x.stride(0),
                             out.stride(0), buf.stride(0), col, HAS_OFF=offsets is not None,
                             SCATTER=scatter is not None, BLOCK=block, num_warps=warps, **pdl.args(x))
    return out


STEP_BLOCK = 128


def step_inputs(kv_lens: torch.Tensor, q_lens: torch.Tensor, tok_row: torch.Tensor, tok_col: torch.Tensor,
                page_table: torch.Tensor, page_size: int, overlap: tuple | None = None,
                ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [T] or None, kv_lens [B], positions [T], slots [T]). `overlap` = (input_ids, row_slot, row_first,
    row_gather, row_num_drafts, row_correct, row_chained, slot_tokens, slot_num_new, slot_dev, slot_drafts, k) adds
    reference.overlap_ids_kv's ids and length correction; None derives positions and slots from kv_lens as
    they are (then kv_lens comes back unchanged). Index tensors are int64, flags bool; slot buffers have unit
    inner stride."""
    # The kernel indexes every vector with unit stride (a no-op for the engine's carved views and rows).
    kv_lens, q_lens, tok_row, tok_col = (x.contiguous() for x in (kv_lens, q_lens, tok_row, tok_col))
    n_tok, n_rows = tok_row.shape[0], kv_lens.shape[0]
    dev = kv_lens.device
    pos = torch.empty(n_tok, dtype=torch.int64, device=dev)
    slots = torch.empty(n_tok, dtype=torch.int64, device=dev)
    pt = page_table if page_table.stride(-1) == 1 else page_table.contiguous()
    if overlap is None:  # positions and slots only: the overlap pointers are never read (OVERLAP=False)
        ids, kv_out, ids_in, k = None, kv_lens, kv_lens, 0
        rest = (kv_lens, kv_lens, kv_lens, kv_lens, kv_lens, kv_lens, 0, kv_lens, kv_lens, kv_lens, 0)
        grid = triton.cdiv(n_tok, STEP_BLOCK)
    else:
        ids_in, row_slot, _first, gather, nd, correct, chained, st, nn, dev_, sd, k = (
            x.contiguous() if isinstance(x, torch.Tensor) else x for x in overlap)
        ids, kv_out = torch.empty_like(ids_in), torch.empty_like(kv_lens)
        rest = (row_slot, gather, nd, correct, chained, st, st.stride(0), nn, dev_, sd, sd.stride(0))
        grid = triton.cdiv(n_tok, STEP_BLOCK) + triton.cdiv(n_rows, STEP_BLOCK)
    if grid:
        _step_inputs_kernel[(grid,)](ids_in, kv_lens, q_lens, tok_row, tok_col, pt, pt.stride(0), pt.shape[1],
                                     page_size, *rest, ids if ids is not None else pos, kv_out, pos, slots,
                                     n_tok, n_rows, K=k, OVERLAP=overlap is not None, BLOCK=STEP_BLOCK,
                                     num_warps=4, **pdl.args(kv_lens))
    return ids, kv_out, pos, slots


# ---- launchers ----------------------------------------------------------------------------------------


def _precise() -> bool:
    """libdevice on the GPU; numpy math under the CPU interpreter (read per launch: tests set the env)."""
    return os.environ.get("TRITON_INTERPRET", "0") != "1"


def _opts() -> dict[str, Any]:
    # No FMA contraction: torch runs a*b and + c as separate kernels, each rounding.
    return {"enable_fp_fusion": False}


def _warps(block: int) -> int:
    return 1 if block <= 256 else 2 if block <= 1024 else 4 if block <= 4096 else 8


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., N] -> [R, N] with unit channel stride (a view when the layout allows)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


# Warps of `_add_norm_kernel` by row width (BLOCK), where measured to beat `_warps` (one program per row:
# at decode its latency is the cost); `benchmarks/add_norm_warps.py` sweeps them on a GPU.
# H200 (docs/results/h200-2026-12-01/tune2/add_norm.log, bit-equal at every count): 4096-wide rows 2.31 ->
# 1.98 us with 8 warps instead of 4 at T = 1 (2.39 -> 2.00 at T = 4); 2048-wide 1.79 -> 1.68 at T = 4.
ADD_NORM_WARPS: dict[int, int] = {2048: 8, 4096: 8}


def add_norm(x: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor | None, eps: float,
             x2: torch.Tensor | None = None, x_scale: float = 1.0, gemma: bool = True,
             out: torch.Tensor | None = None, r_out: torch.Tensor | None = None, rows: torch.Tensor | None = None,
             ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(rms_norm(r) or None when w is None, r) with r = reference.add_residual(x, residual, x2, x_scale).
    x/x2/residual [..., N] in one dtype; `out` / `r_out` ([R, N], any row stride) receive y / r when given.
    When r would be x itself (nothing to add) it is not copied: x is returned as r. `rows` [R] int64: only
    those input rows, in that order (y, r [R, N]: the gather x[rows] etc. folded into the launch)."""
    n = x.shape[-1]
    xr = _rows(x)
    if residual is not None and residual.dtype != x.dtype or x2 is not None and x2.dtype != x.dtype:
        raise TypeError(f"add_rms_norm: x {x.dtype}, residual {getattr(residual, 'dtype', None)} and x2 "
                        f"{getattr(x2, 'dtype', None)} must share one dtype (the model's)")
    has_scale, has_x2, has_res = x_scale != 1.0, x2 is not None, residual is not None
    write_r = has_scale or has_x2 or has_res or r_out is not None or rows is not None
    shape = (rows.shape[0], n) if rows is not None else xr.shape
    r = r_out if r_out is not None else torch.empty(shape, dtype=x.dtype, device=x.device) if write_r else xr
    y = None
    if w is not None:
        ydt = x.dtype if gemma else torch.promote_types(x.dtype, w.dtype)
        y = out if out is not None else torch.empty(shape, dtype=ydt, device=x.device)
    if shape[0]:
        block = triton.next_power_of_2(n)
        res = _rows(residual) if has_res else xr
        x2r = _rows(x2) if has_x2 else xr
        yy = y if y is not None else xr  # placeholders for absent tensors are never read or written
        _add_norm_kernel[(shape[0],)](
            xr, x2r, res, w if w is not None else xr, yy, r, rows.contiguous() if rows is not None else xr, n,
            float(x_scale), float(eps), xr.stride(0), x2r.stride(0), res.stride(0), yy.stride(0), r.stride(0),
            HAS_SCALE=has_scale, HAS_X2=has_x2, HAS_RES=has_res, WRITE_R=write_r, NORM=w is not None,
            GEMMA=gemma, ROWS=rows is not None, PRECISE=_precise(), BLOCK=block,
            num_warps=ADD_NORM_WARPS.get(block, _warps(block)), **_opts(), **pdl.args(xr))
    if rows is not None:
        return y, r
    if y is not None and out is None:
        y = y.view(x.shape)
    if r_out is None:
        r = r.view(x.shape) if write_r else x
    return y, r


NORM_CAT_MAX = 3  # groups of `_norm_cat_kernel`


def norm_cat(xs: list[torch.Tensor], ws: list[torch.Tensor], eps: float, out: torch.Tensor, gemma: bool = True,
             ids: torch.Tensor | None = None) -> torch.Tensor:
    """out[:, i*N:(i+1)*N] = rms_norm(x_i, w_i) for 1 <= len(xs) <= NORM_CAT_MAX inputs [T, N] of one dtype
    (with `ids` [T], xs[0] is a table [V, N] and its rows ids are normed), in one launch; out [T, G*N], any
    row stride. Bit-equal to one `add_norm` per group (the same per-row code, BLOCK and warps)."""
    g, n, t = len(xs), xs[-1].shape[-1], out.shape[0]
    if not 1 <= g <= NORM_CAT_MAX or len(ws) != g or out.shape[1] != g * n or out.stride(1) != 1:
        raise ValueError(f"norm_cat: {g} inputs of width {n} into out {tuple(out.shape)}: 1..{NORM_CAT_MAX} inputs, "
                         "out [T, inputs * width] with unit column stride")
    if any(x.dtype != xs[0].dtype or x.shape[-1] != n or x.stride(-1) != 1 for x in xs):
        raise ValueError("norm_cat: inputs need one dtype, one width and unit column stride")
    if t:
        xr = [xs[0]] + [_rows(x) for x in xs[1:]] if ids is not None else [_rows(x) for x in xs]
        xr += [xr[0]] * (NORM_CAT_MAX - g)
        wr = list(ws) + [ws[0]] * (NORM_CAT_MAX - g)
        block = triton.next_power_of_2(n)
        _norm_cat_kernel[(t, g)](
            xr[0], xr[1], xr[2], wr[0], wr[1], wr[2], ids.contiguous() if ids is not None else xr[0], out, n, float(eps),
            xr[0].stride(0), xr[1].stride(0), xr[2].stride(0), out.stride(0), GATHER=ids is not None,
            GEMMA=gemma, PRECISE=_precise(), BLOCK=block, num_warps=ADD_NORM_WARPS.get(block, _warps(block)),
            **_opts(), **pdl.args(out))
    return out


def rope_table(positions: torch.Tensor, inv_freq: torch.Tensor, mscale: float, dtype: torch.dtype,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [...] -> cos, sin [..., R] (R = 2 * len(inv_freq)), as layers.rope_cos_sin."""
    rdim = 2 * inv_freq.shape[0]
    pos = positions.reshape(-1)
    cos = torch.empty(pos.shape[0], rdim, dtype=dtype, device=positions.device)
    sin = torch.empty_like(cos)
    if pos.shape[0]:
        block = triton.next_power_of_2(rdim)
        _rope_table_kernel[(pos.shape[0],)](pos, inv_freq, cos, sin, rdim, float(mscale),
                                            HAS_MSCALE=mscale != 1.0, PRECISE=_precise(), BLOCK_R=block,
                                            num_warps=1, **_opts(), **pdl.args(pos))
    shape = (*positions.shape, rdim)
    return cos.view(shape), sin.view(shape)


def _heads(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def qkv_rope_store(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, q_w: torch.Tensor | None,
                   k_w: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                   k_pool: torch.Tensor | None, v_pool: torch.Tensor | None, slots: torch.Tensor | None,
                   index: tuple | None = None, rope: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """reference.qkv_rope_store in one launch (k None: reference.qk_norm_rope of q alone). q/k/v [T, H, D]
    with any token/head strides (views of the projections' outputs); pools [S, H, D] or [S, D].

    index = (iq [T, Hi, Di], ik [T, 1, Di], iq_w, ik_w, rope_dim, ik_pool [S, Di]): a sparse layer's
    indexer rides in the same launch (reference.qkv_index_rope_store: its tables are the first rope_dim
    columns of cos/sin, its norms use the same eps); returns (q, iq) then.

    rope = (positions [T], inv_freq [R/2] fp32, mscale) in place of cos / sin (None): the launch computes
    the tables' values itself, as `rope_table` would (a layer that is its forward's only reader of them)."""
    t, hq, dim = q.shape
    if rope is not None:
        pos, inv, mscale = rope
        rdim = 2 * inv.shape[0]
        cos = sin = q  # never read (TABLE=False)
    else:
        rdim = cos.shape[-1]
        pos, inv, mscale = q, q, 1.0  # never read (TABLE=True)
        for name, tab in (("cos", cos), ("sin", sin)):
            if tab.dtype != q.dtype or tab.stride(-1) != 1:
                raise TypeError(f"{name} must be a {q.dtype} table with unit channel stride (rope_cos_sin's), "
                                f"got {tab.dtype} strides {tab.stride()}")
    if rdim > dim or rdim % 2:
        raise ValueError(f"rope dim {rdim} must be even and <= head dim {dim}")
    q = _heads(q)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    hk = k.shape[1] if k is not None else 0
    hv = v.shape[1] if v is not None else 0
    if index is not None:
        iq, ik, iq_w, ik_w, rdim_i, ik_pool = index
        iq, ik = _heads(iq), _heads(ik)
        hiq, dim_i = iq.shape[1], iq.shape[2]
        if ik.shape[1:] != (1, dim_i) or ik_pool.shape[-1] != dim_i or ik_pool.stride(-1) != 1:
            raise ValueError(f"index k {tuple(ik.shape)} / pool {tuple(ik_pool.shape)} must be [T, 1, Di] / "
                             f"[S, Di] (unit channel stride) for index q {tuple(iq.shape)}")
        if rdim_i > min(dim_i, rdim) or rdim_i % 2:
            raise ValueError(f"index rope dim {rdim_i} must be even and <= {min(dim_i, rdim)}")
        iq_out = torch.empty(iq.shape, dtype=iq.dtype, device=iq.device)
    else:
        hiq, dim_i = 0, 0
    block_d = triton.next_power_of_2(max(dim, dim_i))
    block_h = max(1, min(triton.next_power_of_2(max(hq, hk, hv, hiq, 1)), 4096 // block_d))
    nbq, nbk, nbv, nbiq = (triton.cdiv(h, block_h) for h in (hq, hk, hv, hiq))
    nbik = 1 if index is not None else 0
    if not t:
        return q_out if index is None else (q_out, iq_out)
    kk = _heads(k) if k is not None else q
    kp = k_pool.view(k_pool.shape[0], hk, dim) if k is not None else q_out
    vv = _heads(v) if v is not None else q
    vp = v_pool.view(v_pool.shape[0], hv, dim) if v is not None else q_out
    if k is not None and (kp.stride(-1) != 1 or vp.stride(-1) != 1):
        raise ValueError("KV pools need unit channel stride")
    if index is not None:
        ix = (iq, iq.stride(0), iq.stride(1), iq_out, iq_out.stride(0), iq_out.stride(1), iq_w, hiq,
              ik, ik.stride(0), ik_pool, ik_pool.stride(0), ik_w, dim_i, int(rdim_i), nbiq)
    else:
        ix = (q, 0, 0, q_out, 0, 0, q, 0, q, 0, q_out, 0, q, 0, 0, 0)  # never read: INDEX is off
    _qkv_rope_kernel[(t, nbq + nbk + nbv + nbiq + nbik)](
        q, q.stride(0), q.stride(1), q_out, q_out.stride(0), q_out.stride(1), q_w if q_w is not None else q, hq,
        kk, kk.stride(0), kk.stride(1), kp, kp.stride(0), kp.stride(1), k_w if k_w is not None else q, hk,
        vv, vv.stride(0), vv.stride(1), vp, vp.stride(0), vp.stride(1), hv,
        slots if slots is not None else q, cos, sin, cos.stride(0), sin.stride(0),
        pos.contiguous() if rope is not None else pos, inv, float(mscale), dim, rdim, float(eps), nbq,
        nbk, nbv, *ix, Q_NORM=q_w is not None, K_NORM=k_w is not None, INDEX=index is not None,
        TABLE=rope is None, HAS_MSCALE=mscale != 1.0, PRECISE=_precise(), BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=_warps(block_h * block_d), **_opts(), **pdl.args(q))
    return q_out if index is None else (q_out, iq_out)


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gate_up [..., 2I] (gate then up) -> [..., I], as reference.swiglu_oai."""
    gu = _rows(gate_up)
    inter = gu.shape[1] // 2
    out = torch.empty(gu.shape[0], inter, dtype=gu.dtype, device=gu.device)
    if gu.shape[0] and inter:
        block = min(1024, triton.next_power_of_2(inter))
        _swiglu_kernel[(gu.shape[0], triton.cdiv(inter, block))](
            gu, out, inter, gu.stride(0), out.stride(0), float(alpha), float(limit), PRECISE=_precise(),
            BLOCK=block, num_warps=_warps(block), **_opts(), **pdl.args(gu))
    return out.view(*gate_up.shape[:-1], inter)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [..., I] -> silu(gate) * up, as reference.silu_mul."""
    g, u = _rows(gate), _rows(up)
    inter = g.shape[1]
    out = torch.empty_like(g)
    if g.shape[0] and inter:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_mul_kernel[(g.shape[0], triton.cdiv(inter, block))](
            g, u, out, inter, g.stride(0), u.stride(0), out.stride(0), PRECISE=_precise(), BLOCK=block,
            num_warps=_warps(block), **_opts(), **pdl.args(g))
    return out.view(gate.shape)


MAX_EXPERTS, MAX_TOP_K = 1024, 16
ROUTER_GEMV_MAX_T = 64  # larger steps take the tiled router (or the reference's cast + cuBLAS)
ROUTER_TILE_MAX_E = 256  # every expert's logit of a row in one program's registers
# The tiled router's serial loop over H costs it latency that the cast + cuBLAS path does not pay, and its
# advantage grows with T (H200, benchmarks/fused_ops.py --router-sweep): m3-mini (H 2048) 12.4 vs 12.8 us
# at T = 256, 12.6 vs 31.5 at 2048; MiniMax-M3's router (E 128, H 6144) 55 vs 29 us at 256, 55 vs 122 at
# 2048. So it takes steps of at least H / ROUTER_TILE_MIN_T_PER_H tokens.
ROUTER_TILE_MIN_T_PER_H = 4


@triton.jit
def _router_gemv_rows(x_ptr, w_ptr, t, offs_e, em, hidden, stride_x, stride_w, BLOCK_E: tl.constexpr,
                      BLOCK_H: tl.constexpr):
    """[BLOCK_E] fp32 logits sum_h fp32(x[t, h]) * w[e, h] for the experts offs_e (em: which are real). Each
    lane accumulates its own columns in fp32; the lanes are summed once at the end."""
    acc = tl.zeros([BLOCK_E, BLOCK_H], dtype=tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        acc = _router_acc(acc, x_ptr, _router_w_tile(w_ptr, offs_e, em, h0, hidden, stride_w, BLOCK_H), t, h0,
                          hidden, stride_x, BLOCK_H)
    return tl.sum(acc, axis=1)


@triton.jit
def _router_w_tile(w_ptr, offs_e, em, h0, hidden, stride_w, BLOCK_H: tl.constexpr):
    """The [BLOCK_E, BLOCK_H] router weight tile of columns h0.. (fp32, zeros past E and H)."""
    offs_h = h0 + tl.arange(0, BLOCK_H)
    return tl.load(w_ptr + offs_e[:, None].to(tl.int64) * stride_w + offs_h[None, :],
                   mask=em[:, None] & (offs_h < hidden)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _router_acc(acc, x_ptr, wv, t, h0, hidden, stride_x, BLOCK_H: tl.constexpr):
    """acc + wv * fp32(x[t, h0..]): one H step of `_router_gemv_rows`."""
    offs_h = h0 + tl.arange(0, BLOCK_H)
    xv = tl.load(x_ptr + t * stride_x + offs_h, mask=offs_h < hidden, other=0.0).to(tl.float32)
    return acc + wv * xv[None, :]


@triton.jit
def _router_gemv_kernel(x_ptr, w_ptr, out_ptr, hidden, n_exp, stride_x, stride_w, stride_o,
                        BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    """logits[t, e] = sum_h fp32(x[t, h]) * w[e, h] for BLOCK_E experts of one token: the cast, the GEMV
    and its split-K reduction of the cuBLAS path in one launch. Each lane accumulates its own columns in
    fp32 and the lanes are summed once at the end (another order than cuBLAS: equal to ~1e-6 relative,
    not bit for bit)."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    t = tl.program_id(0).to(tl.int64)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    em = offs_e < n_exp
    logits = _router_gemv_rows(x_ptr, w_ptr, t, offs_e, em, hidden, stride_x, stride_w, BLOCK_E, BLOCK_H)
    tl.store(out_ptr + t * stride_o + offs_e, logits, mask=em)


@triton.jit
def _router_topk_program(x_ptr, w_ptr, lg_ptr, cnt_ptr, bias_ptr, wout_ptr, idx_ptr, t, pid_e, hidden, n_exp,
                         stride_x, stride_w, n_prog, TOP_K: tl.constexpr, PRECISE: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_ALL: tl.constexpr,
                         BLOCK_K: tl.constexpr, PRELOAD: tl.constexpr, PDL: tl.constexpr):
    """One program of `_router_topk_kernel` (token t, expert block pid_e); also the router programs of the
    MoE's route + shared-expert launch (moe/direct.py), so the two route bit-equally.

    PRELOAD (one H tile: BLOCK_H >= hidden; the kernel has not waited): the expert rows -- a weight, which
    no kernel writes -- are loaded before the programmatic-dependent-launch wait, x after it (pdl.py's
    exception, design note 48). The same one step of `_router_gemv_rows`: the bits do not change."""
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    em = offs_e < n_exp
    if PRELOAD:
        wv = _router_w_tile(w_ptr, offs_e, em, 0, hidden, stride_w, BLOCK_H)
        pdl_wait(PDL)
        acc = _router_acc(tl.zeros([BLOCK_E, BLOCK_H], dtype=tl.float32), x_ptr, wv, t, 0, hidden, stride_x,
                          BLOCK_H)
        logits = tl.sum(acc, axis=1)
    else:
        logits = _router_gemv_rows(x_ptr, w_ptr, t, offs_e, em, hidden, stride_x, stride_w, BLOCK_E, BLOCK_H)
    tl.store(lg_ptr + t * n_exp + offs_e, logits, mask=em)
    tl.debug_barrier()
    done = tl.atomic_add(cnt_ptr + t, 1, sem="acq_rel", scope="gpu")
    if done == n_prog - 1:
        tl.store(cnt_ptr + t, 0)
        _route_row(lg_ptr + t * n_exp, bias_ptr, wout_ptr + t * TOP_K, idx_ptr + t * TOP_K, n_exp, TOP_K,
                   PRECISE, BLOCK_ALL, BLOCK_K, ".cg")


@triton.jit
def _router_topk_kernel(x_ptr, w_ptr, lg_ptr, cnt_ptr, bias_ptr, wout_ptr, idx_ptr, hidden, n_exp, stride_x,
                        stride_w, n_prog, TOP_K: tl.constexpr, PRECISE: tl.constexpr, BLOCK_E: tl.constexpr,
                        BLOCK_H: tl.constexpr, BLOCK_ALL: tl.constexpr, BLOCK_K: tl.constexpr,
                        PRELOAD: tl.constexpr, PDL: tl.constexpr):
    """Grid (T, n_prog): the router GEMV of `_router_gemv_kernel` for BLOCK_E experts of one token, then the
    token's last program to finish routes it (`_route_row`): one launch instead of two. PRELOAD: the expert
    rows are read before the PDL wait (`_router_topk_program`).

    The last program is found with a per-token counter: each program stores its logits, waits for all of
    its threads (a CTA barrier), then adds 1 with acquire-release semantics at GPU scope, so the program
    that reads n_prog - 1 sees every other program's logits (it loads them from L2, not L1); it resets
    the counter for the next launch. No float atomics: the routing is computed once, by one program,
    from the same logits as the two-launch path, so it is bit-equal to it."""
    if not PRELOAD:
        pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    _router_topk_program(x_ptr, w_ptr, lg_ptr, cnt_ptr, bias_ptr, wout_ptr, idx_ptr, tl.program_id(0).to(tl.int64),
                         tl.program_id(1), hidden, n_exp, stride_x, stride_w, n_prog, TOP_K, PRECISE, BLOCK_E,
                         BLOCK_H, BLOCK_ALL, BLOCK_K, PRELOAD, PDL)


@triton.jit(do_not_specialize=["n_tok"])  # the prompt chunk's length: one compiled variant
def _router_tile_kernel(x_ptr, w3_ptr, bias_ptr, wout_ptr, idx_ptr, n_tok, hidden, n_exp, stride_x, stride_ws,
                        stride_we, TOP_K: tl.constexpr, PRECISE: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """The whole router for BLOCK_M tokens of a prompt-sized step, in one launch.

    Logits [BLOCK_M, E] = x @ w^T in fp32 from bf16 tensor-core products: x is bf16 and the fp32 router
    weight is held as three bf16 parts w = w3[0] + w3[1] + w3[2] (exactly: `router_split`), so every
    product x * w3[i] is exact in fp32 and the one fp32 accumulator sums the three products of each term
    -- an fp32 GEMM in another summation order, from bf16 MMAs. Then `_route_row`'s k rounds on every row
    of the tile at once (every expert's column is in the tile: E <= ROUTER_TILE_MAX_E)."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rm = rows < n_tok
    offs_e = tl.arange(0, BLOCK_E)
    em = offs_e < n_exp
    offs_h = tl.arange(0, BLOCK_H)
    x_ptrs = x_ptr + rows[:, None] * stride_x + offs_h[None, :]  # [BM, BH]
    w_ptrs = w3_ptr + offs_e[None, :].to(tl.int64) * stride_we + offs_h[:, None]  # [BH, BE], part 0
    acc = tl.zeros([BLOCK_M, BLOCK_E], dtype=tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        hm = offs_h < hidden - h0
        xv = tl.load(x_ptrs, mask=rm[:, None] & hm[None, :], other=0.0)
        wm = em[None, :] & hm[:, None]
        for i in tl.static_range(3):
            wv = tl.load(w_ptrs + i * stride_ws, mask=wm, other=0.0)
            if PRECISE:
                acc = tl.dot(xv, wv, acc)
            else:  # the CPU interpreter's bf16 dot is wrong; fp32 operands hold the same values exactly
                acc = tl.dot(xv.to(tl.float32), wv.to(tl.float32), acc, input_precision="ieee")
        x_ptrs += BLOCK_H
        w_ptrs += BLOCK_H

    # _route_row on every row: the highest untaken biased score, lowest id among equals, k times.
    score = tl.math.div_rn(1.0, 1.0 + _exp(-acc, PRECISE))  # [BM, BE] torch's sigmoid
    biased = score + tl.load(bias_ptr + offs_e, mask=em, other=0.0).to(tl.float32)[None, :]
    biased = tl.where(biased != biased, float("inf"), biased)  # NaN ranks first, as torch.sort puts it
    ids = tl.zeros([BLOCK_M, BLOCK_E], dtype=tl.int32) + offs_e[None, :]
    taken = ids >= n_exp  # padding lanes never compete
    ks = tl.arange(0, BLOCK_K)
    wv = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    iv = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        top = tl.max(tl.where(taken, float("-inf"), biased), axis=1)  # [BM]
        pick = tl.min(tl.where((biased == top[:, None]) & ~taken, ids, BLOCK_E), axis=1)  # [BM]
        hit = ids == pick[:, None]
        taken = taken | hit
        wv = tl.where(ks[None, :] == j, tl.sum(tl.where(hit, score, 0.0), axis=1)[:, None], wv)
        iv = tl.where(ks[None, :] == j, pick.to(tl.int64)[:, None], iv)
    km = ks < TOP_K
    total = tl.sum(tl.where(km[None, :], wv, 0.0), axis=1)
    out = rows[:, None] * TOP_K + ks[None, :]
    m = rm[:, None] & km[None, :]
    tl.store(wout_ptr + out, tl.math.div_rn(wv, total[:, None]), mask=m)
    tl.store(idx_ptr + out, iv, mask=m)


def _gemv_blocks(t: int, n_exp: int, hidden: int) -> tuple[int, int, int]:
    """(BLOCK_E, BLOCK_H, warps) of the router GEMV. Decode: one expert row per program, read in one or two
    wide loads (latency is the cost: 4 rows of 512-wide chunks per program took 7.7 us per m3-8b layer on an
    H200, the cuBLAS trio 6 us); wider steps reuse each x chunk over 4 rows."""
    block_e = 1 if t * n_exp <= 1024 else 4
    block_h = min(4096 if block_e == 1 else 512, triton.next_power_of_2(hidden))
    return block_e, block_h, 8 if block_h >= 4096 else 4


def router_preload(launch: dict, block_h: int, hidden: int) -> bool:
    """Whether the decode router's programs read their expert rows before the PDL wait: one H tile, and
    `pdl.preload_weights` for this launch."""
    return block_h >= hidden and pdl.preload_weights(launch)


def _gemv_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.shape[0] <= ROUTER_GEMV_MAX_T and weight.dtype == torch.float32 and weight.stride(-1) == 1
            and x.stride(-1) == 1)


def _tile_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dtype == torch.bfloat16 and weight.dtype == torch.float32 and weight.shape[0] <= ROUTER_TILE_MAX_E
            and x.stride(-1) == 1 and x.shape[0] * ROUTER_TILE_MIN_T_PER_H >= x.shape[1])


def _tile_blocks(t: int, block_e: int) -> tuple[int, int]:
    """(block_m, block_h) of the tiled router, from the H200 sweep: about one wave of programs (16-token
    tiles up to T = 2048, then 32, then 64), 128-wide H chunks unless the [block_m, E] tile is large."""
    bm = 16 if t <= 2048 else 32 if t <= 4096 else 64
    return bm, 64 if bm * block_e > 4096 else 128


def router_split(weight: torch.Tensor) -> torch.Tensor:
    """An fp32 router weight [E, H] as three bf16 parts [3, E, H] whose fp32 sum is exactly the weight: each
    part is the bf16 rounding of what the parts before it left (8 significant bits each, 24 in all = fp32's
    mantissa). bf16 has fp32's exponent range, so this holds for |w| >= 2^-110 (~8e-34); below that the
    last part is a bf16 subnormal and may drop bits (an error under 2^-133 absolute)."""
    parts, rest = [], weight.float()
    for _ in range(3):
        part = rest.to(torch.bfloat16)
        parts.append(part)
        rest = rest - part.float()
    return torch.stack(parts).contiguous()


def route_tiles(x: torch.Tensor, w3: torch.Tensor, bias: torch.Tensor, k: int, block_m: int | None = None,
                block_h: int | None = None, num_warps: int = 4, num_stages: int = 3,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """route(router_logits(x, weight), bias, k) in one launch for prompt-sized steps (`_router_tile_kernel`):
    x [T, H] bf16, w3 = router_split(weight) [3, E, H] bf16 with E <= ROUTER_TILE_MAX_E -> (weights [T, k]
    fp32, experts [T, k] int64). Blocks: None takes `_tile_blocks` (measured, benchmarks/fused_ops.py)."""
    t, hidden = x.shape
    n_exp = w3.shape[1]
    if not 1 <= k <= min(n_exp, MAX_TOP_K):
        raise ValueError(f"triton route supports 1 <= top_k <= min(E, {MAX_TOP_K}), got top_k={k}, E={n_exp}; "
                         f"use fused_backend='reference'")
    w = torch.empty(t, k, dtype=torch.float32, device=x.device)
    idx = torch.empty(t, k, dtype=torch.int64, device=x.device)
    if t:
        block_e = max(16, triton.next_power_of_2(n_exp))
        bm, bh = _tile_blocks(t, block_e)
        bm, bh = block_m or bm, block_h or bh
        _router_tile_kernel[(triton.cdiv(t, bm),)](
            x, w3, bias, w, idx, t, hidden, n_exp, x.stride(0), w3.stride(0), w3.stride(1), TOP_K=k,
            PRECISE=_precise(), BLOCK_M=bm, BLOCK_E=block_e, BLOCK_H=bh,
            BLOCK_K=triton.next_power_of_2(k), num_warps=num_warps, num_stages=num_stages, **_opts(),
            **pdl.args(x))
    return w, idx


def route_tokens(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int, counters: torch.Tensor,
                 split: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """route(router_logits(x, weight), bias, k) in one launch for decode / verify-sized steps (T <= 64):
    x [T, H] -> (weights [T, k] fp32, experts [T, k] int64). counters [>= 64] int32, zero between launches
    (each launch leaves them zero), owned by the caller and used by one stream at a time. Larger steps of
    bf16 activations take the tiled router (one launch too) when `split` = router_split(weight) is given."""
    t, hidden = x.shape
    n_exp = weight.shape[0]
    if not _gemv_ok(x, weight) or not t:
        if t > ROUTER_GEMV_MAX_T and split is not None and _tile_ok(x, weight):
            return route_tiles(x, split, bias, k)
        return route(router_logits(x, weight), bias, k)
    if not 1 <= k <= min(n_exp, MAX_TOP_K) or n_exp > MAX_EXPERTS:
        raise ValueError(f"triton route supports 1 <= top_k <= min(E, {MAX_TOP_K}) and E <= {MAX_EXPERTS}, got "
                         f"top_k={k}, E={n_exp}; use fused_backend='reference'")
    logits = torch.empty(t, n_exp, dtype=torch.float32, device=x.device)
    w = torch.empty(t, k, dtype=torch.float32, device=x.device)
    idx = torch.empty(t, k, dtype=torch.int64, device=x.device)
    block_e, block_h, warps = _gemv_blocks(t, n_exp, hidden)
    n_prog = triton.cdiv(n_exp, block_e)
    launch = pdl.args(x)
    _router_topk_kernel[(t, n_prog)](
        x, weight, logits, counters, bias, w, idx, hidden, n_exp, x.stride(0), weight.stride(0), n_prog,
        TOP_K=k, PRECISE=_precise(), BLOCK_E=block_e, BLOCK_H=block_h, BLOCK_ALL=triton.next_power_of_2(n_exp),
        BLOCK_K=triton.next_power_of_2(k), PRELOAD=router_preload(launch, block_h, hidden), num_warps=warps,
        **_opts(), **launch)
    return w, idx


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, H] -> [T, E] fp32, as reference.router_logits; one kernel for decode / verify-sized steps."""
    t, hidden = x.shape
    n_exp = weight.shape[0]
    if not _gemv_ok(x, weight):
        return _ref.router_logits(x, weight)
    out = torch.empty(t, n_exp, dtype=torch.float32, device=x.device)
    if t:
        block_e, block_h, warps = _gemv_blocks(t, n_exp, hidden)
        _router_gemv_kernel[(t, triton.cdiv(n_exp, block_e))](
            x, weight, out, hidden, n_exp, x.stride(0), weight.stride(0), out.stride(0), BLOCK_E=block_e,
            BLOCK_H=block_h, num_warps=warps, **pdl.args(x))
    return out


def route(logits: torch.Tensor, bias: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] fp32, experts [T, k] int64), as reference.route."""
    t, n_exp = logits.shape
    if not 1 <= k <= min(n_exp, MAX_TOP_K) or n_exp > MAX_EXPERTS:
        raise ValueError(f"triton route supports 1 <= top_k <= min(E, {MAX_TOP_K}) and E <= {MAX_EXPERTS}, got "
                         f"top_k={k}, E={n_exp}; use fused_backend='reference'")
    lg = logits if logits.stride(-1) == 1 else logits.contiguous()
    w = torch.empty(t, k, dtype=torch.float32, device=logits.device)
    idx = torch.empty(t, k, dtype=torch.int64, device=logits.device)
    if t:
        block_e = triton.next_power_of_2(n_exp)
        _route_kernel[(t,)](lg, bias, w, idx, n_exp, lg.stride(0), TOP_K=k, PRECISE=_precise(), BLOCK_E=block_e,
                            BLOCK_K=triton.next_power_of_2(k), num_warps=_warps(block_e), **_opts(), **pdl.args(lg))
    return w, idx


# ---- the backend object -------------------------------------------------------------------------------


def _freeze(v: Any) -> Any:
    if isinstance(v, dict):
        return tuple(sorted((k, _freeze(x)) for k, x in v.items()))
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x) for x in v)
    return v


class TritonFused:
    """The fused Triton ops. It caches RoPE inverse frequencies per (rope config, device) -- computed by
    layers.rope_inv_freq on that device, so they are the reference's exact values -- which is the only
    state it holds; each engine owns its own object."""

    name = "triton"

    def __init__(self, gemv_max_t: int | None = None) -> None:
        from m3eagle.kernels.fused import gemv

        self._gemv = gemv
        self._gemv_counters = gemv.SplitCounters()  # this engine's split-K tile counters
        self._inv_freq: dict[Any, tuple[torch.Tensor, float]] = {}
        self._counters: dict[torch.device, torch.Tensor] = {}  # route_tokens' per-token counters, per device
        # id(router weight) -> (a weak reference to it, its version, router_split of it): the tiled router's
        # parts, dropped when the weight is freed
        self._splits: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}
        # linear(): steps of up to this many rows may run `gemv.linear` instead of cuBLAS, where
        # `gemv.prefers` says it wins (0: never). None: gemv.MAX_T on CUDA, 0 elsewhere -- under the CPU
        # interpreter the kernel is a test subject (tests/test_gemv.py), not a speed-up: an engine test
        # running every projection through it took 160 s instead of ~10.
        self.gemv_max_t = gemv_max_t

    def _gemv_takes(self, x, w) -> bool:
        g = self._gemv
        most = self.gemv_max_t if self.gemv_max_t is not None else (g.MAX_T if x.is_cuda else 0)
        return x.shape[0] <= most and g.supports(x, w) and g.prefers(x.shape[0], w.shape[0], w.shape[1])

    def linear(self, x, w):
        if self._gemv_takes(x, w):
            return self._gemv.linear(x, w, counters=self._gemv_counters)
        return torch.nn.functional.linear(x, w)

    def _act_config(self, x, w):
        """The GEMV config that runs the activation in its epilogue (unsplit GEMV), else None: two launches."""
        return self._gemv.act_config(x.shape[0], w, x.dtype, x.device) if self._gemv_takes(x, w) else None

    # Where `folds` says yes, from a PDL chain of the head's layer on the H200 (benchmarks/fold_chain.py,
    # design note 51): the o_proj / gate_up fold took 11.57 -> 10.86 us per layer at T = 1 and 16.27 -> 17.73
    # at T = 4 (embedded); at T = 1 70.07 -> 69.38 us for m3-mini's 2048-wide head and 183.1 -> 190.0 us for
    # m3-8b's 4096-wide one (every program of gate_up re-reduces the row). Rows and the weight's K at most:
    FOLD_MAX_T = 1
    FOLD_MAX_K = 2048

    def fold_config(self, t: int, w: torch.Tensor):
        """The unsplit GEMV config under which `norm_linear` / `linear_add` with weight w [N, K] run t rows as
        one launch (their norm prologue / residual epilogue), or None: they run as the separate launches."""
        g = self._gemv
        most = self.gemv_max_t if self.gemv_max_t is not None else (g.MAX_T if w.is_cuda else 0)
        if not (1 <= t <= min(most, self.FOLD_MAX_T) and w.dim() == 2 and w.shape[1] <= self.FOLD_MAX_K
                and w.stride(1) == 1 and w.dtype in g.DTYPES and g.prefers(t, w.shape[0], w.shape[1])):
            return None
        return g.act_config(t, w, w.dtype, w.device)

    def folds(self, t, w):
        return self.fold_config(t, w) is not None

    def norm_linear(self, x, nw, eps, w, gemma=False, act=None):
        cfg = self.fold_config(x.shape[0], w)
        if (cfg is not None and x.dtype == nw.dtype == w.dtype and x.stride(-1) == 1 and nw.is_contiguous()
                and (act is None or cfg.block_n % 2 == 0)):
            return self._gemv.norm_linear(x, nw, eps, w, gemma, act, cfg)
        from m3eagle.kernels.fused.backend import ReferenceFused  # the separate launches, each this backend's

        return ReferenceFused.norm_linear(self, x, nw, eps, w, gemma, act)

    def linear_add(self, x, w, residual):
        cfg = self.fold_config(x.shape[0], w)
        if cfg is not None and x.dtype == w.dtype == residual.dtype and x.stride(1) == 1 and residual.stride(1) == 1:
            return self._gemv.linear_add(x, w, residual, cfg)
        return self.add_residual(self.linear(x, w), residual)

    def linear_argmax(self, x, w, offsets=None, out=None, scatter=None):
        # Unlike the norm / residual folds (note 51), this one adds no work to every program: only the last
        # program's reduction of one key per tile, in place of the argmax launch's whole walk.
        cfg = self._act_config(x, w)  # None past T = 4 or where the pick is tl.dot
        cnt = self._gemv_counters.get(x.device) if cfg is not None else None
        if cnt is not None:
            return self._gemv.linear_argmax(x, w, cnt, offsets, out, scatter, cfg)[1]
        return self.argmax(self.linear(x, w), offsets, out, scatter)

    def linear_silu_mul(self, x, w):
        if (cfg := self._act_config(x, w)) is not None:
            return self._gemv.linear_act(x, w, "silu", config=cfg)
        return silu_mul(*self.linear(x, w).chunk(2, -1))

    def linear_swiglu_oai(self, x, w, alpha, limit):
        if (cfg := self._act_config(x, w)) is not None:
            return self._gemv.linear_act(x, w, "swiglu_oai", alpha, limit, cfg)
        return swiglu_oai(self.linear(x, w), alpha, limit)

    def rms_norm(self, x, w, eps, gemma=True, out=None):
        return add_norm(x, None, w, eps, gemma=gemma, out=out)[0]

    def add_rms_norm(self, x, residual, w, eps, x2=None, x_scale=1.0, gemma=True, rows=None):
        y, r = add_norm(x, residual, w, eps, x2, x_scale, gemma, rows=rows)
        return y, r

    def rms_norm_cat(self, xs, ws, eps, out, gemma=True, ids=None):
        n = xs[-1].shape[-1]
        if (len(xs) <= NORM_CAT_MAX and out.stride(1) == 1
                and all(x.dtype == xs[0].dtype and x.shape[-1] == n and x.stride(-1) == 1 for x in xs)):
            return norm_cat(list(xs), list(ws), eps, out, gemma, ids)
        from m3eagle.kernels.fused.backend import ReferenceFused  # several launches, each this backend's add_norm

        return ReferenceFused.rms_norm_cat(self, xs, ws, eps, out, gemma, ids)

    def add_residual(self, x, residual, x2=None, x_scale=1.0, out=None):
        if out is None and residual is None and x2 is None and x_scale == 1.0:
            return x
        return add_norm(x, residual, None, 0.0, x2, x_scale, r_out=out)[1]

    def _rope_inv_freq(self, positions, rotary_dim, theta, scaling):
        from m3eagle.models.layers import rope_inv_freq  # models.layers imports this package

        key = (rotary_dim, float(theta), _freeze(scaling), positions.device)
        hit = self._inv_freq.get(key)
        if hit is None:
            hit = rope_inv_freq(rotary_dim, theta, scaling, positions.device)
            # Under CUDA-graph capture the table's kernels would only run at replay, so a table first made
            # there is used but not kept (the engine's eager warm-up steps fill the cache first).
            if positions.device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
                self._inv_freq[key] = hit
        return hit

    def rope_cos_sin(self, positions, rotary_dim, theta, dtype, scaling=None):
        inv, mscale = self._rope_inv_freq(positions, rotary_dim, theta, scaling)
        return rope_table(positions, inv, mscale, dtype)

    def rope_qkv_store(self, q, k, v, positions, rotary_dim, theta, k_pool, v_pool, slots, scaling=None):
        rope = (positions, *self._rope_inv_freq(positions, rotary_dim, theta, scaling))
        return qkv_rope_store(q, k, v, None, None, 0.0, None, None, k_pool, v_pool, slots, rope=rope)

    def qk_norm_rope(self, x, w, eps, cos, sin):
        return qkv_rope_store(x, None, None, w, None, eps, cos, sin, None, None, None)

    def qkv_rope_store(self, q, k, v, q_w, k_w, eps, cos, sin, k_pool, v_pool, slots):
        return qkv_rope_store(q, k, v, q_w, k_w, eps, cos, sin, k_pool, v_pool, slots)

    def qkv_index_rope_store(self, q, k, v, q_w, k_w, eps, cos, sin, k_pool, v_pool, slots, iq, ik, iq_w, ik_w,
                             index_rope_dim, ik_pool):
        return qkv_rope_store(q, k, v, q_w, k_w, eps, cos, sin, k_pool, v_pool, slots,
                              index=(iq, ik, iq_w, ik_w, index_rope_dim, ik_pool))

    def swiglu_oai(self, gate_up, alpha, limit):
        return swiglu_oai(gate_up, alpha, limit)

    def silu_mul(self, gate, up):
        return silu_mul(gate, up)

    def router_logits(self, x, weight):
        return router_logits(x, weight)

    def route(self, logits, bias, k):
        return route(logits, bias, k)

    def route_tokens(self, x, weight, bias, k):
        c = self._counters.get(x.device)
        if c is None:
            if x.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                # a zero-fill made during capture would run only at replay: the engine's eager warm-up
                # steps allocate the counters first; anything else takes the two-launch path here
                return route(router_logits(x, weight), bias, k)
            c = self._counters[x.device] = torch.zeros(ROUTER_GEMV_MAX_T, dtype=torch.int32, device=x.device)
        split = None
        if x.shape[0] > ROUTER_GEMV_MAX_T and _tile_ok(x, weight):
            split = self._router_split(weight)
        return route_tokens(x, weight, bias, k, c, split)

    def _router_split(self, weight: torch.Tensor) -> torch.Tensor | None:
        """router_split(weight), made once per weight (and again if it is modified in place); None while a
        CUDA graph is being captured without one (a split made then would be filled only at replay: the
        graph runner's eager warm-up of the same step makes it first)."""
        hit = self._splits.get(id(weight))
        if hit is not None and hit[0]() is weight and hit[1] == weight._version:
            return hit[2]
        if weight.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        split = router_split(weight)
        if hit is None or hit[0]() is not weight:  # drop the entry with the weight (new versions replace it)
            weakref.finalize(weight, self._splits.pop, id(weight), None)
        self._splits[id(weight)] = (weakref.ref(weight), weight._version, split)
        return split

    def positions_slots(self, kv_lens, q_lens, tok_row, tok_col, page_table, page_size):
        return step_inputs(kv_lens, q_lens, tok_row, tok_col, page_table, page_size)[2:]

    def overlap_inputs(self, input_ids, meta, row_slot, row_first, row_gather, row_num_drafts, row_correct,
                       row_chained, slot_tokens, slot_num_new, slot_dev, slot_drafts, k):
        ids, kv, pos, slots = step_inputs(meta.kv_lens, meta.q_lens, meta.tok_row, meta.tok_col, meta.page_table,
                                          meta.page_size, (input_ids, row_slot, row_first, row_gather,
                                                           row_num_drafts, row_correct, row_chained, slot_tokens,
                                                           slot_num_new, slot_dev, slot_drafts, k))
        return ids, replace(meta, kv_lens=kv, positions=pos, slot_mapping=slots)

    def sample_positions(self, row_first, row_qlen, row_num_drafts, positions, ids, k):
        return sample_positions(row_first, row_qlen, row_num_drafts, positions, ids, k)

    def commit_outputs(self, *args, tok_row=None, chain=None, pages=None):
        return commit_outputs(*args, tok_row=tok_row, chain=chain, pages=pages)

    def greedy_accept(self, greedy_tok, drafts, num_drafts):
        return greedy_accept(greedy_tok, drafts, num_drafts)

    def argmax(self, x, offsets=None, out=None, scatter=None):
        return argmax(x, offsets, out, scatter)
