"""Real checkpoints mean what their config says, and checkpoints are checked.

- the public MiniMax-M3 config.json (VL wrapper, legacy sparse_attention_config / moe_layer_freq keys, no
  eos_token_id), sizes shrunk, parses as transformers parses it, gives transformers' logits, and the engine
  stops at transformers' default EOS 200020 or at generation_config.json's ids;
- RoPE scaling (rope_parameters or the legacy rope_scaling: linear, yarn, llama3) matches transformers'
  logits; other types are refused;
- quantized checkpoints, the indexer value path, missing size keys and non-positive rms_norm_eps are
  refused with the key named; tie_word_embeddings follows transformers (top-level flag of a VL config);
- NaN / Inf / integer / FP8 weights, truncated safetensors, config / generation_config / tokenizer files
  that do not parse: each raises an error naming the tensor or the file.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from m3eagle import SamplingParams
from m3eagle.config import DEFAULT_EOS_TOKEN_ID, SPARSE, ConfigError, M3Config
from m3eagle.loader.checkpoint import CheckpointError, load_config, load_target, save_target
from m3eagle.loader.eagle3 import load_eagle3
from m3eagle.loader.tokenizer import load_tokenizer
from tests.helpers.hf_utils import random_hf_model, tiny_hf_config
from tests.loader.test_loader import edit_copy
from tests.models.test_parity import RTOL, paged_forward, rel_err

ASSETS = Path(__file__).resolve().parents[2] / "m3eagle" / "assets" / "default"
REAL_VOCAB = 200064  # MiniMax-M3's; kept so that EOS 200020 is a real token of the shrunk model
LM_HEAD = "language_model.lm_head.weight"


def public_config(text, **text_overrides) -> dict:
    """config.json as the public MiniMaxAI/MiniMax-M3 release ships it -- model_type minimax_m3_vl with a
    text_config, legacy `sparse_attention_config` (per-layer sparse_attention_freq and
    sparse_disable_index_value) and `moe_layer_freq`, rope_theta / rotary_dim / partial_rotary_factor at
    the top of text_config, the flags use_gemma_norm / use_qk_norm / attention_output_gate, and no
    eos_token_id anywhere -- with the sizes of `text`, a tiny transformers MiniMaxM3VLTextConfig."""
    sparse = [int(t == SPARSE) for t in text.layer_types]
    rope = text.rope_parameters
    tc = {
        "architectures": ["MiniMaxM3SparseForCausalLM"],
        "hidden_size": text.hidden_size, "intermediate_size": text.intermediate_size,
        "num_hidden_layers": text.num_hidden_layers, "num_attention_heads": text.num_attention_heads,
        "num_key_value_heads": text.num_key_value_heads, "head_dim": text.head_dim, "vocab_size": text.vocab_size,
        "max_position_embeddings": 1048576, "rms_norm_eps": 1e-06, "use_gemma_norm": True,
        "attention_output_gate": False, "rope_theta": rope["rope_theta"],
        "rotary_dim": int(text.head_dim * rope["partial_rotary_factor"]),
        "partial_rotary_factor": rope["partial_rotary_factor"], "hidden_act": "swigluoai", "use_qk_norm": True,
        "tie_word_embeddings": False, "dense_intermediate_size": text.dense_intermediate_size,
        "shared_intermediate_size": text.shared_intermediate_size, "num_local_experts": text.num_local_experts,
        "num_experts_per_tok": text.num_experts_per_tok, "n_shared_experts": 1, "scoring_func": "sigmoid",
        "use_routing_bias": True, "moe_layer_freq": [int(t == "sparse") for t in text.mlp_layer_types],
        "qk_norm_type": "per_head", "num_mtp_modules": 7, "num_nextn_predict_layers": 1,
        "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "routed_scaling_factor": text.routed_scaling_factor,
        "sparse_attention_config": {
            "use_sparse_attention": True, "sparse_index_dim": text.index_head_dim,
            "sparse_num_index_heads": text.index_n_heads, "sparse_topk_blocks": text.index_topk_blocks,
            "sparse_block_size": text.index_block_size, "sparse_disable_index_value": sparse,
            "sparse_score_type": "max", "sparse_init_block": 0, "sparse_local_block": text.index_local_blocks,
            "sparse_attention_freq": sparse},
    }
    tc.update(text_overrides)
    return {"architectures": ["MiniMaxM3SparseForConditionalGeneration"], "model_type": "minimax_m3_vl",
            "image_token_index": 200025, "video_token_index": 200026, "text_config": tc,
            "vision_config": {"hidden_size": 16, "num_attention_heads": 2, "num_hidden_layers": 1,
                              "intermediate_size": 32, "patch_size": 14, "image_size": 28,
                              "model_type": "clip_vision_model", "num_channels": 3},
            "vision_feature_layer": -1, "vision_feature_select_strategy": "full"}


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj))


def config_only(src: Path, dst: Path, gen: dict | None = None) -> Path:
    """A directory holding src's config.json (and a generation_config.json when `gen` is given)."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    if gen is not None:
        write_json(dst / "generation_config.json", gen)
    return dst


