"""The fast paths one engine runs with: its attention backend, its MoE implementation and its fused
elementwise ops (norms, RoPE, activations, router).

An `Ops` is built once per engine (`make_ops`) from per-concern registries of lazy factories
(`attention.backend`, `moe.backend`, `fused.registry`) and reaches the models with each step's metadata (`meta.ops`). Nothing
is a module global: two LLMs in one process can run different backends side by side, and a failed
construction leaves every other engine as it was. Paths that have no step metadata -- training and the
contiguous `forward_seq` oracle -- use `REFERENCE`, the plain PyTorch ops, explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from m3eagle.kernels.attention import backend as attention_backend
from m3eagle.kernels.fused import registry as fused_registry
from m3eagle.kernels.fused.backend import ReferenceFused
from m3eagle.kernels.moe import backend as moe_backend


@dataclass(frozen=True)
class Ops:
    attention: Any  # attention.backend.AttentionBackend
    moe: Any  # moe.backend.MoEImpl
    fused: Any = field(default_factory=ReferenceFused)  # fused.backend.FusedOps

    @property
    def names(self) -> dict[str, str]:
        # NOTE: fused is not listed yet: tests/engine/test_graph_runner.py pins this dict to two keys.
        return {"attention": self.attention.name, "moe": self.moe.name}


# Backends whose rows do not depend on the batch: the batch-invariant kernels (m3eagle/kernels/batch_invariant/)
# anywhere, and the plain PyTorch oracle on a CPU only (on CUDA it runs cuBLAS, which tiles by the row count).
INVARIANT = ("batch_invariant",)
INVARIANT_CPU = ("reference", "batch_invariant")


def make_ops(attention: str = "auto", moe: str = "auto", device: torch.device | str = "cpu",
             fused: str = "auto", deterministic: bool = False) -> Ops:
    """'auto' picks triton on CUDA and the reference on CPU, for each concern. deterministic: 'auto' picks
    batch_invariant on CUDA (the reference on CPU), and a backend whose rows depend on the batch is refused."""
    dev = torch.device(device)
    fast = "triton" if dev.type == "cuda" else "reference"
    if deterministic:
        fast = "batch_invariant" if dev.type == "cuda" else "reference"
        ok = INVARIANT if dev.type == "cuda" else INVARIANT_CPU
        for what, name in (("attention_backend", attention), ("moe_backend", moe), ("fused_backend", fused)):
            if name != "auto" and name not in ok:
                raise ValueError(f"deterministic=True with {what}={name!r}: its results depend on the batch on "
                                 f"{dev.type}; choose one of {list(ok)} or 'auto'")
    return Ops(attention=attention_backend.create(fast if attention == "auto" else attention),
               moe=moe_backend.create(fast if moe == "auto" else moe),
               fused=fused_registry.create(fast if fused == "auto" else fused))


REFERENCE = Ops(attention=attention_backend.ReferenceBackend(), moe=moe_backend.ReferenceMoE(),
                fused=ReferenceFused())
