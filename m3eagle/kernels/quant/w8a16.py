"""W8A16 Triton kernels for MXFP8 weights: activations stay bf16 / fp16 / fp32, weights stay float8_e4m3fn in
memory (one uint8 ue8m0 scale per 1 x 32 block along K, `mxfp8.py`) and are dequantized in registers.

    mx_linear(x [T, K], q [N, K] fp8, scale [N, K/32] u8) -> y [T, N]        (T <= GEMV_MAX_T: the decode GEMV
                                                                             or the tiled GEMM, by the table;
                                                                             else the tiled GEMM; from
                                                                             DEQUANT_MIN_T rows: mx_dequantize
                                                                             into a scratch, then cuBLAS)
    mx_moe_experts(x [T, H], weights [T, k], ids [T, k], w13 [E, 2I, H] fp8 + [E, 2I, H/32],
                   w2 [E, H, I] fp8 + [E, H, I/32], alpha, limit) -> [T, H]   (per-pair GEMVs, two launches)

Dequantization. w = float(q) * 2 ** (s - 127) is exact in fp32: the scale is built from its bits (s << 23, and
0x00400000 -- the subnormal 2 ** -127 -- for s = 0; s = 255 gives inf as `decode_e8m0` does), so every kernel
multiplies by exactly the reference's `dequantize_mx` weight.

Decode GEMV (`_mx_gemv_kernel`, T <= 8). Grid (cdiv(N, BLOCK_N), S). Program (n, s) owns BLOCK_N output rows and
the K range [s * k_split, +k_split) (a whole number of BLOCK_K steps) for the T rows (padded to BLOCK_T, clamped
to row T - 1 and dropped at the store). Two bodies, by the LEAN constexpr (`MxConfig.lean`):
  * Plain (what `pick_config`'s rule and the table's small shapes run): each step loads the fp8 tile [BN, BK] and
    its scales, dequantizes it as a [BN, BK/32, 32] broadcast and reduces sum_k w * x[t] across threads every
    step. Compiled for sm_90 that is ~12 instructions per weight at T = 1 -- byte loads (the unspecialized
    split start hides the alignment), shuffles, a shared-memory round trip and barriers each step -- more than
    an SM issues while HBM delivers its bytes: 16-48% of copy bandwidth measured.
  * LEAN: y[t, n] = sum_c scale[n, c // 4] * sum_{j < 8} q[n, 8c + j] * x[t, 8c + j] over 8-wide chunks c. The
    tile is [BT, BN, BK/8, 8]: a chunk is one thread's 8-byte fp8 load and its 16-byte x load in the same layout
    (x's pointer is broadcast over the rows, so a thread's rows share one x load and conversion; a [BK] x row
    broadcast instead, or 16-byte fp8 loads -- vector width follows the element size -- give x another layout
    and a shared-memory conversion with barriers every step). The chunk's 8 products are summed in the thread,
    scaled once by its group's factor into a [BT, BN, BK/8] fp32 accumulator, and the one cross-thread reduction
    runs after the loop; the split start s * (k_split // BK) * BK is a visible multiple of BK, so loads stay
    vectors. ~4.7 instructions per weight at T = 1 (sm_90, Triton 3.9; each further row adds ~1.5, so the tiled
    kernel takes over above T = 1-2), none of them a shuffle, barrier or shared-memory access. Launched with
    FMA contraction on (the chunk sums become FMAs; the GEMV's rounding is its own either way). No register
    prefetch: a fp8 tile carried across loop iterations is unpacked byte by byte by the compiler (+58%
    instructions); several programs per SM (80 registers at 64 weights per thread) hide the latency instead.

Split-K (S > 1, for N too small to fill the GPU), both kernels: each program stores its fp32 partial to part
[S, T, N]. The partials are summed in split order 0..S-1 -- deterministic, no float atomics -- either by a second
launch (`_split_sum_kernel`), or, with ONE_LAUNCH (`MxConfig.one_launch`), by the output tile's last program to
finish (`_store_out`): CTA barrier (all partial stores issued), atomic_add(acq_rel, gpu scope) on the tile's
int32 counter; the program that reads S - 1 loads all S partials from L2 (.cg) in split order, so the bits do
not depend on which program came last, stores y and zeroes the counter for the next call or graph replay (no
memset node). The counters are `split_counters(device)`: one zeroed [MAX_TILES] buffer per device, made on the
first eager call and never grown; a call captured before they exist takes the second launch. Calls that split
share them, so they must be ordered (one stream at a time), as an engine step's are.

Tiled GEMM (`_mx_gemm_kernel`, T > 8, and T <= 8 where the table says). Grid (cdiv(T, BM) * cdiv(N, BN), S),
grouped (GROUP_M row blocks share a weight column block in L2). Per K step: x tile [BM, BK], fp8 tile [BN, BK]
and scales [BN, BK/32]; the weight is dequantized in registers per 32-column group (the same broadcast) and
rounded to x.dtype -- exact for bf16 (e4m3 has 3 mantissa bits, bf16 7 and fp32's exponent range) -- then
tl.dot(x, w^T) into fp32 (fp32 inputs: input_precision="ieee"); its loads are cp.async-pipelined (num_stages).
fp16 cannot hold every q * 2^e (5 exponent bits), so for fp16 x the scale is applied after the MMA instead
(GROUP_SCALE): per 32-column group acc += tl.dot(x_g, q_g^T) * scale_g (q is exact in fp16, the power of two
exact in fp32). At decode one 16-row block covers every row, so a 9216 x 6144 weight is only 72-144 column tiles:
fewer programs than 132 SMs hold, one wave and a tail (42-76% of copy bandwidth measured unsplit). SPLIT gives
each tile S programs over K [s * k_steps * BK, +k_steps * BK) (the start a visible multiple of BK: vector and
cp.async loads) with the split-K sums above; unsplit (SPLIT off) the kernel compiles as before the split existed.

All kernels: `PDL` constexpr with `pdl_wait(PDL)` first (pdl.py), launched with `**pdl.args(x)` and
`**launch_opts()` (LEAN: contraction on); no host sync, no .item(), no data-dependent shapes: capturable in a
CUDA graph. The path and blocks are `pick_config(t, n, k)`, a pure function of the shape (the measured table
`w8a16_configs.json` first -- the section of this process's GPU model, `benchmarks/w8a16.py --tune --write` fills
it --, else the rule; blocks sized for a 132-SM Hopper).
Under the CPU interpreter a bf16 / fp16 tl.dot multiplies raw bits, so operands are upcast to fp32 there
(UPCAST_DOT).

MoE (`mx_moe_experts`): correctness-first, two launches of per-pair GEMVs, like `moe/direct.py`'s structure
(no sort, no combine launch) but for any T. `_mx_moe_gate_up_kernel` grid (T * k, cdiv(I, BN)): pair p reads
token p // k and expert ids[p]'s gate rows [n] and up rows [I + n] (gate_up holds gate then up, as
`moe/reference.py` chunks it), rounds each sum to x.dtype and applies `swiglu_oai_f32` (fused/activation.py: the
reference's roundings) -> act [T * k, I] in x.dtype. `_mx_moe_down_kernel` grid (T, cdiv(H, BN)): the token's k
experts in order j = 0..k-1, each output rounded to x.dtype, times its fp32 routing weight, summed in fp32 in that
fixed order, rounded once. Pairs whose id is outside [0, E) contribute zero (as the reference's expert_range).
Both run either GEMV body (`_gemv_rows`: the plain per-step dequantized tile, or with `lean` the decode GEMV's
LEAN chunks, compiled without contraction here so the activation keeps its bits); the table's "moe" entry picks.
At prompt sizes each pair re-reads its expert's weights (from L2), so `TritonMoE` runs it only up to GEMV_MAX_T
tokens; above, `moe/triton_moe.py: mx_fused_experts` sorts the pairs by expert and runs grouped GEMMs on this
GEMM's dequantizing tile.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

from m3eagle.kernels import pdl
from m3eagle.kernels.fused.activation import ACTS, silu_mul, store_act_tile, swiglu_oai, swiglu_oai_f32
from m3eagle.kernels.pdl import pdl_wait
from m3eagle.kernels.quant.mxfp8 import DEQUANT_MIN_T, MX_BLOCK
from m3eagle.kernels.split_counters import SplitCounters
from m3eagle.kernels.triton_utils import interpreting, launch_opts, precise

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GEMV_MAX_T = 8  # rows up to which mx_linear runs the decode GEMV; the tiled GEMM above
SMS = 132  # the Hopper parts the blocks are sized for (H100 SXM / H200); keeps pick_config a function of shape
MAX_SPLIT = 8
TUNED_PATH = Path(__file__).with_name("w8a16_configs.json")


# ---- configs ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MxConfig:
    """Launch parameters of one `mx_linear` call. GEMV (use_dot False): block_m is BLOCK_T (next_pow2(T)); lean
    picks the LEAN body. GEMM: block_m rows per program, group_m the grouped order. Both: split_k programs per
    output tile along K, summed by the tile's last program (one_launch) or by a second launch. The fields added
    later default to the earlier behaviour, so older table entries load and run unchanged."""

    use_dot: bool
    block_m: int
    block_n: int
    block_k: int  # a multiple of 32 (whole scale groups)
    num_warps: int = 4
    num_stages: int = 1
    split_k: int = 1
    group_m: int = 8
    lean: bool = False  # GEMV: `_mx_gemv_kernel`'s LEAN body
    one_launch: bool = False  # split-K: the last program sums the partials (split_counters), not a second launch


# The tuned table holds one section per GPU model (`torch.cuda.get_device_name`): an H100's and an H200's
# winners differ at the same shape (their memory systems do). A process uses its device's section, and the other
# sections' entries where its own has none (another Hopper's measured winner beats the rule); without CUDA, the
# sections in file order.
TunedGemv = dict[tuple[int, int, int], MxConfig]


def _load_sections() -> dict[str, tuple[TunedGemv, dict[str, Any]]]:
    """Per device name: (GEMV configs by (T bucket, N, K), the MoE's decode blocks), in file order."""
    if not TUNED_PATH.is_file():
        return {}
    doc = json.loads(TUNED_PATH.read_text())
    return {name: ({(e["t"], e["n"], e["k"]): MxConfig(**e["config"]) for e in sec.get("gemv", [])},
                   sec.get("moe", {}))
            for name, sec in doc.get("devices", {}).items()}


def tuned_view(device_name: str | None) -> tuple[TunedGemv, dict[str, Any]]:
    """The configs a process on `device_name` uses: its section first, then the others' entries for shapes its own
    lacks (file order); the MoE blocks of its section, else the first section's that has any."""
    sections = _load_sections()
    order = ([device_name] if device_name in sections else []) + [n for n in sections if n != device_name]
    gemv: TunedGemv = {}
    for name in reversed(order):  # the first in order wins
        gemv.update(sections[name][0])
    moe = next((sections[n][1] for n in order if sections[n][1]), {})
    return gemv, moe


def write_tuned(entries: TunedGemv, note: str, moe: dict[str, Any] | None, device_name: str) -> None:
    """Merge measured winners into `device_name`'s section of the table (the one writer beside the loader) and
    reload the process's view."""
    doc = json.loads(TUNED_PATH.read_text()) if TUNED_PATH.is_file() else {}
    devices = doc.get("devices", {})
    old = _load_sections().get(device_name, ({}, {}))
    merged = {**old[0], **entries}
    devices[device_name] = {"note": note, "gemv": [{"t": t, "n": n, "k": k, "config": asdict(c)}
                                                   for (t, n, k), c in sorted(merged.items())],
                            "moe": moe if moe is not None else old[1]}
    TUNED_PATH.write_text(json.dumps({"devices": devices}, indent=1) + "\n")
    use_device(device_name)


def use_device(device_name: str | None) -> None:
    """Fill TUNED / MOE_TUNED with `device_name`'s view (tuned_view), in place: the kernels read those dicts."""
    gemv, moe = tuned_view(device_name)
    TUNED.clear()
    TUNED.update(gemv)
    MOE_TUNED.clear()
    MOE_TUNED.update(moe)
    _VIEW[0] = device_name


def _current_view() -> None:
    """Once CUDA is up in this process, switch to its device's view (once: the configs stay a pure function of the
    shape for the rest of the process). Cheap when already chosen: pick_config calls it on every launch."""
    if _VIEW[0] is None and torch.cuda.is_initialized():
        use_device(torch.cuda.get_device_name())


def t_bucket(t: int) -> int:
    return triton.next_power_of_2(max(t, 1))


def pick_config(t: int, n: int, k: int) -> MxConfig:
    """The path and blocks for y [t, n] = x [t, k] @ w[n, k]^T (a pure function of the shape): the tuned table's
    entry for (T bucket, N, K) where there is one, else the rule below.

    GEMV (t <= GEMV_MAX_T): BLOCK_K = min(512, next_pow2(K)) (>= 32), BLOCK_N 16 for t <= 2 else 8 (fp32 products
    of BLOCK_T x BLOCK_N x BLOCK_K stay within a 4-warp program's registers), halved while there are < 4 programs
    per SM; split-K up to 8 when there are < 2 tiles per SM, each split >= 2 K steps.
    GEMM: BM 128 (T >= 256) / 64 / 16-32, BN 128, BK 64, 8 warps (4 for BM <= 32), 3 cp.async stages.
    The rule keeps the plain GEMV body and the two-launch split: the LEAN body, the split tiled kernel and the
    one-launch sum run where the table has measured them (a rule for them would be a guess until a sweep says)."""
    _current_view()
    if t <= GEMV_MAX_T and (hit := TUNED.get((t_bucket(t), n, k))) is not None:
        return hit
    if t <= GEMV_MAX_T:
        bt = triton.next_power_of_2(max(t, 1))
        bk = max(MX_BLOCK, min(512 if t <= 2 else 256, triton.next_power_of_2(k)))
        bn = 16 if t <= 2 else 8
        while bn > 1 and triton.cdiv(n, bn) < 4 * SMS:
            bn //= 2
        tiles = triton.cdiv(n, bn)
        split = 1
        if tiles < 2 * SMS:
            split = max(1, min(MAX_SPLIT, triton.cdiv(4 * SMS, tiles), k // (2 * bk)))
        return MxConfig(False, bt, bn, bk, num_warps=4, num_stages=1, split_k=split)
    if t >= 256:
        return MxConfig(True, 128, 128, 64, num_warps=8, num_stages=3)
    bm = 64 if t > 32 else max(16, triton.next_power_of_2(t))
    return MxConfig(True, bm, 128 if bm >= 64 else 64, 64, num_warps=8 if bm >= 64 else 4, num_stages=3)


TUNED: TunedGemv = tuned_view(None)[0]
MOE_TUNED: dict[str, Any] = tuned_view(None)[1]
_VIEW: list[str | None] = [None]  # the device whose view TUNED holds (None: not chosen yet)


# ---- shared jit helpers -------------------------------------------------------------------------------


@triton.jit
def _e8m0(s):
    """uint8 ue8m0 bytes -> fp32 2 ** (s - 127), exactly (bits: s << 23; s = 0 is the subnormal 2 ** -127)."""
    si = s.to(tl.int32)
    return tl.where(si == 0, 0x00400000, si << 23).to(tl.float32, bitcast=True)


@triton.jit
def _dequant_tile(q_ptrs, s_ptrs, k_ok, g_ok, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr):
    """fp8 tile [BN, BK] at q_ptrs and its scales [BN, BK / 32] at s_ptrs -> fp32 weights [BN, BK] (zeros past K)."""
    if EVEN_K:
        q = tl.load(q_ptrs)
        s = tl.load(s_ptrs)
    else:
        q = tl.load(q_ptrs, mask=k_ok, other=0.0)
        s = tl.load(s_ptrs, mask=g_ok, other=127)
    w = tl.reshape(q.to(tl.float32), [BN, BK // 32, 32]) * _e8m0(s)[:, :, None]
    return tl.reshape(w, [BN, BK])


# ---- decode GEMV --------------------------------------------------------------------------------------


@triton.jit
def _weight_rows(offs_n, N, n_act, ACT: tl.constexpr):
    """The weight rows that output columns offs_n read, clamped (padding re-reads a real row; its column is dropped
    at the store). ACT: the columns are interleaved (gate, up) pairs, column c holding feature c // 2's gate (row
    c // 2) or up (row n_act + c // 2) of the packed [gate; up] weight, so one tile holds both halves of its
    features and can apply the activation."""
    if ACT:
        f = tl.minimum(offs_n // 2, n_act - 1)
        return (f + (offs_n % 2) * n_act).to(tl.int64)
    return tl.minimum(offs_n, N - 1).to(tl.int64)


@triton.jit
def _store_out(acc, offs_t, offs_n, T, N, y_ptr, stride_yt, part_ptr, cnt_ptr, tile, pid_s, col_tile, n_act, alpha,
               limit, SPLIT: tl.constexpr, ONE_LAUNCH: tl.constexpr, ROWS: tl.constexpr, HALF: tl.constexpr,
               ACT: tl.constexpr, PRECISE: tl.constexpr):
    """acc [BT, BN] fp32 of rows offs_t, columns offs_n -> y (unsplit), or this split's partial part[pid_s] [T, N];
    ONE_LAUNCH: then the tile's last program to finish (its counter cnt[tile]) sums the S partials in split order
    into y and zeroes the counter again (for the next launch / graph replay). ACT: the final values go through
    `activation.store_act_tile` (y [T, n_act]) instead; a split ACT launch is always ONE_LAUNCH."""
    mask = (offs_t < T)[:, None] & (offs_n < N)[None, :]
    if SPLIT:
        n_split = tl.num_programs(1)
        plane = tl.cast(T, tl.int64) * N  # one split's [T, N]
        p_ptrs = part_ptr + offs_t.to(tl.int64)[:, None] * N + offs_n[None, :]  # [BT, BN] in split 0
        tl.store(p_ptrs + pid_s * plane, acc, mask=mask)
        if ONE_LAUNCH:
            tl.debug_barrier()  # every thread's partial store is issued before the release below
            done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if done == n_split - 1:
                total = tl.zeros_like(acc)
                for s in range(n_split):  # split order, whichever program came last: the same bits every call
                    total += tl.load(p_ptrs + s * plane, mask=mask, other=0.0, cache_modifier=".cg")
                if ACT:
                    store_act_tile(y_ptr, total, offs_t, offs_t < T, col_tile, n_act, stride_yt, alpha, limit, ACT,
                                   ROWS, HALF, PRECISE)
                else:
                    tl.store(y_ptr + offs_t.to(tl.int64)[:, None] * stride_yt + offs_n[None, :],
                             total.to(y_ptr.dtype.element_ty), mask=mask)
                tl.store(cnt_ptr + tile, 0)
    elif ACT:
        store_act_tile(y_ptr, acc, offs_t, offs_t < T, col_tile, n_act, stride_yt, alpha, limit, ACT, ROWS, HALF,
                       PRECISE)
    else:
        tl.store(y_ptr + offs_t.to(tl.int64)[:, None] * stride_yt + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit(do_not_specialize=["T", "k_split"])
def _mx_gemv_kernel(x_ptr, q_ptr, s_ptr, y_ptr, part_ptr, cnt_ptr, T, N, K, stride_xt, stride_qn, stride_sn,
                    stride_yt, k_split, n_act, alpha, limit, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr, LEAN: tl.constexpr,
                    ONE_LAUNCH: tl.constexpr, ACT: tl.constexpr, PRECISE: tl.constexpr, PDL: tl.constexpr):
    """Grid (cdiv(N, BLOCK_N), S): y[:, n-tile] (SPLIT: its partial part[s] [T, N] fp32) over K [s*k_split, +k_split).
    ACT (1 silu, 2 swiglu-oai; not with LEAN, which contracts FMAs): N = 2 * n_act columns of the packed [gate; up]
    weight, interleaved (`_weight_rows`), y [T, n_act] the activation."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = _weight_rows(offs_n, N, n_act, ACT)  # clamped: padding rows re-read a real row, the store drops them
    offs_t = tl.arange(0, BLOCK_T)
    trow = tl.minimum(offs_t, T - 1).to(tl.int64)
    if LEAN:
        # [BT, BN, NC, 8]: chunks of 8 along K, each one thread's 8-byte fp8 load and 16-byte x load, both in one
        # layout (x broadcast over the rows by its pointer: the thread's rows share one load); the chunk's sum is
        # in-thread FMAs, scaled once, so the loop has no shuffle, no barrier, no shared memory
        NC: tl.constexpr = BLOCK_K // 8
        offs_c = tl.arange(0, NC)
        k0 = pid_s * (k_split // BLOCK_K) * BLOCK_K  # a multiple of BLOCK_K the compiler sees: vector loads
        k_end = tl.minimum(k0 + k_split, K)
        kk = (k0 + offs_c * 8)[None, :, None] + tl.arange(0, 8)[None, None, :]  # [1, NC, 8]
        q_ptrs = q_ptr + rows[:, None, None] * stride_qn + kk  # [BN, NC, 8]
        s_ptrs = s_ptr + rows[:, None] * stride_sn + (k0 // 32 + offs_c // 4)[None, :]  # [BN, NC]: chunk's group
        x_ptrs = x_ptr + trow[:, None, None, None] * stride_xt + (kk + 0 * rows[:, None, None])[None, :, :, :]
        lacc = tl.zeros([BLOCK_T, BLOCK_N, NC], dtype=tl.float32)
        for k in range(k0, k_end, BLOCK_K):
            c_ok = (k + offs_c * 8) < k_end  # whole chunks in or out (K % 32 == 0)
            if EVEN_K:
                q = tl.load(q_ptrs)
                sc = _e8m0(tl.load(s_ptrs))
                x = tl.load(x_ptrs).to(tl.float32)
            else:
                q = tl.load(q_ptrs, mask=c_ok[None, :, None], other=0.0)
                sc = _e8m0(tl.load(s_ptrs, mask=c_ok[None, :], other=127))
                x = tl.load(x_ptrs, mask=c_ok[None, None, :, None], other=0.0).to(tl.float32)
            lacc += tl.sum(q.to(tl.float32)[None, :, :, :] * x, axis=3) * sc[None, :, :]
            q_ptrs += BLOCK_K
            s_ptrs += BLOCK_K // 32
            x_ptrs += BLOCK_K
        acc = tl.sum(lacc, axis=2)  # [BT, BN]: the one cross-thread reduction
    else:
        NB: tl.constexpr = BLOCK_K // 32
        offs_k = tl.arange(0, BLOCK_K)
        offs_g = tl.arange(0, NB)
        k0 = pid_s * k_split
        k_end = tl.minimum(k0 + k_split, K)
        q_ptrs = q_ptr + rows[:, None] * stride_qn + (k0 + offs_k)[None, :]  # [BN, BK]
        s_ptrs = s_ptr + rows[:, None] * stride_sn + (k0 // 32 + offs_g)[None, :]  # [BN, NB]
        x_ptrs = x_ptr + trow[:, None] * stride_xt + (k0 + offs_k)[None, :]  # [BT, BK]
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for k in range(k0, k_end, BLOCK_K):
            k_ok = (k + offs_k) < k_end  # K % 32 == 0: whole groups in or out
            g_ok = (k + offs_g * 32) < k_end
            w = _dequant_tile(q_ptrs, s_ptrs, k_ok[None, :], g_ok[None, :], BLOCK_N, BLOCK_K, EVEN_K)  # [BN, BK]
            if EVEN_K:
                x = tl.load(x_ptrs).to(tl.float32)
            else:
                x = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0).to(tl.float32)  # [BT, BK]
            acc += tl.sum(w[None, :, :] * x[:, None, :], axis=2)  # [BT, BN]
            q_ptrs += BLOCK_K
            s_ptrs += NB
            x_ptrs += BLOCK_K
    _store_out(acc, offs_t, offs_n, T, N, y_ptr, stride_yt, part_ptr, cnt_ptr, pid_n, pid_s, pid_n, n_act, alpha,
               limit, SPLIT, ONE_LAUNCH, BLOCK_T, BLOCK_N // 2, ACT, PRECISE)


@triton.jit(do_not_specialize=["T", "S"])
def _split_sum_kernel(part_ptr, y_ptr, T, N, S, stride_yt, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Grid (T, cdiv(N, BLOCK)): y[t] = sum_{s = 0..S-1} part[s, t] in split order, rounded once to y's dtype."""
    pdl_wait(PDL)
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(S):
        total += tl.load(part_ptr + (s * T + t) * N + offs, mask=ok, other=0.0)
    tl.store(y_ptr + t * stride_yt + offs, total.to(y_ptr.dtype.element_ty), mask=ok)


# ---- tiled GEMM ---------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["T", "k_steps"])
def _mx_gemm_kernel(x_ptr, q_ptr, s_ptr, y_ptr, part_ptr, cnt_ptr, T, N, K, stride_xt, stride_qn, stride_sn, stride_yt,
                    k_steps, n_act, alpha, limit, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr, GROUP_SCALE: tl.constexpr,
                    UPCAST_DOT: tl.constexpr, SPLIT: tl.constexpr, ONE_LAUNCH: tl.constexpr, ACT: tl.constexpr,
                    PRECISE: tl.constexpr, PDL: tl.constexpr):
    """Grid (cdiv(T, BM) * cdiv(N, BN), S), grouped: y tile [BM, BN] = x [BM, K] @ dequant(q, s)[BN, K]^T, fp32 acc;
    SPLIT: program (tile, s) covers K [s * k_steps * BK, +k_steps * BK) and stores its partial (`_store_out`).
    ACT: as `_mx_gemv_kernel`'s (interleaved gate / up columns, y [T, n_act])."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    NB: tl.constexpr = BLOCK_K // 32
    pid = tl.program_id(0)
    num_m = tl.cdiv(T, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_m = tl.minimum(offs_m, T - 1).to(tl.int64)  # clamped, dropped at the store
    rows_n = _weight_rows(offs_n, N, n_act, ACT)
    if SPLIT:  # a whole number of BK steps per split, the start a visible multiple of BK (vector / cp.async loads)
        k0 = tl.program_id(1) * k_steps * BLOCK_K
        k_end = tl.minimum(k0 + k_steps * BLOCK_K, K)
    else:
        k0 = 0
        k_end = K
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    dt = x_ptr.dtype.element_ty
    if GROUP_SCALE:  # fp16: scale applied to each 32-column group's MMA result (q is exact in fp16)
        offs_c = tl.arange(0, 32)
        x_ptrs = x_ptr + rows_m[:, None] * stride_xt + (k0 + offs_c)[None, :]  # [BM, 32]
        q_ptrs = q_ptr + rows_n[:, None] * stride_qn + (k0 + offs_c)[None, :]  # [BN, 32]
        s_ptrs = s_ptr + rows_n * stride_sn + k0 // 32  # [BN]
        for _g in range(k0 // 32, k_end // 32):
            x = tl.load(x_ptrs)
            q = tl.load(q_ptrs).to(dt)
            if UPCAST_DOT:
                part = tl.dot(x.to(tl.float32), tl.trans(q).to(tl.float32), input_precision="ieee")
            else:
                part = tl.dot(x, tl.trans(q))
            acc += part * _e8m0(tl.load(s_ptrs))[None, :]
            x_ptrs += 32
            q_ptrs += 32
            s_ptrs += 1
    else:
        offs_k = tl.arange(0, BLOCK_K)
        offs_g = tl.arange(0, NB)
        x_ptrs = x_ptr + rows_m[:, None] * stride_xt + (k0 + offs_k)[None, :]  # [BM, BK]
        q_ptrs = q_ptr + rows_n[:, None] * stride_qn + (k0 + offs_k)[None, :]  # [BN, BK]
        s_ptrs = s_ptr + rows_n[:, None] * stride_sn + (k0 // 32 + offs_g)[None, :]  # [BN, NB]
        for k in range(k0, k_end, BLOCK_K):
            k_ok = (k + offs_k) < k_end
            g_ok = (k + offs_g * 32) < k_end
            w = _dequant_tile(q_ptrs, s_ptrs, k_ok[None, :], g_ok[None, :], BLOCK_N, BLOCK_K, EVEN_K)
            if EVEN_K:
                x = tl.load(x_ptrs)
            else:
                x = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
            elif UPCAST_DOT:  # interpreter: exact products of the bf16-rounded weight, as the GPU's MMA
                acc = tl.dot(x.to(tl.float32), tl.trans(w.to(dt).to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w.to(dt)), acc)
            x_ptrs += BLOCK_K
            q_ptrs += BLOCK_K
            s_ptrs += NB
    if SPLIT or ACT:
        _store_out(acc, offs_m, offs_n, T, N, y_ptr, stride_yt, part_ptr, cnt_ptr, pid, tl.program_id(1), pid_n,
                   n_act, alpha, limit, SPLIT, ONE_LAUNCH, BLOCK_M, BLOCK_N // 2, ACT, PRECISE)
    else:  # as before the split existed (the measured kernels compile unchanged)
        mask = (offs_m < T)[:, None] & (offs_n < N)[None, :]
        tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_yt + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit(do_not_specialize=["N", "K"])
def _mx_dequant_kernel(q_ptr, s_ptr, w_ptr, N, K, stride_qn, stride_sn, stride_wn, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Grid (cdiv(N, BN), cdiv(K, BK)): w[n, k] = float(q[n, k]) * 2 ** (s[n, k // 32] - 127), exact in fp32, rounded
    once to w's dtype (`mxfp8.dequantize_mx`'s arithmetic: the same bits)."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_g = tl.program_id(1) * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
    n_ok = (offs_n < N)[:, None]
    rows = offs_n.to(tl.int64)[:, None]
    q = tl.load(q_ptr + rows * stride_qn + offs_k[None, :], mask=n_ok & (offs_k < K)[None, :], other=0.0)
    s = tl.load(s_ptr + rows * stride_sn + offs_g[None, :], mask=n_ok & (offs_g < K // 32)[None, :], other=127)
    w = tl.reshape(q.to(tl.float32), [BLOCK_N, BLOCK_K // 32, 32]) * _e8m0(s)[:, :, None]
    tl.store(w_ptr + rows * stride_wn + offs_k[None, :], tl.reshape(w, [BLOCK_N, BLOCK_K]).to(w_ptr.dtype.element_ty),
             mask=n_ok & (offs_k < K)[None, :])


# ---- host API -----------------------------------------------------------------------------------------


def mx_dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """w [N, K] in `dtype` = dequantize_mx(q, scale, dtype) (bit for bit) in one launch; q float8_e4m3fn [N, K] and
    scale uint8 [N, K / 32], both contiguous. Graph-capturable (no host sync)."""
    _check_weight("q", q, scale, "scale", 2, "mx_dequantize")
    n, k = q.shape
    out = torch.empty(n, k, dtype=dtype, device=q.device)  # [N, K]
    bn, bk = 16, min(512, triton.next_power_of_2(k))
    _mx_dequant_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](
        q, scale, out, n, k, q.stride(0), scale.stride(0), out.stride(0), BLOCK_N=bn, BLOCK_K=bk, num_warps=4,
        **pdl.args(q), **launch_opts())
    return out


MAX_TILES = 16384  # output tiles with a one-launch split-K counter (one int32 each: 64 KB per device)
_COUNTERS = SplitCounters(MAX_TILES)


def split_counters(device: torch.device | str) -> torch.Tensor | None:
    """The one-launch split-K tile counters of `device` (split_counters.SplitCounters): None while a CUDA graph is
    being captured before they exist, and that call takes the two-launch sum. Calls that split must be ordered
    (one stream at a time), as an engine step's are."""
    return _COUNTERS.get(device)


def _check_weight(name: str, q: torch.Tensor, scale: torch.Tensor, sname: str, dims: int, fn: str) -> None:
    if not isinstance(q, torch.Tensor) or q.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{fn}: {name} must be a float8_e4m3fn tensor, got "
                        f"{q.dtype if isinstance(q, torch.Tensor) else type(q).__name__}")
    if q.dim() != dims:
        raise ValueError(f"{fn}: {name} must be {dims}-D, got shape {tuple(q.shape)}")
    if q.shape[-1] % MX_BLOCK or q.shape[-1] == 0:
        raise ValueError(f"{fn}: {name}'s K = {q.shape[-1]} must be a positive multiple of {MX_BLOCK} (K % 32 == 0)")
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.uint8:
        raise TypeError(f"{fn}: {sname} must be a uint8 (ue8m0) tensor, got "
                        f"{scale.dtype if isinstance(scale, torch.Tensor) else type(scale).__name__}")
    want = (*q.shape[:-1], q.shape[-1] // MX_BLOCK)
    if tuple(scale.shape) != want:
        raise ValueError(f"{fn}: {sname} shape {tuple(scale.shape)} does not match {name} {tuple(q.shape)}: "
                         f"expected {want} (one byte per 1 x {MX_BLOCK} block along K)")
    if q.device != scale.device:
        raise ValueError(f"{fn}: {name} on {q.device} but {sname} on {scale.device}")
    if not q.is_contiguous() or not scale.is_contiguous():
        raise ValueError(f"{fn}: {name} and {sname} must be contiguous")


def _check_x(fn: str, x: torch.Tensor, k: int, device: torch.device) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in DTYPES:
        raise TypeError(f"{fn}: x must be a bf16 / fp16 / fp32 tensor, got "
                        f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"{fn}: x shape {tuple(x.shape)} must be [T, {k}] (K of the weight)")
    if x.device != device:
        raise ValueError(f"{fn}: x on {x.device} but the weight on {device}")
    if x.stride(1) != 1 and x.shape[1] > 1:
        raise ValueError(f"{fn}: x must have unit column stride, got strides {x.stride()}")
    if device.type != "cuda" and not interpreting():
        raise ValueError(f"{fn}: tensors on {device} need a CUDA device or TRITON_INTERPRET=1")


def mx_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None,
              config: MxConfig | None = None, act: str | None = None, alpha: float = 1.702,
              limit: float = 7.0) -> torch.Tensor:
    """y [T, N] = x [T, K] @ dequantize_mx(q, scale)^T in x.dtype, fp32 accumulation (F.linear, no bias).

    x bf16 / fp16 / fp32 [T, K] (unit column stride), q float8_e4m3fn [N, K], scale uint8 [N, K / 32] (both
    contiguous), K % 32 == 0; out, if given, [T, N] in x.dtype with unit column stride. The path, blocks and
    split are `pick_config`'s (T <= GEMV_MAX_T: the decode GEMV or, where the table says, the tiled GEMM; larger
    T the tiled GEMM), except from DEQUANT_MIN_T rows of bf16 / fp32 x: `mx_dequantize`, then cuBLAS. `config`
    overrides the choice (tests, tuning: it always runs the GEMV or the tiled GEMM).

    act ("silu" / "swiglu_oai", with alpha / limit): q is a packed [gate; up] weight [2I, K] and the result is
    y [T, I] = silu_mul / swiglu_oai of the product, bit for bit the two launches' (mx_linear, then
    fused/activation.py's kernel). The GEMV (plain body) and the tiled GEMM apply it in their epilogue, a split
    one in the tile's last program; the lean GEMV (it contracts FMAs), a two-launch split sum, a column block
    under 2 and the dequantizing path run the two launches instead."""
    fn = "mx_linear"
    _check_weight("q", q, scale, "scale", 2, fn)
    n, k = q.shape
    _check_x(fn, x, k, q.device)
    t = x.shape[0]
    if act is not None and (act not in ACTS or n % 2):
        raise ValueError(f"{fn}: act={act!r} needs one of {sorted(ACTS)} and a packed [gate; up] weight of even N, "
                         f"got N={n}")
    n_out = n // 2 if act is not None else n
    if out is None:
        out = torch.empty(t, n_out, dtype=x.dtype, device=x.device)
    elif (not isinstance(out, torch.Tensor) or tuple(out.shape) != (t, n_out) or out.dtype != x.dtype
          or out.device != x.device or (out.stride(1) != 1 and n_out > 1)):
        raise ValueError(f"{fn}: out must be [{t}, {n_out}] {x.dtype} on {x.device} with unit column stride, got "
                         f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}")
    if t == 0:
        return out
    dequant = config is None and t >= DEQUANT_MIN_T and x.dtype in (torch.bfloat16, torch.float32)
    cfg = config if config is not None else pick_config(t, n, k)
    if cfg.block_k % MX_BLOCK or cfg.block_k < MX_BLOCK:
        raise ValueError(f"{fn}: {cfg}: block_k must be a multiple of {MX_BLOCK}")
    bk = cfg.block_k
    split = max(1, min(cfg.split_k, triton.cdiv(k, bk)))
    k_split = triton.cdiv(triton.cdiv(k, split), bk) * bk  # a whole number of BLOCK_K steps per split
    split = triton.cdiv(k, k_split)  # e.g. K=320, BLOCK_K=64, 3 splits: 2 of 192 and 128 (no empty third)
    tiles = triton.cdiv(n, cfg.block_n) * (1 if not cfg.use_dot else triton.cdiv(t, cfg.block_m))
    cnt = split_counters(x.device) if split > 1 and cfg.one_launch and tiles <= MAX_TILES else None
    if act is not None and (dequant or (cfg.lean and not cfg.use_dot) or cfg.block_n < 2
                            or (split > 1 and cnt is None)):
        y = mx_linear(x, q, scale, config=config)  # [T, 2I], then the activation's own launch
        return out.copy_(swiglu_oai(y, alpha, limit) if act == "swiglu_oai" else silu_mul(*y.chunk(2, -1)))
    if dequant:
        return torch.mm(x, mx_dequantize(q, scale, x.dtype).t(), out=out)  # [T, K] @ [K, N]
    launch = pdl.args(x)
    part = torch.empty(split, t, n, dtype=torch.float32, device=x.device) if split > 1 else out  # [S, T, N]
    common = dict(SPLIT=split > 1, EVEN_K=k % bk == 0, ONE_LAUNCH=cnt is not None, num_warps=cfg.num_warps,
                  ACT=ACTS.get(act, 0), PRECISE=act is not None and precise(), **launch)
    cnt = cnt if cnt is not None else out
    act_args = (n_out, float(alpha), float(limit))
    if not cfg.use_dot:
        # LEAN sums its chunks with FMAs (contraction on: the products' roundings are the GEMV's own, any order)
        opts = {**launch_opts(), "enable_fp_fusion": True} if cfg.lean else launch_opts()
        _mx_gemv_kernel[(tiles, split)](
            x, q, scale, out, part, cnt, t, n, k, x.stride(0), q.stride(0), scale.stride(0), out.stride(0), k_split,
            *act_args, BLOCK_T=triton.next_power_of_2(t), BLOCK_N=cfg.block_n, BLOCK_K=bk, LEAN=cfg.lean,
            num_stages=cfg.num_stages, **common, **opts)
    else:
        interp = interpreting()
        _mx_gemm_kernel[(tiles, split)](
            x, q, scale, out, part, cnt, t, n, k, x.stride(0), q.stride(0), scale.stride(0), out.stride(0),
            k_split // bk, *act_args, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk, GROUP_M=cfg.group_m,
            IEEE=x.dtype == torch.float32, GROUP_SCALE=x.dtype == torch.float16,
            UPCAST_DOT=interp and x.dtype != torch.float32, num_stages=cfg.num_stages, **common, **launch_opts())
    if split > 1 and not common["ONE_LAUNCH"]:  # the partials' ordered sum as a launch of its own
        block = min(1024, triton.next_power_of_2(n))
        _split_sum_kernel[(t, triton.cdiv(n, block))](part, out, t, n, split, out.stride(0), BLOCK=block,
                                                      num_warps=4, **pdl.args(x), **launch_opts())
    return out


# ---- routed MoE with MXFP8 experts --------------------------------------------------------------------


@triton.jit
def _gemv_rows(x_row_ptr, q_rows, s_rows, n_k, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
               LEAN: tl.constexpr):
    """sum_k dequant(q, s)[n, k] * x[k] over k < n_k for the BLOCK_N weight rows whose first weight / first scale
    are at q_rows / s_rows [BN] (row pointers) -> [BN] fp32. LEAN: the decode GEMV's LEAN body (8-wide chunks, one
    thread's 8-byte fp8 and 16-byte x loads, summed in-thread and scaled once; one cross-thread reduction after
    the loop); else each step dequantizes the [BN, BK] tile and reduces it."""
    if LEAN:
        NC: tl.constexpr = BLOCK_K // 8
        offs_c = tl.arange(0, NC)
        kk = (offs_c * 8)[:, None] + tl.arange(0, 8)[None, :]  # [NC, 8]
        q_ptrs = q_rows[:, None, None] + kk[None, :, :]  # [BN, NC, 8]
        s_ptrs = s_rows[:, None] + (offs_c // 4)[None, :]  # [BN, NC]: each chunk's 32-group
        # x's pointer broadcast over the rows: q's layout, so a thread's rows share one x load (the GEMV's LEAN)
        x_ptrs = x_row_ptr + (kk[None, :, :] + tl.zeros([BLOCK_N, 1, 1], tl.int32))  # [BN, NC, 8]
        lacc = tl.zeros([BLOCK_N, NC], dtype=tl.float32)
        for k in range(0, n_k, BLOCK_K):
            if EVEN_K:
                q = tl.load(q_ptrs)
                sc = _e8m0(tl.load(s_ptrs))
                x = tl.load(x_ptrs).to(tl.float32)
            else:
                c_ok = (k + offs_c * 8) < n_k  # whole chunks in or out (K % 32 == 0)
                q = tl.load(q_ptrs, mask=c_ok[None, :, None], other=0.0)
                sc = _e8m0(tl.load(s_ptrs, mask=c_ok[None, :], other=127))
                x = tl.load(x_ptrs, mask=c_ok[None, :, None], other=0.0).to(tl.float32)
            lacc += tl.sum(q.to(tl.float32) * x, axis=2) * sc
            q_ptrs += BLOCK_K
            s_ptrs += BLOCK_K // 32
            x_ptrs += BLOCK_K
        return tl.sum(lacc, axis=1)
    else:
        NB: tl.constexpr = BLOCK_K // 32
        offs_k = tl.arange(0, BLOCK_K)
        offs_g = tl.arange(0, NB)
        q_ptrs = q_rows[:, None] + offs_k[None, :]  # [BN, BK]
        s_ptrs = s_rows[:, None] + offs_g[None, :]  # [BN, NB]
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k in range(0, n_k, BLOCK_K):
            k_ok = (k + offs_k) < n_k
            g_ok = (k + offs_g * 32) < n_k
            w = _dequant_tile(q_ptrs, s_ptrs, k_ok[None, :], g_ok[None, :], BLOCK_N, BLOCK_K, EVEN_K)
            if EVEN_K:
                x = tl.load(x_row_ptr + k + offs_k).to(tl.float32)
            else:
                x = tl.load(x_row_ptr + k + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            acc += w * x[None, :]
            q_ptrs += BLOCK_K
            s_ptrs += NB
        return tl.sum(acc, axis=1)


@triton.jit(do_not_specialize=["P"])
def _mx_moe_gate_up_kernel(x_ptr, ids_ptr, q_ptr, s_ptr, act_ptr, sq_ptr, ss_ptr, sact_ptr, P, E, H, I, IS, stride_xt,
                           stride_qe, stride_qn, stride_se, stride_sn, stride_at, stride_sqn, stride_ssn, stride_sat,
                           alpha, limit, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           EVEN_K: tl.constexpr, PRECISE: tl.constexpr, LEAN: tl.constexpr, PDL: tl.constexpr):
    """Grid (T * k [+ T], cdiv(max(I, IS), BN)): act[p, n-tile] = swiglu_oai(x[p // k] @ gate_e^T, x[p // k] @ up_e^T),
    e = ids[p]; the programs p = P + t past the routed pairs (a grid with a shared expert) compute the shared
    expert's sact[t, n-tile] (width IS)."""
    pdl_wait(PDL)
    p = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if p >= P:  # the shared expert's pair of token p - P: its own weight, width and output
        width = IS
        x_row = x_ptr + (p - P) * stride_xt
        qg = sq_ptr + tl.minimum(offs_n, IS - 1).to(tl.int64) * stride_sqn  # [BN] row pointers
        sg = ss_ptr + tl.minimum(offs_n, IS - 1).to(tl.int64) * stride_ssn
        up = IS * stride_sqn
        up_s = IS * stride_ssn
        out_ptrs = sact_ptr + (p - P) * stride_sat + offs_n
    else:
        e = tl.load(ids_ptr + p).to(tl.int64)
        e = tl.minimum(tl.maximum(e, 0), E - 1)  # an id outside [0, E): any expert (its weight is zeroed in down)
        width = I
        x_row = x_ptr + (p // TOP_K) * stride_xt
        qg = q_ptr + e * stride_qe + tl.minimum(offs_n, I - 1).to(tl.int64) * stride_qn  # [BN] row pointers
        sg = s_ptr + e * stride_se + tl.minimum(offs_n, I - 1).to(tl.int64) * stride_sn
        up = I * stride_qn
        up_s = I * stride_sn
        out_ptrs = act_ptr + p * stride_at + offs_n
    if pid_n * BLOCK_N < width:  # the wider of I and IS sets the grid: the other's extra tiles have no rows
        g = _gemv_rows(x_row, qg, sg, H, BLOCK_N, BLOCK_K, EVEN_K, LEAN)
        u = _gemv_rows(x_row, qg + up, sg + up_s, H, BLOCK_N, BLOCK_K, EVEN_K, LEAN)
        dt = act_ptr.dtype.element_ty
        out = swiglu_oai_f32(g.to(dt).to(tl.float32), u.to(dt).to(tl.float32), alpha, limit, dt, PRECISE)
        tl.store(out_ptrs, out.to(dt), mask=offs_n < width)


@triton.jit(do_not_specialize=["T"])
def _mx_moe_down_kernel(act_ptr, ids_ptr, wts_ptr, q_ptr, s_ptr, out_ptr, sact_ptr, sq_ptr, ss_ptr, T, E, H, I, IS,
                        routed_scale, stride_at, stride_qe, stride_qn, stride_se, stride_sn, stride_ot, stride_sat,
                        stride_sqn, stride_ssn, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        EVEN_K: tl.constexpr, EVEN_KS: tl.constexpr, HAS_SHARED: tl.constexpr, LEAN: tl.constexpr,
                        PDL: tl.constexpr):
    """Grid (T, cdiv(H, BN)): out[t, n-tile] = sum_{j = 0..k-1} wts[t, j] * round(act[t*k + j] @ down_e^T). With
    HAS_SHARED (the direct bf16 kernels' roundings, `moe/direct.py: _down_sum`): each term is rounded again after
    its weight (wts * routed_scale), and the shared expert's rounded sact[t] @ sdown^T joins the fp32 sum last."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, H - 1).to(tl.int64)
    dt = out_ptr.dtype.element_ty
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        p = t * TOP_K + j
        e_raw = tl.load(ids_ptr + p).to(tl.int64)
        wt = tl.load(wts_ptr + p).to(tl.float32)
        wt = tl.where((e_raw >= 0) & (e_raw < E), wt, 0.0)
        e = tl.minimum(tl.maximum(e_raw, 0), E - 1)
        qd = q_ptr + e * stride_qe + rows * stride_qn  # [BN] row pointers
        sd = s_ptr + e * stride_se + rows * stride_sn
        y = _gemv_rows(act_ptr + p * stride_at, qd, sd, I, BLOCK_N, BLOCK_K, EVEN_K, LEAN)
        if HAS_SHARED:
            total += (y.to(dt).to(tl.float32) * (wt * routed_scale)).to(dt).to(tl.float32)
        else:
            total += wt * y.to(dt).to(tl.float32)
    if HAS_SHARED:
        y = _gemv_rows(sact_ptr + t * stride_sat, sq_ptr + rows * stride_sqn, ss_ptr + rows * stride_ssn, IS, BLOCK_N,
                       BLOCK_K, EVEN_KS, LEAN)
        total += y.to(dt).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs_n, total.to(dt), mask=offs_n < H)


def _check_shared(fn: str, shared: Any, h: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The shared expert's (s13_q, s13_s, s2_q, s2_s), checked: MXFP8 [2I_s, H] and [H, I_s] on the experts' device."""
    if not (isinstance(shared, tuple) and len(shared) == 4):
        raise ValueError(f"{fn}: shared must be (s13_q, s13_s, s2_q, s2_s), got {type(shared).__name__}")
    sq13, ss13, sq2, ss2 = shared
    _check_weight("shared s13_q", sq13, ss13, "s13_s", 2, fn)
    _check_weight("shared s2_q", sq2, ss2, "s2_s", 2, fn)
    two_is, hs = sq13.shape
    if two_is % 2 or hs != h or tuple(sq2.shape) != (h, two_is // 2):
        raise ValueError(f"{fn}: the shared expert's s13_q {tuple(sq13.shape)} and s2_q {tuple(sq2.shape)} must be "
                         f"[2I_s, H] and [H, I_s] with H = {h}")
    if sq13.device != device or sq2.device != device:
        raise ValueError(f"{fn}: the shared expert's weights must be on {device}")
    return sq13, ss13, sq2, ss2


def mx_moe_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13_q: torch.Tensor,
                   w13_s: torch.Tensor, w2_q: torch.Tensor, w2_s: torch.Tensor, alpha: float, limit: float,
                   out: torch.Tensor | None = None, block_n: int | None = None, block_k: int | None = None,
                   num_warps: int | None = None, shared: tuple[torch.Tensor, ...] | None = None,
                   routed_scale: float = 1.0, lean: bool | None = None) -> torch.Tensor:
    """Routed experts with MXFP8 weights: x [T, H] (bf16 / fp16 / fp32), topk_weights [T, k] (float; used in
    fp32), topk_ids [T, k] (integer expert ids), w13_q [E, 2I, H] fp8 (gate rows, then up rows) + w13_s
    [E, 2I, H/32] u8, w2_q [E, H, I] fp8 + w2_s [E, H, I/32] u8 -> [T, H] in x.dtype.

    = `moe.reference.experts(x, topk_weights, topk_ids, dequantize_mx(w13_q, w13_s), dequantize_mx(w2_q, w2_s),
    alpha, limit)`, with the reference's roundings (gate_up and down outputs and the activation in x.dtype, the
    weighted sum in fp32) and the k terms summed in order j = 0..k-1. Ids outside [0, E) contribute zero.

    shared = (s13_q [2I_s, H], s13_s, s2_q [H, I_s], s2_s) (MXFP8; I_s any multiple of 32): a shared expert that
    every token uses, run in the same two launches (one more gate_up pair per token, one more term in down).
    Returns routed_scale * experts(...) + shared(x) with the direct bf16 kernels' roundings: each routed term
    rounded again after its weight (routing weight * routed_scale), the shared output rounded, all summed in
    fp32 in order (routed j = 0..k-1, then shared) and rounded once. lean: the GEMVs' LEAN body (None: the tuned
    table's "moe" entry, else the plain body); the same sums in another order, within fp32 rounding."""
    fn = "mx_moe_experts"
    _check_weight("w13_q", w13_q, w13_s, "w13_s", 3, fn)
    _check_weight("w2_q", w2_q, w2_s, "w2_s", 3, fn)
    e, two_i, h = w13_q.shape
    if two_i % 2:
        raise ValueError(f"{fn}: w13_q {tuple(w13_q.shape)} must be [E, 2I, H] (an even number of gate / up rows)")
    inter = two_i // 2
    if tuple(w2_q.shape) != (e, h, inter):
        raise ValueError(f"{fn}: w2_q shape {tuple(w2_q.shape)} must be [E, H, I] = {(e, h, inter)} to match w13_q "
                         f"{tuple(w13_q.shape)}")
    if w2_q.device != w13_q.device:
        raise ValueError(f"{fn}: w2_q on {w2_q.device} but w13_q on {w13_q.device}")
    _check_x(fn, x, h, w13_q.device)
    t = x.shape[0]
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool \
            or topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_ids.device != x.device:
        raise ValueError(f"{fn}: topk_ids must be an integer [T={t}, k] tensor on {x.device}, got "
                         f"{(topk_ids.dtype, tuple(topk_ids.shape)) if isinstance(topk_ids, torch.Tensor) else topk_ids}")
    top_k = topk_ids.shape[1]
    if not isinstance(topk_weights, torch.Tensor) or not topk_weights.dtype.is_floating_point \
            or tuple(topk_weights.shape) != (t, top_k) or topk_weights.device != x.device:
        raise ValueError(f"{fn}: topk_weights must be a float [{t}, {top_k}] tensor on {x.device} (as topk_ids), got "
                         f"{(topk_weights.dtype, tuple(topk_weights.shape)) if isinstance(topk_weights, torch.Tensor) else topk_weights}")  # noqa: E501
    if top_k < 1:
        raise ValueError(f"{fn}: topk_ids has k = 0 columns")
    if out is None:
        out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    elif (not isinstance(out, torch.Tensor) or tuple(out.shape) != (t, h) or out.dtype != x.dtype
          or out.device != x.device or out.stride(1) != 1):
        raise ValueError(f"{fn}: out must be [{t}, {h}] {x.dtype} on {x.device} with unit column stride")
    if t == 0:
        return out
    ids = topk_ids.contiguous()
    wts = topk_weights.float().contiguous()
    act = torch.empty(t * top_k, inter, dtype=x.dtype, device=x.device)  # [T*k, I]
    if shared is not None:
        sq13, ss13, sq2, ss2 = _check_shared(fn, shared, h, w13_q.device)
        s_inter = sq13.shape[0] // 2
        sact = torch.empty(t, s_inter, dtype=x.dtype, device=x.device)  # [T, I_s]
    else:  # placeholders the kernels never read: a grid without the shared pairs has no program that reaches them
        sq13, ss13, sq2, ss2, s_inter, sact = w13_q[0], w13_s[0], w2_q[0], w2_s[0], inter, act
    _current_view()
    tuned = MOE_TUNED if t <= GEMV_MAX_T else {}  # the table's decode-size winner, else the defaults below
    block_k = block_k or tuned.get("block_k")
    block_n = block_n or tuned.get("block_n")
    num_warps = num_warps or tuned.get("num_warps", 4)
    lean = bool(tuned.get("lean", False)) if lean is None else lean
    bk1 = block_k or max(32, min(256, triton.next_power_of_2(h)))
    bk2 = block_k or max(32, min(256, triton.next_power_of_2(max(inter, s_inter))))
    bn1 = block_n or 16
    bn2 = block_n or 16
    pairs = t * top_k + (t if shared is not None else 0)
    _mx_moe_gate_up_kernel[(pairs, triton.cdiv(max(inter, s_inter), bn1))](
        x, ids, w13_q, w13_s, act, sq13, ss13, sact, t * top_k, e, h, inter, s_inter, x.stride(0), w13_q.stride(0),
        w13_q.stride(1), w13_s.stride(0), w13_s.stride(1), act.stride(0), sq13.stride(0), ss13.stride(0),
        sact.stride(0), float(alpha), float(limit), TOP_K=top_k, BLOCK_N=bn1, BLOCK_K=bk1, EVEN_K=h % bk1 == 0,
        PRECISE=not interpreting(), LEAN=lean, num_warps=num_warps, **pdl.args(x), **launch_opts())
    _mx_moe_down_kernel[(t, triton.cdiv(h, bn2))](
        act, ids, wts, w2_q, w2_s, out, sact, sq2, ss2, t, e, h, inter, s_inter, float(routed_scale), act.stride(0),
        w2_q.stride(0), w2_q.stride(1), w2_s.stride(0), w2_s.stride(1), out.stride(0), sact.stride(0), sq2.stride(0),
        ss2.stride(0), TOP_K=top_k, BLOCK_N=bn2, BLOCK_K=bk2, EVEN_K=inter % bk2 == 0, EVEN_KS=s_inter % bk2 == 0,
        HAS_SHARED=shared is not None, LEAN=lean, num_warps=num_warps, **pdl.args(x), **launch_opts())
    return out