@pytest.fixture(scope="module")
def public(tmp_path_factory):
    """(dir, hf model): a shrunk MiniMax-M3 in the public release layout and config, real vocabulary."""
    text = tiny_hf_config(seed=5, vocab=REAL_VOCAB)
    hf = random_hf_model(text, seed=5)
    d0 = tmp_path_factory.mktemp("public_hf")
    hf.save_pretrained(d0)
    d = tmp_path_factory.mktemp("public_m3")
    save_target(load_target(d0), d, layout="public")
    write_json(d / "config.json", public_config(text))
    return d, hf


@pytest.fixture(scope="module")
def tiny(tiny_model):
    """(dir, hf model, ids [1, 160]): the shared tiny transformers checkpoint and a long-enough prompt."""
    d, hf = tiny_model
    ids = torch.randint(0, hf.config.vocab_size, (1, 160), generator=torch.Generator().manual_seed(3))
    return d, hf, ids


def m3_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    m = load_target(path)
    with torch.no_grad():
        return m.compute_logits(m.forward_seq(ids)[0][0])


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits[0].float()


# ------------------------------------------------------------------------------------------------
# 2. the public config: parse, logits, EOS
# ------------------------------------------------------------------------------------------------


def test_public_config_parses_as_transformers_does(public):
    """Every field m3eagle resolves from the public config.json equals transformers' MiniMaxM3VLConfig."""
    from transformers import AutoConfig

    d, _ = public
    c = AutoConfig.from_pretrained(d).text_config
    cfg = load_config(d)
    assert cfg.eos_token_ids == (c.eos_token_id,) == (DEFAULT_EOS_TOKEN_ID,)
    for f in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "intermediate_size", "dense_intermediate_size", "shared_intermediate_size",
              "num_local_experts", "num_experts_per_tok", "index_n_heads", "index_head_dim", "index_block_size",
              "index_topk_blocks", "index_local_blocks", "max_position_embeddings", "bos_token_id",
              "tie_word_embeddings"):
        assert getattr(cfg, f) == getattr(c, f), f
    assert cfg.layer_types == tuple(c.layer_types) and cfg.mlp_layer_types == tuple(c.mlp_layer_types)
    assert cfg.rope_theta == c.rope_parameters["rope_theta"] and cfg.rope_scaling is None
    assert cfg.rotary_dim == int(c.head_dim * c.rope_parameters["partial_rotary_factor"])


def test_public_checkpoint_logits_match_transformers(public):
    d, hf = public
    ids = torch.randint(0, REAL_VOCAB, (1, 48), generator=torch.Generator().manual_seed(0))
    assert rel_err(m3_logits(d, ids), hf_logits(hf, ids)) <= RTOL


@pytest.mark.parametrize("gen, expect", [
    (None, (DEFAULT_EOS_TOKEN_ID,)), ({"eos_token_id": [200020, 200021]}, (200020, 200021)),
    ({"eos_token_id": 7}, (7,)), ({"bos_token_id": 200034}, (DEFAULT_EOS_TOKEN_ID,))],
    ids=["none", "list", "int", "no-eos"])
