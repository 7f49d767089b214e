"""Fused routed experts from Triton kernels: only the chosen experts are computed.

    idx [T, k] ──align──► sorted_ids / block_expert / num_blocks   (align.py: by expert, padded to block_m)
    x [T, H] ──_gate_up_kernel──► act [max_blocks * block_m, I]     grouped GEMM, SwiGLU-OAI in the epilogue
    act ──_down_kernel──► contrib [T * k, H]                         grouped GEMM, times the routing weight
    contrib ──_combine_kernel──► out [T, H]                          sum over k in fp32, fixed order

`reference.experts` is the oracle; tests/test_moe_kernel.py holds these kernels equal to it.

No blocking CPU operation in this path and no data-dependent shape: every buffer and grid is the static
worst case fixed by host ints (T, k, E, H, I, block_m); GEMM programs whose row block is past the device
value `num_blocks` exit at once. So a step can be captured in a CUDA graph and replayed with other routing.

Determinism: every (token, k) contribution is written once to its own row of `contrib` and the k rows are
summed in order (no float atomics), so equal inputs give bit-equal outputs.

Expert subset (tensor / expert parallelism): with expert_range [e0, e1) only those experts are aligned and
computed; the combine skips pairs routed elsewhere, so they contribute zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fused.triton_fused import _route_row
from . import tuning
from .align import Alignment, _align_all, align, empty_alignment
from .reference import local_experts
from .tuning import MoEConfig


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


@triton.jit(do_not_specialize=["num_pairs", "routed_pairs", "max_blocks"])
def _gate_up_kernel(x_ptr, w_ptr, ws_ptr, act_ptr, sorted_ptr, block_expert_ptr, num_blocks_ptr,
                    num_pairs, routed_pairs, shared_col, max_blocks, hidden, inter,
                    stride_xt, stride_xh, stride_we, stride_wn, stride_wh, stride_am, stride_ai,
                    alpha, limit,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, DOT_PREC: tl.constexpr, HAS_SHARED: tl.constexpr):
    """act[r, n] = swiglu_oai(x[token(r)] @ [gate_n; up_n]) for the rows r of one block of one expert.

    gate_up_proj [E, 2I, H] holds gate rows 0..I-1 then up rows I..2I-1; a program computes block_n gate
    columns and the same block_n up columns, so the activation happens in registers. Pair ids from
    routed_pairs on are the shared expert's (ws_ptr [2I, H]): token = pair - routed_pairs."""
    pid_m, pid_n = _block_coords(tl.program_id(0), max_blocks, tl.cdiv(inter, BLOCK_N), GROUP_M)
    if pid_m >= tl.load(num_blocks_ptr):
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < num_pairs  # padding rows load zeros and are not stored
    token = tl.where(pair < routed_pairs, pair // TOP_K, pair - routed_pairs).to(tl.int64)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    w_base = _expert_base(w_ptr, ws_ptr, expert, stride_we, shared_col, HAS_SHARED)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :] * stride_xh  # [BM, BK]
    g_ptrs = w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wh  # [BK, BN]
    u_ptrs = g_ptrs + inter * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
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


@triton.jit(do_not_specialize=["num_pairs", "routed_pairs", "max_blocks", "e_start"])
def _down_kernel(act_ptr, w_ptr, ws_ptr, contrib_ptr, weights_ptr, sorted_ptr, block_expert_ptr, num_blocks_ptr,
                 num_pairs, routed_pairs, shared_col, max_blocks, hidden, inter, routed_scale,
                 stride_am, stride_ai, stride_we, stride_wh, stride_wi, stride_cp, stride_ch,
                 out_ptr, cnt_ptr, idx_ptr, e_start, num_local, stride_ot, stride_oh,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 DOT_PREC: tl.constexpr, HAS_SHARED: tl.constexpr, TOP_K: tl.constexpr,
                 FUSE_COMBINE: tl.constexpr):
    """contrib[pair(r)] = weight(pair(r)) * (act[r] @ down_proj[e]^T) for the rows r of one block; a routed
    pair's weight is its routing weight times routed_scale, a shared-expert pair's is 1.

    The expert output is rounded to the activation dtype before the fp32 weighting, as the reference's
    per-expert einsum result is. The weighted row is stored in the activation dtype too: half the traffic
    of fp32 for a [T*k, H] buffer that prefill writes and reads once; in bf16 that is one more rounding
    per pair, below the reference's own bf16 error.

    FUSE_COMBINE (decode / verify-sized steps): `_combine_kernel`'s work done here, saving its launch. Per
    (token, column block) an int32 counter at cnt_ptr counts the token's pairs stored so far: after its
    stores a program waits for all of its threads (a CTA barrier) and adds 1 per valid row with
    acquire-release semantics at GPU scope; the program that stores a token's last local pair sums that
    token's rows in the combine's order (loaded from L2: other programs wrote them) into out_ptr and
    resets the counter. Same values, same order as the combine: bit-equal to it, no float atomics."""
    pid_m, pid_n = _block_coords(tl.program_id(0), max_blocks, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    if pid_m >= tl.load(num_blocks_ptr):
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < num_pairs
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    w_base = _expert_base(w_ptr, ws_ptr, expert, stride_we, shared_col, HAS_SHARED)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ai  # [BM, BK]
    w_ptrs = w_base + offs_n[None, :] * stride_wh + offs_k[:, None] * stride_wi  # [BK, BN]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
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
    if FUSE_COMBINE:
        # A block's rows are pairs of one expert, so no two valid rows share a token.
        token = tl.where(routed, pair // TOP_K, pair - routed_pairs).to(tl.int64)  # [BM]
        need = tl.zeros([BLOCK_M], dtype=tl.int32) + HAS_SHARED  # the token's local pairs
        for j in tl.static_range(TOP_K):
            ej = tl.load(idx_ptr + token * TOP_K + j, mask=valid, other=-1) - e_start
            need += ((ej >= 0) & (ej < num_local)).to(tl.int32)
        cnt = cnt_ptr + token * tl.cdiv(hidden, BLOCK_N) + pid_n  # [BM]: (token, column block)
        tl.debug_barrier()
        old = tl.atomic_add(cnt, tl.full([BLOCK_M], 1, tl.int32), mask=valid, sem="acq_rel", scope="gpu")
        last = valid & (old == need - 1)
        tl.debug_barrier()
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            ej = tl.load(idx_ptr + token * TOP_K + j, mask=last, other=-1) - e_start
            mine = last & (ej >= 0) & (ej < num_local)
            v = tl.load(contrib_ptr + (token * TOP_K + j)[:, None] * stride_cp + offs_n[None, :] * stride_ch,
                        mask=mine[:, None] & n_ok[None, :], other=0.0, cache_modifier=".cg")
            acc += v.to(tl.float32)
        if HAS_SHARED:
            acc += tl.load(contrib_ptr + (routed_pairs + token)[:, None] * stride_cp + offs_n[None, :] * stride_ch,
                           mask=last[:, None] & n_ok[None, :], other=0.0, cache_modifier=".cg").to(tl.float32)
        tl.store(out_ptr + token[:, None] * stride_ot + offs_n[None, :] * stride_oh,
                 acc.to(out_ptr.dtype.element_ty), mask=last[:, None] & n_ok[None, :])
        tl.store(cnt, tl.zeros([BLOCK_M], dtype=tl.int32), mask=last)


@triton.jit(do_not_specialize=["routed_pairs"])
def _combine_kernel(contrib_ptr, idx_ptr, out_ptr, hidden, e_start, num_local, routed_pairs,
                    stride_cp, stride_ch, stride_ot, stride_oh,
                    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, HAS_SHARED: tl.constexpr):
    """out[t] = sum_j contrib[t*k + j] in fp32, j in order, over the pairs whose expert is local, then the
    shared expert's row routed_pairs + t when there is one. Rows of other ranks' pairs were never written
    (they hold garbage), so they are masked out, not multiplied."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = offs < hidden
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        e = tl.load(idx_ptr + t * TOP_K + j) - e_start
        mine = (e >= 0) & (e < num_local)
        # tl.where, not `ok & mine`: the interpreter turns bool-vector & bool-scalar into an int mask.
        v = tl.load(contrib_ptr + (t * TOP_K + j) * stride_cp + offs * stride_ch, mask=tl.where(mine, ok, False),
                    other=0.0)
        acc += v.to(tl.float32)
    if HAS_SHARED:
        acc += tl.load(contrib_ptr + (routed_pairs + t) * stride_cp + offs * stride_ch, mask=ok,
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs * stride_oh, acc.to(out_ptr.dtype.element_ty), mask=ok)


Shared = tuple[torch.Tensor, torch.Tensor]
"""A shared expert's (gate_up_proj [2I, H], down_proj [H, I]), run as one more expert of the grouped GEMMs."""


def _shared_weights(shared: Shared | None, w13: torch.Tensor, w2: torch.Tensor,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared expert's weights, checked to have the stacks' inner layout (the kernels index both with one
    set of strides; no copy is made: this runs every step), or the stacks themselves as never-read
    placeholders when there is none."""
    if shared is None:
        return w13, w2
    s13, s2 = shared
    if s13.shape != w13.shape[1:] or s2.shape != w2.shape[1:] or s13.dtype != w13.dtype or s2.dtype != w2.dtype:
        raise ValueError(f"a fused shared expert needs the routed experts' shape and dtype: gate_up {tuple(s13.shape)} "
                         f"vs {tuple(w13.shape[1:])}, down {tuple(s2.shape)} vs {tuple(w2.shape[1:])}")
    if s13.stride() != w13.stride()[1:] or s2.stride() != w2.stride()[1:]:
        raise ValueError("a fused shared expert needs the routed stacks' inner strides (contiguous experts)")
    return s13, s2


def gate_up(x: torch.Tensor, w13: torch.Tensor, al: Alignment, top_k: int, alpha: float, limit: float,
            cfg: MoEConfig, shared_gate_up: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H] -> act [max_blocks * block_m, I] (rows of padding entries unwritten).
    With `shared_gate_up` [2I, H] (w13's inner strides; alignment made with shared=True) the shared
    expert's rows are computed too."""
    inter = w13.shape[1] // 2
    ws = w13 if shared_gate_up is None else shared_gate_up
    act = torch.empty(al.max_blocks * al.block_m, inter, dtype=x.dtype, device=x.device)
    grid = (al.max_blocks * triton.cdiv(inter, cfg.block_n),)
    _gate_up_kernel[grid](
        x, w13, ws, act, al.sorted_ids, al.block_expert, al.num_blocks, al.num_pairs, al.routed_pairs,
        w13.shape[0], al.max_blocks,
        x.shape[1], inter, x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2),
        act.stride(0), act.stride(1), float(alpha), float(limit),
        TOP_K=top_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        DOT_PREC=_dot_precision(x.dtype), HAS_SHARED=shared_gate_up is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return act


def down(act: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, al: Alignment, cfg: MoEConfig,
         shared_down: torch.Tensor | None = None, routed_scale: float = 1.0,
         combine_into: tuple[torch.Tensor, int, int, torch.Tensor, bool] | None = None) -> torch.Tensor:
    """act [rows, I], w2 [E, H, I], weights [T, k] (or flat [T*k]) -> contrib [num_pairs, H] in act.dtype
    (rows of non-local pairs unwritten): routed rows weighted by weight * routed_scale, the shared expert's
    rows (`shared_down` [H, I], alignment made with shared=True) by 1.

    combine_into (idx [T, k], e_start, num_local, counters, some_tokens_idle): also do `combine` in the same
    launch and return its [T, H] result instead. counters: int32, >= T * ceil(H / block_n) entries, zero
    between launches (each launch leaves them zero), used by one stream at a time. some_tokens_idle: a
    token may have no local pair (an expert subset, no shared expert): no program would write its row, so
    the output starts zeroed."""
    weights = weights.reshape(-1).float().contiguous()  # [T*k] fp32; no copy when it already is
    hidden, inter = w2.shape[1], w2.shape[2]
    ws = w2 if shared_down is None else shared_down
    contrib = torch.empty(al.num_pairs, hidden, dtype=act.dtype, device=act.device)
    grid = (al.max_blocks * triton.cdiv(hidden, cfg.block_n),)
    if combine_into is None:
        idx, e_start, num_local, cnt, out, top_k = weights, 0, 0, weights, contrib, 1  # unread placeholders
    else:
        idx, e_start, num_local, cnt, some_idle = combine_into
        top_k = idx.shape[1]
        idx = idx.contiguous()
        out = (torch.zeros if some_idle else torch.empty)(idx.shape[0], hidden, dtype=act.dtype, device=act.device)
    _down_kernel[grid](
        act, w2, ws, contrib, weights, al.sorted_ids, al.block_expert, al.num_blocks, al.num_pairs,
        al.routed_pairs, w2.shape[0], al.max_blocks, hidden, inter, float(routed_scale),
        act.stride(0), act.stride(1), w2.stride(0), w2.stride(1), w2.stride(2),
        contrib.stride(0), contrib.stride(1), out, cnt, idx, e_start, num_local, out.stride(0), out.stride(1),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        DOT_PREC=_dot_precision(act.dtype), HAS_SHARED=shared_down is not None, TOP_K=top_k,
        FUSE_COMBINE=combine_into is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return contrib if combine_into is None else out


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
        out.stride(0), out.stride(1), TOP_K=k, BLOCK_H=block_h, HAS_SHARED=shared)
    return out


def fused_experts(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, gate_up_proj: torch.Tensor,
                  down_proj: torch.Tensor, alpha: float, limit: float,
                  expert_range: tuple[int, int] | None = None, config: MoEConfig | None = None,
                  shared: Shared | None = None, routed_scale: float = 1.0,
                  counters: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `reference.experts`: x [T, H], weights [T, k] fp32, idx [T, k] -> [T, H] x.dtype.

    With `shared` (a shared expert of the routed experts' shape; all experts, no expert_range) it returns
    routed_scale * routed + shared_expert(x) -- `SparseMoE`'s whole output -- from the same three launches.
    `config` pins the block sizes; None looks them up by (device, shape, T bucket) in the tuning table.
    `counters` (from `new_counters`): steps of <= FUSE_MAX_T tokens fold the combine into the down
    GEMM's launch (bit-equal)."""
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
    s13, s2 = _shared_weights(shared, w13, w2)
    cfg = config or tuning.get_config(t, num_local, x.shape[1], w2.shape[2], k, x.dtype, x.device)
    al = align(idx, e0, num_local, cfg.block_m, shared=shared is not None)
    act = gate_up(x, w13, al, k, alpha, limit, cfg, s13 if shared is not None else None)
    s2_or_none = s2 if shared is not None else None
    if _fuse_combine(t, x.shape[1], cfg, counters):
        return down(act, w2, weights, al, cfg, s2_or_none, routed_scale,
                    combine_into=(idx, e0, num_local, counters[ROUTE_COUNTERS:],
                                  shared is None and expert_range is not None))
    contrib = down(act, w2, weights, al, cfg, s2_or_none, routed_scale)
    return combine(contrib, idx, e0, num_local, x.dtype, shared is not None)


# ---- decode / verify-sized steps: the router, the alignment and the combine folded into other launches ----

FUSE_MAX_T = 64  # the router GEMV's limit (fused.triton_fused.ROUTER_GEMV_MAX_T)
# Up to here the router's launch also aligns: its last program's one-hot tiles are [pairs, experts], ~8K
# elements for 16 tokens x (4 + 1) pairs and 33 experts, the size align.py keeps its own tiles to.
ROUTE_ALIGN_MAX_T = 16
ROUTE_COUNTERS = 128  # per-token counters of the router [0, 64), the tokens' counter at 64
COMBINE_COUNTERS = FUSE_MAX_T * 1024  # (token, column block) counters of the fused combine


def new_counters(device: torch.device) -> torch.Tensor:
    """The zeroed int32 counters `fused_experts` / `moe_layer` need for their fused launches. Each launch
    leaves them zero; one stream at a time. Allocate outside CUDA-graph capture (a zero-fill recorded in
    a graph would run only at replay)."""
    return torch.zeros(ROUTE_COUNTERS + COMBINE_COUNTERS, dtype=torch.int32, device=device)


def _fuse_combine(t: int, hidden: int, cfg: MoEConfig, counters: torch.Tensor | None) -> bool:
    return counters is not None and t <= FUSE_MAX_T and t * triton.cdiv(hidden, cfg.block_n) <= COMBINE_COUNTERS


@triton.jit(do_not_specialize=["n_tok", "num_pairs", "routed_pairs", "padded_len"])
def _route_align_kernel(x_ptr, w_ptr, lg_ptr, cnt_ptr, bias_ptr, wout_ptr, idx_ptr, hidden, n_exp, stride_x,
                        stride_w, n_prog, n_tok, sorted_ptr, block_expert_ptr, num_blocks_ptr, num_pairs,
                        routed_pairs, num_local, padded_len,
                        TOP_K: tl.constexpr, PRECISE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_ALL: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
                        E_PAD: tl.constexpr, CHUNK: tl.constexpr, TOK_CNT: tl.constexpr):
    """Grid (T, n_prog): fused.triton_fused's `_router_topk_kernel` (router GEMV; the token's last program
    routes it), then the last token to be routed aligns every pair by expert (`align._align_all`): the
    router and the align step of one layer in one launch.

    The tokens' counter (cnt_ptr + TOK_CNT) works like the per-token ones: the routing program stores the
    token's experts, waits for its threads, adds 1 with acquire-release semantics at GPU scope; whoever
    reads T - 1 sees every token's experts (loaded from L2), resets the counter and aligns."""
    t = tl.program_id(0).to(tl.int64)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    em = offs_e < n_exp
    acc = tl.zeros([BLOCK_E, BLOCK_H], dtype=tl.float32)
    for h0 in range(0, hidden, BLOCK_H):  # the same GEMV as _router_topk_kernel: bit-equal logits
        offs_h = h0 + tl.arange(0, BLOCK_H)
        hm = offs_h < hidden
        xv = tl.load(x_ptr + t * stride_x + offs_h, mask=hm, other=0.0).to(tl.float32)
        wv = tl.load(w_ptr + offs_e[:, None].to(tl.int64) * stride_w + offs_h[None, :],
                     mask=em[:, None] & hm[None, :], other=0.0).to(tl.float32)
        acc += wv * xv[None, :]
    tl.store(lg_ptr + t * n_exp + offs_e, tl.sum(acc, axis=1), mask=em)
    tl.debug_barrier()
    done = tl.atomic_add(cnt_ptr + t, 1, sem="acq_rel", scope="gpu")
    if done == n_prog - 1:
        tl.store(cnt_ptr + t, 0)
        _route_row(lg_ptr + t * n_exp, bias_ptr, wout_ptr + t * TOP_K, idx_ptr + t * TOP_K, n_exp, TOP_K,
                   PRECISE, BLOCK_ALL, BLOCK_K, ".cg")
        tl.debug_barrier()
        routed = tl.atomic_add(cnt_ptr + TOK_CNT, 1, sem="acq_rel", scope="gpu")
        if routed == n_tok - 1:
            tl.store(cnt_ptr + TOK_CNT, 0)
            _align_all(idx_ptr, sorted_ptr, block_expert_ptr, num_blocks_ptr, num_pairs, routed_pairs, 0,
                       num_local, padded_len, BLOCK_M, E_PAD, CHUNK, ".cg")


def route_align(x: torch.Tensor, router_w: torch.Tensor, bias: torch.Tensor, top_k: int, block_m: int,
                counters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Alignment]:
    """Route x [T, H] (T <= FUSE_MAX_T, a router `_gemv_ok` takes) and align its pairs plus one shared-expert
    pair per token by expert: (weights [T, k] fp32, experts [T, k] int64, Alignment), equal to
    `route_tokens` then `align(idx, 0, E, block_m, shared=True)`. Steps of <= ROUTE_ALIGN_MAX_T tokens do
    both in one launch."""
    from ..fused import triton_fused as tf

    t, hidden = x.shape
    n_exp = router_w.shape[0]
    if t > ROUTE_ALIGN_MAX_T:  # the router alone in one launch (its counters: the first 64), then align
        w, idx = tf.route_tokens(x, router_w, bias, top_k, counters[:tf.ROUTER_GEMV_MAX_T])
        return w, idx, align(idx, 0, n_exp, block_m, shared=True)
    dev = x.device
    al = empty_alignment(t, top_k, n_exp, block_m, True, dev)
    num_local = n_exp + 1  # the shared expert is the last column
    logits = torch.empty(t, n_exp, dtype=torch.float32, device=dev)
    w = torch.empty(t, top_k, dtype=torch.float32, device=dev)
    idx = torch.empty(t, top_k, dtype=torch.int64, device=dev)
    block_e, block_h, warps = tf._gemv_blocks(t, n_exp, hidden)
    n_prog = triton.cdiv(n_exp, block_e)
    _route_align_kernel[(t, n_prog)](
        x, router_w, logits, counters, bias, w, idx, hidden, n_exp, x.stride(0), router_w.stride(0), n_prog, t,
        al.sorted_ids, al.block_expert, al.num_blocks, al.num_pairs, al.routed_pairs, num_local,
        al.max_blocks * al.block_m,
        TOP_K=top_k, PRECISE=tf._precise(), BLOCK_E=block_e, BLOCK_H=block_h,
        BLOCK_ALL=triton.next_power_of_2(n_exp), BLOCK_K=triton.next_power_of_2(top_k), BLOCK_M=block_m,
        E_PAD=max(16, triton.next_power_of_2(num_local)), CHUNK=max(16, triton.next_power_of_2(al.num_pairs)),
        TOK_CNT=tf.ROUTER_GEMV_MAX_T, num_warps=warps, **tf._opts())
    return w, idx, al


def moe_layer(x: torch.Tensor, router_w: torch.Tensor, bias: torch.Tensor, top_k: int, gate_up_proj: torch.Tensor,
              down_proj: torch.Tensor, shared: Shared, alpha: float, limit: float, routed_scale: float,
              counters: torch.Tensor, config: MoEConfig | None = None) -> torch.Tensor | None:
    """A whole MoE layer for a decode / verify-sized step in three launches: router + align, gate_up, down +
    combine. x [T, H] -> routed_scale * routed + shared [T, H], equal to route_tokens then `fused_experts`
    with `shared` (bit for bit: the same kernels' math). router_w [E, H] fp32, bias [E] fp32; all experts
    on this rank, the shared expert of the routed experts' shape. None when the step does not qualify
    (T = 0 or > FUSE_MAX_T, a router the GEMV does not take): the caller takes the unfused path."""
    from ..fused import triton_fused as tf  # the router's GEMV blocks and limits, one definition

    t, hidden = x.shape
    n_exp = router_w.shape[0]
    if not 0 < t <= min(FUSE_MAX_T, tf.ROUTER_GEMV_MAX_T) or not tf._gemv_ok(x, router_w):
        return None
    if not 1 <= top_k <= min(n_exp, tf.MAX_TOP_K) or n_exp > tf.MAX_EXPERTS:
        return None
    w13, w2 = gate_up_proj, down_proj
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise TypeError(f"triton MoE needs weights in the activation dtype: x is {x.dtype}, gate_up_proj "
                        f"{w13.dtype}, down_proj {w2.dtype}")
    s13, s2 = _shared_weights(shared, w13, w2)
    cfg = config or tuning.get_config(t, n_exp, hidden, w2.shape[2], top_k, x.dtype, x.device)
    if not _fuse_combine(t, hidden, cfg, counters):
        return None
    w, idx, al = route_align(x, router_w, bias, top_k, cfg.block_m, counters)
    act = gate_up(x, w13, al, top_k, alpha, limit, cfg, s13)
    return down(act, w2, w, al, cfg, s2, routed_scale,
                combine_into=(idx, 0, n_exp, counters[ROUTE_COUNTERS:], False))
