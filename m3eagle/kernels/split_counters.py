"""Split-K tile counters: the zeroed int32 buffer a one-launch split-K kernel counts its tiles' finished splits in.

Each launch leaves every counter it touched at zero again (the tile's last program resets it), so one buffer per
device serves every later launch without a memset, inside CUDA graphs too. Calls sharing one `SplitCounters` must
be ordered (one stream at a time), as an engine step's kernels are; owners that may run concurrently hold their own.
Used by the bf16 decode GEMV (fused/gemv.py), the W8A16 kernels (quant/w8a16.py) and the batch-invariant GEMM
(batch_invariant/matmul.py).
"""

from __future__ import annotations

import torch

DEFAULT_TILES = 16384  # output tiles (one int32 each: 64 KB per device)


class SplitCounters:
    """int32 [size] counters per device (or another integer dtype: the int64 running maxima of a folded argmax),
    zero between launches, made on first use and never grown (a graph captured later points at this one live
    buffer)."""

    def __init__(self, size: int = DEFAULT_TILES, dtype: torch.dtype = torch.int32) -> None:
        self.size = size
        self.dtype = dtype
        self._bufs: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device | str) -> torch.Tensor | None:
        """The counters of `device`, allocated on first use; None while a CUDA graph is being captured and they do
        not exist yet (a zero-fill recorded in a graph would run only at replay)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:N" name one buffer
            device = torch.device("cuda", torch.cuda.current_device())
        c = self._bufs.get(device)
        if c is None:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return None
            c = self._bufs[device] = torch.zeros(self.size, dtype=self.dtype, device=device)
        return c

    def __contains__(self, device: torch.device | str) -> bool:
        return torch.device(device) in self._bufs

    def __len__(self) -> int:
        return len(self._bufs)
