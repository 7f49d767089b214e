"""MXFP8 weights of a target model: which weights the W8A16 kernels run, online quantization, and empty MXFP8
parameters for a checkpoint to fill.

The quantized set is every projection of the decoder layers (attention q/k/v/o, the MSA indexer's q/k, the dense
MLP, the shared expert) and the routed experts. The token embedding, the lm_head, the routers (fp32) and the
norms stay as they are: the MiniMax-M3 release lists them in `ignored_layers`, and vLLM's online fp8 leaves them
too. A checkpoint decides for itself: `mx_shells` turns exactly the weights whose scales it holds.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

import torch
import torch.nn as nn

from m3eagle.distributed.layers import (
    SCALE_SUFFIX,
    ColumnParallelLinear,
    RowParallelLinear,
    is_quantized,
    quantize_param,
)
from m3eagle.kernels.quant.mxfp8 import MX_BLOCK
from m3eagle.models.layers import Experts

log = logging.getLogger("m3eagle")


def quantizable(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(state_dict name, module, parameter name) of every weight the W8A16 kernels can run, in module order."""
    out: list[tuple[str, nn.Module, str]] = []
    for prefix, m in model.named_modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.bias is None:
            out.append((f"{prefix}.weight", m, "weight"))
        elif isinstance(m, Experts):
            out += [(f"{prefix}.{p}", m, p) for p in ("gate_up_proj", "down_proj")]
    return out


def quantize_online(model: nn.Module) -> int:
    """Quantize every quantizable weight of `model` to MXFP8 in place (`LLM(quantization="fp8")`); returns how many.
    Weights whose (whole, unsharded) input dim is not a multiple of 32 stay as they are (logged), so a tensor-
    parallel rank quantizes exactly the weights one process would, block for block; a split that cuts a 32-column
    block is refused, naming the weight (as the checkpoint loader refuses it). Run it after the model reached its
    device and dtype and before packing its projections."""
    n, kept = 0, []
    with torch.no_grad():
        for name, m, p in quantizable(model):
            if is_quantized(m, p):
                continue
            w = getattr(m, p)
            spec = getattr(m, "shards", {}).get(p)
            along_k = spec is not None and spec.dim == w.dim() - 1
            if (spec.full if along_k else w.shape[-1]) % MX_BLOCK:
                kept.append(name)
                continue
            if along_k:
                try:
                    spec.blocks(MX_BLOCK)
                except ValueError as e:
                    raise ValueError(f"quantization='fp8': the tensor-parallel split of {name} ({e}); use a "
                                     "tensor_parallel_size that splits it on whole blocks, or no quantization") from None
            quantize_param(m, p)
            n += 1
    if kept:
        log.info("fp8: %d weights stay unquantized (input dim not a multiple of %d), e.g. %s", len(kept), MX_BLOCK,
                 kept[0])
    return n


def mx_shells(model: nn.Module, names: Collection[str]) -> int:
    """Make each quantizable weight `X` whose scales `X_scale_inv` are in `names` (a checkpoint's state_dict keys)
    an uninitialised MXFP8 parameter where it lives (the meta device before allocation); returns how many."""
    n = 0
    for name, m, p in quantizable(model):
        if name + SCALE_SUFFIX not in names:
            continue
        w = getattr(m, p)
        q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
        s = torch.empty(*w.shape[:-1], w.shape[-1] // MX_BLOCK, dtype=torch.uint8, device=w.device)
        quantize_param(m, p, q, s)
        n += 1
    return n
