"""Load MiniMax-M3 checkpoints from a local directory (config.json + safetensors shards).

Two key layouts are accepted and mapped onto m3eagle's parameter names (transformers' text-model names
without the `model.` prefix):

- the public MiniMax-M3 layout: `language_model.model.layers.{i}.block_sparse_moe.experts.{j}.w1/w2/w3`,
  `block_sparse_moe.gate` (fp32), `block_sparse_moe.e_score_correction_bias`, `shared_experts.*`,
  `self_attn.index_{q,k}_{proj,norm}`, `mlp.{gate,up,down}_proj` on dense layers;
- what transformers 5.17 `save_pretrained` writes for MiniMaxM3VL models (`model.language_model.*` or
  `model.*`, stacked `experts.gate_up_proj`, fused `gate_up_proj`).

Tensor parallel (`load_target(..., tp=group)`): each rank reads only its slices of each tensor
(`safe_open(...).get_slice`, the model's `Shard`s in m3eagle.distributed.layers) and only its experts; the
model is allocated on the device once, in the serving dtype, and filled tensor by tensor.

Quantized checkpoints (config `quantization_config`: the MXFP8 release, block FP8): each quantized weight
`X.weight` (float8_e4m3fn) comes with its scale `X.weight_scale_inv` (uint8 ue8m0 bytes for MXFP8, float for
block FP8; for stacked experts `X.gate_up_proj` / `X.gate_up_proj_scale_inv`), read in the stored dtypes --
under tensor parallelism the scale's slice follows its weight's, in whole blocks. MXFP8 weights stay MXFP8: the
model's matching parameters become float8_e4m3fn with their uint8 scales beside them (`models/quant.py`), filled
byte for byte, and the W8A16 kernels run them (the CPU reference dequantizes per call). Block-FP8 weights are
dequantized exactly (`kernels/quant/mxfp8.py`) into the model's dtype as they are read: their float scales have
no exact MX form. Modules listed in `ignored_layers` must be stored unquantized.

Vision weights are skipped with one log line. A missing or mis-shaped tensor raises `CheckpointError`
naming the tensor and the expected shape; so do NaN / Inf values, integer or FP8 tensors where float
weights belong (never cast), an FP8 weight without its scale (named), and an unreadable safetensors file
(named). config.json and
generation_config.json are read as transformers reads them: the EOS ids come from generation_config.json
when it sets them, else from the config (transformers' default 200020 when it names none).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Collection, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from m3eagle.config import ConfigError, M3Config, QuantConfig, eos_ids
from m3eagle.distributed.layers import SCALE_SUFFIX, Shard, param_shards
from m3eagle.distributed.parallel_state import SINGLE, TPGroup
from m3eagle.kernels.quant.mxfp8 import MX_BLOCK, MxWeight, dequantize_block
from m3eagle.models.layers import Router
from m3eagle.models.minimax_m3 import MiniMaxM3
from m3eagle.models.quant import mx_shells

log = logging.getLogger("m3eagle")

_VISION = re.compile(r"^(model\.)?(vision_tower|multi_modal_projector|patch_merge_mlp|visual)\.")
_MTP = re.compile(r"(^|\.)mtp\.")


class CheckpointError(ValueError):
    """A checkpoint file or tensor m3eagle cannot use; the message names the file or the tensor."""


_FP8 = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
        if hasattr(torch, n)}


def read_json(p: Path, error: type[ValueError] = ConfigError) -> dict[str, Any]:
    """A JSON object from file `p`; `error` naming the file when it is not one."""
    try:
        d = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{p} is not valid JSON ({e}); restore the file from the checkpoint") from None
    if not isinstance(d, dict):
        raise error(f"{p} holds a JSON {type(d).__name__}, not an object; restore the file from the checkpoint")
    return d


def read_config(path: str | Path) -> dict[str, Any]:
    p = Path(path) / "config.json"
    if not p.is_file():
        raise CheckpointError(f"no config.json in {path}: pass model= a directory holding config.json and "
                              "*.safetensors")
    return read_json(p)


def load_config(path: str | Path) -> M3Config:
    """The target's M3Config from `path`: config.json, with the EOS ids of generation_config.json when
    that file sets eos_token_id (transformers' generate() reads them there first)."""
    path = Path(path)
    try:
        cfg = M3Config.from_dict(read_config(path))
    except ConfigError as e:
        raise ConfigError(f"{path / 'config.json'}: {e}") from None
    gen = path / "generation_config.json"
    if gen.is_file():
        eos = read_json(gen).get("eos_token_id")
        if eos is not None:
            cfg = replace(cfg, eos_token_ids=eos_ids(eos, f"{gen} eos_token_id"))
    return cfg


def _shards(path: Path) -> list[str]:
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return sorted(p.name for p in path.glob("*.safetensors"))
    weight_map = read_json(index, CheckpointError).get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index} has no weight_map object; restore it or remove it to read every "
                              "*.safetensors file")
    files = sorted(set(weight_map.values()))
    for f in files:
        if not (path / f).is_file():
            raise CheckpointError(f"{index} lists {f}, which is not in {path}; the download is incomplete")
    return files


