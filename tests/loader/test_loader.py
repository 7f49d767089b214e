"""Target checkpoint loading: transformers' save_pretrained output, m3eagle's own writer in both key
layouts (hf / public MiniMax-M3), the VL config form with vision tensors, sharded safetensors, legacy
config keys, and CheckpointError messages that name the tensor and the expected shape."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from m3eagle.config import FULL, M3Config
from m3eagle.loader.checkpoint import CheckpointError, load_target, save_target

PUBLIC = "language_model.model.layers."


@pytest.fixture(scope="module")
def tiny(tiny_model):
    """(dir, hf_model, m3eagle target, ids, reference logits)."""
    d, hf = tiny_model
    target = load_target(d)
    ids = torch.randint(0, target.cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = target.compute_logits(target.forward_seq(ids)[0])
    return d, hf, target, ids, logits


def logits_of(path: Path, ids: torch.Tensor) -> torch.Tensor:
    m = load_target(path)
    with torch.no_grad():
        return m.compute_logits(m.forward_seq(ids)[0])


def edit_copy(src: Path, dst: Path, edit=None, config_edit=None) -> Path:
    """Copy a single-file checkpoint, editing its tensors / config.json."""
    shutil.copytree(src, dst)
    if edit is not None:
        sd = load_file(str(dst / "model.safetensors"))
        edit(sd)
        save_file(sd, str(dst / "model.safetensors"))
    if config_edit is not None:
        conf = json.loads((dst / "config.json").read_text())
        config_edit(conf)
        (dst / "config.json").write_text(json.dumps(conf))
    return dst


@pytest.fixture(scope="module")
def public_dir(tiny, tmp_path_factory):
    d = tmp_path_factory.mktemp("public")
    save_target(tiny[2], d, layout="public")
    return d


def test_transformers_checkpoint_loads(tiny):
    """save_pretrained output loads; logits equal transformers' own on the same weights."""
    d, hf, _, ids, logits = tiny
    with torch.no_grad():
        ref = hf(ids).logits.float()
    assert (logits - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_router_stays_fp32_in_low_precision(tiny):
    """The MoE router (weight and correction bias) stays fp32 when the model is cast to bf16."""
    m = load_target(tiny[0], dtype=torch.bfloat16)
    cfg = m.cfg
    moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe(i)]
    assert moe
    for i in moe:
        gate = m.layers[i].mlp.gate
        assert gate.weight.dtype == torch.float32 and gate.e_score_correction_bias.dtype == torch.float32
    assert m.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert m.embed_tokens.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("layout", ["hf", "public"])
def test_round_trip(tiny, tmp_path, layout):
    """save_target(layout) -> load_target: identical tensors and identical logits."""
    _, _, target, ids, logits = tiny
    save_target(target, tmp_path, layout=layout)
    loaded = load_target(tmp_path)
    assert loaded.cfg == target.cfg
    a, b = target.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert torch.equal(logits_of(tmp_path, ids), logits)


