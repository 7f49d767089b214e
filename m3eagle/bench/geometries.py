"""Named model geometries for `m3eagle bench`: a target config and the Eagle3 head that prices its spec step.

| name     | params (active) | weights                                                                   |
| -------- | --------------- | ------------------------------------------------------------------------- |
| embedded | 9M              | the trained model and head shipped in m3eagle/assets (real acceptance)   |
| m3-mini  | 2.38B (0.62B)   | random, built on the device                                               |
| m3-8b    | ~10B (~4.1B)    | random, built on the device (~8 GB read per bf16 decode step)            |
| tiny     | 0.1M            | random; a CPU smoke geometry for tests (sparse attention active at 40+)  |
| DIR      | -               | a checkpoint directory (`--load-format dummy`: its config, random weights) |

Random Eagle3 heads accept almost nothing, so on m3-mini / m3-8b the bench reports what a speculative
step costs, not what it saves; the speedup comes from the embedded pair.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from m3eagle.config import M3Config
from m3eagle.loader.assets import ASSETS
from m3eagle.models.eagle3 import Eagle3Config, default_aux_layer_ids

FULL, SPARSE, DENSE, MOE = "full_attention", "minimax_m3_sparse", "dense", "sparse"


@dataclass(frozen=True)
class Geometry:
    """What `LLM` is built from: `model` / `draft` are configs (random weights) or directories."""

    name: str
    model: M3Config | Path
    draft: Eagle3Config | Path | None
    load_format: str  # "dummy": random weights on the device; "auto": read the checkpoint
    description: str


def _m3(vocab: int, hidden: int, layers: int, dense_layers: int, heads: int, kv_heads: int, head_dim: int,
        dense_inter: int, experts: int, top_k: int, inter: int, shared: int, index_heads: int,
        index_dim: int, block: int, topk_blocks: int, max_pos: int = 524288) -> M3Config:
    """Dense / full-attention layers first, then MoE / MSA layers (the M3 layout)."""
    d: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, partial_rotary_factor=0.5,
        dense_intermediate_size=dense_inter, num_local_experts=experts, num_experts_per_tok=top_k,
        intermediate_size=inter, shared_intermediate_size=shared, index_n_heads=index_heads,
        index_head_dim=index_dim, index_block_size=block, index_topk_blocks=topk_blocks, index_local_blocks=1,
        layer_types=[FULL] * dense_layers + [SPARSE] * (layers - dense_layers),
        mlp_layer_types=[DENSE] * dense_layers + [MOE] * (layers - dense_layers),
        max_position_embeddings=max_pos, bos_token_id=1, eos_token_id=0)
    return M3Config.from_dict(d)


def _head(t: M3Config, heads: int, kv_heads: int, head_dim: int, inter: int,
          draft_vocab: int | None = None) -> Eagle3Config:
    """An Eagle3 head as wide as its target, sharing the target's embedding table."""
    return Eagle3Config(hidden_size=t.hidden_size, num_attention_heads=heads, num_key_value_heads=kv_heads,
                        head_dim=head_dim, intermediate_size=inter, vocab_size=t.vocab_size,
                        draft_vocab_size=draft_vocab or t.vocab_size,
                        max_position_embeddings=t.max_position_embeddings,
                        aux_layer_ids=default_aux_layer_ids(t.num_hidden_layers), target_hidden_size=t.hidden_size,
                        has_embed=False)


def m3_mini() -> tuple[M3Config, Eagle3Config]:
    t = _m3(vocab=32000, hidden=2048, layers=12, dense_layers=2, heads=16, kv_heads=2, head_dim=128,
            dense_inter=4096, experts=32, top_k=4, inter=1024, shared=1024, index_heads=2, index_dim=128,
            block=128, topk_blocks=16)
    return t, _head(t, heads=16, kv_heads=2, head_dim=128, inter=4096)


def m3_8b() -> tuple[M3Config, Eagle3Config]:
    t = _m3(vocab=32000, hidden=4096, layers=28, dense_layers=2, heads=32, kv_heads=4, head_dim=128,
            dense_inter=12288, experts=16, top_k=4, inter=1536, shared=1536, index_heads=4, index_dim=128,
            block=128, topk_blocks=16)
    return t, _head(t, heads=32, kv_heads=4, head_dim=128, inter=12288)


