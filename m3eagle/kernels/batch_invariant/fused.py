"""`BatchInvariantFused`: the fused ops with every projection on the batch-invariant GEMM (`matmul.py`) and one
composition for every row count.

`TritonFused` runs a projection on the decode GEMV or cuBLAS by row count, and folds norms, residuals,
activations and the greedy pick into the GEMV only for some row counts: each choice moves a row's bf16
rounding points. Here every `linear` (q/k/v, o_proj, MLPs, the shared expert, lm_head, the draft head's
layers and its fc, a shared expert the MoE launches cannot take) runs `matmul.linear`, and a fold is taken
at every row count or at none:

- folded always (folds.py, router.py): the gate_up GEMM + SwiGLU / SiLU-and-multiply (`linear_act`), the LM
  head + argmax (`linear_argmax`) and the router (its fp32 GEMM + the route, `router.route_tokens`), each one
  launch whose bits equal its two-launch form's;
- never folded: the norm prologue and residual epilogue (`norm_linear` / `linear_add` run their separate
  launches).

The norms, RoPE, activations, routing and argmax launches are `TritonFused`'s: each is one program per row whose
block and warps come from the row width alone, so a row's reduction never depends on the batch
(tests/kernels/test_batch_invariant.py holds them to that).
"""

from __future__ import annotations

import torch

from m3eagle.kernels.batch_invariant import folds, matmul, router
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
        return False  # no decode GEMV: its config follows the row count

    def fold_config(self, t, w):
        return None  # norm_linear / linear_add: always the separate launches

    def linear_silu_mul(self, x, w):
        """x [T, K], packed gate / up w [2I, K] -> silu(gate) * up [T, I], one launch (`folds.linear_act`)."""
        if isinstance(w, MxWeight):
            refuse_mxfp8("an MLP's gate_up")
        return folds.linear_act(x, w, "silu")

    def linear_swiglu_oai(self, x, w, alpha, limit):
        """x [T, K], packed gate / up w [2I, K] -> swiglu_oai [T, I], one launch (`folds.linear_act`)."""
        if isinstance(w, MxWeight):
            refuse_mxfp8("an MLP's gate_up")
        return folds.linear_act(x, w, "swiglu_oai", alpha, limit)

    def linear_argmax(self, x, w, offsets=None, out=None, scatter=None):
        """x [T, K], w [V, K] -> argmax ids [T] int64 (+ offsets), one launch (`folds.linear_argmax`)."""
        if isinstance(w, MxWeight):
            refuse_mxfp8("the LM head")
        return folds.linear_argmax(x, w, offsets, out, scatter)

    def router_logits(self, x, weight):
        """x [T, H] -> [T, E] fp32: `router.router_logits` for an fp32 router weight (the checkpoint's), else the
        GEMM in the weight's dtype, as the reference."""
        if weight.dtype == torch.float32:
            return router.router_logits(x, weight)
        return matmul.linear(x.to(weight.dtype), weight).float()

    def route_tokens(self, x, weight, bias, k):
        """x [T, H] -> (weights [T, k] fp32, experts [T, k] int64): one launch (`router.route_tokens`)."""
        if router.supports(x, weight, k):
            return router.route_tokens(x, weight, bias, k)
        return route(self.router_logits(x, weight), bias, k)


def is_batch_invariant(fused: object) -> bool:
    return isinstance(fused, BatchInvariantFused)

