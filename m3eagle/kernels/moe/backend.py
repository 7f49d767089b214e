"""MoE backends behind one small interface, and a registry of lazy factories.

`reference` is the dense PyTorch oracle (`reference.py`): the CPU path, the training path (autograd) and
what the tests hold the fast path to. `triton` computes only the chosen experts with fused Triton kernels
(`triton_moe.py`); triton is imported only when that backend is built.

Backends are objects that an engine owns and hands to the model (`SparseMoE.forward(x, impl)`), never a
module global, so two engines in one process (or a rank of a group) do not share a choice."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

import torch

from m3eagle.kernels.quant.mxfp8 import MxWeight


class MoEImpl(Protocol):
    name: str

    def experts(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, gate_up_proj: torch.Tensor,
                down_proj: torch.Tensor, alpha: float, limit: float,
                expert_range: tuple[int, int] | None = None) -> torch.Tensor:
        """x [T, H], weights [T, k] fp32, idx [T, k] -> sum_j weights[t, j] * expert_{idx[t, j]}(x[t]) over
        the pairs whose expert is in expert_range [e0, e1) (all when None): [T, H] in x.dtype. The expert weights
        may be MxWeights (MXFP8): the W8A16 kernels run them, or the oracle dequantizes them."""
        ...

    # Whether `experts_and_shared` exists: the routed experts and the shared expert in one pass (it returns
    # None for a step whose kernels cannot take that shared expert).
    fuses_shared: bool


class ReferenceMoE:
    """Every expert on every token, combined densely. Graph-capturable and differentiable."""

    name = "reference"
    fuses_shared = False  # the oracle keeps the model's own sum: routed * scale + shared, apart

    def __init__(self) -> None:
        # Imported here, not at the top: reference.py imports models.layers, which imports this module.
        from m3eagle.kernels.moe import reference

        self._experts = reference.experts

    def experts(self, x, weights, idx, gate_up_proj, down_proj, alpha, limit, expert_range=None):
        w13, w2 = (w.dequantize(x.dtype) if isinstance(w, MxWeight) else w for w in (gate_up_proj, down_proj))
        return self._experts(x, weights, idx, w13, w2, alpha, limit, expert_range)


class TritonMoE:
    """Only the chosen experts, from fused Triton kernels; no host sync, so it can be captured in a CUDA
    graph. `config` pins one block configuration (tuning, tests); None picks one per step shape from the
    tuning table (`tuning.py`). Inference only: no autograd."""

    name = "triton"
    fuses_shared = True

    def __init__(self, config: Any = None, fuse_combine: bool = True) -> None:
        from m3eagle.kernels.fused.gemv import SplitCounters
        from m3eagle.kernels.moe import triton_moe  # imports triton
        from m3eagle.kernels.quant import w8a16

        self._mod = triton_moe
        self._w8a16 = w8a16
        self.config = config
        self.fuse_combine = fuse_combine  # decode-sized steps sum in the down launch (triton_moe docstring)
        self._counters = SplitCounters()  # this backend's fused-combine counters, per device
        self._route_counters = SplitCounters()  # the route + shared launch's per-token counters, per device

    def _combine_counters(self, x: torch.Tensor) -> torch.Tensor | None:
        """The zeroed counters of x's device (made on the first eager call; None while a CUDA graph is being
        captured without them: the engine's eager warm-up steps make them first), or None with the fusion
        off -- calls without them run the separate combine."""
        return self._counters.get(x.device) if self.fuse_combine else None

    def experts(self, x, weights, idx, gate_up_proj, down_proj, alpha, limit, expert_range=None):
        if isinstance(gate_up_proj, MxWeight) and isinstance(down_proj, MxWeight):
            if x.shape[0] > self._w8a16.GEMV_MAX_T:  # prompt sizes: the sorted grouped GEMMs on the fp8 tiles
                return self._mod.mx_fused_experts(x, weights, idx, gate_up_proj, down_proj, alpha, limit, expert_range,
                                                  combine_counters=self._combine_counters(x))
            # decode sizes: per-pair GEMVs. expert_range [e0, e1): the range's experts as local 0..e1-e0 (a slice
            # when the stacks hold every expert); ids outside it fall outside [0, e1 - e0) and contribute zero,
            # as in the reference
            g, d, ids = gate_up_proj, down_proj, idx
            if expert_range is not None:
                e0, e1 = expert_range
                if g.shape[0] != e1 - e0:
                    g, d = MxWeight(g.q[e0:e1], g.scale[e0:e1]), MxWeight(d.q[e0:e1], d.scale[e0:e1])
                ids = idx - e0
            return self._w8a16.mx_moe_experts(x, weights, ids, g.q, g.scale, d.q, d.scale, alpha, limit)
        if isinstance(gate_up_proj, MxWeight) or isinstance(down_proj, MxWeight):
            raise ValueError("triton MoE: gate_up_proj and down_proj must both be MXFP8 or both plain")
        return self._mod.fused_experts(x, weights, idx, gate_up_proj, down_proj, alpha, limit, expert_range,
                                       config=self.config, combine_counters=self._combine_counters(x))

    def experts_and_shared(self, x, weights, idx, gate_up_proj, down_proj, shared_gate_up, shared_down, alpha,
                           limit, routed_scale):
        """routed_scale * experts(...) + the shared expert (shared_gate_up [2I_s, H], shared_down [H, I_s]) on
        x, from the routed kernels' launches: the shared expert is one more expert that every token uses
        (`triton_moe.fused_experts(shared=...)`; any width). All experts, one rank. None where this step
        cannot take it (`triton_moe.shared_fusable`: another dtype, or inner strides the sorted GEMMs cannot
        index off the direct path): the caller runs the shared expert apart. All four MXFP8 (MxWeights): the
        decode path's per-pair launches take it (`w8a16.mx_moe_experts(shared=...)`) up to GEMV_MAX_T tokens."""
        ws = (gate_up_proj, down_proj, shared_gate_up, shared_down)
        if any(isinstance(w, MxWeight) for w in ws):
            if not all(isinstance(w, MxWeight) for w in ws) or x.shape[0] > self._w8a16.GEMV_MAX_T:
                return None  # prompt sizes: the sorted MXFP8 GEMMs take no shared expert yet
            return self._w8a16.mx_moe_experts(x, weights, idx, gate_up_proj.q, gate_up_proj.scale, down_proj.q,
                                              down_proj.scale, alpha, limit, routed_scale=routed_scale,
                                              shared=(shared_gate_up.q, shared_gate_up.scale, shared_down.q,
                                                      shared_down.scale))
        if not self._mod.shared_fusable(x.shape[0], idx.shape[1], gate_up_proj, down_proj,
                                        (shared_gate_up, shared_down), self.config):
            return None
        return self._mod.fused_experts(x, weights, idx, gate_up_proj, down_proj, alpha, limit, None,
                                       config=self.config, shared=(shared_gate_up, shared_down),
                                       routed_scale=routed_scale, combine_counters=self._combine_counters(x))

    def route_experts_and_shared(self, x, router_weight, router_bias, top_k, gate_up_proj, down_proj, shared_gate_up,
                                 shared_down, alpha, limit, routed_scale) -> torch.Tensor | None:
        """The whole SparseMoE output, routing included, where the step's tuning entry asks for the route +
        shared-expert launch (`direct.route_direct_experts`: bit-equal to routing with the triton fused ops
        then `experts_and_shared`); None where it does not apply (the caller routes and calls
        experts_and_shared)."""
        t = x.shape[0]
        direct = self._mod.direct
        if t > direct.router.ROUTER_GEMV_MAX_T:  # past the decode router: no table lookup per layer
            return None
        cfg = self.config or self._mod.tuning.get_config(t, gate_up_proj.shape[0], x.shape[1], down_proj.shape[2],
                                                        top_k, x.dtype, x.device)
        shared = (shared_gate_up, shared_down)  # any width: the direct kernels index it apart
        if not (cfg.direct and cfg.route_shared and direct.usable(gate_up_proj, down_proj, shared)
                and gate_up_proj.dtype == x.dtype and down_proj.dtype == x.dtype
                and direct.can_route(x, router_weight, top_k, cfg)):
            return None
        counters = self._route_counters.get(x.device)
        if counters is None or counters.numel() < t:
            return None  # first call under CUDA-graph capture: the engine's eager warm-up makes them first
        return direct.route_direct_experts(x, router_weight, router_bias, top_k, counters, gate_up_proj, down_proj,
                                           alpha, limit, cfg, shared, routed_scale)


def _batch_invariant() -> MoEImpl:
    from m3eagle.kernels.batch_invariant.moe import BatchInvariantMoE  # imports triton

    return BatchInvariantMoE()


_FACTORIES: dict[str, Callable[..., MoEImpl]] = {"reference": ReferenceMoE, "triton": TritonMoE,
                                                 "batch_invariant": _batch_invariant}


def register(name: str, factory: Callable[..., MoEImpl]) -> None:
    _FACTORIES[name] = factory


def names() -> list[str]:
    return sorted(_FACTORIES)


def create(name: str, **kwargs: Any) -> MoEImpl:
    """A new backend object; kwargs go to its constructor (e.g. `config=` for triton)."""
    if name not in _FACTORIES:
        raise ValueError(f"moe_backend={name!r} is unknown; choose one of {names()}")
    return _FACTORIES[name](**kwargs)


@functools.cache
def reference() -> ReferenceMoE:
    """The default when a caller passes no impl. It is stateless, so one shared instance is safe."""
    return ReferenceMoE()
