"""Sharded layers: each rank holds a slice of the full weight, and says which (`shards`), so that the
checkpoint loader and the random-weights builder fill it from the full tensor's coordinates.

    ColumnParallelLinear  weight [out_local, in]: a subset of output rows (heads, an MLP's gate/up halves)
    RowParallelLinear     weight [out, in_local]: partial sums, all-reduced unless the caller fuses them
    VocabParallelEmbedding / ParallelLMHead: vocabulary rows; lookups all-reduced, logits all-gathered

With a one-process group (`SINGLE`) every class is its plain torch counterpart holding the full weight:
the same forward, no collective, the same parameter names (so state_dict and training are unchanged).

MXFP8 weights (`quantize_param`): a parameter `X` becomes float8_e4m3fn with a uint8 buffer `X_scale_inv` beside
it (the checkpoint's names), and `weight_of` hands both to the ops as one `MxWeight`: the fused backends run the
W8A16 kernels, the plain path dequantizes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from m3eagle.distributed.parallel_state import SINGLE, TPGroup
from m3eagle.kernels.quant.mxfp8 import MX_BLOCK, MxWeight, quantize_mx

SCALE_SUFFIX = "_scale_inv"  # X's scales are X_scale_inv (weight_scale_inv, gate_up_proj_scale_inv)


@dataclass(frozen=True)
class Shard:
    """Which part of a full tensor a rank holds: along `dim` (of length `full` in the full tensor), the
    concatenation of the full tensor's ranges `pieces` [(start, length), ...], then zeros up to `size`
    (vocabulary padding)."""

    dim: int
    pieces: tuple[tuple[int, int], ...]
    size: int
    full: int

    def restrict(self, lo: int, hi: int) -> Shard:
        """The part of this shard inside full rows [lo, hi), in that sub-tensor's coordinates (the gate or the
        up half of a fused gate_up weight stored as two checkpoint tensors)."""
        out = []
        for a, n in self.pieces:
            s, e = max(a, lo), min(a + n, hi)
            if s < e:
                out.append((s - lo, e - s))
        return Shard(self.dim, tuple(out), sum(n for _, n in out), hi - lo)

    def blocks(self, block: int) -> Shard:
        """This shard in units of `block` (the same part of a quantized weight's scale tensor, which holds one
        scale per `block` elements along `dim`). Every piece must start on a block boundary and end on one (or
        at the end of the dimension); else ValueError naming the offending offset."""
        if block == 1:
            return self
        out = []
        for a, n in self.pieces:
            if a % block or (n % block and a + n != self.full):
                raise ValueError(f"a shard piece [{a}, {a + n}) of a dimension of {self.full} does not fall on "
                                 f"whole scale blocks of {block}")
            out.append((a // block, -(-n // block)))
        if self.size != sum(n for _, n in self.pieces):
            raise ValueError("a zero-padded shard (vocabulary rows) has no quantization scales")
        return Shard(self.dim, tuple(out), sum(n for _, n in out), -(-self.full // block))

    def read(self, get: Callable[[tuple[slice, ...]], torch.Tensor]) -> torch.Tensor:
        """Assemble the local tensor from `get(index)`, a reader of full-tensor index tuples (a safetensors
        slice, or a tensor's __getitem__)."""
        lead = (slice(None),) * self.dim
        parts = [get(lead + (slice(a, a + n),)) for a, n in self.pieces]
        held = sum(n for _, n in self.pieces)
        if held < self.size:  # vocabulary padding rows are zero
            shape = list(parts[0].shape) if parts else None
            if shape is None:
                raise ValueError("a shard with no pieces cannot infer its shape")
            shape[self.dim] = self.size - held
            parts.append(torch.zeros(shape, dtype=parts[0].dtype, device=parts[0].device))
        return torch.cat(parts, self.dim) if len(parts) > 1 else parts[0]


def rows(start: int, length: int, full: int, size: int | None = None, dim: int = 0) -> Shard:
    """One range [start, start + length) of a dimension of length `full` (zero-padded to `size`)."""
    return Shard(dim, ((start, length),), length if size is None else size, full)


def param_shards(model: nn.Module) -> dict[str, Shard]:
    """Every sharded parameter of `model` by its state_dict name; absent names are replicated."""
    out = {}
    for prefix, m in model.named_modules():
        for pname, spec in getattr(m, "shards", {}).items():
            out[f"{prefix}.{pname}" if prefix else pname] = spec
    return out


def iter_sharded(model: nn.Module) -> Iterator[tuple[str, torch.Tensor, Shard | None]]:
    """(name, local tensor, shard or None) over parameters and floating buffers, tied tensors once."""
    shards, seen = param_shards(model), set()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            yield name, t, shards.get(name)


def linear(x: torch.Tensor, w: torch.Tensor | MxWeight, fused: Any = None) -> torch.Tensor:
    """F.linear(x, w), or `fused.linear` (an m3eagle.kernels.fused.backend object: the engine's decode GEMV, or
    the W8A16 kernel for an MxWeight) when given and x is [T, K]. Without `fused` an MxWeight is dequantized
    into x's dtype first."""
    if fused is not None and x.dim() == 2:
        return fused.linear(x, w)
    return F.linear(x, w.dequantize(x.dtype) if isinstance(w, MxWeight) else w)


def is_quantized(mod: nn.Module, name: str = "weight") -> bool:
    """Whether `mod.<name>` is an MXFP8 parameter (its scale buffer beside it)."""
    return getattr(mod, name + SCALE_SUFFIX, None) is not None


def weight_of(mod: nn.Module, name: str = "weight") -> torch.Tensor | MxWeight:
    """The weight the ops take: `mod.<name>` itself, or an MxWeight of it and its scales."""
    w = getattr(mod, name)
    s = getattr(mod, name + SCALE_SUFFIX, None)
    return w if s is None else MxWeight(w, s)


def quantize_param(mod: nn.Module, name: str = "weight", q: torch.Tensor | None = None,
                   scale: torch.Tensor | None = None) -> None:
    """Make `mod.<name>` [..., N, K] MXFP8 in place: the parameter becomes float8_e4m3fn q and a uint8 buffer
    `<name>_scale_inv` [..., N, K / 32] holds its scales. With q / scale None the current values are quantized
    (online quantization); else they are the given tensors (a checkpoint's). A sharded parameter's scales are
    sharded alike (in scale blocks along K). Quantize last: a later `.to(dtype)` would cast the fp8 values."""
    w = getattr(mod, name)
    if q is None:
        if w.shape[-1] % MX_BLOCK:
            raise ValueError(f"{type(mod).__name__}.{name} {tuple(w.shape)}: MXFP8 needs the input dim to be a "
                             f"multiple of {MX_BLOCK}")
        # one expert at a time: quantize_mx's fp32 temporaries of a whole [E, N, K] stack would not fit
        parts = [quantize_mx(e) for e in w.detach().unbind(0)] if w.dim() == 3 else [quantize_mx(w.detach())]
        q, scale = (torch.stack([a for a, _ in parts]), torch.stack([b for _, b in parts])) if w.dim() == 3 else parts[0]
    if q.dtype != torch.float8_e4m3fn or scale is None or scale.dtype != torch.uint8 or tuple(q.shape) != tuple(w.shape) \
            or tuple(scale.shape) != (*w.shape[:-1], w.shape[-1] // MX_BLOCK):
        raise ValueError(f"{type(mod).__name__}.{name}: MXFP8 needs q float8_e4m3fn {tuple(w.shape)} and scale uint8 "
                         f"{(*w.shape[:-1], w.shape[-1] // MX_BLOCK)}")
    setattr(mod, name, nn.Parameter(q, requires_grad=False))
    mod.register_buffer(name + SCALE_SUFFIX, scale)
    spec = getattr(mod, "shards", {}).get(name)
    if spec is not None:
        mod.shards[name + SCALE_SUFFIX] = spec.blocks(MX_BLOCK) if spec.dim == w.dim() - 1 else spec


class ColumnParallelLinear(nn.Linear):
    """y[..., out_local] = x @ W[rows]^T for this rank's output rows `pieces` of a full [out, in] weight."""

    def __init__(self, in_features: int, out_features: int, pieces: tuple[tuple[int, int], ...] | None = None,
                 bias: bool = False):
        pieces = pieces if pieces is not None else ((0, out_features),)
        local = sum(n for _, n in pieces)
        super().__init__(in_features, local, bias=bias)
        if local != out_features:
            self.shards = {"weight": Shard(0, pieces, local, out_features)}

    def forward(self, x: torch.Tensor, fused: Any = None) -> torch.Tensor:
        if self.bias is None:
            return linear(x, weight_of(self), fused)
        return super().forward(x) if not is_quantized(self) else linear(x, weight_of(self), fused) + self.bias


class RowParallelLinear(nn.Linear):
    """y = x[..., in_local] @ W[:, cols]^T: this rank's partial sum of a full [out, in] weight; with `reduce`
    the partial sums are all-reduced, else the caller adds them into a later all-reduce (the MoE's shared
    expert joins the routed experts' one)."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup = SINGLE, reduce: bool = True,
                 what: str = "in_features"):
        start, local = tp.split(in_features, what)
        super().__init__(local, out_features, bias=False)
        self.tp, self.reduce = tp, reduce and tp.size > 1
        if tp.size > 1:
            self.shards = {"weight": rows(start, local, in_features, dim=1)}

    def forward(self, x: torch.Tensor, fused: Any = None) -> torch.Tensor:
        y = linear(x, weight_of(self), fused)
        return self.tp.all_reduce(y) if self.reduce else y


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, start + per) of the table; a token outside them looks up zeros, and the all-reduce
    leaves each token exactly its one owner's row (a sum of one row and zeros is exact)."""

    def __init__(self, vocab: int, hidden: int, tp: TPGroup = SINGLE):
        self.start, self.held, per = tp.vocab_shard(vocab)
        super().__init__(per, hidden)
        self.tp, self.vocab = tp, vocab
        if tp.size > 1:
            self.shards = {"weight": rows(self.start, self.held, vocab, per)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mine = (local >= 0) & (local < self.held)
        out = F.embedding(torch.where(mine, local, 0), self.weight)  # [T, H]
        return self.tp.all_reduce(out.masked_fill_(~mine[..., None], 0))


class ParallelLMHead(nn.Linear):
    """logits [N, V] = hidden @ W^T with W's vocabulary rows split like `VocabParallelEmbedding` (so a tied
    head shares its shard); each rank's [N, per] logits are all-gathered for sampling and verification."""

    def __init__(self, hidden: int, vocab: int, tp: TPGroup = SINGLE):
        start, held, per = tp.vocab_shard(vocab)
        super().__init__(hidden, per, bias=False)
        self.tp, self.vocab = tp, vocab
        if tp.size > 1:
            self.shards = {"weight": rows(start, held, vocab, per)}

    def forward(self, x: torch.Tensor, fused: Any = None) -> torch.Tensor:
        return self.tp.gather_last(linear(x, self.weight, fused), self.vocab)
