"""Model configuration: the MiniMax-M3 text backbone as its checkpoint's config.json defines it.

`M3Config.from_dict` accepts the full VL config (`model_type: minimax_m3_vl` with a `text_config`), a
text-only config, and the legacy spellings (`sparse_attention_config`, `moe_layer_freq`, `rope_scaling`),
and resolves them the way transformers 5.17's `MiniMaxM3VLConfig` / `MiniMaxM3VLTextConfig` do: the same
defaults where a key is absent (EOS 200020, RoPE theta 5e6, the indexer shape), the same RoPE types
(default, linear, yarn, llama3). The model's sizes have no default: a config without them is refused
rather than read as the full-size model. Values whose semantics m3eagle does not implement (the indexer
value path, other RoPE types, quantization methods other than MXFP8 and block FP8) are rejected here, at load
time, with the key named.

`quantization_config` (top level or in text_config) becomes `M3Config.quantization`: `mxfp8` (the release:
e4m3 weights, one ue8m0 scale per 1 x 32 block, `weight_block_size` [1, 32]) or block `fp8` (float scales per
[bn, bk] tile, DeepSeek / MiniMax-M2 style), with `ignored_layers` (MiniMax's name for transformers'
`modules_to_not_convert`): the modules stored unquantized.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

log = logging.getLogger("m3eagle")

FULL, SPARSE = "full_attention", "minimax_m3_sparse"
DENSE_MLP, MOE_MLP = "dense", "sparse"
# MiniMaxM3VLTextConfig's defaults; the public config.json sets neither (its generation_config.json may).
DEFAULT_EOS_TOKEN_ID, DEFAULT_BOS_TOKEN_ID = 200020, 200034
ROPE_TYPES = ("default", "linear", "yarn", "llama3")  # see models.layers.rope_inv_freq


class ConfigError(ValueError):
    """A config value m3eagle cannot honour; the message names the key and the fix."""


QUANT_METHODS = ("mxfp8", "fp8")


@dataclass(frozen=True)
class QuantConfig:
    """How a checkpoint's weights are quantized (weights only: m3eagle runs them as W8A16)."""

    method: str  # "mxfp8" | "fp8"
    block: tuple[int, int]  # weight_block_size: [1, 32] for mxfp8, [bn, bk] for block fp8
    ignored: tuple[str, ...] = ()  # modules stored unquantized (ignored_layers / modules_to_not_convert)

    def is_ignored(self, module: str) -> bool:
        """Whether a checkpoint module name (e.g. `language_model.model.layers.3.block_sparse_moe.gate`) is listed
        unquantized: listed names match whole dotted components at the name's end (`lm_head` matches
        `language_model.lm_head`), as transformers' `should_convert_module` matches them."""
        return any(module == i or module.endswith("." + i) or module.startswith(i + ".") or ("." + i + ".") in module
                   for i in self.ignored)

    @property
    def scale_dtype(self) -> str:
        return "uint8 (ue8m0 bytes)" if self.method == "mxfp8" else "float32"


