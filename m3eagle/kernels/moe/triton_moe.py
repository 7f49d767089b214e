"""Fused routed experts from Triton kernels: only the chosen experts are computed.

    idx [T, k] ──align──► sorted_ids / block_expert / num_blocks   (align.py: by expert, padded to block_m)
    x [T, H] ──_gate_up_kernel──► act [max_blocks * block_m, I]     grouped GEMM, SwiGLU-OAI in the epilogue
    act ──_down_kernel──► contrib [T * k, H]                         grouped GEMM, times the routing weight
    contrib ──_combine_kernel──► out [T, H]                          sum over k in fp32, fixed order
                                                                   (steps of <= COMBINE_FUSE_MAX_T tokens:
                                                                   by down's last program per column tile)

`reference.experts` is the oracle; tests/kernels/test_moe_kernel.py holds these kernels equal to it. Steps of a
few tokens whose tuning entry says `direct` skip the sort and the combine (`direct.py`: two launches).

No blocking CPU operation in this path and no data-dependent shape: every buffer and grid is the static
worst case fixed by host ints (T, k, E, H, I, block_m); GEMM programs whose row block is past the device
value `num_blocks` exit at once. So a step can be captured in a CUDA graph and replayed with other routing.

Determinism: every (token, k) contribution is written once to its own row of `contrib` and the k rows are
summed in order (no float atomics), so equal inputs give bit-equal outputs.

Fused combine (decode / verify steps). A combine launch for 1-16 tokens is mostly latency (1.6 us of a ~54 us
m3-mini T = 4 layer on an H200), so there the down launch sums the rows itself: each program, after storing
its contrib tile, counts itself in (CTA barrier, then an acquire-release atomic at GPU scope on its column
tile's counter, as `fused/gemv.py`'s split-K does), and the program that completes the count -- every used
row block of that column tile is then stored and visible -- reads the tile's rows for all tokens from L2
and writes out; it zeroes the counter for the next launch / replay. The sum is `_combine_tile`, the combine
kernel's own code, so the two are bit-equal. The counters (one int32 per column tile) are the caller's:
`TritonMoE` owns a `fused/gemv.py` `SplitCounters` (the split-K GEMV's: zeroed per device on the first eager
call, since a zero-fill recorded into a CUDA graph would only run at replay), and a call without them runs
the separate combine.

Expert subset (tensor / expert parallelism): with expert_range [e0, e1) only those experts are aligned and
computed; the combine skips pairs routed elsewhere, so they contribute zero.

MXFP8 experts (`mx_fused_experts`, prompt-sized steps): the same launches with the `MX` constexpr, the weight
stacks fp8 [E, N, K] with ue8m0 scales [E, N, K / 32]; each K step loads the fp8 tile and its scale bytes and
dequantizes in registers into the activation dtype before tl.dot (`_mx_dot`, `w8a16._mx_gemm_kernel`'s tile),
exactly for bf16 / fp32. With MX off the kernels are the bf16 ones (the MX code sits under constexpr branches).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from m3eagle.kernels import pdl
from m3eagle.kernels.moe import direct, tuning
from m3eagle.kernels.moe.align import Alignment, align
from m3eagle.kernels.moe.reference import local_experts
from m3eagle.kernels.moe.tuning import MoEConfig
from m3eagle.kernels.pdl import pdl_wait
from m3eagle.kernels.quant.mxfp8 import MX_BLOCK, MxWeight
from m3eagle.kernels.quant.w8a16 import _dequant_tile, _e8m0


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs must not drop to TF32 (the oracle is exact fp32); bf16 products are exact in fp32.
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _block_coords(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Program -> (row block, column block), GROUP_M row blocks at a time so that consecutive programs
    share weight tiles in L2 (the classic grouped ordering)."""
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _expert_base(w_ptr, ws_ptr, expert, stride_we, shared_col, HAS_SHARED: tl.constexpr):
    """The weights of local expert `expert`: a slice of the stack, or the shared expert's own tensor (same
    inner strides) when it is the shared column."""
    base = w_ptr + expert * stride_we
    if HAS_SHARED:
        if expert == shared_col:
            base = ws_ptr
    return base