def test_eos_ids_resolve_as_transformers(public, tmp_path, gen, expect):
    """generation_config.json's eos_token_id (int or list) wins; without one, the config's (transformers'
    default 200020 when config.json names none). Oracle: transformers' GenerationConfig on the same files."""
    from transformers import AutoConfig, GenerationConfig

    d = config_only(public[0], tmp_path / "c", gen)
    want = GenerationConfig.from_pretrained(d).eos_token_id if gen is not None else None
    if want is None:
        want = GenerationConfig.from_model_config(AutoConfig.from_pretrained(d)).eos_token_id
    want = tuple(want) if isinstance(want, list) else (want,)
    assert load_config(d).eos_token_ids == want == expect


@pytest.fixture(scope="module")
def public_greedy(public):
    """Greedy tokens of the public checkpoint with EOS ignored, and the prompt."""
    from m3eagle import LLM

    prompt = torch.randint(0, REAL_VOCAB, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    llm = LLM(public[0], device="cpu", page_size=4, max_model_len=64)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert DEFAULT_EOS_TOKEN_ID not in out.outputs[0].token_ids
    return prompt, out.outputs[0].token_ids


def test_engine_stops_at_default_eos(public, public_greedy, tmp_path, make_llm):
    """With the public config (no eos_token_id) the engine stops at 200020. Row 200020 of lm_head is made
    twice the row of greedy token 3, so 200020 wins by step 3 at the latest."""
    prompt, ref = public_greedy
    d = tmp_path / "eos"
    shutil.copytree(public[0], d)
    sd = load_file(str(d / "model.safetensors"))
    sd[LM_HEAD][DEFAULT_EOS_TOKEN_ID] = 2 * sd[LM_HEAD][ref[2]]
    save_file(sd, str(d / "model.safetensors"))
    out = make_llm(d, max_model_len=64).generate([prompt], SamplingParams(temperature=0, max_tokens=8))[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].token_ids[-1] == DEFAULT_EOS_TOKEN_ID
    assert len(out.outputs[0].token_ids) <= 3 and out.outputs[0].token_ids[:-1] == ref[: len(out.outputs[0].token_ids) - 1]


def test_engine_stops_at_generation_config_eos_list(public, public_greedy, tmp_path, make_llm):
    """generation_config.json's eos_token_id list replaces the default: the engine stops at its first id
    that greedy decoding reaches."""
    prompt, ref = public_greedy
    d = tmp_path / "gen"
    shutil.copytree(public[0], d)
    other = next(t for t in range(REAL_VOCAB) if t not in ref)
    write_json(d / "generation_config.json", {"bos_token_id": 200034, "eos_token_id": [other, ref[4]]})
    out = make_llm(d, max_model_len=64).generate([prompt], SamplingParams(temperature=0, max_tokens=8))[0]
    stop = ref.index(ref[4])
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].token_ids == ref[: stop + 1]


# ------------------------------------------------------------------------------------------------
# 2. RoPE types
# ------------------------------------------------------------------------------------------------

ROPES = {
    "yarn": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                 "factor": 4.0, "original_max_position_embeddings": 32}},
    # legacy key: replaces rope_parameters; theta and the rotary factor come from the top level
    "yarn-legacy-rope_scaling": {"rope_parameters": None, "rope_theta": 20000.0, "partial_rotary_factor": 0.5,
                                 "rope_scaling": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
                                                  "beta_fast": 16, "beta_slow": 2, "truncate": False}},
    "yarn-mscale": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                        "factor": 8.0, "mscale": 1.0, "mscale_all_dim": 0.5},
                    "max_position_embeddings": 256},
    "linear": {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                   "factor": 3.0}},
    "llama3": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 128}},
}