@dataclass(frozen=True)
class M3Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int  # channels rotated by RoPE (NeoX halves); the rest pass through
    rope_theta: float
    rms_norm_eps: float
    intermediate_size: int  # per routed expert
    dense_intermediate_size: int
    shared_intermediate_size: int
    num_local_experts: int
    num_experts_per_tok: int
    routed_scaling_factor: float
    swiglu_alpha: float
    swiglu_limit: float
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    index_n_heads: int
    index_head_dim: int
    index_block_size: int
    index_topk_blocks: int
    index_local_blocks: int
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    max_position_embeddings: int = 524288
    # Resolved RoPE scaling (rope_type linear / yarn / llama3 and every parameter its formula reads);
    # None for plain RoPE. Unhashed: a dict.
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    # The checkpoint's weight quantization (None: bf16 / fp32 weights).
    quantization: QuantConfig | None = None

    # ---- derived -------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers

    def is_sparse(self, layer: int) -> bool:
        return self.layer_types[layer] == SPARSE

    def is_moe(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == MOE_MLP

    @property
    def index_rope_dim(self) -> int:
        # transformers slices the model's cos/sin to the indexer head dim: cos[..., :index_head_dim].
        return min(self.index_head_dim, self.rotary_dim)

    # ---- parsing -------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> M3Config:
        if not isinstance(d, dict):
            raise ConfigError(f"config.json must hold a JSON object, not a {type(d).__name__}")
        if d.get("model_type") == "minimax_m3_vl" or "text_config" in d:
            top = parse_quantization(d, "")
            if "text_config" not in d:
                raise ConfigError("config.json has model_type minimax_m3_vl but no text_config")
            if not isinstance(d["text_config"], dict):
                raise ConfigError(f"config.json text_config must be a JSON object, not a "
                                  f"{type(d['text_config']).__name__}")
            td = dict(d["text_config"])
            # MiniMaxM3VLConfig ties when either level says so, and the VL model it describes
            # (MiniMaxM3SparseForConditionalGeneration) ties on the top-level flag.
            td["tie_word_embeddings"] = bool(d.get("tie_word_embeddings")) or bool(td.get("tie_word_embeddings"))
            cfg = cls._from_text_dict(td, "text_config.")
            return replace(cfg, quantization=top) if top is not None and cfg.quantization is None else cfg
        return cls._from_text_dict(d, "")

    @classmethod
    def _from_text_dict(cls, d: dict[str, Any], where: str) -> M3Config:
        """Parse a text config; `where` prefixes key names in errors ('text_config.' inside a VL config)."""
        g = d.get
        quantization = parse_quantization(d, where)
        sparse_cfg = g("sparse_attention_config") or {}
        if not isinstance(sparse_cfg, dict):
            raise ConfigError(f"{where}sparse_attention_config must be a JSON object")
        _reject_unsupported(d, sparse_cfg, where)

        # Legacy keys win over the flat ones when present, as in MiniMaxM3VLTextConfig.__post_init__.
        legacy = {
            "index_n_heads": "sparse_num_index_heads",
            "index_head_dim": "sparse_index_dim",
            "index_block_size": "sparse_block_size",
            "index_topk_blocks": "sparse_topk_blocks",
            "index_local_blocks": "sparse_local_block",
        }
        raw = {k: sparse_cfg[v] if v in sparse_cfg else g(k) for k, v in legacy.items()}
        layer_types = g("layer_types")
        if layer_types is None and "sparse_attention_freq" in sparse_cfg:
            layer_types = [SPARSE if f else FULL for f in sparse_cfg["sparse_attention_freq"]]
        mlp_types = g("mlp_layer_types")
        if mlp_types is None and g("moe_layer_freq") is not None:
            mlp_types = [MOE_MLP if f else DENSE_MLP for f in g("moe_layer_freq")]
        raw["num_local_experts"] = g("num_local_experts", g("num_experts"))
        _require_sizes(d, raw, layer_types, mlp_types, where)

        n = _positive_int(g("num_hidden_layers"), where + "num_hidden_layers")
        layer_types = tuple(layer_types or [FULL] * n)
        mlp_types = tuple(mlp_types or [MOE_MLP] * n)
        for name, vals, ok in (("layer_types", layer_types, (FULL, SPARSE)),
                               ("mlp_layer_types", mlp_types, (DENSE_MLP, MOE_MLP))):
            if len(vals) != n:
                raise ConfigError(f"{where}{name} has {len(vals)} entries but num_hidden_layers is {n}")
            bad = sorted(set(vals) - set(ok))
            if bad:
                raise ConfigError(f"{where}{name} contains {bad}; m3eagle implements {list(ok)}")
        _reject_index_value(d, sparse_cfg, layer_types, where)
        # Not sizes: transformers' defaults (the public checkpoint's values) apply when absent.
        defaults = {"index_n_heads": 4, "index_head_dim": 128, "index_block_size": 128,
                    "index_topk_blocks": 16, "index_local_blocks": 1}
        idx = {k: _positive_int(raw[k] if raw[k] is not None else defaults[k], where + k) for k in defaults}

        hidden = _positive_int(g("hidden_size"), where + "hidden_size")
        heads = _positive_int(g("num_attention_heads"), where + "num_attention_heads")
        head_dim = _positive_int(g("head_dim"), where + "head_dim")
        max_pos = _positive_int(g("max_position_embeddings", 524288), where + "max_position_embeddings")
        theta, rot, scaling = _resolve_rope(d, head_dim, max_pos, where)
        if g("rotary_dim") is not None and int(g("rotary_dim")) != rot:
            # transformers derives the rotated width from partial_rotary_factor (default 1.0) and ignores
            # `rotary_dim`; we match it, and say so when the two disagree.
            log.warning("config rotary_dim=%s differs from head_dim*partial_rotary_factor=%s; "
                        "using %s as transformers does", g("rotary_dim"), rot, rot)
        kv_heads = _positive_int(g("num_key_value_heads"), where + "num_key_value_heads")
        if heads % kv_heads:
            raise ConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        if SPARSE in layer_types and heads % idx["index_n_heads"]:
            raise ConfigError(f"num_attention_heads={heads} is not a multiple of index_n_heads="
                              f"{idx['index_n_heads']}")
        eps = g("rms_norm_eps", 1e-6)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            raise ConfigError(f"{where}rms_norm_eps={eps!r} must be a positive number (MiniMax-M3 uses 1e-06)")
        # Sizes that only some layers use: a model without MoE (dense) layers needs no expert (dense) sizes.
        moe = MOE_MLP in mlp_types
        dense = DENSE_MLP in mlp_types

        def size(key: str, used: bool, value: Any = None) -> int:
            value = g(key) if value is None else value
            return _positive_int(value, where + key) if used or value is not None else 1

        top_k = size("num_experts_per_tok", moe, g("num_experts_per_tok", 4))
        experts = size("num_local_experts", moe, raw["num_local_experts"])
        if moe and top_k > experts:
            raise ConfigError(f"{where}num_experts_per_tok={top_k} exceeds num_local_experts={experts}")
        return cls(
            vocab_size=_positive_int(g("vocab_size"), where + "vocab_size"), hidden_size=hidden,
            num_hidden_layers=n, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
            rotary_dim=rot, rope_theta=theta, rms_norm_eps=float(eps),
            intermediate_size=size("intermediate_size", moe),
            dense_intermediate_size=size("dense_intermediate_size", dense),
            shared_intermediate_size=size("shared_intermediate_size", moe),
            num_local_experts=experts, num_experts_per_tok=top_k,
            routed_scaling_factor=float(g("routed_scaling_factor", 2.0)),
            swiglu_alpha=float(g("swiglu_alpha", 1.702)), swiglu_limit=float(g("swiglu_limit", 7.0)),
            layer_types=layer_types, mlp_layer_types=mlp_types, **idx,
            tie_word_embeddings=bool(g("tie_word_embeddings", False)),
            bos_token_id=g("bos_token_id", DEFAULT_BOS_TOKEN_ID),
            eos_token_ids=eos_ids(g("eos_token_id", DEFAULT_EOS_TOKEN_ID), where + "eos_token_id"),
            max_position_embeddings=max_pos, rope_scaling=scaling, quantization=quantization,
        )

    def to_hf_text_dict(self) -> dict[str, Any]:
        """A text-only config.json that transformers' MiniMaxM3VLTextConfig and m3eagle both read."""
        d = asdict(self)
        d.pop("quantization")  # the weights' format, written by whoever writes quantized weights
        eos = d.pop("eos_token_ids")
        d["eos_token_id"] = list(eos) if len(eos) != 1 else eos[0]
        d["layer_types"], d["mlp_layer_types"] = list(self.layer_types), list(self.mlp_layer_types)
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.rotary_dim / self.head_dim}
        d.pop("rope_theta")
        d["rope_parameters"].update(d.pop("rope_scaling") or {})
        d["model_type"] = "minimax_m3_vl_text"
        d["architectures"] = ["MiniMaxM3VLForCausalLM"]
        return d


