"""`BatchInvariantFused`: the fused ops with every projection on the batch-invariant GEMM (`matmul.py`) and one
composition for every row count.

`TritonFused` runs a projection on the decode GEMV or cuBLAS by row count, and folds norms, residuals,
activations and the greedy pick into the GEMV only for some row counts: each choice moves a row's bf16
rounding points. Here every `linear` (q/k/v, o_proj, MLPs, the shared expert, lm_head, the draft head's
layers and its fc) and the router's fp32 GEMM run `matmul.linear`, and the folded forms are always the
separate launches. The norms, RoPE, activations, routing and argmax stay `TritonFused`'s: each is one
program per row whose block and warps come from the row width alone, so a row's reduction never depends on
the batch (tests/kernels/test_batch_invariant.py holds them to that).
"""

from __future__ import annotations

from m3eagle.kernels.batch_invariant import matmul
from m3eagle.kernels.fused.triton_backend import TritonFused
from m3eagle.kernels.moe.router import route
from m3eagle.kernels.quant.mxfp8 import MxWeight


def refuse_mxfp8(what: str) -> None:
    raise ValueError(f"deterministic=True does not run MXFP8 weights ({what}): the batch-invariant GEMM takes "
                     "bf16 / fp16 / fp32 weights; load the checkpoint dequantized or turn deterministic off")


class BatchInvariantFused(TritonFused):
    name = "batch_invariant"

    def __init__(self) -> None:
        super().__init__(gemv_max_t=0)  # never the decode GEMV

    def linear(self, x, w):
        if isinstance(w, MxWeight):
            refuse_mxfp8("a projection")
        return matmul.linear(x, w)

    def _gemv_takes(self, x, w) -> bool:
        return False  # linear_silu_mul / linear_swiglu_oai / linear_argmax: linear, then the row-local op

    def fold_config(self, t, w):
        return None  # norm_linear / linear_add: always the separate launches

    def router_logits(self, x, weight):
        """x [T, H] -> [T, E] fp32: the router GEMM in the router weight's dtype, as the reference."""
        return matmul.linear(x.to(weight.dtype), weight).float()

    def route_tokens(self, x, weight, bias, k):
        return route(self.router_logits(x, weight), bias, k)


def is_batch_invariant(fused: object) -> bool:
    return isinstance(fused, BatchInvariantFused)

