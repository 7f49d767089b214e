"""The batch-invariant GEMM with its neighbour folded into the store: an MLP's SwiGLU / SiLU-and-multiply
(`linear_act`) and the greedy pick (`linear_argmax`), each one launch instead of two.

At batch 1 a launch costs about as much as the bytes it moves, so the activation's own launch after every
gate_up GEMM (the dense MLPs, the shared experts, the draft head's MLP) and the argmax launch after the LM head
are worth folding -- if the fold keeps every bit. Both folds run `matmul.tile_acc`, the plain GEMM's main loop,
under the plain GEMM's `matmul_config` and `split_plan` for the same weight, so each output column is the same
chain of MMAs on the same operands as `matmul.linear` computes it (an MMA's element depends on its own row and
column only), and the split partials are summed in split order by the tile's last program (`sum_partials`):

    linear_act     x [M, K] @ gate_up [2I, K]^T ──_matmul_act_kernel──► act [M, I]
                   A program's BLOCK_N weight rows are BLOCK_N / 2 gate rows and the up rows of the same columns
                   (the weight is gate rows, then up rows), interleaved, so one MMA tile of the plain GEMM's
                   shape holds both inputs of each activation. Where the plain GEMM stores y (S = 1, or the
                   split fixup's last program) the gate and up sums are rounded to x's dtype -- y's bits -- and the
                   activation launch's own code (`activation.silu_mul_f32` / `swiglu_oai_f32`, no FMA
                   contraction) runs on them: bit-equal to `linear_act_two_launch` (linear, then the activation).
    linear_argmax  x [M, K] @ w [V, K]^T ──_matmul_argmax_kernel──► ids [M]
                   Each tile folds its rows' best (value, column) key (the decode GEMV's order: torch.argmax's
                   on the rounded logits, lowest column among equals, NaN first) into a per-row running maximum
                   with one atomic max; the last of a row block's tiles to arrive reads the maxima and zeroes
                   them. A max of exact keys is the same in any order, so the ids
                   equal `argmax.argmax(linear(x, w))` whichever tile arrives last. The logits are not stored.

Every launch-shape choice is the plain GEMM's (from the weight's shape), never the row count. A call without
counters (a CUDA graph captured before any eager call, more tiles than `matmul.MAX_TILES`) takes the two
launches, with the same bits; so does an fp32 activation fold on a GPU, where the fold's launch (compiled
without FMA contraction, for the activation's sake) would turn the fp32 dot's fused multiply-adds into separate
roundings.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3eagle.kernels import pdl
from m3eagle.kernels.batch_invariant import matmul
from m3eagle.kernels.batch_invariant.matmul import last_to_arrive, split_ordered_acc, sum_partials, tile_acc, tile_ids
from m3eagle.kernels.fused import activation
from m3eagle.kernels.fused.activation import ACTS, store_act_tile
from m3eagle.kernels.fused.argmax import argmax, argmax_outputs
from m3eagle.kernels.pdl import pdl_wait
from m3eagle.kernels.split_counters import SplitCounters
from m3eagle.kernels.triton_utils import interpreting, launch_opts, precise


@triton.jit(do_not_specialize=["M", "stride_xm", "stride_ps", "n_inner"])
def _matmul_act_kernel(X, W, Y, P, CNT, M, n_act, K, steps_per_split, n_inner, stride_xm, stride_wn, stride_ym,
                       stride_ps, stride_pm, alpha, limit, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, INNER: tl.constexpr, ACT: tl.constexpr,
                       PRECISE: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST_DOT: tl.constexpr, PDL: tl.constexpr):
    """Grid (cdiv(M, BM) * cdiv(I, BN / 2), S). x [M, K], the packed gate / up weight w [2I, K] (unit K stride),
    y [M, I] = act(x @ gate^T, x @ up^T) (ACT 1: silu(gate) * up; 2: swiglu-oai with alpha / limit). Split: each
    program stores its fp32 partial in its own lane order at P + s * stride_ps (part [S, M, BN * tiles], row
    stride stride_pm) and the tile's last program to arrive (CNT[tile], int32, zero between launches) sums them
    in split order, applies the activation and zeroes CNT[tile]. INNER (grid S = 1): the program sums the n_inner
    splits itself in the same order (`matmul.split_ordered_acc`)."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    HALF: tl.constexpr = BLOCK_N // 2
    pid = tl.program_id(0)
    pid_m, pid_n = tile_ids(pid, M, tl.cdiv(n_act, HALF), BLOCK_M)
    split = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    lane = tl.arange(0, BLOCK_N)
    cols = pid_n * HALF + lane // 2  # [BN] each lane's activation column
    col_ok = cols < n_act
    rows_w = cols + (lane % 2) * n_act  # even lanes: the gate row; odd lanes: the up row of the same column
    k0 = split * steps_per_split * BLOCK_K
    k1 = tl.minimum(k0 + steps_per_split * BLOCK_K, K)
    if INNER:
        acc = split_ordered_acc(X, W, rows_w, col_ok, offs_m, m_ok, K, steps_per_split, n_inner, stride_xm,
                                stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PREC, UPCAST_DOT)  # [BM, BN] fp32
    else:
        acc = tile_acc(X, W, rows_w, col_ok, offs_m, m_ok, k0, k1, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K,
                       DOT_PREC, UPCAST_DOT)  # [BM, BN] fp32
    if SPLIT:
        mask = m_ok[:, None] & col_ok[None, :]
        p_tile = P + offs_m[:, None].to(tl.int64) * stride_pm + (pid_n * BLOCK_N + lane)[None, :]  # in split 0
        tl.store(p_tile + split.to(tl.int64) * stride_ps, acc, mask=mask)
        n_split = tl.num_programs(1)
        if last_to_arrive(CNT + pid, n_split):
            total = sum_partials(p_tile, stride_ps, mask, n_split)  # [BM, BN] fp32
            store_act_tile(Y, total, offs_m, m_ok, pid_n, n_act, stride_ym, alpha, limit, ACT, BLOCK_M, HALF, PRECISE)
            tl.store(CNT + pid, 0)  # zero for the next launch (matmul._matmul_kernel's reset)
    else:
        store_act_tile(Y, acc, offs_m, m_ok, pid_n, n_act, stride_ym, alpha, limit, ACT, BLOCK_M, HALF, PRECISE)