def eos_ids(value: Any, key: str = "eos_token_id") -> tuple[int, ...]:
    """An eos_token_id value (int, list of ints or null) as a tuple of ids."""
    vals = value if isinstance(value, (list, tuple)) else ([] if value is None else [value])
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in vals):
        raise ConfigError(f"{key}={value!r} must be a token id or a list of token ids")
    return tuple(vals)


def _positive_int(value: Any, key: str) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"config {key}={value!r} must be a positive integer")
    return value


def _require_sizes(d: dict[str, Any], raw: dict[str, Any], layer_types: list | None, mlp_types: list | None,
                   where: str) -> None:
    """Name every missing size key at once. transformers would fill in the full-size MiniMax-M3 values,
    which for a small checkpoint means a 60-layer, 6144-wide model: a config without its sizes is an error."""
    need = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim"]
    if mlp_types is None or MOE_MLP in mlp_types:
        need += ["intermediate_size", "shared_intermediate_size", "num_local_experts"]
    if mlp_types is not None and DENSE_MLP in mlp_types:
        need += ["dense_intermediate_size"]
    if layer_types is not None and SPARSE in layer_types:
        need += ["index_n_heads", "index_head_dim"]
    missing = [k for k in need if (raw[k] if k in raw else d.get(k)) is None]
    if missing:
        legacy = {"index_n_heads": " (or sparse_attention_config.sparse_num_index_heads)",
                  "index_head_dim": " (or sparse_attention_config.sparse_index_dim)"}
        names = ", ".join(where + k + legacy.get(k, "") for k in missing)
        raise ConfigError(f"the config is missing {names}; m3eagle does not fall back to the full-size "
                          "MiniMax-M3 sizes. Copy the values from the checkpoint's own config.json.")


