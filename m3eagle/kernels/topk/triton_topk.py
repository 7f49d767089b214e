"""reference.best in one launch: the k largest of each row, ties to the lower index, optionally added to a
per-row base score and written into strided outputs (the draft tree's expansion writes its candidates straight
into the step's candidate buffer).

One program per row. Every score becomes the reference's unique int64 key (the fp32 bits mapped to an int32
that orders like the float, above M - 1 - index), so the largest keys are the answer, in order, exactly.
Each of the BLOCK lanes walks its columns keeping its own DEPTH largest keys sorted (a compare-swap chain:
no reduction inside the loop), DEPTH = min(k, columns per lane): no lane holds more than k of the answer.
Then k rounds take the largest head key over the lanes (one reduction each) and shift the winning lane's
list up. Rows up to BLOCK columns (the rerank's candidates) have DEPTH 1: k reductions of the row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3eagle.kernels import pdl
from m3eagle.kernels.pdl import pdl_wait

MAX_DEPTH = 8  # lanes keep at most this many keys: k <= 8 for rows wider than one block
# below every real key (a real key's high half is an ordered fp32, never -2^31); a constexpr, as jitted code may
# read no other global
_NONE = tl.constexpr(-9223372036854775807)


@triton.jit
def score_keys(x, cols, m, live):
    """reference.best's unique int64 keys of scores x at columns cols of an M-column row (_NONE where not
    live): the fp32 bits mapped to an int32 that orders like the float, above M - 1 - column."""
    bits = x.to(tl.float32).to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # int order == float order
    return tl.where(live, (ordered.to(tl.int64) << 32) | (m - 1 - cols).to(tl.int64), _NONE)


@triton.jit
def _insert(x, v):
    """One compare-swap of the chain: (the larger -> the slot, the smaller -> carried on)."""
    return tl.minimum(x, v), tl.maximum(x, v)


@triton.jit(do_not_specialize=["m", "inner"])
def _topk_kernel(x_ptr, add_ptr, val_ptr, idx_ptr, m, inner, sx0, sx1, sa0, sa1, sv0, sv1, si0, si1,
                 K: tl.constexpr, DEPTH: tl.constexpr, HAS_ADD: tl.constexpr, BLOCK: tl.constexpr,
                 PDL: tl.constexpr):
    """Row r = (r // inner, r % inner) of x (strides sx0, sx1; unit column stride) -> its K best: values
    (+ add[r] when HAS_ADD) at val + .. + j and indices at idx + .. + j, j = 0..K-1, best first."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    r = tl.program_id(0).to(tl.int64)
    r0, r1 = r // inner, r % inner
    row = x_ptr + r0 * sx0 + r1 * sx1
    offs = tl.arange(0, BLOCK)
    none = tl.full([BLOCK], _NONE, tl.int64)
    v0, v1, v2, v3, v4, v5, v6, v7 = none, none, none, none, none, none, none, none  # each lane's best, sorted
    for c0 in range(0, m, BLOCK):
        cols = c0 + offs
        live = cols < m
        key = score_keys(tl.load(row + cols, mask=live, other=0.0), cols, m, live)
        key, v0 = _insert(key, v0)
        if DEPTH > 1:
            key, v1 = _insert(key, v1)
        if DEPTH > 2:
            key, v2 = _insert(key, v2)
        if DEPTH > 3:
            key, v3 = _insert(key, v3)
        if DEPTH > 4:
            key, v4 = _insert(key, v4)
        if DEPTH > 5:
            key, v5 = _insert(key, v5)
        if DEPTH > 6:
            key, v6 = _insert(key, v6)
        if DEPTH > 7:
            key, v7 = _insert(key, v7)
    if HAS_ADD:
        base = tl.load(add_ptr + r0 * sa0 + r1 * sa1).to(tl.float32)
    out_v = val_ptr + r0 * sv0 + r1 * sv1
    out_i = idx_ptr + r0 * si0 + r1 * si1
    for j in tl.static_range(K):
        top = tl.max(v0, axis=0)  # keys are unique: exactly one lane holds it
        i = (m - 1) - (top & 0xFFFFFFFF)
        val = tl.load(row + i)
        if HAS_ADD:
            val = base + val.to(tl.float32)
        tl.store(out_v + j, val.to(val_ptr.dtype.element_ty))
        tl.store(out_i + j, i)
        if j + 1 < K:  # the winning lane's list moves up one
            hit = v0 == top
            v0 = tl.where(hit, v1, v0)
            if DEPTH > 1:
                v1 = tl.where(hit, v2, v1)
            if DEPTH > 2:
                v2 = tl.where(hit, v3, v2)
            if DEPTH > 3:
                v3 = tl.where(hit, v4, v3)
            if DEPTH > 4:
                v4 = tl.where(hit, v5, v4)
            if DEPTH > 5:
                v5 = tl.where(hit, v6, v5)
            if DEPTH > 6:
                v6 = tl.where(hit, v7, v6)


def _block(m: int, k: int) -> int:
    """Lanes per row: the whole row when it fits 1024 (a rerank's candidates), else 1024 (2048 past 8K columns:
    fewer steps of the loop, each a load's latency) with k <= MAX_DEPTH keys kept per lane."""
    if m <= 1024:
        return max(triton.next_power_of_2(m), 16)
    if k > MAX_DEPTH:
        raise ValueError(f"topk: k={k} > {MAX_DEPTH} needs rows of at most 1024 columns, got {m}")
    return 2048 if m > 8192 else 1024


def best(scores: torch.Tensor, k: int, add: torch.Tensor | None = None,
         out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.best (fp32 / bf16 / fp16 scores [..., M], k <= M) in one launch -> (values [..., k], indices
    [..., k] int64). With `add` [...] (the leading shape) the values are add + the k best (fp32: a child's
    cumulative score). `out` = (values, indices), each [A, I, k] for scores [A, I, M] (any leading strides,
    unit last stride), receives them in place (views into a wider buffer)."""
    m = scores.shape[-1]
    if not 1 <= k <= m:
        raise ValueError(f"topk: k={k} must be in 1..{m}")
    lead = scores.shape[:-1]
    x = scores if scores.dim() == 3 else scores.reshape(-1, 1, m) if scores.dim() != 2 else scores[:, None]
    if x.stride(-1) != 1:
        x = x.contiguous()
    a, inner = x.shape[0], x.shape[1]
    if out is None:
        dt = torch.float32 if add is not None else scores.dtype
        vals = torch.empty(a, inner, k, dtype=dt, device=scores.device)
        idx = torch.empty(a, inner, k, dtype=torch.int64, device=scores.device)
    else:
        vals, idx = out
        if vals.shape != (a, inner, k) or idx.shape != (a, inner, k) or idx.dtype != torch.int64 or \
                vals.stride(-1) != 1 or idx.stride(-1) != 1:
            raise ValueError(f"topk: out must be [{a}, {inner}, {k}] views with unit last stride (indices int64); "
                             f"got {tuple(vals.shape)}, {tuple(idx.shape)} {idx.dtype}")
    base = vals
    if add is not None:
        base = add.reshape(a, inner)
    if a * inner:
        block = _block(m, k)
        depth = min(k, triton.cdiv(m, block), MAX_DEPTH)
        _topk_kernel[(a * inner,)](x, base, vals, idx, m, inner, x.stride(0), x.stride(1),
                                   base.stride(0), base.stride(1), vals.stride(0), vals.stride(1),
                                   idx.stride(0), idx.stride(1), K=k, DEPTH=depth, HAS_ADD=add is not None,
                                   BLOCK=block, num_warps=8 if block >= 2048 else 4 if block >= 512 else 1,
                                   **pdl.args(x))
    if out is not None:
        return vals, idx
    return vals.view(*lead, k), idx.view(*lead, k)
