"""Random seeded weights built on the device: vLLM's `load_format="dummy"`.

Benchmarks need real-size geometries without real-size files. `dummy_target` / `dummy_eagle3` build the
modules on the meta device, allocate them once on the target device in the serving dtype, and fill each
tensor in place from seeded device generators -- no fp32 copy, no CPU round trip, nothing read from or
written to disk (a 10B-parameter target is 20 GB of bf16 and fills in about a second on an H200).

Shard by shard, and the same weights whatever the tensor-parallel size: every tensor's values are drawn
in chunks of whole rows of the *full* tensor (dim 0), each chunk from its own generator seeded by (seed,
tensor name, chunk index). A rank draws only the chunks its shard touches (all of them when it holds a
column slice) and keeps its part, so TP=N ranks hold exactly the slices of the TP=1 tensors.

Init scales keep bf16 activations sane through dozens of layers:
- linear and embedding weights ~ N(0, 0.02) (transformers' `initializer_range`);
- Gemma norms (target, scale 1 + w) are zero, Llama norms (Eagle3 head, scale w) are one;
- the MoE router stays fp32, like the public checkpoint, with a zero score-correction bias;
- a draft vocabulary smaller than the target's maps to a seeded sorted subset of target ids (`d2t`).

`config_from(spec)` turns what `LLM(model=...)` accepts without weights -- an `M3Config`, a dict as
config.json holds, or a directory with a config.json -- into a config.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from m3eagle.config import M3Config
from m3eagle.distributed.layers import Shard, iter_sharded
from m3eagle.distributed.parallel_state import SINGLE, TPGroup
from m3eagle.loader.checkpoint import materialize, read_config
from m3eagle.models.eagle3 import Eagle3Config, Eagle3Head, default_aux_layer_ids
from m3eagle.models.layers import GemmaRMSNorm, LlamaRMSNorm, Router
from m3eagle.models.minimax_m3 import MiniMaxM3

LOAD_FORMATS = ("auto", "dummy")
INIT_STD = 0.02
CHUNK_ELEMS = 1 << 24  # elements drawn per generator (whole rows of the full tensor): bounds the scratch


def target_config(spec: M3Config | dict[str, Any] | str | Path) -> M3Config:
    """An M3Config from a config, a config.json dict, or a checkpoint directory (only config.json is read)."""
    if isinstance(spec, M3Config):
        return spec
    if isinstance(spec, dict):
        return M3Config.from_dict(spec)
    return M3Config.from_dict(read_config(spec))


def eagle3_config(spec: Eagle3Config | dict[str, Any] | str | Path, target: M3Config) -> Eagle3Config:
    """An Eagle3Config for `target`, with default aux layer ids filled in; validated against the target."""
    from m3eagle.loader.eagle3 import validate_against_target

    if isinstance(spec, Eagle3Config):
        cfg, explicit = spec, True
    else:
        raw = spec if isinstance(spec, dict) else read_config(spec)
        cfg, explicit = Eagle3Config.from_dict(raw), "target_hidden_size" in raw
    if cfg.aux_layer_ids is None:
        cfg = replace(cfg, aux_layer_ids=default_aux_layer_ids(target.num_hidden_layers))
    validate_against_target(cfg, target, explicit_target_hidden=explicit)
    return cfg


def dummy_target(cfg: M3Config, dtype: torch.dtype, device: str | torch.device, seed: int = 0,
                 tp: TPGroup = SINGLE) -> MiniMaxM3:
    """A MiniMaxM3 with random weights, allocated once on `device` in `dtype` (router fp32); with a
    tensor-parallel group, this rank's shard of the same weights."""
    with torch.device("meta"):
        model = MiniMaxM3(cfg, tp)
    model = materialize(model, dtype, device)
    if cfg.tie_word_embeddings:  # to_empty gives each module its own tensor; tie them again
        model.lm_head.weight = model.embed_tokens.weight
    _fill(model, seed)
    return model.eval().requires_grad_(False)


def dummy_eagle3(cfg: Eagle3Config, dtype: torch.dtype, device: str | torch.device, seed: int = 1) -> Eagle3Head:
    """A random Eagle3 head. Like `load_eagle3`, a head without its own table (cfg.has_embed False) leaves
    the caller to share the target's: `head.set_embedding(target.embed_tokens.weight)`."""
    with torch.device("meta"):
        head = Eagle3Head(cfg)
    head = materialize(head, dtype, device)
    _fill(head, seed)
    if cfg.draft_vocab_size < cfg.vocab_size:
        g = torch.Generator(device="cpu").manual_seed(seed)  # a few KB of ids: the host is fine
        head.set_vocab_mapping(torch.randperm(cfg.vocab_size, generator=g)[: cfg.draft_vocab_size].sort().values)
    else:
        head.d2t.zero_()
        head.t2d.fill_(True)
    return head.eval().requires_grad_(False)


@torch.no_grad()
def _fill(model: torch.nn.Module, seed: int) -> None:
    """Fill every floating tensor in place: norms by rule, the rest ~ N(0, INIT_STD) from per-tensor,
    per-chunk generators (see the module docstring), so the values do not depend on how it is sharded."""
    const: dict[int, float] = {}
    for m in model.modules():
        if isinstance(m, (GemmaRMSNorm, LlamaRMSNorm)):
            const[id(m.weight)] = 0.0 if isinstance(m, GemmaRMSNorm) else 1.0
        elif isinstance(m, Router):
            const[id(m.e_score_correction_bias)] = 0.0
    for name, t, shard in iter_sharded(model):
        if not t.is_floating_point():
            continue
        if id(t) in const:
            t.fill_(const[id(t)])
        else:
            _normal(t, shard, zlib.crc32(f"{seed}:{name}".encode()))


def _normal(t: torch.Tensor, shard: Shard | None, key: int) -> None:
    """t = this rank's part of a full tensor whose rows (dim 0) are drawn in chunks, chunk c from a
    generator seeded by (key, c)."""
    full_shape = list(t.shape)
    if shard is not None:
        full_shape[shard.dim] = shard.full
    row = max(1, math.prod(full_shape[1:]))
    per = max(1, CHUNK_ELEMS // row)  # full rows per chunk: depends on the full shape only
    need = [(0, full_shape[0])] if shard is None or shard.dim else list(shard.pieces)

    def chunk(c: int) -> torch.Tensor:  # full rows [c * per, (c + 1) * per)
        n = min(per, full_shape[0] - c * per)
        g = torch.Generator(device=t.device).manual_seed(key * 1_000_003 + c)
        return torch.empty([n, *full_shape[1:]], dtype=t.dtype, device=t.device).normal_(0.0, INIT_STD, generator=g)

    parts = []
    for a, n in need:  # rows [a, a + n) of the full tensor, chunk by chunk
        for c in range(a // per, -(-(a + n) // per)):
            lo, hi = max(a, c * per), min(a + n, (c + 1) * per)
            x = chunk(c)[lo - c * per: hi - c * per]
            if shard is not None and shard.dim:  # a column slice: keep this rank's columns of the rows
                x = shard.read(x.__getitem__)
            parts.append(x)
    local = torch.cat(parts) if len(parts) > 1 else parts[0]
    t.zero_()  # vocabulary padding rows stay zero
    t.narrow(0, 0, local.shape[0]).copy_(local)
