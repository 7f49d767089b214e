"""RoPE: the cos/sin table of a step's positions, and per-head q/k norm + partial NeoX RoPE + K/V (and MSA
index-K) cache writes, one launch per attention layer.

    kernel              replaces (reference.py)                        bf16 launches before -> after
    _rope_table_kernel  rope_cos_sin (positions -> cos, sin)            12 -> 1 (inv_freq cached)
    _qkv_rope_kernel    q/k norm + partial NeoX RoPE + K/V cache writes 34 -> 1 (indexer: 33 -> 1; the
                        table computed in it for a layer that is its only reader: + the table's 1 -> 0)

Launchers read shapes and strides only (no host sync): CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3eagle.kernels import pdl
from m3eagle.kernels.pdl import pdl_wait
from m3eagle.kernels.triton_utils import cos_precise, launch_opts, precise, rsqrt_precise, sin_precise, warps_for


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
    c = cos_precise(ang, PRECISE)
    s = sin_precise(ang, PRECISE)
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
        c = cos_precise(ang, PRECISE)
        s = sin_precise(ang, PRECISE)
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
        rstd = rsqrt_precise(tl.sum(x * x, axis=1) / dim + eps, PRECISE)[:, None]  # [BH, 1]
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
                                            HAS_MSCALE=mscale != 1.0, PRECISE=precise(), BLOCK_R=block,
                                            num_warps=1, **launch_opts(), **pdl.args(pos))
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
        TABLE=rope is None, HAS_MSCALE=mscale != 1.0, PRECISE=precise(), BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=warps_for(block_h * block_d), **launch_opts(), **pdl.args(q))
    return q_out if index is None else (q_out, iq_out)