INT64_MIN = tl.constexpr(-(2**63))  # a constexpr: jit code reads no plain globals


@triton.jit
def _row_keys(vals, offs_n, N, dt: tl.constexpr):
    """The best of each row of a [BM, BN] tile as an int64 key whose signed order is torch.argmax's (the decode
    GEMV's `_argmax_key`, per row): the value as stored (rounded to dt) in the high 32 bits, its bits made
    monotone (negatives' magnitude bits flipped, -0 taken as +0, every NaN above +inf), 2^31 - 1 - column in
    the low 32 bits (a tie goes to the lower column). Columns past N: INT64_MIN."""
    v = vals.to(dt).to(tl.float32)
    v = tl.where(v == 0.0, 0.0, v)
    bits = v.to(tl.int32, bitcast=True)
    hi = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    hi = tl.where(v != v, 0x7FFFFFFF, hi)
    key = (hi.to(tl.int64) << 32) | (2147483647 - offs_n).to(tl.int64)[None, :]
    key = tl.where((offs_n < N)[None, :], key, INT64_MIN)
    return tl.max(key, axis=1)  # [BM]


@triton.jit
def _argmax_tile(BEST, CNT, cnt_row, vals, offs_m, m_ok, offs_n, N, n_tiles, off_ptr, am_ptr, sc_ptr, sc_rows_ptr,
                 stride_am, stride_sc, col, dt: tl.constexpr, HAS_OFF: tl.constexpr, SCATTER: tl.constexpr):
    """A tile's values are final: fold its rows' best keys into the running maxima BEST[row] ([M] int64, zero
    between launches) with one atomic max each (idempotent, so a layout that holds a row in two threads may
    apply it twice); the row block's last tile to arrive (CNT[cnt_row]) reads each row's maximum, zeroes it,
    and stores the row's column (+ off[column]) as `argmax.argmax` does. A max of exact keys is the same in any
    order of arrival, and the block's tail is one read of its rows. The keys are stored with their sign bit
    flipped and compared unsigned, so that no key (a column past N included) is below the buffer's zero."""
    key = _row_keys(vals, offs_n, N, dt) ^ INT64_MIN  # [BM] signed order -> unsigned order; INT64_MIN -> 0
    best_ptr = BEST.to(tl.pointer_type(tl.uint64), bitcast=True) + offs_m
    tl.atomic_max(best_ptr, key.to(tl.uint64, bitcast=True), mask=m_ok, sem="relaxed", scope="gpu")
    if last_to_arrive(CNT + cnt_row, n_tiles):
        # the other tiles' atomics are visible after the counter's acquire; read them from L2 (.cg), then zero
        best = tl.load(best_ptr, mask=m_ok, other=0, cache_modifier=".cg")  # [BM] uint64
        tl.store(best_ptr, tl.zeros_like(best), mask=m_ok)
        best = best.to(tl.int64, bitcast=True) ^ INT64_MIN
        ids = (2147483647 - (best & 0xFFFFFFFF)).to(tl.int64)  # [BM]
        if HAS_OFF:
            ids += tl.load(off_ptr + ids, mask=m_ok, other=0)
        tl.store(am_ptr + offs_m.to(tl.int64) * stride_am, ids, mask=m_ok)
        if SCATTER:
            dst = tl.load(sc_rows_ptr + offs_m, mask=m_ok, other=0)
            tl.store(sc_ptr + dst * stride_sc + col, ids, mask=m_ok)
        tl.store(CNT + cnt_row, 0)  # zero for the next launch


