"""Eagle3 heads in the public layouts, at MiniMax-M3-like shapes made tiny, through `load_eagle3`.

Every layout an Eagle3 head may come in (the Inferact MiniMax-M3 heads' exact format is tested in
test_public_m3_heads.py) is written here as config.json + model.safetensors and loaded against a small target
config: head_dim from config.json (also where heads x head_dim != hidden), MHA with num_key_value_heads absent /
equal and GQA, key layouts `midlayer.*` / `layers.0.*` with and without `model.`, no `lm_head.weight` (the target's
is shared when the draft vocabulary is the full one), no `embed_tokens.weight`, d2t with and without t2d. Each
loaded head's paged step through the Triton attention backend (interpreter) equals its reference paged step and its
contiguous forward. Bad configs and checkpoints fail naming the key. CPU, fp32: seconds.
"""

from __future__ import annotations

import json
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton` (kernels decorate at import)

from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from m3eagle.config import M3Config  # noqa: E402
from m3eagle.kernels.attention.metadata import TRASH_PAGE, build_metadata  # noqa: E402
from m3eagle.kernels.ops import REFERENCE  # noqa: E402
from m3eagle.loader.checkpoint import CheckpointError  # noqa: E402
from m3eagle.loader.eagle3 import load_eagle3, save_eagle3, share_target_weights  # noqa: E402
from m3eagle.models.eagle3 import Eagle3Config, Eagle3Head  # noqa: E402

VOCAB, HIDDEN, LAYERS, PAGE = 96, 256, 8, 4
AUX = [2, 4, 5]  # "after L layers" of the 8-layer target (the real head: 2, 30, 57 of 60)


def target_cfg() -> M3Config:
    return M3Config(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4,
                    num_key_value_heads=1, head_dim=128, rotary_dim=64, rope_theta=10000.0, rms_norm_eps=1e-6,
                    intermediate_size=16, dense_intermediate_size=32, shared_intermediate_size=16,
                    num_local_experts=4, num_experts_per_tok=2, routed_scaling_factor=2.0, swiglu_alpha=1.702,
                    swiglu_limit=7.0, layer_types=("full_attention",) * LAYERS, mlp_layer_types=("dense",) * LAYERS,
                    index_n_heads=1, index_head_dim=8, index_block_size=4, index_topk_blocks=2,
                    index_local_blocks=1)


class FakeTarget(nn.Module):
    """The two target tables a head may share (MiniMaxM3's attribute names)."""

    def __init__(self, seed: int = 5):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN, _weight=torch.randn(VOCAB, HIDDEN, generator=g))
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=g) * 0.05)


# (query heads, num_key_value_heads or None = absent, head_dim or None = absent)
SHAPES = {
    "mha_4x128": (4, None, 128),  # MiniMax-M3-EAGLE3-like: MHA, heads x head_dim == hidden
    "mha_4x128_explicit_kv": (4, 4, 128),
    "gqa_2x512": (2, 1, 512),  # head_dim 512, GQA
    "gqa_8x64_kv2": (8, 2, 64),  # heads x head_dim (512) != hidden (256): head_dim must come from config
    "gqa_16x96_kv1": (16, 1, 96),  # group 16, head_dim 96
    "mha_4_derived": (4, None, None),  # no head_dim: hidden / heads = 64
    "mha_2x192": (2, None, 192),
}


def public_config(heads: int, kv: int | None, head_dim: int | None, **edit) -> dict:
    d = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": HIDDEN,
         "num_attention_heads": heads, "intermediate_size": 128, "vocab_size": VOCAB, "draft_vocab_size": VOCAB,
         "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
         "max_position_embeddings": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
         "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX, "use_aux_hidden_state": True}}
    if kv is not None:
        d["num_key_value_heads"] = kv
    if head_dim is not None:
        d["head_dim"] = head_dim
    d.update(edit)
    return d


def random_weights(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Eagle3Head's state dict (its own names) for a config.json, random."""
    head = Eagle3Head(replace(Eagle3Config.from_dict(cfg), aux_layer_ids=tuple(AUX)))
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, t in head.state_dict().items():
        if not t.is_floating_point():
            sd[name] = t.clone()
        elif "norm" in name:
            sd[name] = 1.0 + 0.1 * torch.randn(t.shape, generator=g)
        else:
            sd[name] = torch.randn(t.shape, generator=g) * (0.05 if "embed" not in name else 1.0)
    return sd


def write_public(path: Path, cfg: dict, sd: dict[str, torch.Tensor], layout: str = "midlayer",
                 prefix: str = "", drop: tuple[str, ...] = ()) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, t in sd.items():
        if name in drop:
            continue
        if layout == "layers.0" and name.startswith("midlayer."):
            name = "layers.0." + name[len("midlayer."):]
        out[prefix + name] = t.contiguous()
    save_file(out, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def paged_vs_reference(head: Eagle3Head) -> None:
    """One mixed paged step (a 5-token chunk, a decode row over 6 cached, a 1+2 verify row) through the
    Triton attention backend (interpreter) == the reference ops == the contiguous forward (fresh rows)."""
    from m3eagle.kernels.attention.triton_backend import TritonBackend

    c = head.cfg
    g = torch.Generator().manual_seed(1)
    q_lens, kv_lens = [5, 1, 3], [5, 7, 4]
    width = 3
    table = torch.full((3, width), TRASH_PAGE, dtype=torch.int64)
    nxt = 1
    for r, n in enumerate(kv_lens):
        for col in range(-(-n // PAGE)):
            table[r, col] = nxt
            nxt += 1
    slots = (nxt + 1) * PAGE
    meta = build_metadata(q_lens, torch.tensor(kv_lens), table, PAGE, torch.device("cpu"), max_kv=width * PAGE)
    t = sum(q_lens)
    ids = torch.randint(0, VOCAB, (t,), generator=g)
    aux = torch.randn(t, c.aux_hidden_size, generator=g)
    outs = []
    for ops in (REFERENCE, replace(REFERENCE, attention=TritonBackend())):
        cache = head.new_cache(slots, torch.float32, "cpu")
        gc = torch.Generator().manual_seed(2)  # the cached prefixes' K/V: the same in both runs
        cache.k.copy_(torch.randn(cache.k.shape, generator=gc))
        cache.v.copy_(torch.randn(cache.v.shape, generator=gc))
        with torch.no_grad():
            outs.append(head(ids, meta.positions, aux, replace(meta, ops=ops), cache, True))
    for a, b in zip(outs[0], outs[1]):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=2e-5)
    # the fresh row (row 0: kv == q) equals the contiguous oracle
    with torch.no_grad():
        seq_out, _ = head.forward_seq(ids[None, :5], aux[None, :5], True)
    torch.testing.assert_close(outs[1][0][:5], seq_out[0], atol=2e-5, rtol=2e-5)
    logits = head.compute_logits(outs[1][0])
    assert logits.shape == (t, c.draft_vocab_size) and torch.isfinite(logits).all()


LAYOUTS = [("midlayer", ""), ("layers.0", ""), ("midlayer", "model."), ("layers.0", "model.")]


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_public_head_shapes_load_and_step(tmp_path: Path, shape: str):
    heads, kv, head_dim = SHAPES[shape]
    cfg = public_config(heads, kv, head_dim)
    sd = random_weights(cfg)
    # the published heads share the target's embedding and lm_head: neither is in the checkpoint
    layout, prefix = LAYOUTS[sorted(SHAPES).index(shape) % len(LAYOUTS)]
    path = write_public(tmp_path / shape, cfg, sd, layout, prefix, drop=("embed_tokens.weight", "lm_head.weight"))
    head = load_eagle3(path, target_cfg())
    c = head.cfg
    assert c.head_dim == (head_dim or HIDDEN // heads)
    assert (c.num_attention_heads, c.num_key_value_heads) == (heads, kv or heads)
    assert not c.has_embed and not c.has_lm_head and head.lm_head is None
    assert c.aux_layer_ids == tuple(AUX) and c.aux_hidden_size == 3 * HIDDEN
    assert head.midlayer.self_attn.q_proj.weight.shape == (heads * c.head_dim, 2 * HIDDEN)
    torch.testing.assert_close(head.midlayer.self_attn.k_proj.weight, sd["midlayer.self_attn.k_proj.weight"])
    with pytest.raises(RuntimeError, match="no lm_head"):
        head.compute_logits(torch.zeros(1, HIDDEN))
    target = FakeTarget()
    share_target_weights(head, target)
    assert head.lm_head.weight.data_ptr() == target.lm_head.weight.data_ptr()  # shared, not copied
    assert head.embed_tokens.weight.data_ptr() == target.embed_tokens.weight.data_ptr()
    paged_vs_reference(head)


@pytest.mark.parametrize("layout,prefix", LAYOUTS)
def test_key_layouts_with_own_tables(tmp_path: Path, layout: str, prefix: str):
    cfg = public_config(4, None, 128)
    sd = random_weights(cfg)
    head = load_eagle3(write_public(tmp_path, cfg, sd, layout, prefix), target_cfg())
    assert head.cfg.has_embed and head.cfg.has_lm_head
    for name, t in sd.items():
        torch.testing.assert_close(head.state_dict()[name], t.to(head.state_dict()[name].dtype))


def test_save_round_trip_without_lm_head(tmp_path: Path):
    cfg = public_config(2, 1, 512)
    head = load_eagle3(write_public(tmp_path / "a", cfg, random_weights(cfg), drop=("lm_head.weight",)),
                       target_cfg())
    share_target_weights(head, FakeTarget())
    save_eagle3(head, tmp_path / "b")
    again = load_eagle3(tmp_path / "b", target_cfg())
    assert not again.cfg.has_lm_head and again.cfg.head_dim == 512 and again.cfg.num_key_value_heads == 1
    assert again.cfg == head.cfg


def test_zero_d2t_and_t2d_share_the_lm_head(tmp_path: Path):
    cfg = public_config(4, None, 128)
    sd = random_weights(cfg)
    sd["d2t"] = torch.zeros(VOCAB, dtype=torch.int64)
    sd["t2d"] = torch.ones(VOCAB, dtype=torch.bool)
    head = load_eagle3(write_public(tmp_path, cfg, sd, drop=("lm_head.weight",)), target_cfg())
    assert not head.cfg.has_lm_head and not head.d2t.any() and head.t2d.all()


def test_d2t_is_authoritative_and_t2d_only_checked(tmp_path: Path):
    cfg = public_config(4, None, 128, draft_vocab_size=32)
    sd = random_weights(cfg)
    targets = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:32].sort().values
    sd["d2t"] = targets - torch.arange(32)
    sd["t2d"] = torch.zeros(VOCAB, dtype=torch.bool)  # wrong contents, right shape: ignored
    head = load_eagle3(write_public(tmp_path, cfg, sd), target_cfg())
    assert torch.equal(head.draft_to_target(torch.arange(32)), targets)
    assert torch.equal(head.t2d.nonzero().flatten(), targets)


def _bad(tmp_path: Path, cfg_edit: dict | None = None, sd_edit=None, drop=(), base=(4, None, 128)):
    cfg = public_config(*base)
    cfg.update(cfg_edit or {})
    sd = random_weights(public_config(*base))
    if sd_edit:
        sd_edit(sd)
    return write_public(tmp_path, cfg, sd, drop=drop)


def _fc4(sd):
    sd["fc.weight"] = torch.randn(HIDDEN, 4 * HIDDEN)


def _d2t_shift(sd):  # a permutation of the full vocabulary: draft id i -> target id (i + 1) % V
    sd["d2t"] = torch.tensor([1] * (VOCAB - 1) + [-(VOCAB - 1)])


BAD = {
    "lm_head_reduced_vocab": (dict(draft_vocab_size=32), lambda sd: sd.update(d2t=torch.arange(32) * 2),
                              ("lm_head.weight",), ["'lm_head.weight'", "draft_vocab_size=32"]),
    "lm_head_nonzero_d2t": (None, _d2t_shift, ("lm_head.weight",), ["'lm_head.weight'", "nonzero d2t"]),
    "aux_4_ids": ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 5, 8]}}, _fc4, (),
                  ["eagle_aux_hidden_state_layer_ids=[2, 4, 5, 8]", "3 layer taps + the final layer",
                   "exactly 3"]),
    "aux_3_ids_fc4": (None, _fc4, (), ["fc.weight", "4 aux hidden states", "eagle_aux_hidden_state_layer_ids"]),
    "t2d_shape": (None, lambda sd: sd.update(t2d=torch.ones(VOCAB + 1, dtype=torch.bool)), (),
                  ["t2d has shape (97,)", "vocab_size=96"]),
    "d2t_shape": (None, lambda sd: sd.update(d2t=torch.zeros(VOCAB - 1, dtype=torch.int64)), (),
                  ["d2t has shape (95,)"]),
    "d2t_duplicate": (None, lambda sd: sd.update(d2t=-torch.arange(VOCAB)), (), ["same target id"]),
    "kv_heads_not_divisor": ({"num_key_value_heads": 3}, None, (), ["num_key_value_heads=3"]),
    "no_head_dim_uneven": ({"num_attention_heads": 6, "head_dim": None}, None, (), ["no head_dim", "num_attention_heads=6"]),
    "head_dim_mismatch": ({"head_dim": 64}, None, (), ["midlayer.self_attn.q_proj.weight"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_heads_fail_naming_the_key(tmp_path: Path, case: str):
    cfg_edit, sd_edit, drop, needles = BAD[case]
    path = _bad(tmp_path, cfg_edit, sd_edit, drop)
    with pytest.raises((ValueError, CheckpointError)) as err:
        load_eagle3(path, target_cfg())
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


def test_set_lm_head_refuses_a_reduced_vocabulary():
    cfg = Eagle3Config(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=4, intermediate_size=8,
                       vocab_size=VOCAB, draft_vocab_size=32, head_dim=128, aux_layer_ids=tuple(AUX),
                       has_lm_head=False)
    with pytest.raises(ValueError, match="draft_vocab_size=32"):
        Eagle3Head(cfg).set_lm_head(FakeTarget().lm_head)


def test_a_head_without_lm_head_drafts_with_the_targets_through_the_engine(tmp_path, make_llm):
    """A public-style head that ships no lm_head (full vocabulary, no d2t) is served end to end: the engine gives
    it the target's lm_head (the same module, no copy) and speculative greedy output equals plain greedy."""
    from dataclasses import replace as dc_replace

    from m3eagle.bench import geometries
    from m3eagle.loader.checkpoint import save_target
    from m3eagle.loader.dummy import dummy_eagle3, dummy_target
    from m3eagle.loader.eagle3 import save_eagle3
    from tests.helpers.engine_utils import greedy

    target_cfg, head_cfg = geometries.tiny()
    head_cfg = dc_replace(head_cfg, draft_vocab_size=target_cfg.vocab_size, has_lm_head=False)
    save_target(dummy_target(target_cfg, torch.float32, "cpu"), tmp_path / "target")
    save_eagle3(dummy_eagle3(head_cfg, torch.float32, "cpu"), tmp_path / "head")
    spec = make_llm(tmp_path / "target", draft=tmp_path / "head", num_draft_tokens=3)
    assert spec.draft.lm_head is spec.target.lm_head
    plain = make_llm(tmp_path / "target", num_draft_tokens=0)
    prompts = [[5, 9, 17, 3], [40, 2, 2, 7, 11, 13, 100]]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy(12))]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, greedy(12))] == want