def iter_tensors(path: str | Path, read: Callable[[str, Any], torch.Tensor | None] | None = None,
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) over every safetensors shard (the index json when there is one). `read(name,
    safetensors_slice)` reads only part of a tensor (a rank's shard), or returns None to skip it.

    Every floating tensor is checked for NaN / Inf (one reduction per tensor; the load is I/O-bound), and
    a truncated or corrupt file raises CheckpointError naming it instead of safetensors' bare error."""
    path = Path(path)
    files = _shards(path)
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    for f in files:
        try:
            with safe_open(str(path / f), framework="pt") as fh:
                for name in fh.keys():
                    t = fh.get_tensor(name) if read is None else read(name, fh.get_slice(name))
                    if t is None:
                        continue
                    if t.is_floating_point() and t.dtype not in _FP8 and not bool(torch.isfinite(t).all()):
                        raise CheckpointError(f"tensor {name!r} in {path / f} holds NaN or Inf values; the "
                                              "checkpoint is corrupt (or was saved after a diverged step)")
                    yield name, t
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read {path / f} ({e}): the file is truncated or corrupt; "
                                  "download it again") from None


def _canonical(name: str) -> str | None:
    """Checkpoint key -> m3eagle key (experts/gate_proj merging is handled by the caller)."""
    if _VISION.match(name) or _MTP.search(name):
        return None
    for pre in ("language_model.model.", "model.language_model.", "language_model.", "model."):
        if name.startswith(pre):
            name = name[len(pre):]
            break
    name = name.replace(".block_sparse_moe.", ".mlp.")
    name = re.sub(r"\.mlp\.e_score_correction_bias$", ".mlp.gate.e_score_correction_bias", name)
    name = re.sub(r"\.self_attn\.index_(q|k)_(proj|norm)\.", r".self_attn.indexer.\1_\2.", name)
    return name


_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(w1|w2|w3)\.weight$")
_HALF = re.compile(r"(.*)\.(gate_proj|up_proj)\.weight$")
_SCALE = SCALE_SUFFIX  # X.weight_scale_inv scales X.weight; X.gate_up_proj_scale_inv the stacked experts' X.gate_up_proj


def _weight_spec(cfg: M3Config, shards: dict[str, Shard], name: str, rows: int | None) -> Shard | None | bool:
    """The shard of weight `name` (m3eagle name) this rank reads: a Shard, None (the whole tensor) or False (an
    expert of another rank: not read). rows: a gate / up half's rows (None: from the config)."""
    if m := _EXPERT.match(name):
        spec = shards.get(m.group(1) + ".gate_up_proj")
        (e0, n), = spec.pieces if spec is not None else ((0, cfg.num_local_experts),)
        return None if e0 <= int(m.group(2)) < e0 + n else False
    spec = shards.get(name)
    if spec is None and (m := _HALF.match(name)):
        fused = shards.get(m.group(1) + ".gate_up_proj.weight")
        if fused is not None:
            if rows is None:
                rows = cfg.shared_intermediate_size if ".shared_experts" in name else cfg.dense_intermediate_size
            lo = 0 if m.group(2) == "gate_proj" else rows
            spec = fused.restrict(lo, lo + rows)
    return spec


