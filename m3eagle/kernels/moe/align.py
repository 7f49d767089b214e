"""Sort (token, k) pairs by expert on the device, each expert's segment padded to the GEMM row block.

The routed GEMMs in `triton_moe.py` run over row blocks of `block_m` entries that all belong to one
expert. This step lays the T*k pairs out that way, with two small Triton kernels and no host sync:

    sorted_ids [max_blocks * block_m] int32: pair id p = t * k + j, or `num_pairs` (padding, invalid)
    block_expert [max_blocks] int32:         local expert of each row block; -1 past the last used block
    num_blocks [1] int32:                    blocks in use (a device value; GEMM programs past it exit)

    |<- expert 0: c0 pairs, padded ->|<- expert 1 ... ->| ... |<- unused (-1 blocks) ->|
    [p p p p p . . .][p p . . . . . .][p p p p p p p p][p . .] [. . . ...              ]

Within a segment, pairs keep their order in idx (a stable sort), so the layout is deterministic.

With `shared=True` a shared expert (one every token uses) joins as one more local expert, the last: its
pairs are T*k + t, so `triton_moe` runs it in the same grouped GEMMs as the routed experts (one launch
each instead of two cuBLAS GEMMs, an activation and an add per layer). Its segment needs no sorting: it
holds exactly T pairs, in order, right after the routed segments, so the kernels place it by arithmetic
and count only the routed experts. (It was a one-hot column of its own before: at m3-mini T = 4 that
doubled the placing kernel's [pairs, experts] tile, 64 columns for 33 experts, 3.6 vs 1.8 us on an H200.)

Shapes are static worst cases fixed by host ints (T, k, the number of local experts, block_m): at most
min(E, T*k) experts get a pair, each wasting at most block_m - 1 rows, so

    max_blocks = ceil((T*k + min(E, T*k) * (block_m - 1)) / block_m)

No blocking CPU operation in this path: it can be captured in a CUDA graph.

Kernel 1 (`_count_kernel`, one program per chunk of routed pairs): per-chunk expert histogram. Skipped when
one chunk holds every routed pair (decode steps): the single place program counts its own pairs.
Kernel 2 (`_place_kernel`, same grid): every program sums the histograms (so all agree on the segment
offsets), scatters its own chunk's routed pairs to offset + pairs of that expert in earlier chunks + rank
in the chunk, and writes the padding entries, the shared segment's pairs and the block experts of its
share of the padded buffer. The stores of the two roles never touch the same entry, so no barrier is
needed between them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from m3eagle.kernels import pdl
from m3eagle.kernels.pdl import pdl_wait


@dataclass
class Alignment:
    sorted_ids: torch.Tensor  # [max_blocks * block_m] int32, pair ids or num_pairs (padding)
    block_expert: torch.Tensor  # [max_blocks] int32, local expert or -1
    num_blocks: torch.Tensor  # [1] int32, blocks in use
    block_m: int
    max_blocks: int  # host int: the static grid bound
    num_pairs: int  # T*k, or T*(k+1) with a shared expert
    routed_pairs: int  # T*k: pair ids from here on are the shared expert's (one per token)


MAX_TILE = 16384  # elements of a program's [chunk, e_pad] one-hot tile, at most


def chunk_size(num_pairs: int, e_pad: int) -> int:
    """Routed pairs per program (e_pad: the routed experts' one-hot columns). Few pairs (decode) get one chunk
    just big enough: the single program's latency is the whole cost there (a 512-wide tile for 4 pairs cost
    12 us on an H200). Past that a program's one-hot work grows with the chunk and every program's histogram
    reduction with the number of chunks, so the chunk grows slowly with the pairs: `benchmarks/moe_kernel.py
    --align-sweep` on the H200 put the best at 64 pairs up to ~4K pairs and 128 from 8K to 40K (m3-mini,
    with and without the shared expert, measured while the shared expert's pairs were chunked too); 256 past 64K
    is an extrapolation."""
    want = 64 if num_pairs <= 4096 else 128 if num_pairs <= 65536 else 256
    return max(16, min(want, MAX_TILE // e_pad, triton.next_power_of_2(max(1, num_pairs))))


def max_blocks(num_pairs: int, num_local: int, block_m: int) -> int:
    return triton.cdiv(num_pairs + min(num_local, num_pairs) * (block_m - 1), block_m)


@triton.jit
def _pair_expert(idx_ptr, offs, routed_pairs, e_start, num_local):
    """Local routed expert of each pair id in offs, or -1 (past the routed pairs, or another rank's expert).
    The shared expert's pairs (ids from routed_pairs on) are placed by arithmetic, never through here."""
    ok = offs < routed_pairs
    e = tl.load(idx_ptr + offs, mask=ok, other=-1).to(tl.int32) - e_start
    return tl.where(ok & (e >= 0) & (e < num_local), e, -1)  # -1 matches no column


@triton.jit(do_not_specialize=["routed_pairs", "e_start"])
def _count_kernel(idx_ptr, hist_ptr, routed_pairs, e_start, num_local,
                  E_PAD: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """hist[c, e] = routed pairs of chunk c going to local expert e. Other ranks' experts count nowhere."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    e = _pair_expert(idx_ptr, offs, routed_pairs, e_start, num_local)
    hit = (e[:, None] == tl.arange(0, E_PAD)[None, :]).to(tl.int32)  # [CHUNK, E_PAD]
    tl.store(hist_ptr + c * E_PAD + tl.arange(0, E_PAD), tl.sum(hit, 0))


@triton.jit(do_not_specialize=["num_pairs", "routed_pairs", "e_start", "num_chunks", "padded_len",
                             "fill_per_prog"])
def _place_kernel(idx_ptr, hist_ptr, sorted_ptr, block_expert_ptr, num_blocks_ptr,
                  num_pairs, routed_pairs, e_start, num_local, num_chunks, padded_len, fill_per_prog,
                  BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr, HIST_ROWS: tl.constexpr,
                  SINGLE: tl.constexpr, HAS_SHARED: tl.constexpr, PDL: tl.constexpr):
    """num_local counts the local routed experts; with HAS_SHARED the shared expert is column num_local and
    its num_pairs - routed_pairs pairs (ids routed_pairs..) fill the segment after the routed ones."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    c = tl.program_id(0)
    experts = tl.arange(0, E_PAD)

    # This program's routed pairs: hit[i, e] = 1 iff pair c * CHUNK + i goes to local expert e. SINGLE: every
    # program reads the one chunk (to count), only program 0 scatters it, and all share the filling.
    if SINGLE:
        offs = tl.arange(0, CHUNK)
    else:
        offs = c * CHUNK + tl.arange(0, CHUNK)
    e = _pair_expert(idx_ptr, offs, routed_pairs, e_start, num_local)
    mine = (e >= 0) & (c * CHUNK + tl.arange(0, CHUNK) == offs)  # SINGLE: program 0 only
    hit = (e[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK, E_PAD], one 1 per placed pair

    if SINGLE:  # one chunk holds every routed pair (decode): count here, no histogram kernel
        count = tl.sum(hit, 0)
        earlier = tl.zeros([E_PAD], dtype=tl.int32)
    else:  # every program reduces all histograms: totals per expert, and the pairs of earlier chunks
        count = tl.zeros([E_PAD], dtype=tl.int32)
        earlier = tl.zeros([E_PAD], dtype=tl.int32)
        for r0 in range(0, num_chunks, HIST_ROWS):
            rows = r0 + tl.arange(0, HIST_ROWS)
            tile = tl.load(hist_ptr + rows[:, None] * E_PAD + experts[None, :], mask=rows[:, None] < num_chunks,
                           other=0)  # [HIST_ROWS, E_PAD]
            count += tl.sum(tile, 0)
            earlier += tl.sum(tl.where(rows[:, None] < c, tile, 0), 0)
    padded = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [E_PAD]; 0 for empty experts and pad columns
    seg_end = tl.cumsum(padded, 0)
    seg_start = seg_end - padded
    routed_len = tl.sum(padded, 0)  # the shared segment starts here
    n_shared = num_pairs - routed_pairs  # 0 without a shared expert
    total = routed_len + (n_shared + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    if c == 0:
        tl.store(num_blocks_ptr, total // BLOCK_M)

    # Role 1: scatter this chunk's routed pairs. dest = segment start + earlier chunks' pairs + rank in chunk.
    rank = tl.cumsum(hit, 0) - hit  # pairs of the same expert before this one in the chunk
    dest = tl.sum(hit * (rank + (seg_start + earlier)[None, :]), 1)  # [CHUNK]
    tl.store(sorted_ptr + dest, offs, mask=mine)

    # Role 2: positions of this program's share that hold no routed pair get `num_pairs` (padding) or, in
    # the shared segment, its pair routed_pairs + rel; block starts get their expert. The shares are at most
    # CHUNK long when SINGLE (the grid has one program per CHUNK positions: a serial loop in one program cost
    # 7-18 us per MoE layer on an H200 for 80-320 positions). A position p lies in routed expert e's segment
    # iff seg_start[e] <= p < seg_end[e] (empty segments match nothing), and holds a pair iff
    # p - seg_start[e] < count[e].
    lo = c * fill_per_prog
    hi = tl.minimum(lo + fill_per_prog, padded_len)
    for p0 in range(lo, hi, CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        in_share = p < hi
        inside = (p[:, None] >= seg_start[None, :]) & (p[:, None] < seg_end[None, :])  # [CHUNK, E_PAD]
        has_seg = tl.sum(inside.to(tl.int32), 1) > 0
        seg_e = tl.sum(tl.where(inside, experts[None, :], 0), 1)
        rel = tl.sum(tl.where(inside, p[:, None] - seg_start[None, :], 0), 1)
        n_in_seg = tl.sum(tl.where(inside, count[None, :], 0), 1)
        routed_real = has_seg & (rel < n_in_seg)  # role 1's entries: not written here
        value = tl.full([CHUNK], 0, tl.int32) + num_pairs
        if HAS_SHARED:
            in_shared = (p >= routed_len) & (p < total)
            has_seg = has_seg | in_shared
            seg_e = tl.where(in_shared, num_local, seg_e)
            value = tl.where(in_shared & (p - routed_len < n_shared), routed_pairs + p - routed_len, value)
        tl.store(sorted_ptr + p, value, mask=in_share & ~routed_real)
        tl.store(block_expert_ptr + p // BLOCK_M, tl.where(has_seg, seg_e, -1),
                 mask=in_share & (p % BLOCK_M == 0))


def align(idx: torch.Tensor, e_start: int, num_local: int, block_m: int, chunk: int | None = None,
          shared: bool = False) -> Alignment:
    """idx [T, k] global expert ids -> the pairs of experts [e_start, e_start + num_local) sorted by expert
    and padded to block_m (see the module docstring). Launch shapes depend on host ints only. `chunk`
    (pairs per program, a power of two) is for tests that want many programs on few pairs.

    shared: add one pair per token for a shared expert, as local expert `num_local` (its segment comes
    last): pair ids T*k .. T*k + T - 1, token t's being T*k + t. The alignment then has T*(k+1) pairs."""
    flat = idx.reshape(-1)
    if flat.dtype not in (torch.int32, torch.int64):
        flat = flat.to(torch.int64)
    flat = flat.contiguous()
    routed = flat.numel()
    n = routed + (idx.shape[0] if shared else 0)
    nb = max_blocks(n, num_local + int(shared), block_m)
    dev = idx.device
    e_pad = max(16, triton.next_power_of_2(max(1, num_local)))  # routed experts only: the shared one is arithmetic
    chunk = chunk or chunk_size(routed, e_pad)
    num_chunks = max(1, triton.cdiv(routed, chunk))
    padded_len = nb * block_m
    fill_per_prog = triton.cdiv(padded_len, num_chunks) if padded_len else 0
    hist = torch.empty(num_chunks, e_pad, dtype=torch.int32, device=dev)  # [chunks, E_PAD]; unused if single
    sorted_ids = torch.empty(padded_len, dtype=torch.int32, device=dev)
    block_expert = torch.empty(nb, dtype=torch.int32, device=dev)
    num_blocks = torch.empty(1, dtype=torch.int32, device=dev)
    single = num_chunks == 1
    if single:  # several programs share the filling of the padded layout, CHUNK positions each
        num_chunks = max(1, triton.cdiv(padded_len, chunk))
        fill_per_prog = triton.cdiv(padded_len, num_chunks) if padded_len else 0
    if not single:
        _count_kernel[(num_chunks,)](flat, hist, routed, e_start, num_local, E_PAD=e_pad, CHUNK=chunk, **pdl.args(flat))
    _place_kernel[(num_chunks,)](flat, hist, sorted_ids, block_expert, num_blocks, n, routed, e_start, num_local,
                                 num_chunks, padded_len, fill_per_prog, BLOCK_M=block_m, E_PAD=e_pad,
                                 CHUNK=chunk, HIST_ROWS=64, SINGLE=single, HAS_SHARED=shared, **pdl.args(flat))
    return Alignment(sorted_ids, block_expert, num_blocks, block_m, nb, n, routed)
