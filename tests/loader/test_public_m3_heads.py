"""The public MiniMax-M3 Eagle3 heads, Inferact/MiniMax-M3-EAGLE3 (multi-head attention) and
Inferact/MiniMax-M3-EAGLE3-GQA (4 KV heads), in their published format through m3eagle's own loader.

docs/eagle3_heads.md records their config.json and tensors with the sources. Here each head is written as
published -- the same config.json keys and values (top-level fc_norm / norm_output, no eagle_config, no aux
layer ids, no target_hidden_size), the same 17 tensor names (`layers.0.*`, `fc_norm.{0,1,2}`, embed_tokens
and lm_head included, no d2t / t2d), bf16, the TorchSpec safetensors metadata -- with the target-sized widths
(hidden 6144, intermediate 18432, vocabulary 200064) shrunk to an 8-layer tiny target. The attention shape
stays the published one: 64 query heads of head_dim 128 (8192 wide over a narrower hidden), 64 or 4 KV heads.

Checked: both load through `load_eagle3` and `LLM(draft=...)` with the aux taps the heads were trained on
(the default (2, N//2, N-3): (2, 4, 5) here, (2, 30, 57) on the real target); the full-size configs parse
into heads whose tensor shapes and bf16 bytes are the published ones; a renamed or missing tensor and every
wrong config value fail naming it; the head's attention on the Triton kernels (interpreter) equals the
reference at the real head shapes; speculative greedy output equals plain greedy output with each head.
"""

from __future__ import annotations