def _quantized(raw: str, q: torch.Tensor, scale: torch.Tensor, quant: QuantConfig) -> torch.Tensor | MxWeight:
    """One quantized weight and its scale (checkpoint names in errors): MXFP8 as an MxWeight (kept as stored),
    block FP8 dequantized to fp32 (exact)."""
    if quant.method == "mxfp8":
        if scale.dtype != torch.uint8:
            raise CheckpointError(f"tensor {raw + _SCALE!r} is {scale.dtype}; MXFP8 scales are uint8 ue8m0 bytes "
                                  "(quantization_config.quant_method 'mxfp8')")
        if q.dtype != torch.float8_e4m3fn:
            raise CheckpointError(f"tensor {raw!r}: an MXFP8 weight must be float8_e4m3fn, got {q.dtype}")
        k = q.shape[-1]
        if k % MX_BLOCK or tuple(scale.shape) != (*q.shape[:-1], k // MX_BLOCK):
            raise CheckpointError(f"tensor {raw!r}: MXFP8 scale shape {tuple(scale.shape)} does not match weight "
                                  f"{tuple(q.shape)}: expected {(*q.shape[:-1], k // MX_BLOCK)} (one byte per 1 x "
                                  f"{MX_BLOCK} block along the last dim)")
        return MxWeight(q, scale)
    if not scale.is_floating_point():
        raise CheckpointError(f"tensor {raw + _SCALE!r} is {scale.dtype}; block-FP8 scales are floating point "
                              "(quantization_config.quant_method 'fp8')")
    try:
        return dequantize_block(q, scale, quant.block)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"tensor {raw!r}: {e}") from None


def _cat(ts: list[torch.Tensor | MxWeight], dim: int) -> torch.Tensor | MxWeight:
    """torch.cat over plain tensors, or over MxWeights (values and scales alike; dim is not the last)."""
    if all(isinstance(t, MxWeight) for t in ts):
        return MxWeight(torch.cat([t.q for t in ts], dim), torch.cat([t.scale for t in ts], dim))
    if any(isinstance(t, MxWeight) for t in ts):
        raise CheckpointError("the parts of one fused weight (gate/up halves, or one layer's experts) mix MXFP8 and "
                              "unquantized tensors; the checkpoint does not match its quantization_config")
    return torch.cat(ts, dim)


def _stack(ts: list[torch.Tensor | MxWeight]) -> torch.Tensor | MxWeight:
    if all(isinstance(t, MxWeight) for t in ts):
        return MxWeight(torch.stack([t.q for t in ts]), torch.stack([t.scale for t in ts]))
    return _cat([t.unsqueeze(0) for t in ts], 0)  # raises on a mix


def _shard_reader(cfg: M3Config, shards: dict[str, Shard]) -> Callable[[str, Any], torch.Tensor | None]:
    """read(raw name, safetensors slice) for `iter_tensors`: this rank's part of each tensor, by the model's
    shards (m3eagle names): a sharded tensor's pieces, a per-expert tensor only when the expert is this
    rank's, a gate / up half by the matching half of its fused gate_up shard; anything else whole."""

    def read(raw: str, sl: Any) -> torch.Tensor | None:
        name = _canonical(raw)
        if name is None:
            return torch.empty(0)  # vision / MTP: not read, counted as ignored by the caller
        if name.endswith(_SCALE) and cfg.quantization is not None:  # the slice of its weight, in scale blocks
            wname = name[: -len(_SCALE)]
            spec = _weight_spec(cfg, shards, wname, None)
            if spec is False or spec is None:
                return None if spec is False else sl[:]
            bn, bk = cfg.quantization.block
            per_dim = (bn, bk) if len(sl.get_shape()) == 2 else (1, bn, bk)  # stacked experts: [E, N, K]
            try:
                return spec.blocks(per_dim[spec.dim]).read(sl.__getitem__)
            except ValueError as e:
                raise CheckpointError(f"tensor {raw!r}: the tensor-parallel split of {wname!r} cuts a "
                                      f"quantization block ({e}); use a tensor_parallel_size that splits it on "
                                      "whole blocks") from None
        spec = _weight_spec(cfg, shards, name, sl.get_shape()[0])
        if spec is False:
            return None
        return spec.read(sl.__getitem__) if spec is not None else sl[:]

    return read


