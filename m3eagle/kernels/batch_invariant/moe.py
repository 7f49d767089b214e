"""`BatchInvariantMoE`: the routed experts with one launch shape for every step.

`TritonMoE` takes the sort-free per-pair GEMV path for decode-sized steps, the sorted grouped GEMMs above,
with tiles from a tuning table by token bucket, the top-k combine folded into down for small steps and the
shared expert inside the routed launches: a (token, expert) pair's sum order follows the batch. Here every
step runs the sorted path (`triton_moe.fused_experts`) under `moe_config(...)`, a pure function of the
layer's shape (E, H, I, top-k), never of T:

    align (by expert, padded to block_m) -> gate_up GEMM + SwiGLU-OAI -> down GEMM x routing weight
    -> combine: each token's k contributions summed in fp32 in its top-k order (no atomics)

Steps of up to `triton_moe.COMBINE_FUSE_MAX_T` tokens sum in the down launch's last program per column tile
(the fused combine): that sum is `_combine_tile`, the combine launch's own code, so a token's bits are the same
on either side of the threshold and the choice may follow the step's size. Decode steps so save one launch per
layer.

A pair's row is the same chain of MMAs wherever the sort puts it in its expert's row block. The shared expert
rides in the same launches as one more expert every token uses (`experts_and_shared`: its segment of T rows
after the routed ones, each row the same chain of MMAs at every T, summed after the routed rows in the
combine), wherever the sorted GEMMs can index its weights -- a property of the weights, never of the step, so
a layer takes it at every T or at none (the model then runs it apart on the batch-invariant GEMM). Routing is
the fused ops' (router.py: the router GEMV and the route in one row-local launch). `reference.experts` stays
the oracle.
"""

from __future__ import annotations

import torch

from m3eagle.kernels.moe.tuning import MoEConfig
from m3eagle.kernels.quant.mxfp8 import MxWeight
from m3eagle.kernels.split_counters import SplitCounters


def moe_config(num_experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype) -> MoEConfig:
    """16-row blocks (decode steps route ~1 pair per expert), 64-wide column tiles, 64-deep K steps; no split
    tail (it would switch a block's tile height with its fill)."""
    return MoEConfig(block_m=16, block_n=64, block_k=64, group_m=1, num_warps=4, num_stages=3)


class BatchInvariantMoE:
    name = "batch_invariant"
    fuses_shared = True  # the shared expert rides in the routed launches where its weights allow (`experts_and_shared`)

    def __init__(self) -> None:
        from m3eagle.kernels.moe import triton_moe  # imports triton; only when this backend is built

        self._mod = triton_moe
        self._counters = SplitCounters()  # the fused combine's per-column-tile counters, per device

    def experts(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, gate_up_proj: torch.Tensor,
                down_proj: torch.Tensor, alpha: float, limit: float,
                expert_range: tuple[int, int] | None = None) -> torch.Tensor:
        """x [T, H], weights [T, k] fp32, idx [T, k] -> [T, H] in x.dtype (`MoEImpl.experts`)."""
        if isinstance(gate_up_proj, MxWeight) or isinstance(down_proj, MxWeight):
            raise ValueError("deterministic=True does not run MXFP8 experts: the batch-invariant MoE takes "
                             "bf16 / fp16 / fp32 weights; load the checkpoint dequantized or turn deterministic off")
        cfg = moe_config(gate_up_proj.shape[0], x.shape[1], down_proj.shape[2], idx.shape[1], x.dtype)
        return self._mod.fused_experts(x, weights, idx, gate_up_proj, down_proj, alpha, limit, expert_range,
                                       config=cfg, combine_counters=self._counters.get(x.device))

    def experts_and_shared(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor,
                           gate_up_proj: torch.Tensor, down_proj: torch.Tensor, shared_gate_up: torch.Tensor,
                           shared_down: torch.Tensor, alpha: float, limit: float,
                           routed_scale: float) -> torch.Tensor | None:
        """routed_scale * experts(...) + the shared expert (shared_gate_up [2I_s, H], shared_down [H, I_s]) on x
        [T, H], from the routed launches under `moe_config`; None where the sorted GEMMs cannot index the shared
        weights (decided from the weights alone, so the same for every step: the caller runs it apart)."""
        if isinstance(gate_up_proj, MxWeight) or isinstance(down_proj, MxWeight):
            return None  # `experts` refuses MXFP8 by name
        shared = (shared_gate_up, shared_down)
        if not self._mod.sorted_takes_shared(gate_up_proj, down_proj, shared):
            return None
        cfg = moe_config(gate_up_proj.shape[0], x.shape[1], down_proj.shape[2], idx.shape[1], x.dtype)
        return self._mod.fused_experts(x, weights, idx, gate_up_proj, down_proj, alpha, limit, None, config=cfg,
                                       shared=shared, routed_scale=routed_scale,
                                       combine_counters=self._counters.get(x.device))
