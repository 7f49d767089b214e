"""The MoE router on Triton: router logits (fp32 GEMV), sigmoid + bias top-k + renormalisation, and both in
one launch (decode) or one tiled launch (prompt chunks).

    _router_gemv_kernel router_logits (fp32 cast + GEMV, T <= 64)       3 -> 1 (cuBLAS: cast, dot, reduce)
    _route_kernel       sigmoid, + bias, top-k, gather, renormalise     6 -> 1 (after the router GEMM)
    _router_topk_kernel the two above in one launch (T <= 64): the last program of a token routes it
    _router_tile_kernel the cast, the router GEMM and the route (T > 64)  3-4 -> 1 (bf16 MMAs, exact fp32
                        products: the fp32 weight as three bf16 parts; no fp32 copy of x)

Ties: experts are chosen one at a time, the highest biased score first and, among equal scores, the lowest
expert id -- `reference.route`'s rule, and the set CUDA's torch.topk picks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3eagle.kernels import pdl
from m3eagle.kernels.fused import reference as _ref
from m3eagle.kernels.pdl import pdl_wait
from m3eagle.kernels.triton_utils import exp_precise, launch_opts, precise, warps_for


@triton.jit
def _route_row(lg_ptr, bias_ptr, w_ptr, idx_ptr, n_exp, TOP_K: tl.constexpr, PRECISE: tl.constexpr,
               BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, CACHE: tl.constexpr):
    """One token's routing from its logits row at lg_ptr: k rounds of "take the highest untaken biased
    score, lowest id among equals"; weights are the plain sigmoid scores of the taken experts over their
    sum, written to w_ptr / idx_ptr [k]. CACHE: the logits' load cache modifier."""
    offs = tl.arange(0, BLOCK_E)
    m = offs < n_exp
    logit = tl.load(lg_ptr + offs, mask=m, other=0.0, cache_modifier=CACHE).to(tl.float32)
    score = tl.math.div_rn(1.0, 1.0 + exp_precise(-logit, PRECISE))  # [E] torch's sigmoid
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
def router_topk_program(x_ptr, w_ptr, lg_ptr, cnt_ptr, bias_ptr, wout_ptr, idx_ptr, t, pid_e, hidden, n_exp,
                         stride_x, stride_w, n_prog, TOP_K: tl.constexpr, PRECISE: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_ALL: tl.constexpr,
                         BLOCK_K: tl.constexpr, PRELOAD: tl.constexpr, PDL: tl.constexpr):
    """One program of `_router_topk_kernel` (token t, expert block pid_e); also the router programs of the
    MoE's route + shared-expert launch (moe/direct.py), so the two route bit-equally.

    PRELOAD (one H tile: BLOCK_H >= hidden; the kernel has not waited): the expert rows -- a weight, which
    no kernel writes -- are loaded before the programmatic-dependent-launch wait, x after it (pdl.py's
    exception). The same one step of `_router_gemv_rows`: the bits do not change."""
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


@triton.jit(do_not_specialize=["n_tok"])
def _router_topk_kernel(x_ptr, w_ptr, lg_ptr, cnt_ptr, bias_ptr, wout_ptr, idx_ptr, hidden, n_exp, stride_x,
                        stride_w, n_prog, n_tok, TOP_K: tl.constexpr, PRECISE: tl.constexpr, BLOCK_E: tl.constexpr,
                        BLOCK_H: tl.constexpr, BLOCK_ALL: tl.constexpr, BLOCK_K: tl.constexpr,
                        PRELOAD: tl.constexpr, TOKENS: tl.constexpr, PDL: tl.constexpr):
    """Grid (cdiv(T, TOKENS), n_prog): the router GEMV of `_router_gemv_kernel` for BLOCK_E experts of TOKENS
    consecutive tokens, one token after the other with one token's code, then each token's last program to
    finish routes it (`_route_row`): one launch instead of two. A token's arithmetic is the same whatever
    TOKENS is (only how many tokens share a program, and its expert rows in L1, changes). PRELOAD: the expert
    rows are read before the PDL wait (`router_topk_program`).

    The last program is found with a per-token counter: each program stores its logits, waits for all of
    its threads (a CTA barrier), then adds 1 with acquire-release semantics at GPU scope, so the program
    that reads n_prog - 1 sees every other program's logits (it loads them from L2, not L1); it resets
    the counter for the next launch. No float atomics: the routing is computed once, by one program,
    from the same logits as the two-launch path, so it is bit-equal to it."""
    if not PRELOAD:
        pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    t0 = tl.program_id(0).to(tl.int64) * TOKENS
    for t in range(t0, tl.minimum(t0 + TOKENS, n_tok)):
        router_topk_program(x_ptr, w_ptr, lg_ptr, cnt_ptr, bias_ptr, wout_ptr, idx_ptr, t, tl.program_id(1),
                            hidden, n_exp, stride_x, stride_w, n_prog, TOP_K, PRECISE, BLOCK_E, BLOCK_H, BLOCK_ALL,
                            BLOCK_K, PRELOAD, PDL)


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
    score = tl.math.div_rn(1.0, 1.0 + exp_precise(-acc, PRECISE))  # [BM, BE] torch's sigmoid
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