def test_public_layout_keys(tiny, public_dir):
    """The public layout really is MiniMax-M3's: per-expert w1/w2/w3 under block_sparse_moe, index_*
    projections, split dense gate/up, a VL config with text_config; and w1 is the gate half."""
    _, hf, target, _, _ = tiny
    keys = set(load_file(str(public_dir / "model.safetensors")))
    cfg = target.cfg
    assert not any("gate_up_proj" in k for k in keys)
    for i in range(cfg.num_hidden_layers):
        p = f"{PUBLIC}{i}."
        if cfg.is_moe(i):
            for j in range(cfg.num_local_experts):
                for w in ("w1", "w2", "w3"):
                    assert f"{p}block_sparse_moe.experts.{j}.{w}.weight" in keys
            assert f"{p}block_sparse_moe.gate.weight" in keys
            assert f"{p}block_sparse_moe.e_score_correction_bias" in keys
            assert f"{p}block_sparse_moe.shared_experts.gate_proj.weight" in keys
        else:
            assert {f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight", f"{p}mlp.down_proj.weight"} <= keys
        if cfg.is_sparse(i):
            assert {f"{p}self_attn.index_q_proj.weight", f"{p}self_attn.index_k_proj.weight",
                    f"{p}self_attn.index_q_norm.weight", f"{p}self_attn.index_k_norm.weight"} <= keys
    assert "language_model.lm_head.weight" in keys and "language_model.model.embed_tokens.weight" in keys
    i = next(i for i in range(cfg.num_hidden_layers) if cfg.is_moe(i))
    sd = load_file(str(public_dir / "model.safetensors"))
    gate_up = hf.state_dict()[f"model.layers.{i}.mlp.experts.gate_up_proj"]  # [E, 2I, H]
    inter = cfg.intermediate_size
    assert torch.equal(sd[f"{PUBLIC}{i}.block_sparse_moe.experts.1.w1.weight"], gate_up[1, :inter])
    assert torch.equal(sd[f"{PUBLIC}{i}.block_sparse_moe.experts.1.w3.weight"], gate_up[1, inter:])
    conf = json.loads((public_dir / "config.json").read_text())
    assert conf["model_type"] == "minimax_m3_vl" and "text_config" in conf


def test_hf_layout_loads_in_transformers(tiny, tmp_path):
    """What save_target(layout='hf') writes is a checkpoint transformers itself loads, with equal logits."""
    from transformers import MiniMaxM3VLForCausalLM

    _, _, target, ids, logits = tiny
    save_target(target, tmp_path, layout="hf")
    hf = MiniMaxM3VLForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        ref = hf(ids).logits.float()
    assert (logits - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_vl_config_and_vision_tensors_are_ignored(tiny, public_dir, tmp_path):
    """A full VL checkpoint: vision tower / projector / MTP tensors are skipped, the text model loads."""
    _, _, _, ids, logits = tiny
    extra = {"vision_tower.vision_model.encoder.layers.0.x.weight": torch.randn(3, 5),
             "multi_modal_projector.linear_1.weight": torch.randn(7, 2),
             "model.visual.blocks.0.attn.qkv.weight": torch.randn(4, 4),
             "language_model.model.mtp.layers.0.eh_proj.weight": torch.randn(2, 2)}
    d = edit_copy(public_dir, tmp_path / "vl", lambda sd: sd.update(extra))
    assert torch.equal(logits_of(d, ids), logits)


def test_model_language_model_prefix_and_vl_config(tiny, tmp_path):
    """transformers' VL naming (`model.language_model.*`) under a `text_config` config loads too."""
    d0, _, _, ids, logits = tiny

    def rename(sd):
        for k in list(sd):
            if k.startswith("model."):
                sd["model.language_model." + k[len("model."):]] = sd.pop(k)
        sd["model.vision_tower.patch_embed.weight"] = torch.randn(3, 3)

    def vl(conf):
        text = dict(conf)
        conf.clear()
        conf.update({"model_type": "minimax_m3_vl", "text_config": text,
                     "vision_config": {"hidden_size": 8}})

    d = edit_copy(d0, tmp_path / "vlhf", rename, vl)
    assert torch.equal(logits_of(d, ids), logits)


def test_sharded_checkpoint_with_index(tiny, public_dir, tmp_path):
    """Shards listed in model.safetensors.index.json load; a stray *.safetensors not in the index is not
    read (it holds a mis-shaped duplicate that would fail the load)."""
    _, _, _, ids, logits = tiny
    sd = load_file(str(public_dir / "model.safetensors"))
    d = tmp_path / "sharded"
    d.mkdir()
    shutil.copy(public_dir / "config.json", d / "config.json")
    names = sorted(sd)
    shards = [names[i::3] for i in range(3)]
    weight_map = {}
    for i, part in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file({k: sd[k] for k in part}, str(d / fname))
        weight_map.update({k: fname for k in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    save_file({"language_model.model.norm.weight": torch.zeros(3)}, str(d / "stray.safetensors"))
    assert torch.equal(logits_of(d, ids), logits)


def _moe_layer(cfg: M3Config) -> int:
    return next(i for i in range(cfg.num_hidden_layers) if cfg.is_moe(i))


def _dense_layer(cfg: M3Config) -> int:
    return next(i for i in range(cfg.num_hidden_layers) if not cfg.is_moe(i))


@pytest.mark.parametrize("case", [
    "missing_attention", "misshaped_attention", "missing_expert", "misshaped_expert_w1",
    "misshaped_expert_w2", "missing_dense_gate", "missing_lm_head", "misshaped_router"])
def test_bad_tensor_error_names_tensor_and_expected_shape(tiny, public_dir, tmp_path, case):
    """Every missing or mis-shaped tensor raises CheckpointError (never a bare torch error) whose message
    names the offending tensor and the shape the config implies."""
    cfg = tiny[2].cfg
    h, inter, e = cfg.hidden_size, cfg.intermediate_size, _moe_layer(cfg)
    dl = _dense_layer(cfg)
    q_out = cfg.num_attention_heads * cfg.head_dim
    cases = {
        "missing_attention": (lambda sd: sd.pop(f"{PUBLIC}{e}.self_attn.q_proj.weight"),
                              ["q_proj", f"({q_out}, {h})"]),
        "misshaped_attention": (lambda sd: sd.update({f"{PUBLIC}{e}.self_attn.o_proj.weight":
                                                      torch.zeros(q_out, h)}),
                                ["o_proj", f"({h}, {q_out})"]),
        "missing_expert": (lambda sd: sd.pop(f"{PUBLIC}{e}.block_sparse_moe.experts.2.w3.weight"),
                           ["experts.2.w3", f"({inter}, {h})"]),
        "misshaped_expert_w1": (lambda sd: sd.update({f"{PUBLIC}{e}.block_sparse_moe.experts.2.w1.weight":
                                                      torch.zeros(inter - 1, h)}),
                                ["experts.2.w1", f"({inter}, {h})"]),
        "misshaped_expert_w2": (lambda sd: sd.update({f"{PUBLIC}{e}.block_sparse_moe.experts.1.w2.weight":
                                                      torch.zeros(h, inter + 2)}),
                                ["experts.1.w2", f"({h}, {inter})"]),
        "missing_dense_gate": (lambda sd: sd.pop(f"{PUBLIC}{dl}.mlp.gate_proj.weight"),
                               ["gate_proj", f"({cfg.dense_intermediate_size}, {h})"]),
        "missing_lm_head": (lambda sd: sd.pop("language_model.lm_head.weight"),
                            ["lm_head", f"({cfg.vocab_size}, {h})"]),
        "misshaped_router": (lambda sd: sd.update({f"{PUBLIC}{e}.block_sparse_moe.gate.weight":
                                                   torch.zeros(cfg.num_local_experts, h + 1)}),
                             ["gate", f"({cfg.num_local_experts}, {h})"]),
    }
    edit, needles = cases[case]
    d = edit_copy(public_dir, tmp_path / case, edit)
    with pytest.raises(CheckpointError) as err:
        load_target(d)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


def test_missing_directory_pieces(tiny, tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_target(tmp_path)
    shutil.copy(Path(tiny[0]) / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_target(tmp_path)


def test_missing_weights_fail_before_the_model_is_allocated(tmp_path, monkeypatch):
    """A directory with a full-size config.json but no weights must fail with CheckpointError *before*
    allocating the model (for the real MiniMax-M3 config that allocation alone exhausts host memory)."""
    import m3eagle.loader.checkpoint as ckpt

    def no_alloc(cfg):
        raise AssertionError("MiniMaxM3 was allocated before any weights were found")

    monkeypatch.setattr(ckpt, "MiniMaxM3", no_alloc)
    full = {"vocab_size": 200064, "hidden_size": 6144, "num_hidden_layers": 60, "num_attention_heads": 64,
            "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 3072, "shared_intermediate_size": 3072,
            "num_local_experts": 128}  # the real MiniMax-M3 sizes
    (tmp_path / "config.json").write_text(json.dumps(full))
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        ckpt.load_target(tmp_path)


def test_config_matches_transformers_config(tiny_model):
    """M3Config.from_dict(config.json) resolves every field as transformers' text config does."""
    d, hf = tiny_model
    c = hf.config
    cfg = M3Config.from_dict(json.loads((Path(d) / "config.json").read_text()))
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (c.vocab_size, c.hidden_size,
                                                                       c.num_hidden_layers)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        c.num_attention_heads, c.num_key_value_heads, c.head_dim)
    assert cfg.rotary_dim == int(c.head_dim * c.rope_parameters["partial_rotary_factor"])
    assert cfg.layer_types == tuple(c.layer_types) and cfg.mlp_layer_types == tuple(c.mlp_layer_types)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_block_size, cfg.index_topk_blocks,
            cfg.index_local_blocks) == (c.index_n_heads, c.index_head_dim, c.index_block_size,
                                        c.index_topk_blocks, c.index_local_blocks)
    assert cfg.eos_token_ids == (2,) and cfg.tie_word_embeddings is False
    assert M3Config.from_dict(cfg.to_hf_text_dict()) == cfg


def test_legacy_config_keys_parse(tiny_model):
    """sparse_attention_config (sparse_block_size, ...) and moe_layer_freq give the same config as the
    modern keys; a checkpoint carrying the legacy config loads to the same model."""
    d, _ = tiny_model
    modern = json.loads((Path(d) / "config.json").read_text())
    legacy = {k: v for k, v in modern.items() if k not in (
        "layer_types", "mlp_layer_types", "index_n_heads", "index_head_dim", "index_block_size",
        "index_topk_blocks", "index_local_blocks")}
    legacy["sparse_attention_config"] = {
        "sparse_num_index_heads": modern["index_n_heads"], "sparse_index_dim": modern["index_head_dim"],
        "sparse_block_size": modern["index_block_size"], "sparse_topk_blocks": modern["index_topk_blocks"],
        "sparse_local_block": modern["index_local_blocks"], "sparse_score_type": "max",
        "sparse_attention_freq": [int(t != FULL) for t in modern["layer_types"]]}
    legacy["moe_layer_freq"] = [int(t == "sparse") for t in modern["mlp_layer_types"]]
    assert M3Config.from_dict(legacy) == M3Config.from_dict(modern)
    # the VL wrapper around a legacy text config
    assert M3Config.from_dict({"model_type": "minimax_m3_vl", "text_config": legacy}) == \
        M3Config.from_dict(modern)


def test_legacy_config_checkpoint_loads(tiny, tmp_path):
    d0, _, _, ids, logits = tiny

    def to_legacy(conf):
        lt = conf.pop("layer_types")
        conf["sparse_attention_config"] = {"sparse_block_size": conf.pop("index_block_size"),
                                           "sparse_topk_blocks": conf.pop("index_topk_blocks"),
                                           "sparse_attention_freq": [int(t != FULL) for t in lt]}
        conf["moe_layer_freq"] = [int(t == "sparse") for t in conf.pop("mlp_layer_types")]

    d = edit_copy(d0, tmp_path / "legacy", config_edit=to_legacy)
    assert torch.equal(logits_of(d, ids), logits)


def test_rotary_width_follows_partial_rotary_factor():
    """transformers rotates head_dim * partial_rotary_factor channels and ignores `rotary_dim`."""
    base = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "vocab_size": 50, "intermediate_size": 8, "shared_intermediate_size": 8,
            "num_local_experts": 4}
    assert M3Config.from_dict(dict(base, rotary_dim=4)).rotary_dim == 16
    assert M3Config.from_dict(dict(base, partial_rotary_factor=0.5, rotary_dim=16)).rotary_dim == 8
    rp = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}
    cfg = M3Config.from_dict(dict(base, rope_parameters=rp))
    assert (cfg.rotary_dim, cfg.rope_theta) == (4, 1e4)
