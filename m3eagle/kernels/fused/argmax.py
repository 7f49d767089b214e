"""Greedy picks in one launch: the first index of each row's maximum (torch.argmax's rule, NaN first), with the
draft head's draft -> target id map and the draft loop's slot-buffer write folded in (1-4 launches -> 1, no
fp32 copy of bf16 logits). `argmax_outputs` is shared with the GEMV's ARGMAX epilogue (gemv.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3eagle.kernels import pdl
from m3eagle.kernels.pdl import pdl_wait


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


