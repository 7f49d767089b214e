"""Helpers every Triton kernel of the package shares: libdevice math behind a PRECISE switch and the launch
options that keep fused kernels bit-equal to the torch ops they replace.

Exactness. A fused kernel computes in fp32 and rounds to the activation dtype exactly where the reference's
torch ops round (an op on bf16 tensors returns bf16), so elementwise results can be bit-equal to the
reference on CUDA: PyTorch's CUDA kernels compute exp / cos / sin / rsqrt with CUDA's libm and divide with
IEEE division; with PRECISE the kernels call the same libdevice functions and `div_rn`, and
`enable_fp_fusion=False` keeps the compiler from contracting a*b + c into an FMA that the separate torch
kernels cannot form. A reduction's summation order cannot match bit for bit (an RMSNorm's mean square, the
router's renormalising sum may differ in the last fp32 bit).
Under the CPU interpreter (PRECISE off) the math runs in numpy, whose exp/cos differ from torch's CPU ones by
an ulp, and the interpreter truncates fp32 -> bf16 instead of rounding to nearest: CPU tests compare in fp32
and the bf16 checks run on the GPU (benchmarks/fused_ops.py).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

# PRECISE (a constexpr) picks libdevice on the GPU: the functions PyTorch's CUDA kernels call, so results
# are identical. The interpreter has no libdevice; there tl.* maps to numpy.


@triton.jit
def exp_precise(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def rsqrt_precise(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.rsqrt(x)
    else:
        return tl.rsqrt(x)


@triton.jit
def cos_precise(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.cos(x)
    else:
        return tl.cos(x)


@triton.jit
def sin_precise(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.sin(x)
    else:
        return tl.sin(x)


def precise() -> bool:
    """libdevice on the GPU; numpy math under the CPU interpreter (read per launch: tests set the env)."""
    return os.environ.get("TRITON_INTERPRET", "0") != "1"


def interpreting() -> bool:
    """Whether Triton kernels run under the CPU interpreter (TRITON_INTERPRET=1)."""
    return not precise()


def launch_opts() -> dict[str, Any]:
    # No FMA contraction: torch runs a*b and + c as separate kernels, each rounding.
    return {"enable_fp_fusion": False}


def warps_for(block: int) -> int:
    return 1 if block <= 256 else 2 if block <= 1024 else 4 if block <= 4096 else 8


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., N] -> [R, N] with unit channel stride (a view when the layout allows)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