def parse_quantization(d: dict[str, Any], where: str) -> QuantConfig | None:
    """`quantization_config` -> QuantConfig (None when absent); anything m3eagle cannot run exactly is refused
    with the key and value named."""
    q = d.get("quantization_config")
    if not q:
        return None
    key = f"{where}quantization_config"
    if not isinstance(q, dict):
        raise ConfigError(f"{key} must be a JSON object, not a {type(q).__name__}")
    method = q.get("quant_method")
    if method not in QUANT_METHODS:
        raise ConfigError(f"{key}.quant_method={method!r} is not supported; m3eagle loads {', '.join(QUANT_METHODS)} "
                          "checkpoints (MiniMax-M3's MXFP8 release, block-FP8 checkpoints) and unquantized ones")
    block = q.get("weight_block_size", [1, 32] if method == "mxfp8" else None)
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ConfigError(f"{key}.weight_block_size={block!r}: expected two positive ints [rows, cols] per scale "
                          "(per-tensor / per-channel FP8 is not supported)")
    if method == "mxfp8" and list(block) != [1, 32]:
        raise ConfigError(f"{key}.weight_block_size={list(block)!r}: MXFP8 scales 1 x 32 blocks; expected [1, 32]")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ConfigError(f"{key}.activation_scheme={scheme!r}: m3eagle keeps activations in bf16 (W8A16) and "
                          "reads no activation scales; only 'dynamic' checkpoints are supported")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"{key}.fmt={fmt!r}: only e4m3 FP8 weights are supported")
    ignored = q.get("ignored_layers", q.get("modules_to_not_convert")) or []
    if not isinstance(ignored, list) or not all(isinstance(i, str) for i in ignored):
        raise ConfigError(f"{key}.ignored_layers must be a list of module names, got {ignored!r}")
    return QuantConfig(method, (int(block[0]), int(block[1])), tuple(ignored))