def load_state_dict(path: str | Path, cfg: M3Config, shards: dict[str, Shard] | None = None,
                    ) -> dict[str, torch.Tensor]:
    """Read every shard into m3eagle names, merging per-expert w1/w2/w3 and gate/up halves. Those pieces
    are shape-checked here, before merging, so an error names the checkpoint's own key. `shards` (a tensor-
    parallel rank's, from `param_shards(model)`) reads only this rank's slices and experts."""
    sd: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, int, str], tuple[str, torch.Tensor]] = {}
    halves: dict[tuple[str, str], tuple[str, torch.Tensor]] = {}
    quant = cfg.quantization
    fp8: dict[str, torch.Tensor] = {}  # quantized weights waiting for their scale, by checkpoint name
    scales: dict[str, torch.Tensor] = {}  # scales waiting for their weight
    skipped = 0
    for raw, t in iter_tensors(path, _shard_reader(cfg, shards) if shards else None):
        name = _canonical(raw)
        if name is None:
            skipped += 1
            continue
        if quant is not None and raw.endswith(_SCALE):
            raw = raw[: -len(_SCALE)]
            if raw not in fp8:
                scales[raw] = t
                continue
            t, name = _quantized(raw, fp8.pop(raw), t, quant), _canonical(raw)
        elif quant is not None and t.dtype in _FP8:
            module = raw.rsplit(".", 1)[0] if raw.endswith(".weight") else raw
            if quant.is_ignored(module):
                raise CheckpointError(f"tensor {raw!r} is {t.dtype} but quantization_config.ignored_layers lists "
                                      f"{module!r} as unquantized; the config does not match the weights")
            if raw not in scales:
                fp8[raw] = t
                continue
            t = _quantized(raw, t, scales.pop(raw), quant)
        if not isinstance(t, MxWeight):
            _check_float(raw, t)
        m = _EXPERT.match(name)
        if m:
            experts[(m.group(1), int(m.group(2)), m.group(3))] = (raw, t)
            continue
        m = _HALF.match(name)
        if m:
            halves[(m.group(1), m.group(2))] = (raw, t)
            continue
        sd[name] = t
    if fp8:
        raw = sorted(fp8)[0]
        raise CheckpointError(f"missing tensor {raw + _SCALE!r}: the {quant.method.upper()} weight {raw!r} has no "
                              f"scale ({quant.scale_dtype}); {len(fp8)} quantized weights lack theirs")
    if scales:
        raw = sorted(scales)[0]
        raise CheckpointError(f"tensor {raw + _SCALE!r} scales a weight {raw!r} that is not FP8 (or missing); "
                              "the checkpoint does not match its quantization_config")
    if skipped:
        log.info("ignored %d vision/MTP tensors (m3eagle serves the text backbone)", skipped)
    h, inter = cfg.hidden_size, cfg.intermediate_size
    want = {"w1": (inter, h), "w3": (inter, h), "w2": (h, inter)}
    for prefix in sorted({k[0] for k in experts}):
        parts: dict[str, list[torch.Tensor]] = {"w1": [], "w2": [], "w3": []}
        spec = (shards or {}).get(prefix + ".gate_up_proj")
        (e0, n), = spec.pieces if spec is not None else ((0, cfg.num_local_experts),)
        for j in range(e0, e0 + n):
            for w in ("w1", "w3", "w2"):
                key = (prefix, j, w)
                if key not in experts:
                    raise CheckpointError(f"missing tensor {prefix}.{j}.{w}.weight, expected shape {want[w]} "
                                          f"(config says num_local_experts={cfg.num_local_experts})")
                raw, t = experts[key]
                if tuple(t.shape) != want[w]:
                    raise CheckpointError(f"tensor {raw!r} has shape {tuple(t.shape)}, expected {want[w]}")
                parts[w].append(t)
        sd[prefix + ".gate_up_proj"] = _stack([_cat([a, b], 0) for a, b in zip(parts["w1"], parts["w3"])])
        sd[prefix + ".down_proj"] = _stack(parts["w2"])
    for prefix in sorted({k[0] for k in halves}):
        inter = cfg.shared_intermediate_size if prefix.endswith("shared_experts") else cfg.dense_intermediate_size
        spec = (shards or {}).get(prefix + ".gate_up_proj.weight")
        inter = spec.size // 2 if spec is not None else inter  # this rank's rows of each half
        pieces = []
        for w in ("gate_proj", "up_proj"):
            if (prefix, w) not in halves:
                raise CheckpointError(f"missing tensor {prefix}.{w}.weight, expected shape {(inter, h)}")
            raw, t = halves[(prefix, w)]
            if tuple(t.shape) != (inter, h):
                raise CheckpointError(f"tensor {raw!r} has shape {tuple(t.shape)}, expected {(inter, h)}")
            pieces.append(t)
        sd[prefix + ".gate_up_proj.weight"] = _cat(pieces, 0)
    for name in [n for n, t in sd.items() if isinstance(t, MxWeight)]:  # MXFP8: values and scales by their names
        t = sd.pop(name)
        sd[name], sd[name + _SCALE] = t.q, t.scale
    return sd


