"""Building blocks shared by the target and the draft head: norms, RoPE, SwiGLU-OAI, MoE.

The elementwise math lives in `m3eagle.kernels.fused.reference` (and is re-exported here): the modules call it, and
the paged forward paths hand the same ops to the engine's fused backend (`meta.ops.fused`) instead."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from m3eagle.distributed.layers import (
    SCALE_SUFFIX,
    ColumnParallelLinear,
    RowParallelLinear,
    is_quantized,
    linear,
    rows,
    weight_of,
)
from m3eagle.distributed.parallel_state import SINGLE, TPGroup
from m3eagle.kernels.fused import reference as fused_ref
from m3eagle.kernels.moe import backend as moe_backend
from m3eagle.kernels.quant.mxfp8 import MxWeight


class GemmaRMSNorm(nn.Module):
    """RMSNorm computed in fp32 and scaled by (1 + w); the checkpoint stores w (zero-initialised)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_ref.rms_norm(x, self.weight, self.eps)


class LlamaRMSNorm(nn.Module):
    """Plain RMSNorm (scale w), as Llama-style Eagle3 heads use."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_ref.rms_norm(x, self.weight, self.eps, gemma=False)


class PackedLinears:
    """Bias-free Linears that read the same input, run as one GEMM on the fast path.

    `pack()` moves their weights back to back into one [sum(out), in] tensor and makes each module's
    weight a view of its rows: the values, state_dict names and the reference path stay as they were, and
    no memory is duplicated. `__call__` falls back to the separate modules when a weight was replaced
    after packing (a reload), so a stale pack can never be used. Pack after the model reached its final
    device and dtype (`.to()` makes new tensors) and after quantizing. MXFP8 modules pack their scales alike
    (rows of [sum(out), in / 32]); a group mixing MXFP8 and plain weights stays unpacked."""

    def __init__(self, mods: list[nn.Linear]):
        self.mods = mods
        self.sizes = [m.weight.shape[0] for m in mods]
        self.weight: torch.Tensor | None = None  # [sum(sizes), in]
        self.scale: torch.Tensor | None = None  # [sum(sizes), in / 32] uint8 when MXFP8

    def pack(self) -> None:
        if self.is_packed():
            return
        quant = [is_quantized(m) for m in self.mods]
        if any(quant) and not all(quant):
            return
        w = torch.cat([m.weight.detach() for m in self.mods], 0)
        s = torch.cat([getattr(m, "weight" + SCALE_SUFFIX) for m in self.mods], 0) if all(quant) else None
        for m, n, off in zip(self.mods, self.sizes, _offsets(self.sizes)):
            m.weight.data = w[off:off + n]
            if s is not None:
                setattr(m, "weight" + SCALE_SUFFIX, s[off:off + n])
        self.weight, self.scale = w, s

    def is_packed(self) -> bool:
        return self.weight is not None and _views_of(self.weight, [m.weight for m in self.mods], self.sizes) and (
            self.scale is None or _views_of(self.scale, [getattr(m, "weight" + SCALE_SUFFIX, None) for m in self.mods],
                                            self.sizes))

    def packed_weight(self) -> torch.Tensor | MxWeight:
        """The packed weight as the ops take it (an MxWeight when MXFP8)."""
        assert self.weight is not None
        return self.weight if self.scale is None else MxWeight(self.weight, self.scale)

    def __call__(self, x: torch.Tensor, fused: Any = None) -> list[torch.Tensor]:
        """x [T, in] -> one [T, n_i] output per module (column views of one GEMM's output when packed).
        `fused` (an m3eagle.kernels.fused.backend object) runs the packed GEMM (its decode GEMV); None = F.linear."""
        if self.is_packed():
            return list(linear(x, self.packed_weight(), fused).split(self.sizes, -1))
        return [m(x) for m in self.mods]


def _views_of(whole: torch.Tensor, parts: list[torch.Tensor | None], sizes: list[int]) -> bool:
    """Whether parts[i] is rows [off_i, off_i + sizes[i]) of `whole` (the packed storage)."""
    row = whole.stride(0) * whole.element_size()
    return all(p is not None and p.data_ptr() == whole.data_ptr() + off * row and p.shape[0] == n
               for p, n, off in zip(parts, sizes, _offsets(sizes)))


def pack_projections(model: nn.Module) -> int:
    """Pack every PackedLinears group of `model` (see there); returns how many groups are packed."""
    groups = [v for m in model.modules() for v in vars(m).values() if isinstance(v, PackedLinears)]
    for g in groups:
        g.pack()
    return len(groups)


def _offsets(sizes: list[int]) -> list[int]:
    out, off = [], 0
    for n in sizes:
        out.append(off)
        off += n
    return out


class SwigluOaiMLP(nn.Module):
    """gate_up_proj [2I, H] (gate rows then up rows) and down_proj [H, I]. Tensor parallel: each rank holds
    I / N of the gate rows and the matching up rows (column parallel) and the matching down_proj columns
    (row parallel); `reduce` all-reduces the output, else the caller folds it into its own all-reduce."""

    def __init__(self, hidden: int, inter: int, alpha: float, limit: float, tp: TPGroup = SINGLE,
                 reduce: bool = True, what: str = "intermediate_size"):
        super().__init__()
        self.alpha, self.limit = alpha, limit
        s, n = tp.split(inter, what)
        self.gate_up_proj = ColumnParallelLinear(hidden, 2 * inter, ((s, n), (inter + s, n)))
        self.down_proj = RowParallelLinear(inter, hidden, tp, reduce, what)

    def forward(self, x: torch.Tensor, fused: Any = None) -> torch.Tensor:
        """x [T, H] -> [T, H]. `fused` (an m3eagle.kernels.fused.backend object) runs the activation; None = reference."""
        gu = self.gate_up_proj
        if fused is not None and x.dim() == 2 and gu.bias is None:  # one launch on the decode GEMV's path
            a = fused.linear_swiglu_oai(x, weight_of(gu), self.alpha, self.limit)
        else:
            act = fused if fused is not None else fused_ref
            a = act.swiglu_oai(gu(x, fused), self.alpha, self.limit)
        return self.down_proj(a, fused)


class SiluMLP(nn.Module):
    """Llama MLP (gate/up/down), used by the Eagle3 head."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.gate_up = PackedLinears([self.gate_proj, self.up_proj])  # one GEMM once packed

    def forward(self, x: torch.Tensor, fused: Any = None) -> torch.Tensor:
        if fused is not None and x.dim() == 2 and self.gate_up.is_packed():
            a = fused.linear_silu_mul(x, self.gate_up.weight)  # one launch on the decode GEMV's path
        else:
            act = fused if fused is not None else fused_ref
            a = act.silu_mul(*self.gate_up(x, fused))
        return linear(a, self.down_proj.weight, fused)


class Router(nn.Module):
    """fp32 sigmoid router. `e_score_correction_bias` steers selection only; the combine weights are
    the plain sigmoid scores of the chosen experts, renormalised."""

    def __init__(self, hidden: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, fused: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] fp32, experts [T, k] int64); ties go to the lowest expert id (see
        fused.reference.route). `fused` runs the GEMM and everything after it; None = reference."""
        f = fused if fused is not None else fused_ref
        return f.route_tokens(x, self.weight, self.e_score_correction_bias, self.top_k)


class Experts(nn.Module):
    """Routed experts as stacked weights: gate_up_proj [E, 2I, H] (gate rows then up rows), down_proj
    [E, H, I] -- the layout transformers uses, so its save_pretrained output loads as is."""

    def __init__(self, num_experts: int, hidden: int, inter: int, alpha: float, limit: float,
                 tp: TPGroup = SINGLE):
        super().__init__()
        self.alpha, self.limit = alpha, limit
        # Expert parallel: this rank owns experts [e0, e0 + n) and runs the MoE's expert-subset mode on every
        # token; the other ranks' experts contribute zero here and arrive through the layer's all-reduce.
        e0, n = tp.split(num_experts, "num_local_experts")
        self.expert_range = (e0, e0 + n) if tp.size > 1 else None
        self.gate_up_proj = nn.Parameter(torch.empty(n, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(n, hidden, inter))
        if tp.size > 1:
            self.shards = {"gate_up_proj": rows(e0, n, num_experts), "down_proj": rows(e0, n, num_experts)}

    def forward(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor,
                impl: moe_backend.MoEImpl | None = None) -> torch.Tensor:
        """x [T, H], weights/idx [T, k] -> [T, H]. `impl` (an `m3eagle.kernels.moe.backend` object the engine owns)
        does the work; None means the dense reference, which training and `forward_seq` use."""
        impl = impl if impl is not None else moe_backend.reference()
        return impl.experts(x, weights, idx, weight_of(self, "gate_up_proj"), weight_of(self, "down_proj"),
                            self.alpha, self.limit, self.expert_range)


class SparseMoE(nn.Module):
    """Router (replicated: every rank routes every token), routed experts (expert parallel) and the shared
    expert (tensor parallel, not reduced on its own: its partial sum joins the routed one's all-reduce)."""

    def __init__(self, hidden: int, inter: int, shared_inter: int, num_experts: int, top_k: int,
                 scaling: float, alpha: float, limit: float, tp: TPGroup = SINGLE):
        super().__init__()
        self.routed_scaling_factor = scaling
        self.gate = Router(hidden, num_experts, top_k)
        self.experts = Experts(num_experts, hidden, inter, alpha, limit, tp)
        self.shared_experts = SwigluOaiMLP(hidden, shared_inter, alpha, limit, tp, reduce=False,
                                           what="shared_intermediate_size")

    def forward(self, x: torch.Tensor, impl: moe_backend.MoEImpl | None = None) -> torch.Tensor:
        """The training / oracle path (one rank: with tensor parallelism the sum would be this rank's part)."""
        w, idx = self.gate(x)
        # Routed output is scaled; the shared expert is not.
        return self.experts(x, w, idx, impl) * self.routed_scaling_factor + self.shared_experts(x)

    def forward_parts(self, x: torch.Tensor, ops: Any) -> tuple[torch.Tensor, torch.Tensor | None, float]:
        """Paged path with the engine's `ops` (m3eagle.kernels.ops.Ops): (a, b, s) [T, H], [T, H] | None, float,
        standing for a * s + b, which the caller leaves to the next fused add + norm. Usually (routed,
        shared, routed_scaling_factor); a MoE backend that fuses the shared expert into the routed kernels
        returns the whole sum, (out, None, 1.0)."""
        fast = getattr(ops.moe, "route_experts_and_shared", None)
        # The router + shared-expert launch routes as the triton fused ops do (bit for bit), so it stands in
        # for them only: with the reference ops the routing would change.
        if fast is not None and getattr(ops.fused, "name", "") == "triton" and self.shared_joinable() \
                and not self.quantized():
            g, e, sh = self.gate, self.experts, self.shared_experts
            out = fast(x, g.weight, g.e_score_correction_bias, g.top_k, e.gate_up_proj, e.down_proj,
                       sh.gate_up_proj.weight, sh.down_proj.weight, sh.alpha, sh.limit, self.routed_scaling_factor)
            if out is not None:
                return out, None, 1.0
        w, idx = self.gate(x, ops.fused)
        return self.expert_parts(x, w, idx, ops.moe, ops.fused)

    def expert_parts(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, impl: Any, fused: Any = None,
                     ) -> tuple[torch.Tensor, torch.Tensor | None, float]:
        """forward_parts after routing (w, idx [T, k] given): the shared expert inside the routed kernels
        when `impl` can and the weights allow it, else the two parts apart."""
        if getattr(impl, "fuses_shared", False) and self.shared_joinable() and self.quantized() in (0, 4):
            sh, e = self.shared_experts, self.experts
            out = impl.experts_and_shared(x, w, idx, weight_of(e, "gate_up_proj"), weight_of(e, "down_proj"),
                                          weight_of(sh.gate_up_proj), weight_of(sh.down_proj), sh.alpha, sh.limit,
                                          self.routed_scaling_factor)
            if out is not None:  # None: this step's kernels cannot take this shared expert
                return out, None, 1.0
        return self.experts(x, w, idx, impl), self.shared_experts(x, fused), self.routed_scaling_factor

    def quantized(self) -> int:
        """How many of the four expert weights (routed gate_up / down, shared gate_up / down) are MXFP8: 0 or 4
        may run the shared expert in the routed launches (the bf16 kernels, or the W8A16 decode MoE); a mix runs
        it apart, and any runs no bf16-only fused launch."""
        e, sh = self.experts, self.shared_experts
        return (is_quantized(e, "gate_up_proj") + is_quantized(e, "down_proj") + is_quantized(sh.gate_up_proj)
                + is_quantized(sh.down_proj))

    def shared_joinable(self) -> bool:
        """The shared expert may ride in the routed kernels if they can take its shape (the impl decides per
        step): one rank holds every expert and both use the same activation constants."""
        e, sh = self.experts, self.shared_experts
        return e.expert_range is None and (sh.alpha, sh.limit) == (e.alpha, e.limit)

    def can_fuse_shared(self) -> bool:
        """`shared_joinable`, and the shared expert has the routed experts' very shape and inner layout (one
        set of strides indexes both). The triton kernels also take other widths (`shared_joinable` is what
        the layer asks); this stricter test names the case any grouped-GEMM kernel could take."""
        e, sh = self.experts, self.shared_experts
        s13, s2 = sh.gate_up_proj.weight, sh.down_proj.weight
        return (e.expert_range is None and s13.shape == e.gate_up_proj.shape[1:] and s2.shape == e.down_proj.shape[1:]
                and s13.stride() == e.gate_up_proj.stride()[1:] and s2.stride() == e.down_proj.stride()[1:]
                and (sh.alpha, sh.limit) == (e.alpha, e.limit))
