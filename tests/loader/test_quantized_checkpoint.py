"""Quantized checkpoints: MiniMax-M3's MXFP8 release format and block FP8, against transformers 5.17 as the oracle.

Synthetic checkpoints are written in the release's exact format -- its config.json with the sizes shrunk and a
`quantization_config` (quant_method mxfp8, weight_block_size [1, 32], ignored_layers), `*.weight` float8_e4m3fn
with `*.weight_scale_inv` uint8 ue8m0 bytes per 1 x 32 block, per-expert w1/w2/w3, routers / norms / embeddings
unquantized -- and transformers' own stacked layout. transformers loads them dequantizing (FineGrainedFP8 on the
CPU); m3eagle must give the same logits and the same greedy tokens. A scale applied wrongly (shifted a block,
transposed, inverted) is shown to fail the comparison; bad configs and tensors are refused by name; a
tensor-parallel rank reads exactly its slice of weights and scales.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from m3eagle.config import ConfigError, QuantConfig, parse_quantization
from m3eagle.distributed.layers import param_shards
from m3eagle.distributed.parallel_state import TPGroup
from m3eagle.kernels.quant import mxfp8
from m3eagle.loader import checkpoint
from m3eagle.loader.checkpoint import CheckpointError, load_target, save_target
from m3eagle.models.minimax_m3 import MiniMaxM3
from tests.helpers.hf_utils import random_hf_model, tiny_hf_config
from tests.loader.test_config_semantics import public_config
from tests.models.test_parity import RTOL, rel_err

pytest.importorskip("accelerate")  # transformers loads FP8 checkpoints through it

VOCAB, LAYERS = 128, 4
# the projections the release stores in FP8 (embeddings, lm_head, routers, norms stay bf16 / fp32)
QUANTIZED = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|index_q_proj|index_k_proj|gate_proj|up_proj|down_proj|"
                       r"w1|w2|w3)\.weight$")
IGNORED = ["lm_head", "model.embed_tokens", "vision_tower", "multi_modal_projector"] + [
    f"model.layers.{i}.block_sparse_moe.gate" for i in range(LAYERS)]
MXFP8 = {"quant_method": "mxfp8", "activation_scheme": "dynamic", "weight_block_size": [1, 32], "ignored_layers": IGNORED}
BLOCK = [16, 32]  # a block-FP8 tile small enough for the tiny model (DeepSeek-style checkpoints use [128, 128])


def quantize_block(w: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block FP8 as DeepSeek-style checkpoints store it: q = w / scale per [bn, bk] tile, scale = amax / 448."""
    bn, bk = block
    n, k = w.shape
    tiles = w.float().reshape(n // bn, bn, k // bk, bk)
    scale = (tiles.abs().amax((1, 3)) / mxfp8.E4M3_MAX).clamp(min=1e-12)  # [n / bn, k / bk]
    q = (tiles / scale[:, None, :, None]).reshape(n, k).to(torch.float8_e4m3fn)
    return q, scale


def write_quantized(src: Path, dst: Path, text, method: str = "mxfp8") -> Path:
    """src's public-layout tensors with every release-quantized projection in FP8 (+ its weight_scale_inv), and
    the public config.json with the quantization_config."""
    dst.mkdir()
    out = {}
    for k, v in load_file(str(src / "model.safetensors")).items():
        if QUANTIZED.search(k):
            q, s = mxfp8.quantize_mx(v) if method == "mxfp8" else quantize_block(v, BLOCK)
            out[k], out[k + "_scale_inv"] = q, s
        else:
            out[k] = v
    save_file(out, str(dst / "model.safetensors"))
    conf = public_config(text)
    conf["quantization_config"] = MXFP8 if method == "mxfp8" else {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": BLOCK, "ignored_layers": IGNORED}
    (dst / "config.json").write_text(json.dumps(conf))
    return dst


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """(mxfp8 dir, block-fp8 dir, text config): a shrunk MiniMax-M3 (every K a multiple of 32) in the release layout."""
    text = tiny_hf_config(seed=11, vocab=VOCAB, layers=LAYERS, hidden=64, head_dim=16, inter=32, dense_inter=64,
                          shared_inter=64, index_head_dim=32)
    hf = random_hf_model(text, seed=11)
    root = tmp_path_factory.mktemp("quantized")
    hf.save_pretrained(root / "hf")
    save_target(load_target(root / "hf"), root / "public", layout="public")
    return (write_quantized(root / "public", root / "mx", text), write_quantized(root / "public", root / "fp8", text, "fp8"),
            text)


def hf_oracle(path: Path):
    from transformers import MiniMaxM3SparseForConditionalGeneration

    return MiniMaxM3SparseForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def logits_of(model: MiniMaxM3, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model.forward_seq(ids)[0][0])


IDS = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def mx_oracle(release):
    with torch.no_grad():
        return hf_oracle(release[0])(input_ids=IDS).logits[0].float()


def test_config_reads_the_release_quantization(release):
    cfg = checkpoint.load_config(release[0])
    assert cfg.quantization == QuantConfig("mxfp8", (1, 32), tuple(IGNORED))
    assert cfg.quantization.is_ignored("language_model.model.layers.2.block_sparse_moe.gate")
    assert cfg.quantization.is_ignored("language_model.lm_head")
    assert not cfg.quantization.is_ignored("language_model.model.layers.2.self_attn.q_proj")


@pytest.mark.parametrize("method", ["mxfp8", "fp8"])
def test_logits_match_transformers_dequantizing(release, method, mx_oracle):
    """The same FP8 bytes through m3eagle's loader and transformers' FineGrainedFP8 dequantization: the same
    logits (both products are exact in fp32; what differs is summation order)."""
    path = release[0] if method == "mxfp8" else release[1]
    ref = mx_oracle if method == "mxfp8" else hf_oracle(path)(input_ids=IDS).logits[0].float().detach()
    assert rel_err(logits_of(load_target(path), IDS), ref) <= RTOL


def test_greedy_tokens_match_transformers(release, make_llm):
    """20 prompts, 8 greedy tokens each, through the engine (paged, chunked) vs transformers' generate on the
    dequantized model."""
    hf = hf_oracle(release[0])
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, VOCAB, (int(n),), generator=g).tolist() for n in torch.randint(4, 30, (20,), generator=g)]
    want = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
        want.append(out[0, len(p):].tolist())
    from tests.helpers.engine_utils import greedy

    llm = make_llm(release[0], num_draft_tokens=0)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(8))]
    assert got == want


