"""Programmatic dependent launch (PDL) for the engine's Triton kernels, in small-batch CUDA graphs by default.

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

When. Only on a CUDA device of compute capability >= 9; M3EAGLE_PDL (read at each launch, so a process can
A/B it) says where: "1" every launch, "0" none, unset ("auto") only the launches captured into the CUDA
graphs of small batch buckets (<= AUTO_MAX_BUCKET rows; the GraphRunner opens `scope(True)` around their
capture). Why not everywhere: on the H200 PDL made the batch-1 steps faster (m3-mini 0.70 -> 0.63 ms per
step) but the m3-mini batch-32 K=3 step slower (2.43 -> 2.60 ms) -- multi-wave kernels gain little from an
earlier launch, and the cause of the loss is not known. Under the CPU interpreter PDL is always off (no launch
option, no wait).

Exceptions, each named in tests/kernels/test_pdl.py, all reads of weights no kernel writes into registers before
the wait, so that their latency overlaps the predecessor's tail; everything else they read after it:
- the decode MoE's down kernel with PRELOAD (moe/direct.py): its routing too (written two
  launches back, complete before its predecessor's programs passed their own waits) -- its weight stream
  overlaps gate_up's last wave; the routed gate_up launch's shared-down programs likewise;
- the decode GEMV's first weight tile and the decode router's expert rows (`preload_weights`): their
  predecessors at batch 1 are latency-bound norm / attention launches that stream little.

Not done here: prefetching weights into L2 before the wait (the early blocks idle there). Built and measured
on the H200, it made every decode layer slower -- the predecessor is itself streaming tens of MB, so the
prefetched lines are evicted before use.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Iterator

import torch
import triton
import triton.language as tl


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


AUTO_MAX_BUCKET = 4  # "auto": graphs of batch buckets up to this many rows launch with PDL
_SCOPE: contextvars.ContextVar[bool] = contextvars.ContextVar("m3eagle_pdl_scope", default=False)


@contextlib.contextmanager
def scope(on: bool) -> Iterator[None]:
    """Launches inside take PDL under M3EAGLE_PDL=auto when `on` (the GraphRunner's small-bucket captures)."""
    token = _SCOPE.set(on)
    try:
        yield
    finally:
        _SCOPE.reset(token)


def mode() -> str:
    """M3EAGLE_PDL as "1", "0" or "auto" (unset); anything else is an error that names the choices."""
    m = os.environ.get("M3EAGLE_PDL", "auto").strip().lower() or "auto"
    if m not in ("0", "1", "auto"):
        raise ValueError(f"M3EAGLE_PDL={m!r}: use 1 (every launch), 0 (none) or auto / unset (small-batch graphs)")
    return m


def enabled(device: torch.device) -> bool:
    """PDL for a launch on `device` now: asked for (M3EAGLE_PDL=1, or auto inside `scope(True)`) and
    supported (CUDA, sm_90+)."""
    if device.type != "cuda":
        return False
    m = mode()
    if m == "0" or (m == "auto" and not _SCOPE.get()):
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


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


def preload_weights(launch: dict) -> bool:
    """Whether a kernel launched with these `args` keywords reads its weights before its wait (the second
    exception above: the decode GEMV's first weight tile, the router's expert rows): with PDL on,
    unless M3EAGLE_PDL_PRELOAD=0 (an A/B switch, read at each launch like M3EAGLE_PDL)."""
    if not launch.get("PDL"):
        return False
    m = os.environ.get("M3EAGLE_PDL_PRELOAD", "1").strip() or "1"
    if m not in ("0", "1"):
        raise ValueError(f"M3EAGLE_PDL_PRELOAD={m!r}: use 1 (weights read before the PDL wait; the default) or 0")
    return m == "1"
