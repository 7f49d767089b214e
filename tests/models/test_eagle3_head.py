"""Eagle3 head and its loader: checkpoint round-trips, validation messages, paged == contiguous, the
training-time-test unrolling against the paged draft chain, and the draft-vocabulary mapping.
CPU, fp32, tiny shapes: seconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from m3eagle.config import M3Config
from m3eagle.kernels.attention.metadata import TRASH_PAGE, build_metadata
from m3eagle.loader.checkpoint import CheckpointError
from m3eagle.loader.eagle3 import load_eagle3, save_eagle3
from m3eagle.models.eagle3 import Eagle3Config, Eagle3Head, default_aux_layer_ids
from m3eagle.models.minimax_m3 import MiniMaxM3

PAGE = 4
VOCAB, HIDDEN, LAYERS = 64, 32, 6


def target_cfg(**kw) -> M3Config:
    base = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, rotary_dim=8, rope_theta=10000.0, rms_norm_eps=1e-6,
                intermediate_size=16, dense_intermediate_size=32, shared_intermediate_size=16,
                num_local_experts=4, num_experts_per_tok=2, routed_scaling_factor=2.0, swiglu_alpha=1.702,
                swiglu_limit=7.0, layer_types=("full_attention",) * LAYERS,
                mlp_layer_types=("dense",) * LAYERS,
                index_n_heads=2, index_head_dim=8, index_block_size=4, index_topk_blocks=2,
                index_local_blocks=1)
    base.update(kw)
    return M3Config(**base)


def head_cfg(**kw) -> Eagle3Config:
    base = dict(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                intermediate_size=48, vocab_size=VOCAB, draft_vocab_size=40, rope_theta=10000.0,
                aux_layer_ids=(1, 3, 5))
    base.update(kw)
    return Eagle3Config(**base)


def random_head(cfg: Eagle3Config, seed: int = 0) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(cfg)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))  # plain (w) scale, not (1 + w)
            else:
                p.normal_(0.0, 0.2 if "embed" not in name else 1.0)
    if cfg.draft_vocab_size < cfg.vocab_size:
        head.set_vocab_mapping(torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size].sort().values)
    return head.eval()


def inputs(cfg: Eagle3Config, b: int, s: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, cfg.vocab_size, (b, s), generator=g),
            torch.randn(b, s, cfg.aux_hidden_size, generator=g))


# ------------------------------------------------------------------------------------------------
# config
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [{}, {"fc_norm": True, "norm_output": True}, {"aux_layer_ids": None},
                                {"target_hidden_size": 48, "has_embed": False, "aux_layer_ids": (0, 2)}])
def test_config_round_trip(kw):
    cfg = head_cfg(**kw)
    d = cfg.to_dict()
    assert d["architectures"] == ["LlamaForCausalLMEagle3"]
    assert Eagle3Config.from_dict(json.loads(json.dumps(d))) == cfg


def test_config_from_specforge_style_dict():
    d = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 32, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 48, "vocab_size": 64, "draft_vocab_size": 40,
         "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "num_hidden_layers": 1, "rope_scaling": None,
         "norm_output": True,
         "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5], "fc_norm": True}}
    cfg = Eagle3Config.from_dict(d)
    assert (cfg.head_dim, cfg.target_hidden_size, cfg.aux_layer_ids) == (8, 32, (1, 3, 5))
    assert cfg.fc_norm and cfg.norm_output and cfg.has_embed
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.aux_hidden_size) == (500000.0, 1e-5, 96)


@pytest.mark.parametrize("edit, msg", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type='yarn'"),
    ({"rope_parameters": {"rope_type": "llama3"}}, "rope_parameters.rope_type='llama3'"),
    ({"fc_norm": False, "eagle_config": {"fc_norm": True}}, "fc_norm=False at the top level"),
    ({"num_hidden_layers": 2}, "num_hidden_layers=2"),
    ({"norm_before_fc": True}, "norm_before_fc=true"),
    ({"vocab_size": None}, "'vocab_size'"),
])
def test_config_rejects(edit, msg):
    d = head_cfg().to_dict()
    d.update(edit)
    with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("(", r"\(")):
        Eagle3Config.from_dict(d)


def test_default_aux_layer_ids():
    assert default_aux_layer_ids(60) == (2, 30, 57)
    assert default_aux_layer_ids(6) == (2, 3, 3)


def test_forward_seq_matches_a_hand_written_eagle3_layer():
    """Pins the EAGLE-3 layer math independently of the module: concat order (embedding part first),
    the residual stream starting at the hidden input, plain-w RMSNorm, full-head NeoX RoPE, GQA."""
    head = random_head(head_cfg())
    ids, aux = inputs(head.cfg, 1, 6)
    p = {k: v.detach() for k, v in head.state_dict().items()}

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    def rope(x):  # x [S, heads, 8]
        inv = 1.0 / (10000.0 ** (torch.arange(0, 8, 2).float() / 8))
        f = torch.arange(x.shape[0]).float()[:, None] * inv
        cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]
        return x * cos + torch.cat([-x[..., 4:], x[..., :4]], -1) * sin

    h = aux[0] @ p["fc.weight"].T
    x = torch.cat([rms(p["embed_tokens.weight"][ids[0]], p["midlayer.input_layernorm.weight"]),
                   rms(h, p["midlayer.hidden_norm.weight"])], -1)
    a = "midlayer.self_attn."
    q = rope((x @ p[a + "q_proj.weight"].T).view(6, 4, 8)).transpose(0, 1)
    k = rope((x @ p[a + "k_proj.weight"].T).view(6, 2, 8)).repeat_interleave(2, 1).transpose(0, 1)
    v = (x @ p[a + "v_proj.weight"].T).view(6, 2, 8).repeat_interleave(2, 1).transpose(0, 1)
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1)
    h = h + o.reshape(6, 32) @ p[a + "o_proj.weight"].T
    m = rms(h, p["midlayer.post_attention_layernorm.weight"])
    mlp = "midlayer.mlp."
    act = torch.nn.functional.silu(m @ p[mlp + "gate_proj.weight"].T) * (m @ p[mlp + "up_proj.weight"].T)
    h = h + act @ p[mlp + "down_proj.weight"].T
    h_out, h_next = head.forward_seq(ids, aux, True)
    torch.testing.assert_close(h_next[0], h, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h_out[0], rms(h, p["norm.weight"]), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# loader round trips
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["midlayer", "layers.0"])
@pytest.mark.parametrize("eagle31", [False, True])
def test_round_trip(tmp_path: Path, layout: str, eagle31: bool):
    cfg = head_cfg(fc_norm=eagle31, norm_output=eagle31)
    head = random_head(cfg)
    save_eagle3(head, tmp_path, layout=layout)
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert ("midlayer.self_attn.q_proj.weight" in keys) == (layout == "midlayer")
    assert ("layers.0.self_attn.q_proj.weight" in keys) == (layout == "layers.0")
    assert ("fc_norm.2.weight" in keys) == eagle31
    loaded = load_eagle3(tmp_path, target_cfg())
    assert loaded.cfg == cfg
    ref_sd, got_sd = head.state_dict(), loaded.state_dict()
    assert ref_sd.keys() == got_sd.keys()
    for k in ref_sd:
        assert torch.equal(ref_sd[k], got_sd[k]), k
    ids, aux = inputs(cfg, 2, 9)
    for a, b in zip(head.forward_seq(ids, aux, True), loaded.forward_seq(ids, aux, True)):
        assert torch.equal(a, b)


def test_eagle31_options_change_the_math():
    """fc_norm normalises each aux chunk; norm_output hands the normed hidden to the next step."""
    base = random_head(head_cfg())
    ids, aux = inputs(base.cfg, 1, 6)
    for kw in ({"fc_norm": True}, {"norm_output": True}):
        other = Eagle3Head(head_cfg(**kw))
        other.load_state_dict(base.state_dict(), strict=False)  # fc_norm keeps its ones init
        a, b = base.forward_seq(ids, aux, True), other.forward_seq(ids, aux, True)
        if "norm_output" in kw:
            assert torch.equal(a[0], b[0]) and torch.equal(b[1], b[0]) and not torch.equal(a[1], b[1])
        else:
            assert not torch.allclose(a[0], b[0])
    # fc_norm with unit weights is exactly a per-chunk RMSNorm before fc.
    other = Eagle3Head(head_cfg(fc_norm=True))
    other.load_state_dict(base.state_dict(), strict=False)
    chunks = aux.split(HIDDEN, -1)
    normed = torch.cat([c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6) for c in chunks], -1)
    torch.testing.assert_close(other.forward_seq(ids, aux, True)[0], base.forward_seq(ids, normed, True)[0])


def test_bf16_storage(tmp_path: Path):
    head = random_head(head_cfg())
    save_eagle3(head, tmp_path, dtype=torch.bfloat16)
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert stored["fc.weight"].dtype == torch.bfloat16
    assert stored["d2t"].dtype == torch.int64 and stored["t2d"].dtype == torch.bool
    loaded = load_eagle3(tmp_path, target_cfg(), dtype=torch.float32)
    assert torch.equal(loaded.fc.weight, head.fc.weight.bfloat16().float())
    assert torch.equal(loaded.d2t, head.d2t)
    loaded16 = load_eagle3(tmp_path, target_cfg(), dtype=torch.bfloat16)
    assert loaded16.lm_head.weight.dtype == torch.bfloat16 and loaded16.d2t.dtype == torch.int64


def test_missing_embedding_shares_the_target_table(tmp_path: Path):
    target = MiniMaxM3(target_cfg())
    torch.nn.init.normal_(target.embed_tokens.weight)
    target.requires_grad_(False)
    full = random_head(head_cfg())
    with torch.no_grad():
        full.embed_tokens.weight.copy_(target.embed_tokens.weight)
    lean = random_head(head_cfg(has_embed=False))
    lean.load_state_dict({k: v for k, v in full.state_dict().items() if k != "embed_tokens.weight"})
    save_eagle3(lean, tmp_path)
    assert "embed_tokens.weight" not in load_file(str(tmp_path / "model.safetensors"))

    head = load_eagle3(tmp_path, target_cfg())
    assert not head.cfg.has_embed and head.embed_tokens is None
    ids, aux = inputs(head.cfg, 1, 5)
    with pytest.raises(RuntimeError, match="set_embedding"):
        head.forward_seq(ids, aux, True)
    head.set_embedding(target.embed_tokens.weight)
    assert head.embed_tokens.weight.data_ptr() == target.embed_tokens.weight.data_ptr()
    assert not head.embed_tokens.weight.requires_grad
    for a, b in zip(head.forward_seq(ids, aux, True), full.forward_seq(ids, aux, True)):
        assert torch.equal(a, b)
    # Saving the sharing head still writes no embedding: the table belongs to the target.
    save_eagle3(head, tmp_path / "again")
    assert "embed_tokens.weight" not in load_file(str(tmp_path / "again" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"\(64, 48\).*\(64, 32\)"):
        head.set_embedding(torch.zeros(64, 48))


def test_checkpoint_without_vocab_mapping_is_full_vocab(tmp_path: Path):
    head = random_head(head_cfg(draft_vocab_size=VOCAB))
    save_eagle3(head, tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    save_file({k: v for k, v in sd.items() if k not in ("d2t", "t2d")}, str(tmp_path / "model.safetensors"))
    loaded = load_eagle3(tmp_path, target_cfg())
    assert torch.equal(loaded.d2t, torch.zeros(VOCAB, dtype=torch.int64)) and bool(loaded.t2d.all())


def test_t2d_or_d2t_alone_implies_the_other(tmp_path: Path):
    head = random_head(head_cfg())
    for drop in ("d2t", "t2d"):
        save_eagle3(head, tmp_path / drop)
        f = tmp_path / drop / "model.safetensors"
        save_file({k: v for k, v in load_file(str(f)).items() if k != drop}, str(f))
        loaded = load_eagle3(tmp_path / drop, target_cfg())
        assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)


def test_default_aux_ids_when_config_names_none(tmp_path: Path):
    save_eagle3(random_head(head_cfg(aux_layer_ids=None)), tmp_path)
    assert load_eagle3(tmp_path, target_cfg()).cfg.aux_layer_ids == (2, 3, 3)


def test_model_prefix_and_sharded_index(tmp_path: Path):
    head = random_head(head_cfg())
    save_eagle3(head, tmp_path, layout="layers.0")
    sd = load_file(str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors").unlink()
    names = sorted(sd)
    shards = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2:]}
    for f, ks in shards.items():
        save_file({"model." + k: sd[k] for k in ks}, str(tmp_path / f))
    weight_map = {"model." + k: f for f, ks in shards.items() for k in ks}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded = load_eagle3(tmp_path, target_cfg())
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), loaded.state_dict().values()))


# ------------------------------------------------------------------------------------------------
# validation messages: every one names both values
# ------------------------------------------------------------------------------------------------


def write_ckpt(path: Path, head: Eagle3Head, config_edit=None, tensor_edit=None) -> Path:
    save_eagle3(head, path)
    if config_edit:
        d = json.loads((path / "config.json").read_text())
        config_edit(d)
        (path / "config.json").write_text(json.dumps(d))
    if tensor_edit:
        sd = load_file(str(path / "model.safetensors"))
        tensor_edit(sd)
        save_file(sd, str(path / "model.safetensors"))
    return path


def _drop(key):
    return lambda d: d.pop(key)


def _set(key, value):
    return lambda d: d.__setitem__(key, value)


CASES = {
    "hidden": (dict(hidden_size=48, head_dim=12), _drop("target_hidden_size"), None,
               ["hidden_size=48", "hidden_size=32"]),
    "target_hidden": (dict(target_hidden_size=48), None, None, ["target_hidden_size=48", "hidden_size=32"]),
    "vocab": (dict(vocab_size=80), None, None, ["vocab_size=80", "vocab_size=64"]),
    "aux_range": (dict(aux_layer_ids=(1, 3, 7)), None, None, ["holds 7", "[0, 6]", "num_hidden_layers=6"]),
    "d2t_len": ({}, _set("draft_vocab_size", 30), None, ["(40,)", "draft_vocab_size=30"]),
    "t2d_len": ({}, None, lambda sd: sd.__setitem__("t2d", sd["t2d"][:50]), ["(50,)", "vocab_size=64"]),
    "no_d2t": ({}, None, lambda sd: (sd.pop("d2t"), sd.pop("t2d")), ["draft_vocab_size=40", "vocab_size=64"]),
    "d2t_range": ({}, None, lambda sd: sd["d2t"].__setitem__(0, 100), ["vocab_size=64", "outside [0, 64)"]),
    "missing": ({}, None, lambda sd: sd.pop("midlayer.mlp.up_proj.weight"),
                ["'midlayer.mlp.up_proj.weight'", "(48, 32)"]),
    "shape": ({}, None, lambda sd: sd.__setitem__("norm.weight", torch.ones(31)), ["(31,)", "(32,)"]),
    "fc_width": ({}, None, lambda sd: sd.__setitem__("fc.weight", torch.zeros(32, 64)),
                 ["64 inputs", "= 96"]),
    "no_embed_wide": (dict(hidden_size=48, head_dim=12, target_hidden_size=32), None,
                      lambda sd: sd.pop("embed_tokens.weight"), ["hidden_size=48", "hidden_size=32"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_validation_messages(tmp_path: Path, case: str):
    kw, config_edit, tensor_edit, parts = CASES[case]
    path = write_ckpt(tmp_path, random_head(head_cfg(**kw)), config_edit, tensor_edit)
    with pytest.raises(ValueError) as e:
        load_eagle3(path, target_cfg())
    for p in parts:
        assert p in str(e.value), (p, str(e.value))
    if case in ("missing", "shape"):
        assert isinstance(e.value, CheckpointError)


# ------------------------------------------------------------------------------------------------
# paged forward == contiguous forward
# ------------------------------------------------------------------------------------------------


class Pool:
    """Hands out pages 1.. (page 0 is the trash page) in a scrambled order, so rows are not contiguous."""

    def __init__(self, head: Eagle3Head, num_pages: int = 64, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.free = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
        self.cache = head.new_cache(num_pages * PAGE, torch.float32, "cpu")

    def table(self, lengths: list[int], width: int) -> torch.Tensor:
        t = torch.full((len(lengths), width), TRASH_PAGE, dtype=torch.int64)
        for r, n in enumerate(lengths):
            for c in range(-(-n // PAGE)):
                t[r, c] = self.free.pop()
        return t


def paged_step(head, pool, table, ids_rows, hid_rows, kv_lens, from_aux):
    """Run one paged step; ids_rows / hid_rows are per-row lists of this step's tokens."""
    q_lens = [len(x) for x in ids_rows]
    max_kv = -(-max(kv_lens) // PAGE) * PAGE
    meta = build_metadata(q_lens, torch.tensor(kv_lens), table, PAGE, torch.device("cpu"), max_kv)
    ids, hid = torch.cat(ids_rows), torch.cat(hid_rows)
    return head(ids, meta.positions, hid, meta, pool.cache, from_aux)


@pytest.mark.parametrize("eagle31", [False, True])
def test_paged_equals_seq_one_and_several_rows(eagle31: bool):
    head = random_head(head_cfg(fc_norm=eagle31, norm_output=eagle31))
    lens = [10, 7, 3, 12]
    ids, aux = inputs(head.cfg, len(lens), max(lens))
    pool = Pool(head)
    table = pool.table(lens, 5)
    with torch.no_grad():
        out, nxt = paged_step(head, pool, table, [ids[b, :n] for b, n in enumerate(lens)],
                              [aux[b, :n] for b, n in enumerate(lens)], lens, True)
        o = 0
        for b, n in enumerate(lens):
            ref_out, ref_next = head.forward_seq(ids[b:b + 1, :n], aux[b:b + 1, :n], True)
            torch.testing.assert_close(out[o:o + n], ref_out[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(nxt[o:o + n], ref_next[0], atol=1e-5, rtol=1e-5)
            o += n
        # from_aux=False: the hidden input is already [T, H] (a previous step's h_next).
        hid = torch.randn(1, 9, HIDDEN)
        pool1 = Pool(head, seed=3)
        out1, _ = paged_step(head, pool1, pool1.table([9], 3), [ids[0, :9]], [hid[0]], [9], False)
        ref1 = head.forward_seq(ids[:1, :9], hid, False)[0][0]
        torch.testing.assert_close(out1, ref1, atol=1e-5, rtol=1e-5)


def test_paged_chunked_equals_one_shot():
    head = random_head(head_cfg())
    ids, aux = inputs(head.cfg, 2, 11)
    pool = Pool(head)
    table = pool.table([11, 11], 3)
    with torch.no_grad():
        # row 0 in chunks 6 + 5, row 1 in chunks 4 + 7: two steps, each mixing both rows.
        a_out, _ = paged_step(head, pool, table, [ids[0, :6], ids[1, :4]], [aux[0, :6], aux[1, :4]],
                              [6, 4], True)
        b_out, b_next = paged_step(head, pool, table, [ids[0, 6:], ids[1, 4:]], [aux[0, 6:], aux[1, 4:]],
                                   [11, 11], True)
        ref_out, ref_next = head.forward_seq(ids, aux, True)
    torch.testing.assert_close(torch.cat([a_out[:6], b_out[:5]]), ref_out[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([a_out[6:], b_out[5:]]), ref_out[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b_next[5:], ref_next[1, 4:], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# training-time test == the paged draft chain
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("eagle31", [False, True])
def test_ttt_unroll_equals_paged_draft_chain(eagle31: bool):
    """forward_seq with cache_kv, step s at index j, equals the inference chain whose accepted prefix
    ends at token j: step 0 over the prefix (paged), then s single-token steps at positions j+1..j+s."""
    head = random_head(head_cfg(fc_norm=eagle31, norm_output=eagle31))
    s_len, steps = 8, 3
    g = torch.Generator().manual_seed(5)
    step_ids = [torch.randint(0, VOCAB, (s_len,), generator=g) for _ in range(steps)]
    aux = torch.randn(1, s_len, head.cfg.aux_hidden_size, generator=g)
    with torch.no_grad():
        kv: list = []
        ttt = [head.forward_seq(step_ids[0][None], aux, True, kv)]
        assert all(torch.equal(a, b) for a, b in zip(ttt[0], head.forward_seq(step_ids[0][None], aux, True)))
        for s in range(1, steps):
            ttt.append(head.forward_seq(step_ids[s][None], ttt[-1][1], False, kv))
        assert len(kv) == steps

        # One paged row per chain end j, each holding the whole step-0 sequence (as the engine's step 0
        # writes K/V for every target token, accepted or not), then the chain's single-token steps.
        pool = Pool(head, num_pages=128)
        rows = list(range(s_len))
        table = pool.table([s_len + steps] * len(rows), 3)
        out, nxt = paged_step(head, pool, table, [step_ids[0]] * len(rows), [aux[0]] * len(rows),
                              [s_len] * len(rows), True)
        torch.testing.assert_close(out[:s_len], ttt[0][0][0], atol=1e-5, rtol=1e-5)
        hid = torch.stack([nxt[j * s_len + j] for j in rows])  # [rows, H]: h_next at each chain end
        for s in range(1, steps):
            # kv_len j + s + 1: the prefix 0..j plus s drafts; this step overwrites position j + s.
            out, hid = paged_step(head, pool, table, [step_ids[s][j:j + 1] for j in rows],
                                  [hid[j:j + 1] for j in rows], [j + s + 1 for j in rows], False)
            torch.testing.assert_close(out, ttt[s][0][0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(hid, ttt[s][1][0], atol=1e-5, rtol=1e-5)


def test_ttt_is_differentiable():
    head = random_head(head_cfg()).train().requires_grad_(True)
    ids, aux = inputs(head.cfg, 2, 7)
    kv: list = []
    loss = torch.zeros(())
    hid, from_aux = aux, True
    for _ in range(3):
        h_out, hid = head.forward_seq(ids, hid, from_aux, kv)
        loss = loss + head.compute_logits(h_out).logsumexp(-1).mean()
        from_aux = False
    loss.backward()
    for name in ("fc.weight", "midlayer.self_attn.k_proj.weight", "lm_head.weight", "embed_tokens.weight"):
        g = dict(head.named_parameters())[name].grad
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0, name


# ------------------------------------------------------------------------------------------------
# draft vocabulary
# ------------------------------------------------------------------------------------------------


def test_d2t_mapping_and_probs_scatter():
    head = Eagle3Head(head_cfg())
    target_ids = torch.randperm(VOCAB)[:40].sort().values
    head.set_vocab_mapping(target_ids)
    assert torch.equal(head.draft_to_target(torch.arange(40)), target_ids)
    assert torch.equal(head.draft_to_target(torch.tensor([[3, 0], [39, 7]])),
                       target_ids[torch.tensor([[3, 0], [39, 7]])])
    assert int(head.t2d.sum()) == 40 and bool(head.t2d[target_ids].all())
    probs = torch.softmax(torch.randn(5, 40), -1)
    full = head.draft_probs_to_target(probs)
    assert full.shape == (5, VOCAB)
    assert torch.equal(full[:, target_ids], probs)
    assert torch.equal(full[:, ~head.t2d], torch.zeros(5, VOCAB - 40))
    torch.testing.assert_close(full.sum(-1), torch.ones(5))

    ident = Eagle3Head(head_cfg(draft_vocab_size=VOCAB))
    assert bool(ident.t2d.all())
    p = torch.softmax(torch.randn(3, VOCAB), -1)
    assert torch.equal(ident.draft_probs_to_target(p), p)
    assert ident.compute_logits(torch.randn(2, HIDDEN)).dtype == torch.float32