@pytest.mark.parametrize("name", list(ROPES))
def test_rope_scaling_logits_match_transformers(tiny, tmp_path, name):
    """fp32 logits (contiguous and paged) equal transformers' for each RoPE type m3eagle implements, given
    as rope_parameters or as the legacy rope_scaling; and they differ from plain RoPE's, so the scaling is
    really applied."""
    from transformers import MiniMaxM3VLForCausalLM

    d0, _, ids = tiny
    d = edit_copy(d0, tmp_path / name, config_edit=lambda c: c.update(ROPES[name]))
    hf = MiniMaxM3VLForCausalLM.from_pretrained(d).eval()
    assert hf.config.rope_parameters["rope_type"] == name.split("-")[0]
    ref = hf_logits(hf, ids)
    model = load_target(d)
    with torch.no_grad():
        seq = model.compute_logits(model.forward_seq(ids)[0][0])
    paged = paged_forward(model, [[ids[0]]], page_size=4)[0]
    assert rel_err(seq, ref) <= RTOL and rel_err(paged, ref) <= RTOL
    assert rel_err(m3_logits(d0, ids), ref) > 1e-3
    assert model.cfg.rope_scaling["rope_type"] == name.split("-")[0]
    assert M3Config.from_dict(model.cfg.to_hf_text_dict()) == model.cfg


@pytest.mark.parametrize("edit, key", [
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_parameters.rope_type='dynamic'"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
     "rope_scaling.rope_type='longrope'"),
    ({"rope_scaling": {"rope_type": "yarn"}}, "rope_scaling with rope_type 'yarn' needs factor"),
])
def test_unimplemented_rope_is_refused(tiny, edit, key):
    conf = json.loads((Path(tiny[0]) / "config.json").read_text())
    conf.update(edit)
    with pytest.raises(ConfigError, match=key.replace("(", r"\(").replace("[", r"\[")):
        M3Config.from_dict(conf)


# ------------------------------------------------------------------------------------------------
# 2. quantization, tied embeddings, index value path, missing sizes
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["top", "text_config"])
def test_quantization_config_is_read_at_either_level(public, tmp_path, where):
    """The release's quantization_config parses from the top level or text_config; an unsupported method is
    refused naming the key (tests/loader/test_quantized_checkpoint.py loads the weights themselves)."""
    mx = {"quant_method": "mxfp8", "activation_scheme": "dynamic", "weight_block_size": [1, 32],
          "ignored_layers": ["lm_head"]}

    def quantize(conf, q=mx):
        (conf if where == "top" else conf["text_config"])["quantization_config"] = q

    assert load_config(edit_copy(public[0], tmp_path / "q", config_edit=quantize)).quantization.method == "mxfp8"
    d = edit_copy(public[0], tmp_path / "gptq", config_edit=lambda c: quantize(c, {"quant_method": "gptq"}))
    prefix = "" if where == "top" else "text_config."
    with pytest.raises(ConfigError, match=f"{prefix}quantization_config.quant_method='gptq' is not supported"):
        load_target(d)


