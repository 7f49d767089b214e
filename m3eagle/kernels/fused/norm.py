"""Residual add + RMSNorm (Gemma or Llama) in one launch, and 2-3 RMSNorms written side by side into one row
(the Eagle3 head's inputs, with the embedding lookup folded in).

    kernel              replaces (reference.py)                        bf16 launches before -> after
    _add_norm_kernel    residual add(s) + RMSNorm                       10-13 -> 1 (+ a row gather: the
                        embedding lookup, the sampled / last-accepted rows -> 0)
    _norm_cat_kernel    2-3 RMSNorms into one row (+ embedding lookup)  2-3 fused launches (+ a gather) -> 1

`rms_rstd` / `rms_scale` are also the decode GEMV's NORM prologue (gemv.py), so both round alike by
construction. Launchers read shapes and strides only (no host sync): CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3eagle.kernels import pdl
from m3eagle.kernels.pdl import pdl_wait
from m3eagle.kernels.triton_utils import as_rows, launch_opts, precise, rsqrt_precise, warps_for


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
    return rsqrt_precise(tl.sum(r * r, axis=0) / n + eps, PRECISE)


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


# Warps of `_add_norm_kernel` by row width (BLOCK), where measured to beat `warps_for` (one program per row: at
# decode its latency is the cost). On an H200, bit-equal at every count: 4096-wide rows take 1.98 us with 8 warps
# instead of 2.31 with 4 at T = 1 (2.00 vs 2.39 at T = 4); 2048-wide rows 1.68 vs 1.79 us at T = 4.
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
    xr = as_rows(x)
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
        res = as_rows(residual) if has_res else xr
        x2r = as_rows(x2) if has_x2 else xr
        yy = y if y is not None else xr  # placeholders for absent tensors are never read or written
        _add_norm_kernel[(shape[0],)](
            xr, x2r, res, w if w is not None else xr, yy, r, rows.contiguous() if rows is not None else xr, n,
            float(x_scale), float(eps), xr.stride(0), x2r.stride(0), res.stride(0), yy.stride(0), r.stride(0),
            HAS_SCALE=has_scale, HAS_X2=has_x2, HAS_RES=has_res, WRITE_R=write_r, NORM=w is not None,
            GEMMA=gemma, ROWS=rows is not None, PRECISE=precise(), BLOCK=block,
            num_warps=ADD_NORM_WARPS.get(block, warps_for(block)), **launch_opts(), **pdl.args(xr))
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
        xr = [xs[0]] + [as_rows(x) for x in xs[1:]] if ids is not None else [as_rows(x) for x in xs]
        xr += [xr[0]] * (NORM_CAT_MAX - g)
        wr = list(ws) + [ws[0]] * (NORM_CAT_MAX - g)
        block = triton.next_power_of_2(n)
        _norm_cat_kernel[(t, g)](
            xr[0], xr[1], xr[2], wr[0], wr[1], wr[2], ids.contiguous() if ids is not None else xr[0], out, n, float(eps),
            xr[0].stride(0), xr[1].stride(0), xr[2].stride(0), out.stride(0), GATHER=ids is not None,
            GEMMA=gemma, PRECISE=precise(), BLOCK=block, num_warps=ADD_NORM_WARPS.get(block, warps_for(block)),
            **launch_opts(), **pdl.args(out))
    return out