def _shifted(q, s, dtype=torch.float32):  # the scale of the next block along K
    return mxfp8.dequantize_mx(q, s.roll(1, dims=-1), dtype)


def _inverse(q, s, dtype=torch.float32):  # 2 ** (127 - byte): the scale applied as its inverse
    return mxfp8.dequantize_mx(q, (254 - s.int()).clamp(0, 254).to(torch.uint8), dtype)


def _transposed(q, s, dtype=torch.float32):  # the [N, K/32] bytes read as if stored [K/32, N]
    return mxfp8.dequantize_mx(q, s.reshape(-1).reshape(s.shape[-1], -1).t().contiguous().reshape(s.shape), dtype)


@pytest.mark.parametrize("wrong", [_shifted, _inverse, _transposed], ids=["shifted", "inverse", "transposed"])
def test_a_misapplied_scale_fails_the_comparison(release, mx_oracle, monkeypatch, wrong):
    """Mutation check of the test above: the loader with a wrongly applied scale is far outside its tolerance."""
    monkeypatch.setattr(mxfp8.MxWeight, "dequantize", lambda self, dtype=torch.float32: wrong(self.q, self.scale, dtype))
    assert rel_err(logits_of(load_target(release[0]), IDS), mx_oracle) > 50 * RTOL


def test_mxfp8_weights_stay_fp8_byte_for_byte(release):
    """The release's FP8 values and ue8m0 scales land in the model as stored (no dequantize-requantize): every
    per-expert and per-projection tensor of the file equals its slice of the model's parameters, bit for bit, and
    the unquantized ones (routers, norms, embeddings, lm_head) stay floating point."""
    model = load_target(release[0])
    sd = model.state_dict()
    f = load_file(str(release[0] / "model.safetensors"))
    n_fp8 = 0
    for k, v in f.items():
        m = re.match(r"language_model\.model\.(layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\."
                     r"(weight|weight_scale_inv)$", k)
        if m is None:
            continue
        layer, e, w, what = m.groups()
        suffix = "" if what == "weight" else "_scale_inv"
        stack = sd[f"{layer}.mlp.experts.{'down_proj' if w == 'w2' else 'gate_up_proj'}{suffix}"]
        half = stack.shape[1] // 2
        got = stack[int(e)] if w == "w2" else stack[int(e), :half] if w == "w1" else stack[int(e), half:]
        assert got.dtype == v.dtype and torch.equal(got.view(torch.uint8), v.view(torch.uint8)), k
        n_fp8 += what == "weight"
    q = sd["layers.0.self_attn.q_proj.weight"]
    assert q.dtype == torch.float8_e4m3fn and sd["layers.0.self_attn.q_proj.weight_scale_inv"].dtype == torch.uint8
    assert torch.equal(q.view(torch.uint8), f["language_model.model.layers.0.self_attn.q_proj.weight"].view(torch.uint8))
    assert n_fp8 > 0
    assert sd["layers.1.mlp.gate.weight"].dtype == torch.float32 and sd["lm_head.weight"].dtype == torch.float32