def test_fp8_weights_without_quantization_config_are_refused(tiny, tmp_path):
    """float8_e4m3fn weights with weight_scale_inv are refused (never cast to unscaled floats)."""
    key = "model.layers.1.self_attn.q_proj.weight"

    def to_fp8(sd):
        w = sd[key]
        sd[key] = w.to(torch.float8_e4m3fn)
        sd[key + "_scale_inv"] = torch.ones(w.shape[0], w.shape[1] // 16)

    d = edit_copy(Path(tiny[0]), tmp_path / "fp8", to_fp8)
    with pytest.raises(CheckpointError, match=f"{key}.*float8_e4m3fn"):
        load_target(d)


def test_top_level_tie_word_embeddings_ties_as_transformers(tiny, tmp_path):
    """A VL config with tie_word_embeddings true at the top level only (the text_config says false) and no
    lm_head tensor: transformers' MiniMaxM3SparseForConditionalGeneration ties, and so does m3eagle."""
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration

    d0, _, ids = tiny

    def rename(sd):
        sd.pop("lm_head.weight")
        for k in list(sd):
            sd["model.language_model." + k[len("model."):]] = sd.pop(k)

    def vl(conf):
        text = dict(conf, tie_word_embeddings=False)
        conf.clear()
        conf.update(public_config_wrapper(text, tie_word_embeddings=True))

    d = edit_copy(Path(d0), tmp_path / "tied", rename, vl)
    hf = MiniMaxM3SparseForConditionalGeneration.from_pretrained(d).eval()
    m = load_target(d)
    assert m.cfg.tie_word_embeddings and m.lm_head.weight is m.embed_tokens.weight
    with torch.no_grad():
        got = m.compute_logits(m.forward_seq(ids)[0][0])
    assert rel_err(got, hf_logits(hf, ids)) <= RTOL


def public_config_wrapper(text: dict, **top) -> dict:
    """A VL config around an existing text config dict, with the public release's top-level keys."""
    return {"architectures": ["MiniMaxM3SparseForConditionalGeneration"], "model_type": "minimax_m3_vl",
            "text_config": text, "vision_config": {"hidden_size": 16, "num_attention_heads": 2,
                                                    "num_hidden_layers": 1, "intermediate_size": 32,
                                                    "patch_size": 14, "image_size": 28},
            "projector_hidden_size": 16, **top}


@pytest.mark.parametrize("case", ["different_lm_head", "lm_head_only"])
def test_tie_follows_the_checkpoint_as_transformers(tiny, tmp_path, case):
    """tie_word_embeddings true, as transformers' from_pretrained applies it: a checkpoint with its own,
    different lm_head is not tied (transformers warns); one with lm_head but no embed_tokens ties the
    embedding to lm_head. Logits equal transformers' in both cases."""
    from transformers import MiniMaxM3VLForCausalLM

    d0, _, ids = tiny
    edit = (lambda sd: sd.pop("model.embed_tokens.weight")) if case == "lm_head_only" else None
    d = edit_copy(Path(d0), tmp_path / case, edit, config_edit=lambda c: c.update(tie_word_embeddings=True))
    ref = hf_logits(MiniMaxM3VLForCausalLM.from_pretrained(d).eval(), ids)
    m = load_target(d)
    head = load_file(str(Path(d) / "model.safetensors"))["lm_head.weight"]
    assert torch.equal(m.lm_head.weight, head)
    assert m.cfg.tie_word_embeddings == (case == "lm_head_only")
    with torch.no_grad():
        got = m.compute_logits(m.forward_seq(ids)[0][0])
    assert rel_err(got, ref) <= RTOL


def test_index_value_path_is_refused_under_the_public_key(public):
    """sparse_attention_config.sparse_disable_index_value = 0 on a sparse layer is refused; 0 on a dense
    layer (as the public config has) is fine."""
    conf = json.loads((public[0] / "config.json").read_text())
    tc = conf["text_config"]
    flags = tc["sparse_attention_config"]["sparse_disable_index_value"]
    assert flags[0] == 0 and M3Config.from_dict(conf).layer_types[0] != SPARSE
    i = flags.index(1)
    flags[i] = 0
    with pytest.raises(ConfigError, match=rf"sparse_disable_index_value is 0 on sparse layers \[{i}\]"):
        M3Config.from_dict(conf)


def test_leading_block_selection_is_refused(public):
    conf = json.loads((public[0] / "config.json").read_text())
    conf["text_config"]["sparse_attention_config"]["sparse_init_block"] = 1
    with pytest.raises(ConfigError, match="sparse_init_block=1"):
        M3Config.from_dict(conf)


@pytest.mark.parametrize("edit, key", [({"use_gemma_norm": False}, "use_gemma_norm=False"),
                                       ({"attention_output_gate": True}, "attention_output_gate=True")])
def test_public_flags_with_other_math_are_refused(public, edit, key):
    conf = json.loads((public[0] / "config.json").read_text())
    conf["text_config"].update(edit)
    with pytest.raises(ConfigError, match=f"text_config.{key}"):
        M3Config.from_dict(conf)


def test_missing_sizes_are_named():
    """A config without the model's sizes fails, naming every missing key (no full-size defaults)."""
    with pytest.raises(ConfigError) as e:
        M3Config.from_dict({})
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "intermediate_size", "shared_intermediate_size", "num_local_experts"):
        assert key in str(e.value)
    with pytest.raises(ConfigError, match="missing text_config.hidden_size;"):
        M3Config.from_dict({"model_type": "minimax_m3_vl", "text_config": {
            k: v for k, v in public_config(tiny_hf_config())["text_config"].items() if k != "hidden_size"}})


@pytest.mark.parametrize("drop, key", [("dense_intermediate_size", "dense_intermediate_size"),
                                       ("index_head_dim", "index_head_dim"),
                                       ("num_local_experts", "num_local_experts"),
                                       ("head_dim", "head_dim")])