@triton.jit(do_not_specialize=["M", "stride_xm", "stride_ps", "stride_am", "stride_sc", "col"])
def _matmul_argmax_kernel(X, W, BEST, P, CNT, M, N, K, steps_per_split, stride_xm, stride_wn, stride_ps, stride_pm,
                          off_ptr, am_ptr, sc_ptr, sc_rows_ptr, stride_am, stride_sc, col, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, HAS_OFF: tl.constexpr,
                          SCATTER: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST_DOT: tl.constexpr,
                          PDL: tl.constexpr):
    """Grid (cdiv(M, BM) * cdiv(N, BN), S): `_matmul_kernel`'s tiles of logits = x @ w^T (rounded to x's dtype,
    as `linear` stores them), then argmax per row instead of the store (`_argmax_tile`). CNT [>= tiles + row blocks] int32,
    zero between launches: CNT[tile] counts a tile's splits, CNT[tiles + row block] the row block's tiles.
    BEST [>= M] int64, zero between launches: each row's running maximum key; P the split partials [S, M, N]
    fp32."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = tile_ids(pid, M, n_tiles, BLOCK_M)
    split = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k0 = split * steps_per_split * BLOCK_K
    k1 = tl.minimum(k0 + steps_per_split * BLOCK_K, K)
    acc = tile_acc(X, W, offs_n, n_ok, offs_m, m_ok, k0, k1, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K,
                   DOT_PREC, UPCAST_DOT)  # [BM, BN] fp32
    cnt_row = tl.cdiv(M, BLOCK_M) * n_tiles + pid_m
    if SPLIT:
        mask = m_ok[:, None] & n_ok[None, :]
        p_tile = P + offs_m[:, None].to(tl.int64) * stride_pm + offs_n[None, :]  # [BM, BN], in split 0
        tl.store(p_tile + split.to(tl.int64) * stride_ps, acc, mask=mask)
        n_split = tl.num_programs(1)
        if last_to_arrive(CNT + pid, n_split):
            tl.store(CNT + pid, 0)  # this tile's splits are all in: zero for the next launch
            total = sum_partials(p_tile, stride_ps, mask, n_split)  # [BM, BN] fp32
            _argmax_tile(BEST, CNT, cnt_row, total, offs_m, m_ok, offs_n, N, n_tiles, off_ptr, am_ptr, sc_ptr,
                         sc_rows_ptr, stride_am, stride_sc, col, X.dtype.element_ty, HAS_OFF, SCATTER)
    else:
        _argmax_tile(BEST, CNT, cnt_row, acc, offs_m, m_ok, offs_n, N, n_tiles, off_ptr, am_ptr, sc_ptr,
                     sc_rows_ptr, stride_am, stride_sc, col, X.dtype.element_ty, HAS_OFF, SCATTER)


def _operands(x: torch.Tensor, w: torch.Tensor, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    if not matmul.supports(x, w):
        raise ValueError(f"{what} needs 2-D x / w of one float dtype with equal K, got x {tuple(x.shape)} "
                         f"{x.dtype}, w {tuple(w.shape)} {w.dtype}")
    return (x if x.stride(-1) == 1 else x.contiguous()), (w if w.stride(-1) == 1 else w.contiguous())


def act_folds(x: torch.Tensor) -> bool:
    """Whether `linear_act` folds for x's dtype and device: not fp32 on a GPU (the module docstring says why)."""
    return x.dtype != torch.float32 or interpreting() or x.device.type != "cuda"


