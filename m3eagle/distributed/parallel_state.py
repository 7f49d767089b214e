"""The tensor-parallel group one engine runs in: its rank, its size, and the two collectives the models
need (all-reduce of partial sums, all-gather of vocabulary shards).

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


class TPError(ValueError):
    """A tensor-parallel size the model cannot be split by; the message names the option and the fix."""


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup of the data plane (NCCL on GPUs, gloo on CPU)
    control: Any = None  # a gloo group for rank 0's step headers (host ints; see launch.py)
    # Seconds spent inside all_reduce / all_gather calls since the last reset (host wall time: on a GPU it
    # only means something with CUDA_LAUNCH_BLOCKING or eager sync; the bench reads the profiler instead).
    comm_seconds: float = field(default=0.0, repr=False)
    timed: bool = field(default=False, repr=False)

    @property
    def is_driver(self) -> bool:
        """Rank 0 runs the scheduler and broadcasts each step to the others."""
        return self.rank == 0

    # ---- collectives --------------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group in place and return it (x itself when size is 1)."""
        if self.size == 1:
            return x
        t0 = time.perf_counter() if self.timed else 0.0
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
