"""The batch-invariant GEMM: y = x @ w^T with one tile configuration per weight shape, whatever the row count.

A row's bits depend on the order its K products are summed in and on the MMA instruction that sums them.
cuBLAS and the decode GEMV pick both from the row count (tile shapes, split-K, GEMV vs `tl.dot`), so a row
alone and the same row among 63 others round differently. Here `matmul_config(n, k, dtype)` -- a pure
function of one row's work, never of M -- fixes BLOCK_M / BLOCK_N / BLOCK_K, the warps and the K split:

    x [M, K] ──_matmul_kernel──► part [S, M, N] fp32   grid (cdiv(M, BM) * cdiv(N, BN), S): split s sums
                                                        its K range in BLOCK_K steps, in order
    part ──_split_sum_kernel──► y [M, N]                the S partials summed in split order (S > 1 only)

Each output element is then the same chain of MMAs on the same operands at every M, its row's position in
the M tile included (an MMA's element is a function of its own row and column). The split count is fixed per
(N, K) so decode-sized steps still spread a weight over enough programs to stream it; it never changes
with the batch. `reference_linear` (F.linear) is the oracle; tests hold the kernel to it and to itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from m3eagle.kernels import pdl
from m3eagle.kernels.pdl import pdl_wait
from m3eagle.kernels.triton_utils import interpreting

# Programs one row block should occupy to stream a weight near copy bandwidth (about two waves of an H100's
# 132 SMs).
TARGET_PROGRAMS = 256
# A K split must keep at least this many K steps: shorter ones add partial traffic for little parallelism.
MIN_K_STEPS_PER_SPLIT = 4
MAX_SPLITS = 8


@dataclass(frozen=True)
class MatmulConfig:
    """Launch shape of `_matmul_kernel`; `matmul_config` makes it from (N, K, dtype) only."""

    block_m: int
    block_n: int
    block_k: int
    splits: int  # K splits, each a contiguous run of whole BLOCK_K steps
    num_warps: int
    num_stages: int


def matmul_config(n: int, k: int, dtype: torch.dtype) -> MatmulConfig:
    """The configuration for every GEMM with weight [n, k] in `dtype`, at every row count.

    64-row tiles keep the MMA on Hopper's warpgroup instruction for every M (a 16-row tile would switch the
    instruction, and with it the in-MMA summation, between decode and prompt steps). 64 x 128 weight tiles
    stream a weight fastest at decode on an H100 among the row-invariant 64-row configurations
    (benchmarks/batch_invariant_gemm.py: 35-50% below 32-column tiles at T = 1, and faster at prompt size);
    a K split in runs of at least MIN_K_STEPS_PER_SPLIT steps then gives a decode step ~TARGET_PROGRAMS
    programs streaming. A weight wide enough to fill them unsplit (an LM head) keeps 64-deep K tiles: more
    programs stay resident, and it streams faster than with 128."""
    if dtype == torch.float32:  # fp32 (the CPU / interpreter path): smaller tiles keep registers in bounds
        block_m, block_n, block_k = 32, 32, 32
    else:
        block_m, block_n = 64, 64
        block_k = 64 if -(-n // block_n) >= TARGET_PROGRAMS else 128
    steps = -(-k // block_k)
    tiles = -(-n // block_n)
    splits = 1
    while (splits * 2 <= MAX_SPLITS and tiles * splits < TARGET_PROGRAMS
           and steps // (splits * 2) >= MIN_K_STEPS_PER_SPLIT):
        splits *= 2
    return MatmulConfig(block_m, block_n, block_k, splits, num_warps=4, num_stages=3)


# The row count is not a specialisation key: a new M must not compile a new variant (and it must not change
# the code a row runs: the launch shape above never reads it).
@triton.jit(do_not_specialize=["M", "stride_xm", "stride_ps"])
def _matmul_kernel(X, W, Y, M, N, K, steps_per_split,
                   stride_xm, stride_wn, stride_ym, stride_ps, stride_pm,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                   DOT_PREC: tl.constexpr, UPCAST_DOT: tl.constexpr, PDL: tl.constexpr):
    """Grid (cdiv(M, BM) * cdiv(N, BN), splits). x [M, K] and w [N, K] with unit K stride. Unsplit: y [M, N]
    in Y's dtype; split: fp32 partials at Y + s * stride_ps."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid_m = pid // n_tiles
    pid_n = pid % n_tiles
    split = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    k0 = split * steps_per_split * BLOCK_K
    k1 = tl.minimum(k0 + steps_per_split * BLOCK_K, K)
    x_ptrs = X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kk in range(k0, k1, BLOCK_K):
        k_ok = (kk + offs_k) < k1
        a = tl.load(x_ptrs + kk, mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        b = tl.load(w_ptrs + kk, mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [BN, BK]
        if UPCAST_DOT:  # the interpreter's bf16 dot multiplies raw bits: give it the same values in fp32
            acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PREC)
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT:
        ptr = Y + split.to(tl.int64) * stride_ps + offs_m[:, None].to(tl.int64) * stride_pm + offs_n[None, :]
        tl.store(ptr, acc, mask=mask)
    else:
        ptr = Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
        tl.store(ptr, acc.to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["numel", "stride_ps"])
def _split_sum_kernel(P, Y, numel, stride_ps, SPLITS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """y[i] = sum_s part[s, i], s = 0, 1, ... in order (fp32), rounded once to Y's dtype. P / Y contiguous."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    acc = tl.load(P + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(P + s * stride_ps + offs, mask=ok, other=0.0)
    tl.store(Y + offs, acc.to(Y.dtype.element_ty), mask=ok)


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 must not drop to TF32; bf16 / fp16 products are exact in fp32 either way.
    return "ieee" if dtype == torch.float32 else "tf32"


def supports(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Plain 2-D operands of one float dtype (MXFP8 weights are refused by the deterministic mode itself)."""
    return (x.dim() == 2 and w.dim() == 2 and x.dtype == w.dtype
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and x.shape[1] == w.shape[1])


def linear(x: torch.Tensor, w: torch.Tensor, config: MatmulConfig | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N] in x's dtype, each row's bits independent of M and of the other rows.
    `config` exists for tests (a mutated, M-dependent choice); the engine always takes `matmul_config`."""
    if not supports(x, w):
        raise ValueError(f"batch-invariant linear needs 2-D x / w of one float dtype with equal K, got "
                         f"x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    m, k = x.shape
    n = w.shape[0]
    cfg = config or matmul_config(n, k, w.dtype)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    steps = -(-k // cfg.block_k)
    splits = max(1, min(cfg.splits, steps))
    per_split = -(-steps // splits)
    splits = -(-steps // per_split)  # no empty split
    part = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1 else y
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), splits)
    _matmul_kernel[grid](
        x, w, part, m, n, k, per_split, x.stride(0), w.stride(0), y.stride(0),
        part.stride(0) if splits > 1 else 0, part.stride(1) if splits > 1 else 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=splits > 1,
        DOT_PREC=_dot_precision(x.dtype), UPCAST_DOT=interpreting() and x.dtype != torch.float32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.args(x))
    if splits > 1:
        block = 1024
        _split_sum_kernel[(triton.cdiv(m * n, block),)](part, y, m * n, part.stride(0), SPLITS=splits, BLOCK=block,
                                                       num_warps=4, **pdl.args(x))
    return y


def reference_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The oracle: F.linear (it may sum in another order; tests compare within rounding)."""
    return torch.nn.functional.linear(x, w)
