"""Load and save Eagle3 draft heads (config.json + safetensors, the EAGLE / SpecForge layout).

Accepted key spellings, mapped onto `Eagle3Head`'s names: `midlayer.*` or `layers.0.*` (speculators,
some SpecForge exports), each with or without a `model.` prefix (which any other key may carry too); `fc`,
`fc_norm.{i}` (Eagle3.1), `norm`, `lm_head`, `d2t`, `t2d`, and an optional `embed_tokens.weight` --
without it the head borrows the target's table (`head.cfg.has_embed` is False and the caller runs
`head.set_embedding(...)`).

Optional `lm_head.weight`: a head that drafts over the target's whole vocabulary (draft_vocab_size ==
vocab_size; d2t absent or all zero) may leave it out and share the target's lm_head
(`head.cfg.has_lm_head` is False; `share_target_weights(head, target)` shares both tables). With a
reduced draft vocabulary it is required, and its absence fails naming the tensor.

Vocabulary mapping: `d2t` [Vd] (target id = draft id + d2t[draft id]) is authoritative; a `t2d` [V]
beside it is checked for shape and otherwise ignored (t2d is re-derived from d2t). `t2d` alone defines
the draft ids as the marked target ids in order.

Attention shape: head_dim is config.json's `head_dim` when present (never re-derived as hidden / heads);
`num_key_value_heads` absent or equal to the heads is multi-head attention, a divisor is GQA.

Aux inputs: m3eagle drafts from exactly 3 aux hidden states (fc over 3 x target_hidden_size). A config
that names another number of `eagle_aux_hidden_state_layer_ids` (e.g. 3 layer taps + the final layer) or
of `num_aux_hidden_states` is refused at load time.

Tensor names are checked as a set: a tensor the head does not have (a renamed one, `fc_norm.*` under a
config without fc_norm) fails naming it, as a missing one does; only derived rotary tables
(`*rotary_emb.inv_freq`) are skipped. The head is built on the meta device and allocated once in the
serving dtype, so a 3.3B-parameter head costs its bf16 bytes, not an fp32 copy on the host.

Everything that would make the head disagree with its target fails at load time with a `ValueError`
(`CheckpointError` for tensors) naming both values: widths, vocabulary sizes, aux layer ids, the draft
vocabulary mapping, missing or mis-shaped tensors.

NOTE: `eagle_config.eagle_aux_hidden_state_layer_ids` are read in m3eagle's convention, "the residual
stream after L layers" (vLLM's). SpecForge's HF backend and sglang's explicit-id path read the same
field as "the output of 0-based layer L" (one layer deeper). Such a head still loads and drafts
losslessly, only with lower acceptance; rewrite its ids (+1) in config.json to match.

The public MiniMax-M3 heads (Inferact/MiniMax-M3-EAGLE3 and -GQA) are in m3eagle's convention: TorchSpec
trained them on hidden states captured by vLLM, shifting its own post-layer ids [1, N//2 - 1, N - 4] by
one to vLLM's capture indices (2, N//2, N - 3) = (2, 30, 57) on the 60-layer target. Their config.json
names no ids, so `default_aux_layer_ids` gives exactly those three, as vLLM's default does when it serves
them. The "+ the final layer" of their model card is the last hidden state TorchSpec computes the
target's logits from (the training labels), not a fourth fc input: fc takes 3 x 6144. docs/eagle3_heads.md
has the configs and the sources.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from m3eagle.config import ConfigError, M3Config
from m3eagle.loader.checkpoint import CheckpointError, iter_tensors, load_into, materialize, read_config
from m3eagle.models.eagle3 import Eagle3Config, Eagle3Head, default_aux_layer_ids

log = logging.getLogger("m3eagle")

LAYOUTS = ("midlayer", "layers.0")
NUM_AUX = 3  # aux hidden states fc reads: the target's residual stream after 3 of its layers
# Tensors some exports carry that the head derives itself (the rotary table); any other unknown name fails.
DERIVED = ("rotary_emb.inv_freq",)


def canonical_name(name: str) -> str:
    """Checkpoint key -> Eagle3Head key."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("layers.0."):
        name = "midlayer." + name[len("layers.0."):]
    return name


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    for raw, t in iter_tensors(path):
        name = canonical_name(raw)
        if name in sd:
            raise CheckpointError(f"Eagle3 checkpoint {path} holds {name!r} twice (as {raw!r} and another "
                                  "spelling); keep one of midlayer.* / layers.0.*")
        sd[name] = t
    return sd


