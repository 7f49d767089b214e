"""Programmatic dependent launch (PDL) for the engine's Triton kernels: opt-in, `M3EAGLE_PDL=1`.

Why. A decode step is a chain of ~90-150 small kernels (embedded / m3-mini) replayed from a CUDA graph;
each boundary costs the next kernel's launch and prologue after the previous one has fully drained. With
PDL (Hopper and later) a kernel may be scheduled while its predecessor's last blocks still run, and it
waits in-kernel (`griddepcontrol.wait`) until the predecessor has completed and its writes are visible.

Contract. Every Triton kernel of the engine takes a `PDL` constexpr and its first statement is
`pdl_wait(PDL)`: with PDL on, `tl.extra.cuda.gdc_wait()` before any global load or store, then
`gdc_launch_dependents()` (the next kernel's blocks may now be scheduled, to wait in their turn); it is
launched with `launch_pdl=True`.
Waiting first means a kernel touches no memory before every earlier kernel of the stream has finished
(by induction: a kernel triggers only after its own wait; a predecessor that never triggers -- cuBLAS, a
torch op -- triggers at its completion), so results are bit-equal to launches without PDL: only launch
latency and block scheduling overlap the predecessor's tail. Kernels not launched here (cuBLAS,
torch) launch as before and wait for their predecessor in full.

Off by default: enabled only on a CUDA device of compute capability >= 9 with M3EAGLE_PDL=1 (read at each
launch, so a process can A/B it). Under the CPU interpreter PDL is always off (no launch option, no wait).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """PDL for launches on `device`: asked for (M3EAGLE_PDL=1) and supported (CUDA, sm_90+)."""
    return (device.type == "cuda" and os.environ.get("M3EAGLE_PDL", "0") == "1"
            and _capable(device.index if device.index is not None else torch.cuda.current_device()))


def args(t: torch.Tensor) -> dict:
    """Launch keywords for a kernel whose tensors live with `t`: the PDL constexpr, and with PDL on the
    launch option that lets the kernel start before its predecessor drains."""
    if enabled(t.device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Every engine kernel's first statement. With PDL on: wait until the stream's previous kernel has
    finished and its writes are visible, then let the next kernel's blocks be scheduled. Off: nothing."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
