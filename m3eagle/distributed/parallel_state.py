"""The tensor-parallel group one engine runs in: its rank, its size, and the two collectives the models
need (all-reduce of partial sums, all-gather of vocabulary shards).

Every cross-rank sum of the forward path (o_proj, the MLPs' down_proj, the MoE's routed + shared sum, the
vocab-parallel embedding lookup, the Eagle3 head's use of those) goes through `TPGroup.all_reduce`. By default
that is the backend's all-reduce, whose summation order is its own: NCCL picks algorithm, protocol and chunking
from the message size (rows x hidden), and a ring starts each chunk's sum at another rank, so an element's bits
depend on the batch. With `deterministic` (the engine's deterministic mode) a floating-point sum is
`fixed_order_all_reduce` instead: gather the partials, then add them in rank order 0, 1, .., W-1, so an
element's bits depend on its W partials alone (docs/design/deterministic.md).

A `TPGroup` is handed to the model at construction (no module global), so two engines in one process, or
a test that builds a rank by hand, never share one. `SINGLE` is the one-process group: every collective is
a no-op that returns its input, so tp=1 runs the same model code with no communication at all.

How a rank's heads are chosen (`head_shard`): rank r of N holds query heads [r*Hq/N, (r+1)*Hq/N). A
grouped head kind (KV heads, the indexer's heads) with at least N heads is split the same way; with fewer
it is replicated: rank r holds the one head its query heads read, head r // (N / H).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

# torch >= 2.12 renames all_gather_into_tensor (deprecated there) to all_gather_single; same contract.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def rank_order_sum(parts: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """parts [W, *S] (rank r's partial sum at parts[r]) -> out [*S] = (..((p0 + p1) + p2) ..) + p[W-1], written into
    `out` and returned. Half types accumulate in fp32 and round once into out's dtype (as the GEMMs that made the
    partials accumulate); fp32 / fp64 add in their own dtype. Only elementwise adds in a fixed order: an element's
    bits depend on its W values and nothing else -- not on S, not on where the element sits, not on how the
    device tiles the launch. W elementwise launches."""
    w = parts.shape[0]
    if w == 1:
        return out.copy_(parts[0])
    if parts.dtype not in (torch.float16, torch.bfloat16):  # fp32 / fp64: the chain runs in out itself
        torch.add(parts[0], parts[1], out=out)
        for r in range(2, w):
            out.add_(parts[r])
        return out
    acc = parts[0].float()  # exact upcast; each add_ then runs in fp32 (the promoted dtype)
    for r in range(1, w - 1):
        acc.add_(parts[r])
    return torch.add(acc, parts[w - 1], out=out)  # the last add in fp32, rounded once into out's dtype


# A message of at least this many bytes takes the two-phase fixed-order sum, whose traffic is an all-reduce's;
# a smaller one takes one all-gather (one collective: decode-sized messages are latency-bound). Both give the
# same bits, so the choice, which follows the row count, changes no result.
TWO_PHASE_MIN_BYTES = 1 << 20


def fixed_order_all_reduce(x: torch.Tensor, size: int, group: Any, two_phase: bool | None = None) -> torch.Tensor:
    """Sum x [*S] over the `size` ranks of `group` in rank order (see rank_order_sum), in place; returns x.

    One phase: all-gather every rank's whole partial and sum locally. Each rank receives (size - 1) x the
    message, size x what a ring all-reduce's reduce-scatter phase moves. Two phases (`two_phase`; None: from
    the message size, and never inside a CUDA-graph capture, whose collective stays the all-gather the logits
    gather captures too): an all-to-all hands rank r slice r of every rank's partial, rank r sums its slice in
    rank order, and an all-gather of the sums gives every rank the whole: an all-reduce's bytes, two
    collectives. Either way an element's sum is the same elementwise adds in the same order, so the two paths
    agree bit for bit and every rank holds the same bits. Fixed shapes, no host sync."""
    n = x.numel()
    if two_phase is None:
        two_phase = n * x.element_size() >= TWO_PHASE_MIN_BYTES and not (
            x.is_cuda and torch.cuda.is_current_stream_capturing())
    flat = x.contiguous().view(-1)  # [n]
    if not two_phase:
        parts = torch.empty(size * n, dtype=x.dtype, device=x.device)  # [W * n], rank r's partial at r
        _all_gather(parts, flat, group=group)
        return rank_order_sum(parts.view(size, *x.shape), x)
    c = -(-n // size)  # elements of each rank's slice (the last slice zero-padded)
    send = flat if c * size == n else torch.cat([flat, flat.new_zeros(c * size - n)])  # [W * c]
    recv = torch.empty_like(send)  # [W * c]: rank j's partial of this rank's slice at j
    dist.all_to_all_single(recv, send, group=group)
    mine = rank_order_sum(recv.view(size, c), torch.empty(c, dtype=x.dtype, device=x.device))  # [c]
    whole = torch.empty(size * c, dtype=x.dtype, device=x.device)  # [W * c]
    _all_gather(whole, mine, group=group)
    return x.copy_(whole[:n].view(x.shape))


class TPError(ValueError):
    """A tensor-parallel size the model cannot be split by; the message names the option and the fix."""


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup of the data plane (NCCL on GPUs, gloo on CPU)
    control: Any = None  # a gloo group for rank 0's step headers (host ints; see engine/executor.py)
    # Seconds spent inside all_reduce / all_gather calls since the last reset (host wall time: on a GPU it
    # only means something with CUDA_LAUNCH_BLOCKING or eager sync; the bench reads the profiler instead).
    comm_seconds: float = field(default=0.0, repr=False)
    timed: bool = field(default=False, repr=False)
    # The deterministic mode: floating-point sums in rank order (fixed_order_all_reduce), not the backend's order.
    deterministic: bool = False

    @property
    def is_driver(self) -> bool:
        """Rank 0 runs the scheduler and broadcasts each step to the others."""
        return self.rank == 0

    # ---- collectives --------------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group in place and return it (x itself when size is 1). The one entry point of every
        cross-rank sum: with `deterministic` a floating-point x is summed in rank order (`fixed_order_all_reduce`:
        the same bits whatever x's row count); else, and for integer x (whose sum is exact in any order), the
        backend's all-reduce."""
        if self.size == 1:
            return x
        t0 = time.perf_counter() if self.timed else 0.0
        if self.deterministic and x.is_floating_point():
            fixed_order_all_reduce(x, self.size, self.group)
        else:
            dist.all_reduce(x, group=self.group)
        if self.timed:
            self.comm_seconds += time.perf_counter() - t0
        return x

    def gather_last(self, x: torch.Tensor, full: int) -> torch.Tensor:
        """x [N, per] (this rank's slice of the last dim) -> [N, full]: every rank's slice, in rank order,
        cut to `full` columns (the vocabulary may be padded to size * per)."""
        if self.size == 1:
            return x[..., :full] if x.shape[-1] != full else x
        t0 = time.perf_counter() if self.timed else 0.0
        parts = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)  # [P*N, per]
        _all_gather(parts, x.contiguous(), group=self.group)
        if self.timed:
            self.comm_seconds += time.perf_counter() - t0
        return parts.view(self.size, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], -1)[..., :full]

    # ---- how tensors are split ----------------------------------------------------------------------
    def split(self, n: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's equal share of n items; n must divide evenly."""
        if n % self.size:
            raise TPError(f"tensor_parallel_size={self.size} does not divide {what}={n}; choose a "
                          f"tensor_parallel_size that divides it")
        per = n // self.size
        return self.rank * per, per

    def head_shard(self, num_heads: int, what: str) -> tuple[int, int]:
        """(first head, count) of a grouped head kind: split when num_heads >= size, else replicated so that
        each rank holds the one head its query heads need (see the module docstring)."""
        if num_heads % self.size == 0:
            return self.split(num_heads, what)
        if self.size % num_heads == 0:
            return self.rank // (self.size // num_heads), 1
        raise TPError(f"tensor_parallel_size={self.size} and {what}={num_heads}: one must divide the other "
                      "(heads are split, or replicated across the ranks of a group); choose another size")

    def vocab_shard(self, vocab: int) -> tuple[int, int, int]:
        """(start, rows held, rows allocated) of a vocabulary split in ceil(V / size) rows per rank; the last
        ranks may hold fewer real rows (zero padding)."""
        per = -(-vocab // self.size)
        start = min(self.rank * per, vocab)
        return start, min(per, vocab - start), per


SINGLE = TPGroup()
"""One process: no communication (every collective returns its input)."""