def linear_act(x: torch.Tensor, w: torch.Tensor, act: str, alpha: float = 0.0, limit: float = 0.0,
               config: matmul.MatmulConfig | None = None) -> torch.Tensor:
    """act(x @ w[:I]^T, x @ w[I:]^T) -> [M, I] in x's dtype for a packed gate / up weight w [2I, K], one launch:
    "silu" silu(gate) * up (the Llama MLP), "swiglu_oai" M3's clamped (up + 1) * gate * sigmoid(alpha * gate).
    Bit-equal to `linear_act_two_launch` under the same config (`matmul_config` of w's shape unless given)."""
    x, w = _operands(x, w, "linear_act")
    if act not in ACTS:
        raise ValueError(f"linear_act: act={act!r}; choose one of {sorted(ACTS)}")
    if w.shape[0] % 2:
        raise ValueError(f"linear_act: w [{w.shape[0]}, {w.shape[1]}] must be a packed [2I, K] gate / up weight")
    m, k = x.shape
    inter = w.shape[0] // 2
    cfg = config or matmul.matmul_config(w.shape[0], k, w.dtype)  # the plain GEMM's, for the packed weight
    y = torch.empty(m, inter, dtype=x.dtype, device=x.device)  # [M, I]
    if m == 0 or inter == 0:
        return y
    splits, per_split = matmul.split_plan(k, cfg)
    half = cfg.block_n // 2
    n_tiles = triton.cdiv(inter, half)
    tiles = triton.cdiv(m, cfg.block_m) * n_tiles
    inner = splits > 1 and matmul.inner_splits(tiles)  # each program sums its tile's splits: no partials
    split = splits > 1 and not inner  # the splits run across programs, summed by each tile's last one
    cnt = matmul.tile_counters(x.device) if split and tiles <= matmul.MAX_TILES else None  # [MAX_TILES] i32
    if not act_folds(x) or (split and cnt is None):
        return linear_act_two_launch(x, w, act, alpha, limit, cfg)
    part = (torch.empty(splits, m, n_tiles * cfg.block_n, dtype=torch.float32, device=x.device) if split
            else y)  # [S, M, tiles * BN] fp32, in the programs' lane order
    _matmul_act_kernel[(tiles, splits if split else 1)](
        x, w, y, part, cnt if cnt is not None else y, m, inter, k, per_split, splits if inner else 1, x.stride(0),
        w.stride(0), y.stride(0), part.stride(0) if split else 0, part.stride(1) if split else 0, float(alpha),
        float(limit), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=split, INNER=inner,
        ACT=ACTS[act],
        PRECISE=precise(), **matmul.dot_args(x.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **launch_opts(), **pdl.args(x))
    return y


def linear_act_two_launch(x: torch.Tensor, w: torch.Tensor, act: str, alpha: float = 0.0, limit: float = 0.0,
                          config: matmul.MatmulConfig | None = None) -> torch.Tensor:
    """The unfolded form, and the reference `linear_act` is held to: `matmul.linear`, then the activation's own
    launch (`activation.silu_mul` on the gate / up halves, or `activation.swiglu_oai`)."""
    y = matmul.linear(x, w, config)  # [M, 2I]
    if act == "silu":
        return activation.silu_mul(*y.chunk(2, -1))
    return activation.swiglu_oai(y, alpha, limit)


# Rows a folded argmax keeps running maxima for (int64 each, 512 KB per device): more take the two launches.
ARGMAX_ROWS = 1 << 16
_BEST = SplitCounters(ARGMAX_ROWS, torch.int64)


def best_keys(device: torch.device | str) -> torch.Tensor | None:
    """The folded argmax's running maxima of `device` (int64 [ARGMAX_ROWS], zero between launches; made and
    shared as `matmul.tile_counters`, None inside a capture before the first eager call)."""
    return _BEST.get(device)


def linear_argmax(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, scatter: tuple[torch.Tensor, torch.Tensor, int] | None = None,
                  config: matmul.MatmulConfig | None = None) -> torch.Tensor:
    """argmax.argmax(linear(x, w), offsets, out, scatter) -> ids [M] int64 in one launch (the logits are not
    kept): x [M, K], w [V, K]. Equal to `linear_argmax_two_launch` under the same config."""
    x, w = _operands(x, w, "linear_argmax")
    m, k = x.shape
    n = w.shape[0]
    cfg = config or matmul.matmul_config(n, k, w.dtype)
    splits, per_split = matmul.split_plan(k, cfg)
    n_tiles = triton.cdiv(n, cfg.block_n)
    m_blocks = triton.cdiv(m, cfg.block_m)
    fits = m_blocks * (n_tiles + 1) <= matmul.MAX_TILES and m <= ARGMAX_ROWS
    cnt = matmul.tile_counters(x.device) if fits else None  # [MAX_TILES] int32
    best = best_keys(x.device) if fits else None  # [ARGMAX_ROWS] int64
    if cnt is None or best is None or m == 0 or n == 0:
        return linear_argmax_two_launch(x, w, offsets, out, scatter, cfg)
    out, buf, rows, col = argmax_outputs(m, x.device, out, scatter)
    part = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1 else best  # [S, M, N]
    _matmul_argmax_kernel[(m_blocks * n_tiles, splits)](
        x, w, best, part, cnt, m, n, k, per_split, x.stride(0), w.stride(0), part.stride(0) if splits > 1 else 0,
        part.stride(1) if splits > 1 else 0, offsets if offsets is not None else out, out, buf, rows,
        out.stride(0), buf.stride(0), col, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SPLIT=splits > 1, HAS_OFF=offsets is not None, SCATTER=scatter is not None, **matmul.dot_args(x.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.args(x))
    return out


def linear_argmax_two_launch(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor | None = None,
                             out: torch.Tensor | None = None,
                             scatter: tuple[torch.Tensor, torch.Tensor, int] | None = None,
                             config: matmul.MatmulConfig | None = None) -> torch.Tensor:
    """The unfolded form and `linear_argmax`'s reference: `matmul.linear`, then `argmax.argmax`'s launch."""
    return argmax(matmul.linear(x, w, config), offsets, out, scatter)