def test_missing_size_of_a_used_layer_kind_is_named(tiny, drop, key):
    conf = json.loads((Path(tiny[0]) / "config.json").read_text())
    del conf[drop]
    with pytest.raises(ConfigError, match=f"missing {key}"):
        M3Config.from_dict(conf)


# ------------------------------------------------------------------------------------------------
# 5. checkpoints are checked
# ------------------------------------------------------------------------------------------------

Q_PROJ = "model.layers.1.self_attn.q_proj.weight"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weight_is_named(tiny, tmp_path, bad):
    def poison(sd):
        sd[Q_PROJ][3, 5] = bad

    d = edit_copy(Path(tiny[0]), tmp_path / "nan", poison)
    with pytest.raises(CheckpointError, match=f"'{Q_PROJ}'.*NaN or Inf"):
        load_target(d)


def test_integer_weight_is_refused_not_cast(tiny, tmp_path):
    def to_int(sd):
        sd[Q_PROJ] = (sd[Q_PROJ] * 100).to(torch.int32)

    d = edit_copy(Path(tiny[0]), tmp_path / "int", to_int)
    with pytest.raises(CheckpointError, match=f"'{Q_PROJ}'.*torch.int32"):
        load_target(d)


def test_integer_weight_in_eagle3_head_is_refused(tmp_path):
    def to_int(sd):
        sd["fc.weight"] = torch.ones_like(sd["fc.weight"], dtype=torch.int64)

    d = edit_copy(ASSETS / "draft", tmp_path / "draft", to_int)
    with pytest.raises(CheckpointError, match="'fc.weight'.*torch.int64"):
        load_eagle3(d, load_config(ASSETS / "target"))


@pytest.mark.parametrize("eps", [0.0, -1e-6])
def test_non_positive_rms_norm_eps_is_refused(tmp_path, eps):
    conf = json.loads((ASSETS / "target" / "config.json").read_text())
    with pytest.raises(ConfigError, match="rms_norm_eps"):
        M3Config.from_dict(dict(conf, rms_norm_eps=eps))
    d = edit_copy(ASSETS / "draft", tmp_path / "draft", config_edit=lambda c: c.update(rms_norm_eps=eps))
    with pytest.raises(ConfigError, match="rms_norm_eps"):
        load_eagle3(d, load_config(ASSETS / "target"))


@pytest.mark.parametrize("damage", ["truncated", "garbage_header"])
def test_corrupt_safetensors_names_the_file(tiny, tmp_path, damage):
    d = edit_copy(Path(tiny[0]), tmp_path / damage)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\xff" * 64 + data[64:])
    with pytest.raises(CheckpointError, match=re.escape(str(f))):
        load_target(d)


@pytest.mark.parametrize("name, text, error", [
    ("config.json", "{not json", ConfigError), ("config.json", "[1, 2]", ConfigError),
    ("config.json", '"a string"', ConfigError), ("generation_config.json", "{oops", ConfigError),
    ("model.safetensors.index.json", "not json", CheckpointError)])
def test_unparsable_json_names_the_file(tiny, tmp_path, name, text, error):
    d = edit_copy(Path(tiny[0]), tmp_path / "j")
    (d / name).write_text(text)
    with pytest.raises(error, match=re.escape(str(d / name))):
        load_target(d)


def test_text_config_that_is_not_an_object_is_named():
    with pytest.raises(ConfigError, match="text_config must be a JSON object"):
        M3Config.from_dict({"model_type": "minimax_m3_vl", "text_config": [1]})


def test_corrupt_tokenizer_names_the_file(tmp_path):
    """A tokenizer.json that does not parse fails at LLM construction with the file named."""
    from m3eagle import LLM

    d = tmp_path / "target"
    shutil.copytree(ASSETS / "target", d)
    assert load_tokenizer(d) is not None
    (d / "tokenizer.json").write_text('{"version": "1.0", "model": 42}')
    with pytest.raises(CheckpointError, match=re.escape(str(d / "tokenizer.json"))):
        load_tokenizer(d)
    with pytest.raises(CheckpointError, match=re.escape(str(d / "tokenizer.json"))):
        LLM(d, device="cpu", num_draft_tokens=0, max_model_len=64)
