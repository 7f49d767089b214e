"""Model configuration: the MiniMax-M3 text backbone as its checkpoint's config.json defines it.

`M3Config.from_dict` accepts the full VL config (`model_type: minimax_m3_vl` with a `text_config`), a
text-only config, and the legacy spellings (`sparse_attention_config`, `moe_layer_freq`), and resolves
them the way transformers 5.17's `MiniMaxM3VLTextConfig` does. Values whose semantics m3eagle does not
implement are rejected here, at load time, with the option named.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger("m3eagle")

FULL, SPARSE = "full_attention", "minimax_m3_sparse"
DENSE_MLP, MOE_MLP = "dense", "sparse"


class ConfigError(ValueError):
    """A config value m3eagle cannot honour; the message names the key and the fix."""


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
        if d.get("model_type") == "minimax_m3_vl" or "text_config" in d:
            if "text_config" not in d:
                raise ConfigError("config.json has model_type minimax_m3_vl but no text_config")
            td = dict(d["text_config"])
            td.setdefault("tie_word_embeddings", d.get("tie_word_embeddings", False))
            return cls.from_dict(td)
        g = d.get
        sparse_cfg = dict(g("sparse_attention_config") or {})
        n = int(g("num_hidden_layers", 60))
        _reject_unsupported(d, sparse_cfg)

        legacy = {
            "index_n_heads": "sparse_num_index_heads",
            "index_head_dim": "sparse_index_dim",
            "index_block_size": "sparse_block_size",
            "index_topk_blocks": "sparse_topk_blocks",
            "index_local_blocks": "sparse_local_block",
        }
        idx = {k: sparse_cfg.get(v, g(k)) for k, v in legacy.items()}
        defaults = {"index_n_heads": 4, "index_head_dim": 128, "index_block_size": 128,
                    "index_topk_blocks": 16, "index_local_blocks": 1}
        idx = {k: int(v if v is not None else defaults[k]) for k, v in idx.items()}

        layer_types = g("layer_types")
        if layer_types is None and "sparse_attention_freq" in sparse_cfg:
            layer_types = [SPARSE if f else FULL for f in sparse_cfg["sparse_attention_freq"]]
        layer_types = tuple(layer_types or [FULL] * n)
        mlp_types = g("mlp_layer_types")
        if mlp_types is None and g("moe_layer_freq") is not None:
            mlp_types = [MOE_MLP if f else DENSE_MLP for f in g("moe_layer_freq")]
        mlp_types = tuple(mlp_types or [MOE_MLP] * n)
        for name, vals, ok in (("layer_types", layer_types, (FULL, SPARSE)),
                               ("mlp_layer_types", mlp_types, (DENSE_MLP, MOE_MLP))):
            if len(vals) != n:
                raise ConfigError(f"{name} has {len(vals)} entries but num_hidden_layers is {n}")
            bad = sorted(set(vals) - set(ok))
            if bad:
                raise ConfigError(f"{name} contains {bad}; m3eagle implements {list(ok)}")

        hidden = int(g("hidden_size", 6144))
        heads = int(g("num_attention_heads", 64))
        head_dim = int(g("head_dim") or hidden // heads)
        rope = dict(g("rope_parameters") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"rope_parameters.rope_type={rope_type!r} is not implemented; only 'default'")
        theta = float(rope.get("rope_theta", g("rope_theta", 5000000.0)))
        prf = rope.get("partial_rotary_factor", g("partial_rotary_factor"))
        # transformers derives the rotated width from partial_rotary_factor (default 1.0) and ignores
        # `rotary_dim`; we match it, and say so when the two disagree.
        rot = int(head_dim * float(prf)) if prf is not None else head_dim
        if g("rotary_dim") is not None and int(g("rotary_dim")) != rot:
            log.warning("config rotary_dim=%s differs from head_dim*partial_rotary_factor=%s; "
                        "using %s as transformers does", g("rotary_dim"), rot, rot)
        kv_heads = int(g("num_key_value_heads", 4))
        if heads % kv_heads:
            raise ConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        if SPARSE in layer_types and heads % idx["index_n_heads"]:
            raise ConfigError(f"num_attention_heads={heads} is not a multiple of index_n_heads="
                              f"{idx['index_n_heads']}")
        eos = g("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=int(g("vocab_size", 200064)), hidden_size=hidden, num_hidden_layers=n,
            num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
            rotary_dim=rot, rope_theta=theta, rms_norm_eps=float(g("rms_norm_eps", 1e-6)),
            intermediate_size=int(g("intermediate_size", 3072)),
            dense_intermediate_size=int(g("dense_intermediate_size", 12288)),
            shared_intermediate_size=int(g("shared_intermediate_size", 3072)),
            num_local_experts=int(g("num_local_experts", g("num_experts", 128))),
            num_experts_per_tok=int(g("num_experts_per_tok", 4)),
            routed_scaling_factor=float(g("routed_scaling_factor", 2.0)),
            swiglu_alpha=float(g("swiglu_alpha", 1.702)), swiglu_limit=float(g("swiglu_limit", 7.0)),
            layer_types=layer_types, mlp_layer_types=mlp_types, **idx,
            tie_word_embeddings=bool(g("tie_word_embeddings", False)),
            bos_token_id=g("bos_token_id"), eos_token_ids=eos_ids,
            max_position_embeddings=int(g("max_position_embeddings", 524288)),
        )

    def to_hf_text_dict(self) -> dict[str, Any]:
        """A text-only config.json that transformers' MiniMaxM3VLTextConfig and m3eagle both read."""
        d = asdict(self)
        eos = d.pop("eos_token_ids")
        d["eos_token_id"] = list(eos) if len(eos) != 1 else eos[0]
        d["layer_types"], d["mlp_layer_types"] = list(self.layer_types), list(self.mlp_layer_types)
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.rotary_dim / self.head_dim}
        d.pop("rope_theta")
        d["model_type"] = "minimax_m3_vl_text"
        d["architectures"] = ["MiniMaxM3VLForCausalLM"]
        return d


def _reject_unsupported(d: dict[str, Any], sparse_cfg: dict[str, Any]) -> None:
    score = sparse_cfg.get("sparse_score_type", d.get("sparse_score_type", "max"))
    if score != "max":
        raise ConfigError(f"sparse_score_type={score!r} is not implemented; m3eagle's indexer max-pools "
                          "key scores per block ('max'). Remove the key or set it to 'max'.")
    act = d.get("hidden_act", "swigluoai")
    if act not in ("swigluoai", "silu"):
        raise ConfigError(f"hidden_act={act!r} is not implemented; MiniMax-M3 uses 'swigluoai'")
    scoring = d.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise ConfigError(f"scoring_func={scoring!r} is not implemented; the M3 router is sigmoid")
    if sparse_cfg.get("sparse_use_index_value", False) or d.get("index_use_value", False):
        raise ConfigError("the indexer value path (sparse_use_index_value) is not implemented")