def test_transformers_layout_loads_the_same_weights(release, tmp_path):
    """The same FP8 bytes in transformers' own key layout (model.layers.*, stacked experts.gate_up_proj [E, 2I, H]
    with experts.gate_up_proj_scale_inv [E, 2I, H/32], fused gate_up_proj): the model m3eagle builds is identical."""
    want = load_target(release[0]).state_dict()
    d = tmp_path / "hf_layout"
    d.mkdir()
    sd = load_file(str(release[0] / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for k, v in sd.items():
        k2 = k.replace("language_model.model.", "model.language_model.").replace("language_model.lm_head", "lm_head")
        if m := re.match(r"(.*)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.(weight|weight_scale_inv)$", k2):
            groups.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3) + m.group(4)] = v
            continue
        out[k2] = v
    for prefix, experts in groups.items():
        e = [experts[j] for j in sorted(experts)]
        base = prefix + ".block_sparse_moe.experts."
        out[base + "gate_up_proj"] = torch.stack([torch.cat([x["w1weight"], x["w3weight"]]) for x in e])
        out[base + "gate_up_proj_scale_inv"] = torch.stack([torch.cat([x["w1weight_scale_inv"], x["w3weight_scale_inv"]])
                                                            for x in e])
        out[base + "down_proj"] = torch.stack([x["w2weight"] for x in e])
        out[base + "down_proj_scale_inv"] = torch.stack([x["w2weight_scale_inv"] for x in e])
    save_file(out, str(d / "model.safetensors"))
    (d / "config.json").write_text((release[0] / "config.json").read_text())
    got = load_target(d).state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("rank", [0, 1])
def test_a_tensor_parallel_rank_reads_its_slice_of_weights_and_scales(release, rank):
    """Each rank's shard (column-parallel rows, row-parallel columns in whole 32-blocks, its experts) equals the
    matching slice of the whole model, so the scales were sliced with their weights."""
    full = load_target(release[0]).state_dict()
    tp = TPGroup(rank=rank, size=2)
    part = load_target(release[0], tp=tp)
    shards = param_shards(part)
    assert any(s.dim == 1 for s in shards.values())  # a row-parallel weight, cut along K
    for name, t in part.state_dict().items():
        spec = shards.get(name)
        want = full[name] if spec is None else spec.read(full[name].__getitem__)
        assert torch.equal(t, want), name


def test_a_split_inside_a_scale_block_is_refused():
    """A rank's columns must hold whole 1 x 32 blocks: a split that cuts one is named, never read shifted."""
    from m3eagle.distributed.layers import rows

    assert rows(32, 32, 64, dim=1).blocks(32).pieces == ((1, 1),)
    with pytest.raises(ValueError, match=r"\[16, 32\) of a dimension of 64 does not fall on whole scale blocks of 32"):
        rows(16, 16, 64, dim=1).blocks(32)


def _edit(release, tmp_path, edit=None, quant=None) -> Path:
    d = tmp_path / "edited"
    d.mkdir()
    sd = load_file(str(release[0] / "model.safetensors"))
    if edit is not None:
        edit(sd)
    save_file(sd, str(d / "model.safetensors"))
    conf = json.loads((release[0] / "config.json").read_text())
    if quant is not None:
        conf["quantization_config"] = {**conf["quantization_config"], **quant}
    (d / "config.json").write_text(json.dumps(conf))
    return d


Q = "language_model.model.layers.1.self_attn.q_proj.weight"


@pytest.mark.parametrize("quant, match", [
    ({"quant_method": "awq"}, r"quantization_config.quant_method='awq' is not supported"),
    ({"weight_block_size": [1, 16]}, r"quantization_config.weight_block_size=\[1, 16\]"),
    ({"weight_block_size": None}, r"quantization_config.weight_block_size=None"),
    ({"activation_scheme": "static"}, r"quantization_config.activation_scheme='static'"),
    ({"ignored_layers": "lm_head"}, r"quantization_config.ignored_layers must be a list")])
def test_unsupported_quantization_configs_are_refused_by_key(release, tmp_path, quant, match):
    with pytest.raises(ConfigError, match=match):
        load_target(_edit(release, tmp_path, quant=quant))


@pytest.mark.parametrize("edit, match", [
    (lambda sd: sd.pop(Q + "_scale_inv"), rf"missing tensor '{re.escape(Q)}_scale_inv'"),
    (lambda sd: sd.update({Q + "_scale_inv": sd[Q + "_scale_inv"].float()}),
     rf"'{re.escape(Q)}_scale_inv' is torch.float32"),
    (lambda sd: sd.update({Q + "_scale_inv": sd[Q + "_scale_inv"][:, :1].contiguous()}),
     rf"tensor '{re.escape(Q)}'.*scale shape"),
    (lambda sd: sd.update({Q: mxfp8.dequantize_mx(sd[Q], sd[Q + "_scale_inv"])}), rf"'{re.escape(Q)}_scale_inv' scales"),
    (lambda sd: sd.update({"language_model.lm_head.weight": sd["language_model.lm_head.weight"].to(torch.float8_e4m3fn)}),
     r"'language_model.lm_head.weight' is torch.float8_e4m3fn but quantization_config.ignored_layers lists")],
    ids=["missing-scale", "float-scale", "scale-shape", "scale-without-fp8", "fp8-in-ignored"])
def test_bad_quantized_tensors_are_refused_by_name(release, tmp_path, edit, match):
    with pytest.raises(CheckpointError, match=match):
        load_target(_edit(release, tmp_path, edit))


def test_parse_quantization_accepts_transformers_spelling():
    q = parse_quantization({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                                    "modules_to_not_convert": ["lm_head"]}}, "")
    assert q == QuantConfig("fp8", (128, 128), ("lm_head",))
    assert parse_quantization({}, "") is None