def _resolve_rope(d: dict[str, Any], head_dim: int, max_pos: int, where: str,
                  ) -> tuple[float, int, dict[str, Any] | None]:
    """(theta, rotary width, scaling) as transformers' RotaryEmbeddingConfigMixin resolves them: a legacy
    `rope_scaling` dict replaces `rope_parameters`; top-level rope_theta / partial_rotary_factor fill keys
    the dict lacks; a top-level original_max_position_embeddings wins over the dict's."""
    src = "rope_scaling" if d.get("rope_scaling") else "rope_parameters"
    rope = d.get(src) or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{where}{src} must be a JSON object")
    if {FULL, SPARSE} & set(rope):
        raise ConfigError(f"{where}{src} is per layer type; MiniMax-M3 (and transformers' model) uses one RoPE "
                          "for every layer. Give a single dict.")
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta", d.get("rope_theta", 5000000.0)))
    prf = rope.get("partial_rotary_factor", d.get("partial_rotary_factor"))
    rot = int(head_dim * float(prf)) if prf is not None else head_dim
    if rot <= 0 or rot % 2:
        raise ConfigError(f"{where}partial_rotary_factor={prf} gives a rotary width of {rot} channels of "
                          f"head_dim={head_dim}; it must be even and positive")
    if kind == "default":
        return theta, rot, None
    if kind not in ROPE_TYPES:
        raise ConfigError(f"{where}{src}.rope_type={kind!r} is not implemented; m3eagle implements "
                          f"{list(ROPE_TYPES)} (position-dependent types such as 'dynamic' and 'longrope' are not)")
    need = ("factor", "low_freq_factor", "high_freq_factor") if kind == "llama3" else ("factor",)
    missing = [k for k in need if k not in rope]
    if missing:
        raise ConfigError(f"{where}{src} with rope_type {kind!r} needs {', '.join(missing)}")
    if kind == "linear":
        return theta, rot, {"rope_type": kind, "factor": float(rope["factor"])}
    orig = int(d.get("original_max_position_embeddings", rope.get("original_max_position_embeddings", max_pos)))
    if kind == "llama3":
        return theta, rot, {"rope_type": kind, "factor": float(rope["factor"]),
                            "low_freq_factor": float(rope["low_freq_factor"]),
                            "high_freq_factor": float(rope["high_freq_factor"]),
                            "original_max_position_embeddings": orig}
    factor = float(rope["factor"]) if rope["factor"] is not None else max_pos / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = rope.get("attention_factor")
    if attn is None:
        ms, ms_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attn = mscale(factor, ms) / mscale(factor, ms_all) if ms and ms_all else mscale(factor)
    return theta, rot, {"rope_type": kind, "factor": factor, "original_max_position_embeddings": orig,
                        "attention_factor": float(attn), "beta_fast": float(rope.get("beta_fast") or 32),
                        "beta_slow": float(rope.get("beta_slow") or 1), "truncate": bool(rope.get("truncate", True))}


def _reject_index_value(d: dict[str, Any], sparse_cfg: dict[str, Any], layer_types: tuple[str, ...],
                        where: str) -> None:
    """The public config says, per layer, `sparse_attention_config.sparse_disable_index_value`: 1 on every
    sparse layer (the indexer only selects blocks). 0 on a sparse layer means an index value / output
    projection that m3eagle does not implement."""
    flags = sparse_cfg.get("sparse_disable_index_value", d.get("sparse_disable_index_value"))
    if flags is None:
        return
    key = f"{where}sparse_attention_config.sparse_disable_index_value"
    if not isinstance(flags, (list, tuple)):
        flags = [flags] * len(layer_types)
    if len(flags) != len(layer_types):
        raise ConfigError(f"{key} has {len(flags)} entries but num_hidden_layers is {len(layer_types)}")
    on = [i for i, (t, f) in enumerate(zip(layer_types, flags)) if t == SPARSE and not f]
    if on:
        raise ConfigError(f"{key} is 0 on sparse layers {on}: the indexer value path is not implemented "
                          "(MiniMax-M3 sets 1 on every sparse layer)")


def _reject_unsupported(d: dict[str, Any], sparse_cfg: dict[str, Any], where: str = "") -> None:
    score = sparse_cfg.get("sparse_score_type", d.get("sparse_score_type", "max"))
    if score != "max":
        raise ConfigError(f"{where}sparse_score_type={score!r} is not implemented; m3eagle's indexer max-pools "
                          "key scores per block ('max'). Remove the key or set it to 'max'.")
    init = sparse_cfg.get("sparse_init_block", 0)
    if init:
        raise ConfigError(f"{where}sparse_attention_config.sparse_init_block={init!r}: force-selecting the "
                          "leading key blocks is not implemented (MiniMax-M3 uses 0)")
    act = d.get("hidden_act", "swigluoai")
    if act not in ("swigluoai", "silu"):
        raise ConfigError(f"{where}hidden_act={act!r} is not implemented; MiniMax-M3 uses 'swigluoai'")
    scoring = d.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise ConfigError(f"{where}scoring_func={scoring!r} is not implemented; the M3 router is sigmoid")
    if sparse_cfg.get("sparse_use_index_value", False) or d.get("index_use_value", False):
        raise ConfigError(f"{where}sparse_attention_config.sparse_use_index_value: the indexer value path is "
                          "not implemented")
    # Flags of the public config whose other value changes the math but not a tensor shape, so a
    # checkpoint would load and silently compute something else.
    for key, want in (("use_gemma_norm", True), ("attention_output_gate", False)):
        if key in d and bool(d[key]) != want:
            raise ConfigError(f"{where}{key}={d[key]!r} is not implemented; MiniMax-M3 sets {want}")
