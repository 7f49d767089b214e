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

Weight prefetch (PDL = PREFETCH, the default with PDL on). A kernel launched early spends its wait idle,
while its predecessor (a norm, an attention, a router: short and latency-bound) leaves HBM mostly unused.
So before `pdl_wait` a kernel may ask L2 for the lines it will read that no kernel of the step writes --
its weights (`prefetch_rows`: `prefetch.global.L2`, a hint that loads nothing into registers) -- and it
may read, with L2-coherent `.cg` loads, metadata written two or more launches back (the routed experts'
ids: written by the router before the gate_up kernel that precedes down). Why that is safe: a kernel's
blocks are scheduled only after every block of its predecessor has passed its own wait, so every launch
before the predecessor has completed and its writes are in L2. Values never differ: a prefetch only moves
lines into L2, so results stay bit-equal to launches without PDL. M3EAGLE_PDL_PREFETCH=0 keeps the wait
and drops the prefetch (an A/B switch).

When. Only on a CUDA device of compute capability >= 9; M3EAGLE_PDL (read at each launch, so a process can
A/B it) says where: "1" every launch, "0" none, unset ("auto") only the launches captured into the CUDA
graphs of small batch buckets (<= AUTO_MAX_BUCKET rows; the GraphRunner opens `scope(True)` around their
capture). Why not everywhere: on the H200 PDL made the batch-1 steps faster (m3-mini 0.70 -> 0.63 ms per
step, design note 35) but the m3-mini batch-32 K=3 step slower (2.43 -> 2.60 ms, docs/results/
h200-2026-12-01c/pdl_ab) -- multi-wave kernels gain little from an earlier launch, and the cause of the
loss is not known. Under the CPU interpreter PDL is always off (no launch option, no wait).
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


WAIT, PREFETCH = 1, 2  # values of the kernels' PDL constexpr (0: off)


def prefetch_on() -> bool:
    """M3EAGLE_PDL_PREFETCH (read at each launch): "1" / unset prefetch weights before the wait, "0" not."""
    m = os.environ.get("M3EAGLE_PDL_PREFETCH", "1").strip() or "1"
    if m not in ("0", "1"):
        raise ValueError(f"M3EAGLE_PDL_PREFETCH={m!r}: use 1 (prefetch weights into L2 before the PDL wait) or 0")
    return m == "1"


def args(t: torch.Tensor) -> dict:
    """Launch keywords for a kernel whose tensors live with `t`: the PDL constexpr (0 off, WAIT, PREFETCH),
    and with PDL on the launch option that lets the kernel start before its predecessor drains."""
    if enabled(t.device):
        return {"PDL": PREFETCH if prefetch_on() else WAIT, "launch_pdl": True}
    return {"PDL": 0}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Every engine kernel's first memory-ordering statement. With PDL on: wait until the stream's previous
    kernel has finished and its writes are visible, then let the next kernel's blocks be scheduled. Off:
    nothing. Before it a kernel touches only what `prefetch_rows` may (see the module docstring)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _prefetch_l2(ptrs):
    """One `prefetch.global.L2` per element of ptrs (any shape): the line holding it is fetched into L2."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def prefetch_rows(row_ptrs, n, PDL: tl.constexpr, LINES: tl.constexpr):
    """With PDL == PREFETCH (before `pdl_wait`): ask L2 for elements [0, n) of every row starting at
    row_ptrs [R] (read-only data only: weights). LINES 128-byte lines per row per loop step, so one step is
    an [R, LINES] tile of prefetches spread over the program's threads. Off: nothing (also under the CPU
    interpreter, where PDL is always 0)."""
    if PDL == 2:
        LINE: tl.constexpr = 1024 // row_ptrs.dtype.element_ty.primitive_bitwidth  # elements per 128 B
        offs = tl.arange(0, LINES) * LINE  # [L]
        for k in range(0, n, LINES * LINE):
            cols = tl.minimum(k + offs, n - 1)  # in-bounds: the last line repeats (a no-op prefetch)
            _prefetch_l2(row_ptrs[:, None] + cols[None, :])  # [R, L]
