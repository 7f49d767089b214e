"""Tensor and expert parallelism on torch.distributed (NCCL on GPUs, gloo on CPU).

- `parallel_state.py`: `TPGroup` (rank, size, the process groups) and how heads / experts / vocabulary split;
- `layers.py`: sharded linear and embedding layers, and the `Shard` that says which slice a rank holds;
- `m3eagle/engine/executor.py`: starting the ranks (spawned workers, or torchrun), the per-step broadcast, faults
  and shutdown.

See docs/design/parallel.md.
"""

from m3eagle.distributed.parallel_state import SINGLE, TPError, TPGroup

__all__ = ["SINGLE", "TPError", "TPGroup"]