def router_gemv_blocks(t: int, n_exp: int, hidden: int) -> tuple[int, int, int]:
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


def router_gemv_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.shape[0] <= ROUTER_GEMV_MAX_T and weight.dtype == torch.float32 and weight.stride(-1) == 1
            and x.stride(-1) == 1)


def router_tile_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dtype == torch.bfloat16 and weight.dtype == torch.float32 and weight.shape[0] <= ROUTER_TILE_MAX_E
            and x.stride(-1) == 1 and x.shape[0] * ROUTER_TILE_MIN_T_PER_H >= x.shape[1])


def router_tile_blocks(t: int, block_e: int) -> tuple[int, int]:
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
    fp32, experts [T, k] int64). Blocks: None takes `router_tile_blocks` (measured, benchmarks/fused_ops.py)."""
    t, hidden = x.shape
    n_exp = w3.shape[1]
    if not 1 <= k <= min(n_exp, MAX_TOP_K):
        raise ValueError(f"triton route supports 1 <= top_k <= min(E, {MAX_TOP_K}), got top_k={k}, E={n_exp}; "
                         f"use fused_backend='reference'")
    w = torch.empty(t, k, dtype=torch.float32, device=x.device)
    idx = torch.empty(t, k, dtype=torch.int64, device=x.device)
    if t:
        block_e = max(16, triton.next_power_of_2(n_exp))
        bm, bh = router_tile_blocks(t, block_e)
        bm, bh = block_m or bm, block_h or bh
        _router_tile_kernel[(triton.cdiv(t, bm),)](
            x, w3, bias, w, idx, t, hidden, n_exp, x.stride(0), w3.stride(0), w3.stride(1), TOP_K=k,
            PRECISE=precise(), BLOCK_M=bm, BLOCK_E=block_e, BLOCK_H=bh,
            BLOCK_K=triton.next_power_of_2(k), num_warps=num_warps, num_stages=num_stages, **launch_opts(),
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
    if not router_gemv_ok(x, weight) or not t:
        if t > ROUTER_GEMV_MAX_T and split is not None and router_tile_ok(x, weight):
            return route_tiles(x, split, bias, k)
        return route(router_logits(x, weight), bias, k)
    if not 1 <= k <= min(n_exp, MAX_TOP_K) or n_exp > MAX_EXPERTS:
        raise ValueError(f"triton route supports 1 <= top_k <= min(E, {MAX_TOP_K}) and E <= {MAX_EXPERTS}, got "
                         f"top_k={k}, E={n_exp}; use fused_backend='reference'")
    logits = torch.empty(t, n_exp, dtype=torch.float32, device=x.device)
    w = torch.empty(t, k, dtype=torch.float32, device=x.device)
    idx = torch.empty(t, k, dtype=torch.int64, device=x.device)
    block_e, block_h, warps = router_gemv_blocks(t, n_exp, hidden)
    n_prog = triton.cdiv(n_exp, block_e)
    launch = pdl.args(x)
    _router_topk_kernel[(t, n_prog)](
        x, weight, logits, counters, bias, w, idx, hidden, n_exp, x.stride(0), weight.stride(0), n_prog, t,
        TOP_K=k, PRECISE=precise(), BLOCK_E=block_e, BLOCK_H=block_h, BLOCK_ALL=triton.next_power_of_2(n_exp),
        BLOCK_K=triton.next_power_of_2(k), PRELOAD=router_preload(launch, block_h, hidden), TOKENS=1,
        num_warps=warps, **launch_opts(), **launch)
    return w, idx


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, H] -> [T, E] fp32, as reference.router_logits; one kernel for decode / verify-sized steps."""
    t, hidden = x.shape
    n_exp = weight.shape[0]
    if not router_gemv_ok(x, weight):
        return _ref.router_logits(x, weight)
    out = torch.empty(t, n_exp, dtype=torch.float32, device=x.device)
    if t:
        block_e, block_h, warps = router_gemv_blocks(t, n_exp, hidden)
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
        _route_kernel[(t,)](lg, bias, w, idx, n_exp, lg.stride(0), TOP_K=k, PRECISE=precise(), BLOCK_E=block_e,
                            BLOCK_K=triton.next_power_of_2(k), num_warps=warps_for(block_e), **launch_opts(), **pdl.args(lg))
    return w, idx