M3_LAYERS, M3_DENSE_LAYERS = 60, 3


def m3(num_layers: int = M3_LAYERS) -> tuple[M3Config, Eagle3Config]:
    """MiniMax-M3's real text backbone (the release's config.json: hidden 6144, 64 query / 4 KV heads of 128,
    vocabulary 200064, 3 dense layers of 12288 then MoE layers of 128 experts of 3072, top 4, one shared expert of
    3072, an indexer of 4 heads of 128 over 128-token blocks, top 16) cut to its first `num_layers` layers, so that
    a share of the real model's layers fits one GPU and its per-layer step, bytes and MBU are measured at the
    real shapes. Four layers at least: the Eagle3 head taps three of them. The head is multi-head attention as
    wide as the target."""
    if not 4 <= num_layers <= M3_LAYERS:
        raise ValueError(f"--num-layers {num_layers}: choose 4..{M3_LAYERS} (MiniMax-M3 has {M3_LAYERS} layers; the "
                         "Eagle3 head taps three)")
    dense = M3_DENSE_LAYERS
    t = _m3(vocab=200064, hidden=6144, layers=num_layers, dense_layers=dense, heads=64, kv_heads=4, head_dim=128,
            dense_inter=12288, experts=128, top_k=4, inter=3072, shared=3072, index_heads=4, index_dim=128,
            block=128, topk_blocks=16)
    return t, _head(t, heads=48, kv_heads=48, head_dim=128, inter=16384)


def tiny() -> tuple[M3Config, Eagle3Config]:
    # Block 8 x top-2 = 16 tokens: any prompt past 16 tokens exercises block selection. The head drafts
    # over half the vocabulary, so the d2t mapping runs too.
    t = _m3(vocab=512, hidden=64, layers=4, dense_layers=1, heads=4, kv_heads=2, head_dim=16, dense_inter=128,
            experts=8, top_k=2, inter=32, shared=32, index_heads=2, index_dim=16, block=8, topk_blocks=2,
            max_pos=4096)
    return t, _head(t, heads=4, kv_heads=2, head_dim=16, inter=128, draft_vocab=256)


NAMED = {"m3-mini": m3_mini, "m3-8b": m3_8b, "m3": m3, "tiny": tiny}
NAMES = ("embedded", *NAMED)


def resolve(name: str, draft: str | Path | None = None, load_format: str = "auto",
            num_layers: int | None = None) -> Geometry:
    """--geometry NAME|DIR (+ --draft DIR, --load-format, --num-layers for m3) -> Geometry; errors name the option."""
    if num_layers is not None and name != "m3":
        raise ValueError(f"--num-layers is for --geometry m3 (the real model cut to N layers), not {name!r}")
    if name in NAMED:
        if draft is not None:
            raise ValueError(f"--draft is for --geometry DIR; the named geometry {name!r} brings its own "
                             "random Eagle3 head")
        target, head = NAMED[name](num_layers) if num_layers is not None else NAMED[name]()
        what = f" ({target.num_hidden_layers} of its {M3_LAYERS} layers)" if name == "m3" else ""
        return Geometry(name, target, head, "dummy", f"{name}{what}: random weights (seed 0) built on the device")
    if name == "embedded":
        d = Path(draft) if draft is not None else (ASSETS / "draft")
        what = "random weights" if load_format == "dummy" else "the trained weights"
        return Geometry(name, ASSETS / "target", d if (d / "config.json").is_file() else None, load_format,
                        f"embedded model and Eagle3 head ({what})")
    path = Path(name)
    if not (path / "config.json").is_file():
        raise ValueError(f"--geometry {name!r} is neither a named geometry ({', '.join(NAMES)}) nor a "
                         "directory holding config.json")
    what = "random weights" if load_format == "dummy" else "checkpoint weights"
    return Geometry(path.name or str(path), path, Path(draft) if draft is not None else None, load_format,
                    f"{path} ({what})")