@triton.jit
def _valid_rows(sorted_ptr, pid_m, num_pairs, BLOCK_M: tl.constexpr):
    """How many entries of row block pid_m are pairs, not padding (the align puts them first)."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    return tl.sum((tl.load(sorted_ptr + rows) < num_pairs).to(tl.int32), axis=0)


@triton.jit
def _mx_dot(a, q_ptrs, s_ptrs, k_left, acc, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
            DOT_PREC: tl.constexpr, GROUP_SCALE: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """acc [BM, BN] + a [BM, BK] @ w^T, w [BN, BK] the fp8 tile at q_ptrs [BN, BK] times its ue8m0 scales at s_ptrs
    [BN, BK / 32] (`w8a16._mx_gemm_kernel`'s tile): dequantized in registers and rounded to a's dtype, exact for
    bf16 / fp32 (an e4m3 value times a power of two). Columns from k_left on read as zero unless EVEN_K.
    GROUP_SCALE (fp16 a, BLOCK_K == 32 and K a multiple of 32: whole steps): fp16 cannot hold every q * 2 ** e, so
    the MMA takes q (exact in fp16) and its fp32 result is scaled per column. UPCAST_DOT (the CPU interpreter,
    whose bf16 / fp16 tl.dot multiplies raw bits): the same operand values as fp32, input_precision ieee."""
    dt = a.dtype
    if GROUP_SCALE:
        q = tl.load(q_ptrs).to(dt)  # [BN, 32]
        scale = tl.trans(_e8m0(tl.load(s_ptrs)))  # [1, BN]
        if UPCAST_DOT:
            part = tl.dot(a.to(tl.float32), tl.trans(q.to(tl.float32)), input_precision="ieee")
        else:
            part = tl.dot(a, tl.trans(q))
        acc += part * scale
    else:
        k_ok = tl.arange(0, BLOCK_K)[None, :] < k_left  # K % 32 == 0: whole scale groups in or out
        g_ok = (tl.arange(0, BLOCK_K // 32) * 32)[None, :] < k_left
        w = _dequant_tile(q_ptrs, s_ptrs, k_ok, g_ok, BLOCK_N, BLOCK_K, EVEN_K).to(dt)  # [BN, BK]
        if UPCAST_DOT:
            acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PREC)
    return acc


@triton.jit
def _gate_up_tile(x_ptr, w_base, s_base, act_ptr, sorted_ptr, row0, pid_n, num_pairs, routed_pairs, hidden, inter,
                  stride_xt, stride_xh, stride_wn, stride_wh, stride_sn, stride_am, stride_ai, alpha, limit,
                  TOP_K: tl.constexpr, BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  DOT_PREC: tl.constexpr, MX: tl.constexpr, GROUP_SCALE: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """The act rows row0 .. row0 + BM - 1, columns of tile pid_n, of one expert (weights at w_base; MX: fp8 with
    their scales [2I, H / 32] at s_base, row stride stride_sn, `_mx_dot`).

    The K loop stays masked even where the shapes divide into whole tiles: unmasked loads (padding rows
    reading token 0) made this GEMM slower on the H200 (m3-mini T = 2048: 165 -> 191 us, T = 256: 76 ->
    115 us), unlike down's, whose unmasked loads pay."""
    rows = row0 + tl.arange(0, BM)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < num_pairs  # padding rows load zeros and are not stored
    token = tl.where(pair < routed_pairs, pair // TOP_K, pair - routed_pairs).to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :] * stride_xh  # [BM, BK]
    g_ptrs = w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wh  # [BK, BN]
    u_ptrs = g_ptrs + inter * stride_wn
    acc_g = tl.zeros([BM, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BM, BLOCK_N], dtype=tl.float32)
    if MX:  # [BN, BK] tiles of rows clamped into the expert (columns past inter are not stored)
        w_rows = tl.minimum(offs_n, inter - 1).to(tl.int64)
        q_ptrs = w_base + w_rows[:, None] * stride_wn + offs_k[None, :] * stride_wh  # [BN, BK]
        s_ptrs = s_base + w_rows[:, None] * stride_sn + tl.arange(0, BLOCK_K // 32)[None, :]  # [BN, BK / 32]
        for k0 in range(0, hidden, BLOCK_K):
            k_ok = offs_k < hidden - k0
            a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            acc_g = _mx_dot(a, q_ptrs, s_ptrs, hidden - k0, acc_g, BLOCK_N, BLOCK_K, False, DOT_PREC, GROUP_SCALE,
                            UPCAST_DOT)
            acc_u = _mx_dot(a, q_ptrs + inter * stride_wn, s_ptrs + inter * stride_sn, hidden - k0, acc_u, BLOCK_N,
                            BLOCK_K, False, DOT_PREC, GROUP_SCALE, UPCAST_DOT)
            a_ptrs += BLOCK_K * stride_xh
            q_ptrs += BLOCK_K * stride_wh
            s_ptrs += BLOCK_K // 32
    else:
        for k0 in range(0, hidden, BLOCK_K):
            k_ok = offs_k < hidden - k0
            a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & n_ok[None, :]
            acc_g = tl.dot(a, tl.load(g_ptrs, mask=w_mask, other=0.0), acc_g, input_precision=DOT_PREC)
            acc_u = tl.dot(a, tl.load(u_ptrs, mask=w_mask, other=0.0), acc_u, input_precision=DOT_PREC)
            a_ptrs += BLOCK_K * stride_xh
            g_ptrs += BLOCK_K * stride_wh
            u_ptrs += BLOCK_K * stride_wh

    # SwiGLU-OAI exactly as layers.swiglu_oai: gate clamped above only, up on both sides.
    gate = tl.minimum(acc_g, limit)
    up = tl.minimum(tl.maximum(acc_u, -limit), limit)
    act = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
    out_ptrs = act_ptr + rows.to(tl.int64)[:, None] * stride_am + offs_n[None, :] * stride_ai
    tl.store(out_ptrs, act.to(act_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs", "routed_pairs", "max_blocks"])
def _gate_up_kernel(x_ptr, w_ptr, ws_ptr, s_ptr, act_ptr, sorted_ptr, block_expert_ptr, num_blocks_ptr,
                    num_pairs, routed_pairs, shared_col, max_blocks, hidden, inter, s_inter, n_cols,
                    stride_xt, stride_xh, stride_we, stride_wn, stride_wh, stride_se, stride_sn, stride_am, stride_ai,
                    alpha, limit,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, DOT_PREC: tl.constexpr, HAS_SHARED: tl.constexpr,
                    SHARED_APART: tl.constexpr, SPLIT_TAIL: tl.constexpr, MX: tl.constexpr, GROUP_SCALE: tl.constexpr,
                    UPCAST_DOT: tl.constexpr, PDL: tl.constexpr):
    """act[r, n] = swiglu_oai(x[token(r)] @ [gate_n; up_n]) for the rows r of one block of one expert.

    gate_up_proj [E, 2I, H] holds gate rows 0..I-1 then up rows I..2I-1; a program computes block_n gate
    columns and the same block_n up columns, so the activation happens in registers. Pair ids from
    routed_pairs on are the shared expert's (ws_ptr [2I, H]): token = pair - routed_pairs.
    SPLIT_TAIL: a block with at most BLOCK_M / 2 pairs (an expert's last, padded block) runs a half-height
    tile -- the same rows, half the MMA work on padding. SHARED_APART: the shared expert is s_inter wide, not
    inter (same inner strides); n_cols = max(inter, s_inter) columns of tiles, a block's tiles past its
    expert's width store nothing, and the shared expert's blocks call the tile with their own width (a
    separate call keeps the routed one's argument hints). MX: w_ptr is the fp8 stack [E, 2I, H] and s_ptr its scales
    [E, 2I, H / 32] (unit stride along H / 32; no shared expert), dequantized per tile (`_mx_dot`)."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    pid_m, pid_n = _block_coords(tl.program_id(0), max_blocks, tl.cdiv(n_cols, BLOCK_N), GROUP_M)
    if pid_m >= tl.load(num_blocks_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    w_base = _expert_base(w_ptr, ws_ptr, expert, stride_we, shared_col, HAS_SHARED)
    s_base = s_ptr
    if MX:
        s_base = s_ptr + expert * stride_se
    if SHARED_APART:
        if expert == shared_col:
            if pid_n * BLOCK_N < s_inter:
                _gate_up_tile(x_ptr, w_base, s_base, act_ptr, sorted_ptr, pid_m * BLOCK_M, pid_n, num_pairs,
                              routed_pairs, hidden, s_inter, stride_xt, stride_xh, stride_wn, stride_wh, stride_sn,
                              stride_am, stride_ai, alpha, limit, TOP_K, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PREC, MX,
                              GROUP_SCALE, UPCAST_DOT)
            return
        if pid_n * BLOCK_N >= inter:
            return
    if SPLIT_TAIL and _valid_rows(sorted_ptr, pid_m, num_pairs, BLOCK_M) <= BLOCK_M // 2:
        _gate_up_tile(x_ptr, w_base, s_base, act_ptr, sorted_ptr, pid_m * BLOCK_M, pid_n, num_pairs, routed_pairs,
                      hidden, inter, stride_xt, stride_xh, stride_wn, stride_wh, stride_sn, stride_am, stride_ai, alpha,
                      limit, TOP_K, BLOCK_M // 2, BLOCK_N, BLOCK_K, DOT_PREC, MX, GROUP_SCALE, UPCAST_DOT)
    else:
        _gate_up_tile(x_ptr, w_base, s_base, act_ptr, sorted_ptr, pid_m * BLOCK_M, pid_n, num_pairs, routed_pairs,
                      hidden, inter, stride_xt, stride_xh, stride_wn, stride_wh, stride_sn, stride_am, stride_ai, alpha,
                      limit, TOP_K, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PREC, MX, GROUP_SCALE, UPCAST_DOT)


@triton.jit
def _down_tile(act_ptr, w_base, s_base, contrib_ptr, weights_ptr, sorted_ptr, row0, pid_n, num_pairs, routed_pairs,
               hidden, inter, routed_scale, stride_am, stride_ai, stride_wh, stride_wi, stride_sh, stride_cp, stride_ch,
               BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
               EVEN: tl.constexpr, MX: tl.constexpr, GROUP_SCALE: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """The contrib rows of the pairs in act rows row0 .. row0 + BM - 1, columns of tile pid_n (MX: fp8 weights
    with their scales [H, I / 32] at s_base, row stride stride_sh, `_mx_dot`).

    EVEN (the K range a multiple of BLOCK_K, hidden of BLOCK_N): whole tiles, no mask. act has every padded
    row (gate_up leaves padding rows unwritten), and an MMA row depends only on its own A row, so the
    stored rows are bit-equal to the masked loads'."""
    rows = row0 + tl.arange(0, BM)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < num_pairs

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ai  # [BM, BK]
    w_ptrs = w_base + offs_n[None, :] * stride_wh + offs_k[:, None] * stride_wi  # [BK, BN]
    acc = tl.zeros([BM, BLOCK_N], dtype=tl.float32)
    if MX:  # [BN, BK] tiles of rows clamped into H (columns past hidden are not stored)
        w_rows = tl.minimum(offs_n, hidden - 1).to(tl.int64)
        q_ptrs = w_base + w_rows[:, None] * stride_wh + offs_k[None, :] * stride_wi  # [BN, BK]
        s_ptrs = s_base + w_rows[:, None] * stride_sh + tl.arange(0, BLOCK_K // 32)[None, :]  # [BN, BK / 32]
        for k0 in range(0, inter, BLOCK_K):
            if EVEN:
                a = tl.load(a_ptrs)
            else:
                a = tl.load(a_ptrs, mask=valid[:, None] & (offs_k < inter - k0)[None, :], other=0.0)
            acc = _mx_dot(a, q_ptrs, s_ptrs, inter - k0, acc, BLOCK_N, BLOCK_K, EVEN, DOT_PREC, GROUP_SCALE,
                          UPCAST_DOT)
            a_ptrs += BLOCK_K * stride_ai
            q_ptrs += BLOCK_K * stride_wi
            s_ptrs += BLOCK_K // 32
    else:
        for k0 in range(0, inter, BLOCK_K):
            if EVEN:
                a = tl.load(a_ptrs)
                w = tl.load(w_ptrs)
            else:
                k_ok = offs_k < inter - k0
                a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(a, w, acc, input_precision=DOT_PREC)
            a_ptrs += BLOCK_K * stride_ai
            w_ptrs += BLOCK_K * stride_wi

    routed = pair < routed_pairs
    route_w = tl.load(weights_ptr + pair, mask=valid & routed, other=0.0).to(tl.float32)  # [BM]
    route_w = tl.where(routed, route_w * routed_scale, 1.0)
    out_ty = contrib_ptr.dtype.element_ty
    y = acc.to(out_ty).to(tl.float32) * route_w[:, None]
    out_ptrs = contrib_ptr + pair.to(tl.int64)[:, None] * stride_cp + offs_n[None, :] * stride_ch
    tl.store(out_ptrs, y.to(out_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs", "routed_pairs", "max_blocks", "n_tok", "e_start"])
def _down_kernel(act_ptr, w_ptr, ws_ptr, s_ptr, contrib_ptr, weights_ptr, sorted_ptr, block_expert_ptr, num_blocks_ptr,
                 idx_ptr, out_ptr, cnt_ptr,
                 num_pairs, routed_pairs, shared_col, max_blocks, hidden, inter, s_inter, routed_scale, n_tok, e_start,
                 num_local, stride_am, stride_ai, stride_we, stride_wh, stride_wi, stride_swh, stride_se, stride_sh,
                 stride_cp, stride_ch, stride_ot, stride_oh,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 DOT_PREC: tl.constexpr, HAS_SHARED: tl.constexpr, SHARED_APART: tl.constexpr,
                 SPLIT_TAIL: tl.constexpr, TOP_K: tl.constexpr, FUSE_COMBINE: tl.constexpr, T_PAD: tl.constexpr,
                 EVEN: tl.constexpr, MX: tl.constexpr, GROUP_SCALE: tl.constexpr, UPCAST_DOT: tl.constexpr,
                 PDL: tl.constexpr):
    """contrib[pair(r)] = weight(pair(r)) * (act[r] @ down_proj[e]^T) for the rows r of one block; a routed
    pair's weight is its routing weight times routed_scale, a shared-expert pair's is 1. SPLIT_TAIL as in
    `_gate_up_kernel`. FUSE_COMBINE (n_tok <= T_PAD tokens, cnt [cdiv(hidden, BLOCK_N)] int32 zero between
    launches): the last program of each column tile also writes out[:, tile] (module docstring); idx_ptr,
    out_ptr, e_start, num_local and the out strides serve only that. MX: w_ptr is the fp8 stack [E, H, I] and s_ptr
    its scales [E, H, I / 32] (unit stride along I / 32; no shared expert), as in `_gate_up_kernel`.

    The expert output is rounded to the activation dtype before the fp32 weighting, as the reference's
    per-expert einsum result is. The weighted row is stored in the activation dtype too: half the traffic
    of fp32 for a [T*k, H] buffer that prefill writes and reads once; in bf16 that is one more rounding
    per pair, below the reference's own bf16 error."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    pid_m, pid_n = _block_coords(tl.program_id(0), max_blocks, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    used_blocks = tl.load(num_blocks_ptr)
    if pid_m >= used_blocks:
        if FUSE_COMBINE:
            if (used_blocks == 0) & (pid_m == 0):  # no local pair at all (another rank's experts): out = 0,
                # as the combine would sum it; nobody else writes this column tile
                tok = tl.arange(0, T_PAD)
                offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
                tl.store(out_ptr + tok.to(tl.int64)[:, None] * stride_ot + offs[None, :] * stride_oh,
                         tl.zeros([T_PAD, BLOCK_N], dtype=out_ptr.dtype.element_ty),
                         mask=(tok < n_tok)[:, None] & (offs < hidden)[None, :])
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    w_base = _expert_base(w_ptr, ws_ptr, expert, stride_we, shared_col, HAS_SHARED)
    s_base = s_ptr
    if MX:
        s_base = s_ptr + expert * stride_se
    if SHARED_APART and expert == shared_col:  # its own K range and row stride (SHARED_APART: gate_up's)
        _down_tile(act_ptr, w_base, s_base, contrib_ptr, weights_ptr, sorted_ptr, pid_m * BLOCK_M, pid_n, num_pairs,
                   routed_pairs, hidden, s_inter, routed_scale, stride_am, stride_ai, stride_swh, stride_wi, stride_sh,
                   stride_cp, stride_ch, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PREC, EVEN, MX, GROUP_SCALE, UPCAST_DOT)
    elif SPLIT_TAIL and _valid_rows(sorted_ptr, pid_m, num_pairs, BLOCK_M) <= BLOCK_M // 2:
        _down_tile(act_ptr, w_base, s_base, contrib_ptr, weights_ptr, sorted_ptr, pid_m * BLOCK_M, pid_n, num_pairs,
                   routed_pairs, hidden, inter, routed_scale, stride_am, stride_ai, stride_wh, stride_wi, stride_sh,
                   stride_cp, stride_ch, BLOCK_M // 2, BLOCK_N, BLOCK_K, DOT_PREC, EVEN, MX, GROUP_SCALE, UPCAST_DOT)
    else:
        _down_tile(act_ptr, w_base, s_base, contrib_ptr, weights_ptr, sorted_ptr, pid_m * BLOCK_M, pid_n, num_pairs,
                   routed_pairs, hidden, inter, routed_scale, stride_am, stride_ai, stride_wh, stride_wi, stride_sh,
                   stride_cp, stride_ch, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PREC, EVEN, MX, GROUP_SCALE, UPCAST_DOT)
    if FUSE_COMBINE:
        tl.debug_barrier()  # every thread's contrib stores are issued before the release below
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == used_blocks - 1:  # every used row block of this column tile is stored: sum the tokens
            tl.store(cnt_ptr + pid_n, 0)  # zero again for the next launch / graph replay
            tok = tl.arange(0, T_PAD)  # [TP]
            offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
            ok = (tok < n_tok)[:, None] & (offs < hidden)[None, :]  # [TP, BN]
            acc = _combine_tile(contrib_ptr, idx_ptr, tok, tok < n_tok, offs, ok, e_start, num_local, routed_pairs,
                                stride_cp, stride_ch, TOP_K, HAS_SHARED, ".cg")  # other programs' rows: from L2
            tl.store(out_ptr + tok.to(tl.int64)[:, None] * stride_ot + offs[None, :] * stride_oh,
                     acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _combine_tile(contrib_ptr, idx_ptr, tok, tok_ok, offs, ok, e_start, num_local, routed_pairs, stride_cp,
                  stride_ch, TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, CACHE: tl.constexpr):
    """[TP, BN] fp32: for tokens tok [TP] (tok_ok: which are real) and columns offs [BN] (ok [TP, BN]: which
    entries are real), sum_j contrib[t*k + j] in order over the pairs whose expert is local, then the shared
    expert's row routed_pairs + t when there is one. Rows of other ranks' pairs were never written (they
    hold garbage), so they are masked out, not multiplied. The combine kernel and down's fused combine both
    sum here: bit-equal by construction."""
    t = tok.to(tl.int64)
    acc = tl.zeros(ok.shape, dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        e = tl.load(idx_ptr + t * TOP_K + j, mask=tok_ok, other=0, cache_modifier=CACHE) - e_start  # [TP]
        mine = (e >= 0) & (e < num_local)
        # tl.where, not `ok & mine`: the interpreter turns bool-vector & bool-scalar into an int mask.
        v = tl.load(contrib_ptr + (t * TOP_K + j)[:, None] * stride_cp + offs[None, :] * stride_ch,
                    mask=tl.where(mine[:, None], ok, False), other=0.0, cache_modifier=CACHE)
        acc += v.to(tl.float32)
    if HAS_SHARED:
        acc += tl.load(contrib_ptr + (routed_pairs + t)[:, None] * stride_cp + offs[None, :] * stride_ch, mask=ok,
                       other=0.0, cache_modifier=CACHE).to(tl.float32)
    return acc


@triton.jit(do_not_specialize=["routed_pairs"])
def _combine_kernel(contrib_ptr, idx_ptr, out_ptr, hidden, e_start, num_local, routed_pairs,
                    stride_cp, stride_ch, stride_ot, stride_oh,
                    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, HAS_SHARED: tl.constexpr, PDL: tl.constexpr):
    """out[t] = `_combine_tile` of token t = program_id(0), BLOCK_H columns per program."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    tok = tl.program_id(0) + tl.arange(0, 1)  # [1]
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    ok = (offs < hidden)[None, :] & (tok >= 0)[:, None]  # [1, BH]
    acc = _combine_tile(contrib_ptr, idx_ptr, tok, tok >= 0, offs, ok, e_start, num_local, routed_pairs,
                        stride_cp, stride_ch, TOP_K, HAS_SHARED, "")
    tl.store(out_ptr + tok.to(tl.int64)[:, None] * stride_ot + offs[None, :] * stride_oh,
             acc.to(out_ptr.dtype.element_ty), mask=ok)


Shared = tuple[torch.Tensor, torch.Tensor]
"""A shared expert's (gate_up_proj [2I_s, H], down_proj [H, I_s]; I_s may differ from the routed I), run as one
more expert of the grouped GEMMs."""


def _shared_problem(shared: Shared, w13: torch.Tensor, w2: torch.Tensor) -> str | None:
    """Why the sorted GEMMs cannot index this shared expert, or None: they need gate_up [2I_s, H] with the
    stacks' inner strides (I_s may differ from I) and down [H, I_s] with the stack's unit stride along I."""
    s13, s2 = shared
    if (s13.dim() != 2 or s2.dim() != 2 or s13.shape[1] != w13.shape[2] or s2.shape[0] != w2.shape[1]
            or s13.shape[0] != 2 * s2.shape[1] or s13.dtype != w13.dtype or s2.dtype != w2.dtype):
        return (f"a fused shared expert needs gate_up [2I_s, H] and down [H, I_s] of the routed experts' H and dtype: "
                f"gate_up {tuple(s13.shape)}, down {tuple(s2.shape)}, routed gate_up {tuple(w13.shape[1:])}")
    if s13.stride() != w13.stride()[1:] or s2.stride(1) != w2.stride(2):
        return "a fused shared expert needs the routed stacks' inner strides (contiguous experts)"
    return None


def _shared_weights(shared: Shared | None, w13: torch.Tensor, w2: torch.Tensor,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared expert's weights, checked against what the sorted GEMMs can index (`_shared_problem`; no
    copy is made: this runs every step), or the stacks themselves as never-read placeholders when there is
    none."""
    if shared is None:
        return w13, w2
    problem = _shared_problem(shared, w13, w2)
    if problem is not None:
        raise ValueError(problem)
    return shared


def sorted_takes_shared(w13: torch.Tensor, w2: torch.Tensor, shared: Shared) -> bool:
    """Whether the sorted grouped GEMMs can index this shared expert (shapes, dtype and inner strides only: the
    answer is the same for every step)."""
    return _shared_problem(shared, w13, w2) is None


def shared_fusable(t: int, k: int, w13: torch.Tensor, w2: torch.Tensor, shared: Shared,
                   config: MoEConfig | None = None) -> bool:
    """Whether `fused_experts(shared=...)` takes this shared expert for a step of t tokens (any width): the
    sorted GEMMs' conditions (then every path can), else the direct path's where the step's config is
    direct (its kernels index the shared expert with its own strides)."""
    if sorted_takes_shared(w13, w2, shared):
        return True
    cfg = config or tuning.get_config(t, w13.shape[0], w13.shape[2], w2.shape[2], k, w13.dtype, w13.device)
    return bool(cfg.direct) and direct.usable(w13, w2, shared)


def _mx_args(w: torch.Tensor | MxWeight, x: torch.Tensor, cfg: MoEConfig, shared: torch.Tensor | None,
             ) -> tuple[torch.Tensor, torch.Tensor, int, int, dict[str, bool]]:
    """(the weight stack the kernel reads, the scale pointer, its expert and row strides, the MX constexprs) for
    a plain stack (its own tensor as the never-read scale pointer) or an MXFP8 one (`w` [E, N, K] fp8 with
    scale [E, N, K / 32] u8, unit stride along K and K / 32; block_k a multiple of 32, 32 for fp16 x: its
    GROUP_SCALE steps are one scale group; no shared expert)."""
    if not isinstance(w, MxWeight):
        return w, w, 0, 0, {"MX": False, "GROUP_SCALE": False, "UPCAST_DOT": False}
    q, sc = w.q, w.scale
    if shared is not None:
        raise ValueError("the MXFP8 sorted MoE runs the shared expert apart (no fused shared expert)")
    if q.dtype != torch.float8_e4m3fn or sc.dtype != torch.uint8 or q.dim() != 3 \
            or tuple(sc.shape) != (*q.shape[:2], q.shape[2] // MX_BLOCK) or q.shape[2] % MX_BLOCK:
        raise ValueError(f"MXFP8 experts need q [E, N, K] float8_e4m3fn (K % {MX_BLOCK} == 0) and scale [E, N, K / "
                         f"{MX_BLOCK}] uint8: got q {q.dtype} {tuple(q.shape)}, scale {sc.dtype} {tuple(sc.shape)}")
    if q.stride(2) != 1 or sc.stride(2) != 1:
        raise ValueError(f"MXFP8 experts need unit stride along K: q {q.stride()}, scale {sc.stride()}")
    group = x.dtype == torch.float16
    if cfg.block_k % MX_BLOCK or (group and cfg.block_k != MX_BLOCK):
        raise ValueError(f"MXFP8 experts need block_k a multiple of {MX_BLOCK} ({MX_BLOCK} for fp16), got {cfg}")
    interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
    return q, sc, sc.stride(0), sc.stride(1), {"MX": True, "GROUP_SCALE": group,
                                               "UPCAST_DOT": interp and x.dtype != torch.float32}


def _split_tail(cfg: MoEConfig) -> bool:
    """Half-height tail tiles: asked for, and block_m / 2 still at least tl.dot's 16 rows."""
    return bool(cfg.split_tail) and cfg.block_m >= 32


def gate_up(x: torch.Tensor, w13: torch.Tensor | MxWeight, al: Alignment, top_k: int, alpha: float, limit: float,
            cfg: MoEConfig, shared_gate_up: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H] -> act [max_blocks * block_m, max(I, I_s)] (rows of padding entries
    unwritten; a row's columns past its expert's width too). With `shared_gate_up` [2I_s, H] (w13's inner
    strides; alignment made with shared=True) the shared expert's rows are computed too. w13 may be an MXFP8
    MxWeight (`_mx_args`), dequantized per tile into x.dtype."""
    w13, s13, stride_se, stride_sn, mx = _mx_args(w13, x, cfg, shared_gate_up)
    inter = w13.shape[1] // 2
    ws = w13 if shared_gate_up is None else shared_gate_up
    s_inter = ws.shape[-2] // 2
    n_cols = max(inter, s_inter)
    act = torch.empty(al.max_blocks * al.block_m, n_cols, dtype=x.dtype, device=x.device)
    grid = (al.max_blocks * triton.cdiv(n_cols, cfg.block_n),)
    _gate_up_kernel[grid](
        x, w13, ws, s13, act, al.sorted_ids, al.block_expert, al.num_blocks, al.num_pairs, al.routed_pairs,
        w13.shape[0], al.max_blocks,
        x.shape[1], inter, s_inter, n_cols, x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2),
        stride_se, stride_sn, act.stride(0), act.stride(1), float(alpha), float(limit),
        TOP_K=top_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        DOT_PREC=_dot_precision(x.dtype), HAS_SHARED=shared_gate_up is not None,
        SHARED_APART=shared_gate_up is not None and s_inter != inter, SPLIT_TAIL=_split_tail(cfg), **mx,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.args(x))
    return act


COMBINE_FUSE_MAX_T = 16  # steps of up to this many tokens sum in down's last programs (module docstring)


def down(act: torch.Tensor, w2: torch.Tensor | MxWeight, weights: torch.Tensor, al: Alignment, cfg: MoEConfig,
         shared_down: torch.Tensor | None = None, routed_scale: float = 1.0,
         combine_into: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int] | None = None,
         even: bool | None = None) -> torch.Tensor:
    """act [rows, max(I, I_s)], w2 [E, H, I], weights [T, k] (or flat [T*k]) -> contrib [num_pairs, H] in
    act.dtype (rows of non-local pairs unwritten): routed rows weighted by weight * routed_scale, the shared
    expert's rows (`shared_down` [H, I_s], unit stride along I_s; alignment made with shared=True) by 1.

    combine_into = (idx [T, k] contiguous, out [T, H], counters, e_start, num_local) also writes
    combine(contrib, idx, e_start, num_local, out.dtype, shared) into out, from the same launch (T <=
    COMBINE_FUSE_MAX_T, cdiv(H, block_n) <= counters.numel(); counters zero, used by one stream at a time).
    `even` forces the unmasked K loop on or off (tests); None takes it wherever I, I_s and H divide into
    whole tiles (act must then have every padded row: gate_up's buffer has). w2 may be an MXFP8 MxWeight
    (`_mx_args`)."""
    w2, s2, stride_se, stride_sh, mx = _mx_args(w2, act, cfg, shared_down)
    weights = weights.reshape(-1).float().contiguous()  # [T*k] fp32; no copy when it already is
    hidden, inter = w2.shape[1], w2.shape[2]
    ws = w2 if shared_down is None else shared_down
    s_inter, s_row = (shared_down.shape[1], shared_down.stride(0)) if shared_down is not None else (inter, w2.stride(1))
    if even is None:
        even = inter % cfg.block_k == 0 and s_inter % cfg.block_k == 0 and hidden % cfg.block_n == 0
    if even and act.shape[0] < al.max_blocks * al.block_m:
        raise ValueError(f"down: act has {act.shape[0]} rows; the unmasked loop reads all "
                         f"{al.max_blocks * al.block_m} padded rows (pass even=False)")
    contrib = torch.empty(al.num_pairs, hidden, dtype=act.dtype, device=act.device)
    n_tiles = triton.cdiv(hidden, cfg.block_n)
    grid = (al.max_blocks * n_tiles,)
    if combine_into is not None:
        idx, out, counters, e_start, num_local = combine_into
        n_tok, top_k = idx.shape
        if n_tok > COMBINE_FUSE_MAX_T or n_tiles > counters.numel() or not idx.is_contiguous():
            raise ValueError(f"fused combine: {n_tok} tokens (<= {COMBINE_FUSE_MAX_T}), {n_tiles} column tiles "
                             f"(<= {counters.numel()} counters), contiguous idx ({idx.is_contiguous()})")
    else:  # placeholders the kernel never reads (FUSE_COMBINE off)
        idx, out, counters, e_start, num_local, n_tok, top_k = weights, contrib, weights, 0, 0, 0, 1
    _down_kernel[grid](
        act, w2, ws, s2, contrib, weights, al.sorted_ids, al.block_expert, al.num_blocks, idx, out, counters,
        al.num_pairs, al.routed_pairs, w2.shape[0], al.max_blocks, hidden, inter, s_inter, float(routed_scale), n_tok,
        e_start, num_local, act.stride(0), act.stride(1), w2.stride(0), w2.stride(1), w2.stride(2), s_row, stride_se,
        stride_sh, contrib.stride(0), contrib.stride(1), out.stride(0), out.stride(1),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        DOT_PREC=_dot_precision(act.dtype), HAS_SHARED=shared_down is not None,
        SHARED_APART=shared_down is not None and s_inter != inter, SPLIT_TAIL=_split_tail(cfg), TOP_K=top_k,
        FUSE_COMBINE=combine_into is not None,
        T_PAD=max(1, triton.next_power_of_2(n_tok)), EVEN=even, **mx, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl.args(act))
    return contrib


def combine(contrib: torch.Tensor, idx: torch.Tensor, e_start: int, num_local: int, out_dtype: torch.dtype,
            shared: bool = False) -> torch.Tensor:
    """contrib [num_pairs, H], idx [T, k] -> [T, H]: the local pairs of each token (and its shared-expert
    row T*k + t when `shared`) summed in fp32."""
    t, k = idx.shape
    idx = idx.contiguous()  # the kernel reads idx[t, j] at t * k + j
    hidden = contrib.shape[1]
    out = torch.empty(t, hidden, dtype=out_dtype, device=contrib.device)
    block_h = min(1024, triton.next_power_of_2(hidden))
    _combine_kernel[(t, triton.cdiv(hidden, block_h))](
        contrib, idx, out, hidden, e_start, num_local, t * k, contrib.stride(0), contrib.stride(1),
        out.stride(0), out.stride(1), TOP_K=k, BLOCK_H=block_h, HAS_SHARED=shared, **pdl.args(contrib))
    return out


def fused_experts(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, gate_up_proj: torch.Tensor,
                  down_proj: torch.Tensor, alpha: float, limit: float,
                  expert_range: tuple[int, int] | None = None, config: MoEConfig | None = None,
                  shared: Shared | None = None, routed_scale: float = 1.0,
                  combine_counters: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `reference.experts`: x [T, H], weights [T, k] fp32, idx [T, k] -> [T, H] x.dtype.

    With `shared` (a shared expert of the routed experts' shape -- on the direct path of any width,
    `shared_fusable`; all experts, no expert_range) it returns
    routed_scale * routed + shared_expert(x) -- `SparseMoE`'s whole output -- from the same three launches.
    `config` pins the block sizes; None looks them up by (device, shape, T bucket) in the tuning table.
    `combine_counters` (zeroed int32, one per column tile: `fused/gemv.py`'s `SplitCounters`, the caller's,
    one stream at a time): steps of up to
    COMBINE_FUSE_MAX_T tokens on the sorted path sum their rows in the down launch (no combine launch)."""
    w13, w2, e0 = local_experts(gate_up_proj, down_proj, expert_range)
    t, k = idx.shape
    num_local = w13.shape[0]
    if shared is not None and expert_range is not None:
        raise ValueError("a fused shared expert needs all experts (expert_range=None): under expert "
                         "parallelism the shared expert is split by tensor parallelism instead")
    if t == 0 or (num_local == 0 and shared is None):
        return torch.zeros_like(x)
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise TypeError(f"triton MoE needs weights in the activation dtype: x is {x.dtype}, gate_up_proj "
                        f"{w13.dtype}, down_proj {w2.dtype}")
    cfg = config or tuning.get_config(t, num_local, x.shape[1], w2.shape[2], k, x.dtype, x.device)
    if cfg.direct and direct.usable(w13, w2, shared):  # few tokens: no sort, two launches (any shared width)
        return direct.direct_experts(x, weights, idx, w13, w2, e0, alpha, limit, cfg, shared, routed_scale)
    s13, s2 = _shared_weights(shared, w13, w2)
    al = align(idx, e0, num_local, cfg.block_m, shared=shared is not None)
    act = gate_up(x, w13, al, k, alpha, limit, cfg, s13 if shared is not None else None)
    dcfg = cfg.down()
    s_down = s2 if shared is not None else None
    if (combine_counters is not None and t <= COMBINE_FUSE_MAX_T
            and triton.cdiv(w2.shape[1], dcfg.block_n) <= combine_counters.numel()):
        out = torch.empty(t, x.shape[1], dtype=x.dtype, device=x.device)
        down(act, w2, weights, al, dcfg, s_down, routed_scale, (idx.contiguous(), out, combine_counters, e0, num_local))
        return out
    contrib = down(act, w2, weights, al, dcfg, s_down, routed_scale)
    return combine(contrib, idx, e0, num_local, x.dtype, shared is not None)


def mx_fused_experts(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, gate_up_proj: MxWeight,
                     down_proj: MxWeight, alpha: float, limit: float, expert_range: tuple[int, int] | None = None,
                     config: MoEConfig | None = None, combine_counters: torch.Tensor | None = None) -> torch.Tensor:
    """`fused_experts` for MXFP8 experts (prompt-sized steps; `w8a16.mx_moe_experts` is the decode path):
    x [T, H] bf16 / fp16 / fp32, weights [T, k] fp32, idx [T, k], gate_up_proj MxWeight(q [E, 2I, H] fp8,
    scale [E, 2I, H / 32] u8), down_proj MxWeight(q [E, H, I], scale [E, H, I / 32]) -> [T, H] x.dtype.

    = `reference.experts` on the dequantized weights, rounded as `fused_experts` rounds: the same sort, grouped
    GEMMs (each weight tile dequantized in registers, exactly) and combine. No shared expert (MXFP8 layers run
    it apart). `config` pins the blocks (block_k a multiple of 32; 32 for fp16 x); None takes
    `tuning.mx_config`'s rule. `combine_counters` as in `fused_experts`."""
    if not (isinstance(gate_up_proj, MxWeight) and isinstance(down_proj, MxWeight)):
        raise TypeError("mx_fused_experts: gate_up_proj and down_proj must both be MxWeights")
    q13, q2, e0 = local_experts(gate_up_proj.q, down_proj.q, expert_range)
    s13, s2, _ = local_experts(gate_up_proj.scale, down_proj.scale, expert_range)
    num_local, two_i, hidden = q13.shape
    if two_i % 2 or tuple(q2.shape) != (num_local, hidden, two_i // 2):
        raise ValueError(f"MXFP8 experts: gate_up q {tuple(q13.shape)} must be [E, 2I, H] and down q "
                         f"{tuple(q2.shape)} [E, H, I] of the same E, H, I")
    if x.dim() != 2 or x.shape[1] != hidden or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"MXFP8 experts: x must be bf16 / fp16 / fp32 [T, {hidden}], got {x.dtype} {tuple(x.shape)}")
    t, k = idx.shape
    if t == 0 or num_local == 0:
        return torch.zeros_like(x)
    cfg = config or tuning.mx_config(t, num_local, k, x.dtype)
    al = align(idx, e0, num_local, cfg.block_m)
    act = gate_up(x, MxWeight(q13, s13), al, k, alpha, limit, cfg)
    dcfg = cfg.down()
    w2 = MxWeight(q2, s2)
    if (combine_counters is not None and t <= COMBINE_FUSE_MAX_T
            and triton.cdiv(hidden, dcfg.block_n) <= combine_counters.numel()):
        out = torch.empty(t, hidden, dtype=x.dtype, device=x.device)
        down(act, w2, weights, al, dcfg, combine_into=(idx.contiguous(), out, combine_counters, e0, num_local))
        return out
    contrib = down(act, w2, weights, al, dcfg)
    return combine(contrib, idx, e0, num_local, x.dtype)