def _check_float(name: str, t: torch.Tensor) -> None:
    """Target weights are floating point: an integer or FP8 tensor is refused, never cast (a cast would
    load unscaled quantized values or an index table as weights)."""
    if t.dtype in _FP8:
        raise CheckpointError(f"tensor {name!r} is {t.dtype} but config.json has no quantization_config: FP8 "
                              "weights are read only as the config's quant_method ('mxfp8' or block 'fp8') says, "
                              "never cast unscaled")
    if not t.is_floating_point():
        raise CheckpointError(f"tensor {name!r} has dtype {t.dtype} where floating-point weights belong; "
                              "the checkpoint is not a MiniMax-M3 bf16/fp32 checkpoint")


def load_into(model: torch.nn.Module, sd: dict[str, torch.Tensor], what: str,
              optional: tuple[str, ...] = ()) -> None:
    """Copy sd into the model's parameters/buffers, checking presence and shape of every tensor."""
    own = dict(model.named_parameters())
    own.update(dict(model.named_buffers()))
    for name, p in own.items():
        t = sd.get(name)
        if t is None:
            if any(re.fullmatch(o, name) for o in optional):
                continue
            raise CheckpointError(f"{what}: missing tensor {name!r}, expected shape {tuple(p.shape)}")
        if tuple(t.shape) != tuple(p.shape):
            raise CheckpointError(f"{what}: tensor {name!r} has shape {tuple(t.shape)}, expected "
                                  f"{tuple(p.shape)}")
        if p.dtype in _FP8 or p.dtype == torch.uint8:  # MXFP8 values and scales: byte for byte, never cast
            if t.dtype != p.dtype:
                raise CheckpointError(f"{what}: tensor {name!r} is {t.dtype} where the MXFP8 weight needs {p.dtype}")
        elif p.is_floating_point():
            try:
                _check_float(name, t)
            except CheckpointError as e:
                raise CheckpointError(f"{what}: {e}") from None
        with torch.no_grad():
            p.copy_(t.to(p.dtype))
    extra = sorted(set(sd) - set(own))
    if extra:
        log.warning("%s: %d unused tensors, e.g. %s", what, len(extra), extra[:3])


