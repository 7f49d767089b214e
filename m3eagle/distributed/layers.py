"""Sharded layers: each rank holds a slice of the full weight, and says which (`shards`), so that the
checkpoint loader and the random-weights builder fill it from the full tensor's coordinates.

    ColumnParallelLinear  weight [out_local, in]: a subset of output rows (heads, an MLP's gate/up halves)
    RowParallelLinear     weight [out, in_local]: partial sums, all-reduced unless the caller fuses them
    VocabParallelEmbedding / ParallelLMHead: vocabulary rows; lookups all-reduced, logits all-gathered

With a one-process group (`SINGLE`) every class is its plain torch counterpart holding the full weight:
the same forward, no collective, the same parameter names (so state_dict and training are unchanged).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from m3eagle.distributed.parallel_state import SINGLE, TPGroup


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


def linear(x: torch.Tensor, w: torch.Tensor, fused: Any = None) -> torch.Tensor:
    """F.linear(x, w), or `fused.linear` (an m3eagle.kernels.fused.backend object: the engine's decode GEMV) when
    given and x is [T, K]."""
    return fused.linear(x, w) if fused is not None and x.dim() == 2 else F.linear(x, w)


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
        return linear(x, self.weight, fused) if self.bias is None else super().forward(x)


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
        y = linear(x, self.weight, fused)
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
