"""Random seeded weights built on the device: vLLM's `load_format="dummy"`.

Benchmarks need real-size geometries without real-size files. `dummy_target` / `dummy_eagle3` build the
modules on the meta device, allocate them once on the target device in the serving dtype, and fill each
tensor in place with a seeded device generator -- no fp32 copy, no CPU round trip, nothing read from or
written to disk (a 10B-parameter target is 20 GB of bf16 and fills in about a second on an H200).

Init scales keep bf16 activations sane through dozens of layers:
- linear and embedding weights ~ N(0, 0.02) (transformers' `initializer_range`);
- Gemma norms (target, scale 1 + w) are zero, Llama norms (Eagle3 head, scale w) are one;
- the MoE router stays fp32, like the public checkpoint, with a zero score-correction bias;
- a draft vocabulary smaller than the target's maps to a seeded sorted subset of target ids (`d2t`).

`config_from(spec)` turns what `LLM(model=...)` accepts without weights -- an `M3Config`, a dict as
config.json holds, or a directory with a config.json -- into a config.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..config import M3Config
from ..models.eagle3 import Eagle3Config, Eagle3Head, default_aux_layer_ids
from ..models.layers import GemmaRMSNorm, LlamaRMSNorm, Router
from ..models.minimax_m3 import MiniMaxM3
from .checkpoint import read_config

LOAD_FORMATS = ("auto", "dummy")
INIT_STD = 0.02


def target_config(spec: M3Config | dict[str, Any] | str | Path) -> M3Config:
    """An M3Config from a config, a config.json dict, or a checkpoint directory (only config.json is read)."""
    if isinstance(spec, M3Config):
        return spec
    if isinstance(spec, dict):
        return M3Config.from_dict(spec)
    return M3Config.from_dict(read_config(spec))


def eagle3_config(spec: Eagle3Config | dict[str, Any] | str | Path, target: M3Config) -> Eagle3Config:
    """An Eagle3Config for `target`, with default aux layer ids filled in; validated against the target."""
    from .eagle3 import validate_against_target

    if isinstance(spec, Eagle3Config):
        cfg, explicit = spec, True
    else:
        raw = spec if isinstance(spec, dict) else read_config(spec)
        cfg, explicit = Eagle3Config.from_dict(raw), "target_hidden_size" in raw
    if cfg.aux_layer_ids is None:
        cfg = replace(cfg, aux_layer_ids=default_aux_layer_ids(target.num_hidden_layers))
    validate_against_target(cfg, target, explicit_target_hidden=explicit)
    return cfg


def dummy_target(cfg: M3Config, dtype: torch.dtype, device: str | torch.device, seed: int = 0) -> MiniMaxM3:
    """A MiniMaxM3 with random weights, allocated once on `device` in `dtype` (router fp32)."""
    with torch.device("meta"):
        model = MiniMaxM3(cfg)
    model = _materialize(model, dtype, device)
    if cfg.tie_word_embeddings:  # to_empty gives each module its own tensor; tie them again
        model.lm_head.weight = model.embed_tokens.weight
    _fill(model, seed)
    return model.eval().requires_grad_(False)


def dummy_eagle3(cfg: Eagle3Config, dtype: torch.dtype, device: str | torch.device, seed: int = 1) -> Eagle3Head:
    """A random Eagle3 head. Like `load_eagle3`, a head without its own table (cfg.has_embed False) leaves
    the caller to share the target's: `head.set_embedding(target.embed_tokens.weight)`."""
    with torch.device("meta"):
        head = Eagle3Head(cfg)
    head = _materialize(head, dtype, device)
    _fill(head, seed)
    if cfg.draft_vocab_size < cfg.vocab_size:
        g = torch.Generator(device="cpu").manual_seed(seed)  # a few KB of ids: the host is fine
        head.set_vocab_mapping(torch.randperm(cfg.vocab_size, generator=g)[: cfg.draft_vocab_size].sort().values)
    else:
        head.d2t.zero_()
        head.t2d.fill_(True)
    return head.eval().requires_grad_(False)


def _materialize(model: torch.nn.Module, dtype: torch.dtype, device: str | torch.device) -> torch.nn.Module:
    # On meta, .to(dtype) costs nothing; to_empty then allocates each tensor once, already in dtype.
    model.to(dtype=dtype)
    for m in model.modules():
        if isinstance(m, Router):
            m.float()  # router weight and bias stay fp32 (cast_model does the same for checkpoints)
    return model.to_empty(device=device)


@torch.no_grad()
def _fill(model: torch.nn.Module, seed: int) -> None:
    """Fill every floating tensor in place, in a fixed order, from one seeded generator on its device."""
    dev = next(model.parameters()).device
    g = torch.Generator(device=dev).manual_seed(seed)
    done: set[int] = set()
    for m in model.modules():
        if isinstance(m, GemmaRMSNorm):
            m.weight.zero_()
        elif isinstance(m, LlamaRMSNorm):
            m.weight.fill_(1.0)
        elif isinstance(m, Router):
            m.weight.normal_(0.0, INIT_STD, generator=g)
            m.e_score_correction_bias.zero_()
        else:
            continue
        done.update(id(t) for t in [*m.parameters(), *m.buffers()])
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in done or not t.is_floating_point():
            continue
        done.add(id(t))  # a tied tensor is filled once
        t.normal_(0.0, INIT_STD, generator=g)