def load_target(path: str | Path, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", tp: TPGroup = SINGLE) -> MiniMaxM3:
    """The target at `path`, allocated once on `device` in `dtype` (routers fp32). With a tensor-parallel
    group, this rank's shard, read slice by slice."""
    cfg = load_config(path)
    with torch.device("meta"):  # shapes (and shards) before reading: nothing allocated yet
        shards = param_shards(MiniMaxM3(cfg, tp)) if tp.size > 1 else None
    sd = load_state_dict(path, cfg, shards)  # before allocating: a weightless directory fails cheaply
    if cfg.tie_word_embeddings:
        cfg = _tie(cfg, sd)
    elif "lm_head.weight" not in sd and "embed_tokens.weight" in sd:
        raise CheckpointError(f"missing tensor 'lm_head.weight', expected shape "
                              f"{(cfg.vocab_size, cfg.hidden_size)} (or set tie_word_embeddings)")
    optional = (r".*e_score_correction_bias",) + ((r"lm_head\.weight",) if cfg.tie_word_embeddings else ())
    with torch.device("meta"):
        model = MiniMaxM3(cfg, tp)
    model = materialize(model, dtype, device, quantized=sd.keys())
    if cfg.tie_word_embeddings:  # to_empty gave each module its own tensor; tie them again
        model.lm_head.weight = model.embed_tokens.weight
    with torch.no_grad():  # the optional score-correction bias defaults to zero when absent
        for m in model.modules():
            if isinstance(m, Router):
                m.e_score_correction_bias.zero_()
    load_into(model, sd, "target checkpoint", optional)
    return model.eval().requires_grad_(False)


def materialize(model: torch.nn.Module, dtype: torch.dtype, device: str | torch.device,
                quantized: Collection[str] = ()) -> torch.nn.Module:
    """Allocate a meta-device model once on `device`, already in `dtype` (uninitialised); routers stay fp32. The
    weights whose scales are named in `quantized` (a checkpoint's keys) are allocated as MXFP8 instead."""
    model.to(dtype=dtype)  # on meta this costs nothing
    for m in model.modules():
        if isinstance(m, Router):
            m.float()  # router weight and bias stay fp32 (cast_model does the same)
    mx_shells(model, quantized)  # after the cast: a cast would turn the fp8 values into plain numbers
    return model.to_empty(device=device)


def _tie(cfg: M3Config, sd: dict[str, torch.Tensor]) -> M3Config:
    """tie_word_embeddings as transformers' from_pretrained applies it: with only one of the two tensors
    present the other shares it; with both present and different they stay separate (a config that
    contradicts its checkpoint)."""
    emb, head = sd.get("embed_tokens.weight"), sd.get("lm_head.weight")
    if emb is None and head is not None:
        sd["embed_tokens.weight"] = sd.pop("lm_head.weight")
    elif emb is not None and head is not None and not torch.equal(emb, head):
        log.warning("tie_word_embeddings is set but the checkpoint holds a different lm_head.weight; not tying "
                    "(as transformers); set tie_word_embeddings false to silence this")
        return replace(cfg, tie_word_embeddings=False)
    else:
        sd.pop("lm_head.weight", None)
    return cfg


def cast_model(model: MiniMaxM3, dtype: torch.dtype, device: str | torch.device) -> MiniMaxM3:
    """Move to device/dtype; the router (weight and bias) stays fp32 as in the public checkpoint."""
    routers = {n: (m.weight.data.float(), m.e_score_correction_bias.float())
               for n, m in model.named_modules() if n.endswith("mlp.gate")}
    model.to(device=device, dtype=dtype)
    for n, m in model.named_modules():
        if n in routers:
            m.weight.data = routers[n][0].to(device)
            m.e_score_correction_bias = routers[n][1].to(device)
    return model.eval().requires_grad_(False)


def save_target(model: MiniMaxM3, path: str | Path, layout: str = "hf") -> None:
    """Write config.json + model.safetensors. layout='hf' writes transformers' MiniMaxM3VLForCausalLM
    names; layout='public' writes the MiniMax-M3 release layout (per-expert w1/w2/w3)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg
    sd = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    out: dict[str, torch.Tensor] = {}
    if layout == "hf":
        for k, v in sd.items():
            out[k if k == "lm_head.weight" else "model." + k] = v
        conf = cfg.to_hf_text_dict()
    elif layout == "public":
        for k, v in sd.items():
            if k == "lm_head.weight":
                out["language_model.lm_head.weight"] = v
                continue
            moe = re.search(r"\.mlp\.(gate\.|experts\.|shared_experts\.)", k) is not None
            base = "language_model.model." + (k.replace(".mlp.", ".block_sparse_moe.") if moe else k)
            base = base.replace(".block_sparse_moe.gate.e_score_correction_bias",
                                ".block_sparse_moe.e_score_correction_bias")
            base = re.sub(r"\.self_attn\.indexer\.(q|k)_(proj|norm)\.", r".self_attn.index_\1_\2.", base)
            if base.endswith("experts.gate_up_proj"):
                inter = v.shape[1] // 2
                for j in range(v.shape[0]):
                    out[base[: -len("gate_up_proj")] + f"{j}.w1.weight"] = v[j, :inter].clone()
                    out[base[: -len("gate_up_proj")] + f"{j}.w3.weight"] = v[j, inter:].clone()
            elif base.endswith("experts.down_proj"):
                for j in range(v.shape[0]):
                    out[base[: -len("down_proj")] + f"{j}.w2.weight"] = v[j].clone()
            elif base.endswith("gate_up_proj.weight"):
                inter = v.shape[0] // 2
                out[base.replace("gate_up_proj", "gate_proj")] = v[:inter].clone()
                out[base.replace("gate_up_proj", "up_proj")] = v[inter:].clone()
            else:
                out[base] = v
        conf = {"model_type": "minimax_m3_vl", "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
                "text_config": cfg.to_hf_text_dict()}
    else:
        raise ValueError(f"layout={layout!r}: choose 'hf' or 'public'")
    save_file(out, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(conf, indent=2))