import json
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton` (kernels decorate at import)

from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from m3eagle.config import M3Config  # noqa: E402
from m3eagle.kernels.attention.metadata import build_metadata  # noqa: E402
from m3eagle.kernels.ops import REFERENCE  # noqa: E402
from m3eagle.loader.checkpoint import CheckpointError  # noqa: E402
from m3eagle.loader.eagle3 import canonical_name, load_eagle3  # noqa: E402
from m3eagle.models.eagle3 import Eagle3Config, Eagle3Head, default_aux_layer_ids  # noqa: E402

MHA, GQA = "Inferact/MiniMax-M3-EAGLE3", "Inferact/MiniMax-M3-EAGLE3-GQA"


def published_config(name: str) -> dict:
    """config.json of the public head. rms_norm_eps, rope_theta and max_position_embeddings were not found
    verbatim (docs/eagle3_heads.md): TorchSpec copies them from the target (1e-6, 5e6, 524288)."""
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 6144,
            "intermediate_size": 18432, "num_hidden_layers": 1, "num_attention_heads": 64,
            "num_key_value_heads": 64 if name == MHA else 4, "head_dim": 128, "hidden_act": "silu",
            "vocab_size": 200064, "draft_vocab_size": 200064, "tie_word_embeddings": False,
            "fc_norm": True, "norm_output": True, "rms_norm_eps": 1e-06, "rope_theta": 5000000.0,
            "rope_scaling": None, "max_position_embeddings": 524288, "attention_bias": False,
            "attention_dropout": 0.0, "torch_dtype": "bfloat16", "use_cache": True}


def published_shapes(name: str, h: int = 6144, i: int = 18432, v: int = 200064) -> dict[str, tuple[int, ...]]:
    """The 17 tensors of the public head by their published names (hidden h, intermediate i, vocabulary v
    given: the shrunk heads keep the attention's 64 x 128 query and 64 or 4 x 128 KV width)."""
    q, kv = 64 * 128, (64 if name == MHA else 4) * 128
    return {"embed_tokens.weight": (v, h), "fc.weight": (h, 3 * h),
            **{f"fc_norm.{j}.weight": (h,) for j in range(3)},
            "layers.0.input_layernorm.weight": (h,), "layers.0.hidden_norm.weight": (h,),
            "layers.0.post_attention_layernorm.weight": (h,),
            "layers.0.self_attn.q_proj.weight": (q, 2 * h), "layers.0.self_attn.k_proj.weight": (kv, 2 * h),
            "layers.0.self_attn.v_proj.weight": (kv, 2 * h), "layers.0.self_attn.o_proj.weight": (h, q),
            "layers.0.mlp.gate_proj.weight": (i, h), "layers.0.mlp.up_proj.weight": (i, h),
            "layers.0.mlp.down_proj.weight": (h, i), "norm.weight": (h,), "lm_head.weight": (v, h)}


# ---- the tiny target and the shrunk heads -----------------------------------------------------------------
VOCAB, HIDDEN, LAYERS, PAGE = 256, 64, 8, 4


def tiny_target() -> M3Config:
    """MiniMax-M3's layout (a dense full-attention layer first, then MoE + sparse layers), tiny."""
    return M3Config(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, rotary_dim=8, rope_theta=5000000.0, rms_norm_eps=1e-6,
                    intermediate_size=32, dense_intermediate_size=128, shared_intermediate_size=32,
                    num_local_experts=4, num_experts_per_tok=2, routed_scaling_factor=2.0, swiglu_alpha=1.702,
                    swiglu_limit=7.0, layer_types=("full_attention",) + ("minimax_m3_sparse",) * (LAYERS - 1),
                    mlp_layer_types=("dense",) + ("sparse",) * (LAYERS - 1), index_n_heads=2, index_head_dim=16,
                    index_block_size=8, index_topk_blocks=2, index_local_blocks=1, max_position_embeddings=4096)


def shrunk_config(name: str, **edit) -> dict:
    """The published config.json with the target-sized widths cut to the tiny target's."""
    return {**published_config(name), "hidden_size": HIDDEN, "intermediate_size": 3 * HIDDEN, "vocab_size": VOCAB,
            "draft_vocab_size": VOCAB, **edit}


def shrunk_tensors(name: str, seed: int = 0, tables: dict[str, torch.Tensor] | None = None,
                   ) -> dict[str, torch.Tensor]:
    """The published tensor set at the shrunk widths, bf16, by the published names; `tables` gives
    embed_tokens.weight / lm_head.weight (the published heads ship copies of the target's)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, shape in published_shapes(name, HIDDEN, 3 * HIDDEN, VOCAB).items():
        if len(shape) == 1:  # norms near one, as trained ones are
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) * (1.0 if "embed" in key else 0.05)
        out[key] = t.to(torch.bfloat16)
    out.update({k: t.to(torch.bfloat16) for k, t in (tables or {}).items()})
    return out


def write_head(path: Path, cfg: dict, sd: dict[str, torch.Tensor]) -> Path:
    """model.safetensors as TorchSpec's converter writes it (one file, its version in the metadata) + config."""
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path / "model.safetensors"),
              metadata={"torchspec_version": "0.1.0"})
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    """The tiny target, its embedding and lm_head rounded to bf16 so that a head's bf16 copies equal them."""
    from m3eagle.loader.checkpoint import save_target
    from m3eagle.loader.dummy import dummy_target

    target = dummy_target(tiny_target(), torch.float32, "cpu", seed=3)
    for t in (target.embed_tokens.weight, target.lm_head.weight):
        t.copy_(t.bfloat16().float())
    d = tmp_path_factory.mktemp("tiny_m3_target")
    save_target(target, d)
    return d


@pytest.fixture(scope="module")
def heads(target_dir, tmp_path_factory) -> dict[str, Path]:
    """Both heads as published, their embed_tokens / lm_head copies of the target's."""
    from m3eagle.loader.checkpoint import load_target

    target = load_target(target_dir)
    tables = {"embed_tokens.weight": target.embed_tokens.weight, "lm_head.weight": target.lm_head.weight}
    root = tmp_path_factory.mktemp("public_m3_heads")
    return {name: write_head(root / name.split("/")[1], shrunk_config(name), shrunk_tensors(name, i, tables))
            for i, name in enumerate((MHA, GQA))}


# ---- the published format at full size --------------------------------------------------------------------
def real_m3_target() -> M3Config:
    from m3eagle.bench.geometries import m3

    return m3()[0]  # the release's text backbone: 60 layers, hidden 6144, vocabulary 200064


@pytest.mark.parametrize("name", [MHA, GQA])
def test_full_size_config_gives_the_published_tensors(name: str):
    from m3eagle.loader.eagle3 import validate_against_target

    cfg = Eagle3Config.from_dict(published_config(name))
    target = real_m3_target()
    assert cfg.aux_layer_ids is None  # named nowhere in config.json: the default taps apply
    cfg = replace(cfg, aux_layer_ids=default_aux_layer_ids(target.num_hidden_layers))
    assert cfg.aux_layer_ids == (2, 30, 57)  # what vLLM taps when it serves them (and TorchSpec trained on)
    validate_against_target(cfg, target, explicit_target_hidden=False)
    assert (cfg.head_dim, cfg.num_attention_heads, cfg.fc_norm, cfg.norm_output) == (128, 64, True, True)
    with torch.device("meta"):
        head = Eagle3Head(cfg)
    shapes = {canonical_name(k): v for k, v in published_shapes(name).items()}
    got = {k: tuple(t.shape) for k, t in head.state_dict().items() if k not in ("d2t", "t2d")}
    assert got == shapes
    weight_bytes = 2 * sum(torch.Size(s).numel() for s in shapes.values())  # bf16
    if name == GQA:
        # revision 96692486's model.safetensors is 6,149,993,396 bytes: these weights plus a ~9 KB header
        assert 0 < 6_149_993_396 - weight_bytes < 64 * 1024
    else:
        assert round(weight_bytes / 1e9, 1) == 6.5  # "model.safetensors (6.5GB)"


# ---- loading the published format ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", [MHA, GQA])
def test_published_format_loads(heads, name: str):
    from safetensors.torch import load_file

    sd = load_file(str(heads[name] / "model.safetensors"))
    head = load_eagle3(heads[name], tiny_target(), torch.bfloat16)
    c = head.cfg
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (64, 64 if name == MHA else 4, 128)
    assert c.num_attention_heads * c.head_dim != c.hidden_size  # 8192-wide attention over a narrower stream
    assert c.aux_layer_ids == (2, 4, 5) == default_aux_layer_ids(LAYERS)
    assert c.fc_norm and c.norm_output and c.has_embed and c.has_lm_head and c.target_hidden_size == HIDDEN
    assert c.draft_vocab_size == VOCAB and not head.d2t.any() and head.t2d.all()  # no d2t: the full vocabulary
    state = head.state_dict()
    for key, t in sd.items():  # every published tensor landed, bit for bit, under its m3eagle name
        assert state[canonical_name(key)].dtype == torch.bfloat16
        assert torch.equal(state[canonical_name(key)], t), key
    assert len(sd) == 17 and set(state) == {canonical_name(k) for k in sd} | {"d2t", "t2d"}


def _rename(old: str, new: str):
    return lambda sd: sd.__setitem__(new, sd.pop(old))


BAD = {  # case: (config.json edit, tensor edit, what the error must name)
    "renamed_q_proj": ({}, _rename("layers.0.self_attn.q_proj.weight", "layers.0.self_attn.qproj.weight"),
                       ["'midlayer.self_attn.q_proj.weight'", "'midlayer.self_attn.qproj.weight'"]),
    "renamed_layer_prefix": ({}, _rename("layers.0.hidden_norm.weight", "layers.1.hidden_norm.weight"),
                             ["'midlayer.hidden_norm.weight'", "'layers.1.hidden_norm.weight'"]),
    "missing_fc_norm_1": ({}, lambda sd: sd.pop("fc_norm.1.weight"), ["'fc_norm.1.weight'"]),
    "missing_final_norm": ({}, lambda sd: sd.pop("norm.weight"), ["'norm.weight'"]),
    "fc_norm_off": ({"fc_norm": False}, None, ["fc_norm", "'fc_norm.0.weight'"]),
    "kv_heads": ({"num_key_value_heads": 8}, None, ["'midlayer.self_attn.k_proj.weight'"]),
    "head_dim": ({"head_dim": 96}, None, ["'midlayer.self_attn.q_proj.weight'"]),
    "heads": ({"num_attention_heads": 32}, None, ["'midlayer.self_attn.q_proj.weight'"]),
    "intermediate": ({"intermediate_size": 2 * HIDDEN}, None, ["'midlayer.mlp.gate_proj.weight'"]),
    "hidden": ({"hidden_size": 2 * HIDDEN}, None, ["hidden_size=128", f"hidden_size={HIDDEN}"]),
    "vocab": ({"vocab_size": VOCAB + 1}, None, [f"vocab_size={VOCAB + 1}", f"vocab_size={VOCAB}"]),
    "layers": ({"num_hidden_layers": 2}, None, ["num_hidden_layers=2"]),
    "partial_rotary": ({"partial_rotary_factor": 0.5}, None, ["partial_rotary_factor=0.5"]),
    "rope_scaling": ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, None, ["rope_scaling.rope_type='yarn'"]),
    "four_aux": ({"eagle_aux_hidden_state_layer_ids": [2, 4, 5, 8]}, None,
                 ["eagle_aux_hidden_state_layer_ids=[2, 4, 5, 8]", "3 layer taps + the final layer"]),
    "num_aux": ({"num_aux_hidden_states": 4}, None, ["num_aux_hidden_states=4"]),
    "aux_disagree": ({"eagle_aux_hidden_state_layer_ids": [2, 4, 5],
                      "eagle_config": {"eagle_aux_hidden_state_layer_ids": [3, 5, 6]}}, None,
                     ["eagle_aux_hidden_state_layer_ids=[2, 4, 5]", "[3, 5, 6]"]),
    "norm_output_disagree": ({"eagle_config": {"norm_output": False}}, None, ["norm_output"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_published_head_fails_naming_it(tmp_path: Path, case: str):
    edit, tensors, needles = BAD[case]
    sd = shrunk_tensors(GQA)
    if tensors is not None:
        tensors(sd)
    path = write_head(tmp_path / case, shrunk_config(GQA, **edit), sd)
    with pytest.raises((ValueError, CheckpointError)) as err:
        load_eagle3(path, tiny_target())
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


# ---- running them -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [MHA, GQA])
def test_attention_on_triton_kernels_at_the_real_head_shape(heads, name: str):
    """One paged step of the loaded head (a 3-token chunk over 2 cached tokens, pages out of order) through
    the Triton attention backend (interpreter) == the reference ops. One row keeps the interpreter's
    64-KV-head grid short; tests/kernels/test_attention_head_shapes.py runs these shapes over more rows."""
    from m3eagle.kernels.attention.triton_backend import TritonBackend

    head = load_eagle3(heads[name], tiny_target())  # fp32 compute over the bf16 weights
    c = head.cfg
    q_lens, kv_lens = [3], [5]
    table = torch.tensor([[3, 1]])  # out of order: the kernels follow the table
    meta = build_metadata(q_lens, torch.tensor(kv_lens), table, PAGE, torch.device("cpu"), max_kv=2 * PAGE)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (sum(q_lens),), generator=g)
    aux = torch.randn(sum(q_lens), c.aux_hidden_size, generator=g)
    outs = []
    for ops in (REFERENCE, replace(REFERENCE, attention=TritonBackend())):
        cache = head.new_cache(5 * PAGE, torch.float32, "cpu")
        gc = torch.Generator().manual_seed(8)  # the cached prefixes' K/V: the same in both runs
        cache.k.copy_(torch.randn(cache.k.shape, generator=gc))
        cache.v.copy_(torch.randn(cache.v.shape, generator=gc))
        with torch.no_grad():
            outs.append(head(ids, meta.positions, aux, replace(meta, ops=ops), cache, True))
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=2e-5)
    assert torch.equal(outs[0][1], outs[0][0])  # norm_output: the next step's hidden is the normed output


PROMPTS = [[5, 9, 17, 3, 200, 31], [40, 2, 2, 7, 11, 13, 100, 64, 1, 250, 3]]


@pytest.fixture(scope="module")
def plain_greedy(target_dir, one_thread) -> list[list[int]]:
    from m3eagle import LLM
    from tests.helpers.engine_utils import assert_clean, greedy

    llm = LLM(target_dir, num_draft_tokens=0, device="cpu", page_size=PAGE, max_model_len=64, num_pages=48)
    out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(14))]
    assert_clean(llm)
    return out


@pytest.mark.parametrize("name", [MHA, GQA])
def test_speculative_greedy_equals_plain_greedy(heads, target_dir, plain_greedy, make_llm, name: str):
    """`LLM(model, draft=<the published directory>)`, as `m3eagle generate --draft DIR` builds it."""
    from tests.helpers.engine_utils import greedy

    spec = make_llm(target_dir, draft=heads[name], num_draft_tokens=3, max_model_len=64, num_pages=48)
    assert spec.draft.cfg.aux_layer_ids == (2, 4, 5) and spec.draft.cfg.norm_output
    # the checkpoint's embed_tokens / lm_head equal the target's: the target's are shared, not held twice
    assert spec.draft.embed_tokens.weight.data_ptr() == spec.target.embed_tokens.weight.data_ptr()
    assert spec.draft.lm_head.weight.data_ptr() == spec.target.lm_head.weight.data_ptr()
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, greedy(14))] == plain_greedy
    assert spec.stats()["num_drafted"] > 0


def test_own_tables_that_differ_from_the_targets_stay_the_heads(heads):
    """Sharing is deduplication only: a table that is not an exact copy (here lm_head one ulp off in one
    entry), or one being trained, stays the head's own."""
    from m3eagle.loader.eagle3 import share_target_weights

    head = load_eagle3(heads[GQA], tiny_target())
    fake = torch.nn.Module()
    fake.embed_tokens = torch.nn.Embedding(VOCAB, HIDDEN, _weight=head.embed_tokens.weight.clone())
    fake.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    with torch.no_grad():
        fake.lm_head.weight.copy_(head.lm_head.weight)
        fake.lm_head.weight[3, 5] = torch.nextafter(fake.lm_head.weight[3, 5], torch.tensor(1e9))
    own_lm = head.lm_head
    share_target_weights(head, fake)
    assert head.embed_tokens.weight.data_ptr() == fake.embed_tokens.weight.data_ptr()
    assert head.lm_head is own_lm
    trained = load_eagle3(heads[GQA], tiny_target()).requires_grad_(True)
    own_emb = trained.embed_tokens
    share_target_weights(trained, fake)
    assert trained.embed_tokens is own_emb


def test_explicit_top_level_aux_ids_are_read_as_vllm_reads_them(tmp_path: Path):
    """rtp-llm and vLLM read a top-level eagle_aux_hidden_state_layer_ids as capture indices ("after L
    layers"), m3eagle's convention: ids given there replace the default, unshifted."""
    path = write_head(tmp_path, shrunk_config(GQA, eagle_aux_hidden_state_layer_ids=[1, 3, 8]), shrunk_tensors(GQA))
    assert load_eagle3(path, tiny_target()).cfg.aux_layer_ids == (1, 3, 8)