def load_eagle3(path: str | Path, target_cfg: M3Config, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> Eagle3Head:
    """Build the Eagle3 head stored at `path` for the target described by `target_cfg`.

    Returns the head in eval mode with gradients off (trainers call `.train().requires_grad_(True)`).
    When `head.cfg.has_embed` is False, call `head.set_embedding(target.embed_tokens.weight)`."""
    raw = read_config(path)
    cfg = Eagle3Config.from_dict(raw)
    if not cfg.rms_norm_eps > 0:
        raise ConfigError(f"{Path(path) / 'config.json'}: Eagle3 rms_norm_eps={cfg.rms_norm_eps} must be positive "
                          "(the norms divide by sqrt(mean(x^2) + eps))")
    sd = load_state_dict(path)
    cfg = replace(cfg, has_embed="embed_tokens.weight" in sd, has_lm_head="lm_head.weight" in sd,
                  aux_layer_ids=cfg.aux_layer_ids or default_aux_layer_ids(target_cfg.num_hidden_layers))
    _check_aux_count(cfg, sd, raw.get("num_aux_hidden_states"))
    validate_against_target(cfg, target_cfg, explicit_target_hidden="target_hidden_size" in raw)
    _check_fc(cfg, sd)
    _fill_vocab_mapping(cfg, sd)
    _check_lm_head(cfg, sd)
    with torch.device("meta"):  # shapes only: the real tensors are allocated once, in `dtype`, on `device`
        head = Eagle3Head(cfg)
    _check_names(head, sd, path)
    head = materialize(head, dtype, device)
    load_into(head, sd, f"Eagle3 checkpoint {path}")
    return head.eval().requires_grad_(False)


def validate_against_target(cfg: Eagle3Config, target: M3Config, explicit_target_hidden: bool = True) -> None:
    """Raise ValueError, naming both values, wherever the head cannot consume this target."""
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(f"Eagle3 head vocab_size={cfg.vocab_size} does not match the target's "
                         f"vocab_size={target.vocab_size}; the head was trained for another tokenizer")
    if not explicit_target_hidden and cfg.hidden_size != target.hidden_size:
        raise ValueError(f"Eagle3 head hidden_size={cfg.hidden_size} does not match the target's "
                         f"hidden_size={target.hidden_size}; a head of another width must say "
                         "target_hidden_size in its config.json")
    if cfg.target_hidden_size != target.hidden_size:
        raise ValueError(f"Eagle3 head target_hidden_size={cfg.target_hidden_size} does not match the "
                         f"target's hidden_size={target.hidden_size}")
    n = target.num_hidden_layers
    for i in cfg.aux_layer_ids or ():
        if not 0 <= i <= n:
            raise ValueError(f"Eagle3 eagle_aux_hidden_state_layer_ids={list(cfg.aux_layer_ids)} holds {i}, "
                             f"outside [0, {n}] for the target's num_hidden_layers={n}")
    if not cfg.has_embed and cfg.hidden_size != target.hidden_size:
        raise ValueError(f"Eagle3 checkpoint has no embed_tokens.weight and its hidden_size="
                         f"{cfg.hidden_size} differs from the target's hidden_size={target.hidden_size}, so "
                         "the target's embedding table cannot be shared; ship embed_tokens.weight")
    if not cfg.has_lm_head and cfg.hidden_size != target.hidden_size:
        raise ValueError(f"Eagle3 checkpoint has no lm_head.weight and its hidden_size={cfg.hidden_size} "
                         f"differs from the target's hidden_size={target.hidden_size}, so the target's lm_head "
                         "cannot be shared; ship lm_head.weight")


def share_target_weights(head: Eagle3Head, target: torch.nn.Module) -> Eagle3Head:
    """Give a loaded head the target tables its checkpoint left out: the embedding (cfg.has_embed False)
    and the lm_head (cfg.has_lm_head False). Under tensor parallelism the target's vocab-parallel modules
    themselves are shared (their lookups all-reduce, their logits all-gather).

    A frozen head whose own table is an exact copy of the target's (the public MiniMax-M3 heads ship both,
    copied from the target: 2 x 2.5 GB) shares the target's instead, as vLLM does: the same values, one
    copy in memory. Under tensor parallelism every rank compares its shard and all agree (one all-reduce
    per table, so every rank must call this)."""
    emb = target.embed_tokens
    if not head.cfg.has_embed or _copy_of(head.embed_tokens.weight, emb):
        tp = getattr(emb, "tp", None)
        if tp is not None and tp.size > 1:
            head.embed_tokens = emb
        else:
            head.set_embedding(emb.weight)
    c = head.cfg
    full_vocab = c.draft_vocab_size == c.vocab_size and not bool(head.d2t.any())
    if not c.has_lm_head or (full_vocab and _copy_of(head.lm_head.weight, target.lm_head)):
        head.set_lm_head(target.lm_head)
    return head


def _copy_of(own: torch.Tensor, module: torch.nn.Module) -> bool:
    """True when the head's frozen [V, H] table equals the target module's table (its rows on every rank).
    A trainable table stays the head's own: training would otherwise update the target's."""
    theirs = getattr(module, "weight", None)
    tp = getattr(module, "tp", None)
    size = tp.size if tp is not None else 1
    same = not own.requires_grad and theirs is not None and own.dtype == theirs.dtype and own.shape[1:] == theirs.shape[1:]
    if same:
        if size > 1:  # this rank's rows: [start, start + held) of the vocabulary
            start, held, _ = tp.vocab_shard(own.shape[0])
            same = torch.equal(own[start:start + held], theirs[:held].to(own.device))
        else:
            same = own.shape == theirs.shape and torch.equal(own, theirs.to(own.device))
    if size == 1:
        return same
    differ = torch.tensor([0.0 if same else 1.0], device=own.device)
    return not bool(tp.all_reduce(differ).item())


def _check_names(head: Eagle3Head, sd: dict[str, torch.Tensor], path: str | Path) -> None:
    """Every tensor the head has is in the checkpoint and every checkpoint tensor is one of the head's:
    a tensor left unread would be a part of the trained model silently dropped."""
    state = head.state_dict()
    own = set(state)
    missing = sorted(own - set(sd))
    extra = sorted(n for n in set(sd) - own if not n.endswith(DERIVED))
    if not missing and not extra:
        return
    norms = [n for n in extra if n.startswith("fc_norm.")]
    if norms and not head.cfg.fc_norm:
        raise CheckpointError(f"Eagle3 checkpoint {path} holds {norms} but config.json does not set fc_norm: "
                              "true (Eagle3.1: one RMSNorm per aux chunk before fc); without it the norms would "
                              "be dropped")
    parts = []
    if missing:
        parts.append("missing " + ", ".join(f"{n!r} {tuple(state[n].shape)}" for n in missing))
    if extra:
        parts.append("unexpected " + ", ".join(repr(n) for n in extra))
    raise CheckpointError(f"Eagle3 checkpoint {path}: {'; '.join(parts)} (names after mapping layers.0.* to "
                          "midlayer.* and dropping a model. prefix)")


def _check_aux_count(cfg: Eagle3Config, sd: dict[str, torch.Tensor], num_aux: Any = None) -> None:
    ids = list(cfg.aux_layer_ids or ())
    if num_aux is not None and int(num_aux) != len(ids):
        raise ValueError(f"Eagle3 config num_aux_hidden_states={num_aux} but {len(ids)} aux layer ids "
                         f"{ids}; m3eagle drafts from exactly {NUM_AUX} aux hidden states")
    fc = sd.get("fc.weight")
    if len(ids) == NUM_AUX:
        if fc is not None and fc.dim() == 2 and fc.shape[1] == (NUM_AUX + 1) * cfg.target_hidden_size:
            raise CheckpointError(f"Eagle3 fc.weight takes {fc.shape[1]} = 4 x target_hidden_size="
                                  f"{cfg.target_hidden_size} inputs: 4 aux hidden states (3 layer taps + the final "
                                  f"layer?), but eagle_aux_hidden_state_layer_ids={ids} names 3; m3eagle drafts "
                                  f"from exactly {NUM_AUX} aux hidden states (fc over 3 x target_hidden_size)")
        return
    extra = (" (3 layer taps + the final layer)" if len(ids) == NUM_AUX + 1 else "")
    raise ValueError(f"Eagle3 config eagle_aux_hidden_state_layer_ids={ids} names {len(ids)} aux hidden states"
                     f"{extra}; m3eagle supports exactly {NUM_AUX}: the target's residual stream after 3 of its "
                     "layers, concatenated into fc (fc.weight [hidden_size, 3 x target_hidden_size]). A head "
                     "trained with another number of aux inputs cannot be loaded")


def _check_lm_head(cfg: Eagle3Config, sd: dict[str, torch.Tensor]) -> None:
    """Without lm_head.weight the head shares the target's, which scores the target's vocabulary: only a
    head whose draft vocabulary IS the target's (no reduced vocab: d2t zero) can do that."""
    if cfg.has_lm_head:
        return
    d2t = sd["d2t"]  # filled in by _fill_vocab_mapping
    if cfg.draft_vocab_size != cfg.vocab_size or bool(d2t.any()):
        raise CheckpointError(f"Eagle3 checkpoint has no 'lm_head.weight' (expected shape "
                              f"{(cfg.draft_vocab_size, cfg.hidden_size)}): it may be left out only when the head "
                              f"shares the target's lm_head, i.e. draft_vocab_size == vocab_size and d2t absent or "
                              f"all zero; this head has draft_vocab_size={cfg.draft_vocab_size}, vocab_size="
                              f"{cfg.vocab_size}" + (", and a nonzero d2t" if bool(d2t.any()) else ""))


def _check_fc(cfg: Eagle3Config, sd: dict[str, torch.Tensor]) -> None:
    # load_into would catch it too; this message says *why* the width is what it is.
    fc = sd.get("fc.weight")
    if fc is not None and fc.dim() == 2 and fc.shape[1] != cfg.aux_hidden_size:
        raise CheckpointError(f"Eagle3 fc.weight takes {fc.shape[1]} inputs, but {cfg.num_aux} aux layers x "
                              f"target_hidden_size={cfg.target_hidden_size} = {cfg.aux_hidden_size}; check "
                              "eagle_aux_hidden_state_layer_ids and target_hidden_size")


def _fill_vocab_mapping(cfg: Eagle3Config, sd: dict[str, torch.Tensor]) -> None:
    """Complete d2t / t2d in `sd` (either implies the other; neither means the full vocabulary) and check
    them against draft_vocab_size / vocab_size."""
    vd, v = cfg.draft_vocab_size, cfg.vocab_size
    d2t, t2d = sd.get("d2t"), sd.get("t2d")
    if d2t is not None and tuple(d2t.shape) != (vd,):
        raise ValueError(f"Eagle3 d2t has shape {tuple(d2t.shape)} but draft_vocab_size={vd} (expected "
                         f"({vd},)); config.json and weights disagree")
    if t2d is not None and tuple(t2d.shape) != (v,):
        raise ValueError(f"Eagle3 t2d has shape {tuple(t2d.shape)} but vocab_size={v} (expected ({v},))")
    if d2t is None and t2d is None:
        if vd != v:
            raise ValueError(f"Eagle3 checkpoint has no d2t/t2d, which means the full vocabulary, but "
                             f"draft_vocab_size={vd} != vocab_size={v}")
        sd["d2t"] = torch.zeros(vd, dtype=torch.int64)
        sd["t2d"] = torch.ones(v, dtype=torch.bool)
        return
    if d2t is None:
        ids = t2d.bool().nonzero().flatten()  # draft ids are the kept target ids, in order
        if ids.numel() != vd:
            raise ValueError(f"Eagle3 t2d marks {ids.numel()} target ids but draft_vocab_size={vd}")
        sd["d2t"] = ids - torch.arange(vd)
        return
    if d2t.is_floating_point() or d2t.dtype == torch.bool:
        raise ValueError(f"Eagle3 d2t has dtype {d2t.dtype}; it holds integer offsets (target id = draft id + "
                         "d2t[draft id])")
    target_ids = d2t.long() + torch.arange(vd)
    lo, hi = int(target_ids.min()), int(target_ids.max())
    if lo < 0 or hi >= v:
        raise ValueError(f"Eagle3 d2t maps draft ids to target ids in [{lo}, {hi}], outside [0, {v}) for "
                         f"vocab_size={v}")
    if target_ids.unique().numel() != vd:
        raise ValueError(f"Eagle3 d2t maps two draft ids to the same target id ({vd} draft ids, "
                         f"{target_ids.unique().numel()} distinct targets)")
    sd["d2t"] = d2t.long()
    # d2t is authoritative: a t2d beside it was checked for shape above and is otherwise ignored.
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[target_ids] = True
    sd["t2d"] = t2d


def save_eagle3(head: Eagle3Head, path: str | Path, layout: str = "midlayer",
                dtype: torch.dtype | None = None) -> None:
    """Write config.json (LlamaForCausalLMEagle3 style) + model.safetensors.

    layout 'midlayer' (EAGLE / SpecForge) or 'layers.0' (speculators); dtype casts the floating tensors
    (e.g. torch.bfloat16) while d2t / t2d keep int64 / bool. A head with cfg.has_embed False writes no
    embed_tokens.weight even when it currently shares the target's table."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: choose one of {LAYOUTS}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    out: dict[str, torch.Tensor] = {}
    for name, t in head.state_dict().items():
        if (name == "embed_tokens.weight" and not head.cfg.has_embed) or (
                name.startswith("lm_head.") and not head.cfg.has_lm_head):
            continue
        if layout == "layers.0" and name.startswith("midlayer."):
            name = "layers.0." + name[len("midlayer."):]
        t = t.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[name] = t.contiguous().cpu()
    save_file(out, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(head.cfg.to_dict(), indent=2))
