"""`m3eagle bench` on CPU: a tiny geometry through every code path (plain + spec, the steady-state step
profile, the profiler, --compare-hf), the JSON document's schema, the byte count checked by hand, and
the random-weight loader (load_format="dummy") the large geometries stand on."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest
import torch

from m3eagle.bench import geometries, roofline
from m3eagle.config import M3Config
from m3eagle.entrypoints.cli import main
from m3eagle.models.eagle3 import Eagle3Config

TINY = ["bench", "--geometry", "tiny", "--device", "cpu", "--prompt-len", "24", "--max-tokens", "3",
        "--repeats", "1", "--decode-steps", "1", "--profile-steps", "1", "--bandwidth-gib", "0.01"]


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def tiny_doc(one_thread):
    """One tiny run through every path: batch 1 and 2, plain and spec (K=3), --compare-hf; JSON on stdout."""
    rc, out, err = _run(TINY + ["--batch-sizes", "1,2", "--compare-hf"])
    assert rc == 0, err
    return json.loads(out), err


# ---- the JSON document ---------------------------------------------------------------------------

NUM = (int, float)
SCHEMA = {
    "schema": str, "command": str, "geometry": dict, "env": dict, "settings": dict, "bandwidth": dict,
    "build_s": NUM, "results": list, "speedup": list, "compare_hf": (dict, type(None)), "definitions": dict,
    "wall_s": NUM,
}
ROW = {"batch": int, "mode": str, "num_draft_tokens": int, "tok_s": dict, "acceptance": (dict, type(None)),
       "step": dict, "roofline": dict, "first_token_ms": NUM, "steps": NUM}
STEP = {"context": NUM, "tokens": int, "step_ms": NUM, "host_ms": NUM, "device_wait_ms": NUM,
        "graph_launch_ms": (*NUM, type(None)),
        "torch_ops_per_step": NUM, "kernels_per_step": (*NUM, type(None)), "memcpy_per_step": (*NUM, type(None)),
        "gpu_busy_ms": (*NUM, type(None)), "gpu_busy_frac": (*NUM, type(None))}
ROOF = {"bytes_per_step": NUM, "bytes": dict, "draft_bytes": (dict, type(None)), "experts_per_moe_layer": list,
        "experts_source": str, "expected_experts": NUM, "mbu": NUM, "roofline_tok_s": NUM}
STATS = {"median": NUM, "min": NUM, "max": NUM, "samples": list}


def _check(d: dict, schema: dict, where: str) -> None:
    for key, typ in schema.items():
        assert key in d, f"{where}: missing {key!r}"
        assert isinstance(d[key], typ), f"{where}.{key}: {type(d[key]).__name__} is not {typ}"


def test_json_schema(tiny_doc):
    doc, _ = tiny_doc
    _check(doc, SCHEMA, "doc")
    assert doc["schema"] == "m3eagle.bench/1"
    _check(doc["geometry"], {"name": str, "params": int, "active_params": int, "draft_params": int, "target": dict,
                             "draft": dict, "load_format": str}, "geometry")
    _check(doc["env"], {"device": str, "device_name": str, "dtype": str, "torch": str, "attention_backend": str,
                        "overlap": bool, "engine_config": dict}, "env")
    _check(doc["bandwidth"], {"buffer_bytes": int, "bytes_per_s": NUM}, "bandwidth")
    assert [(r["batch"], r["mode"]) for r in doc["results"]] == [(1, "plain"), (1, "spec"), (2, "plain"), (2, "spec")]
    for r in doc["results"]:
        _check(r, ROW, "row")
        _check(r["tok_s"], STATS, "tok_s")
        _check(r["step"], STEP, "step")
        _check(r["roofline"], ROOF, "roofline")
        assert r["tok_s"]["min"] <= r["tok_s"]["median"] <= r["tok_s"]["max"]
        assert len(r["tok_s"]["samples"]) == 1
        assert (r["acceptance"] is None) == (r["mode"] == "plain")
        assert (r["roofline"]["draft_bytes"] is None) == (r["mode"] == "plain")
        assert r["first_token_ms"] > 0
        # 3 new tokens: a prompt step, then 2 more plain decode steps (or fewer when drafts were accepted),
        # and under overlap at most one step more to drain
        assert (r["steps"] in (3, 4)) if r["mode"] == "plain" else (2 <= r["steps"] <= 4), r["steps"]
    assert [s["batch"] for s in doc["speedup"]] == [1, 2]
    assert set(doc["definitions"]) >= {"tok_s", "step_ms", "host_ms", "gpu_busy_ms", "mbu", "roofline_tok_s"}


def test_step_profile_on_cpu(tiny_doc):
    """The profiler path runs on CPU; the CUDA-only measures are null there, the rest are real numbers."""
    doc, _ = tiny_doc
    k = doc["settings"]["num_draft_tokens"]
    assert k == 3
    for r in doc["results"]:
        st, rf = r["step"], r["roofline"]
        assert st["step_ms"] > 0 and 0 < st["host_ms"] <= st["step_ms"] + 1e-6
        assert st["torch_ops_per_step"] > 0
        assert st["kernels_per_step"] is None and st["gpu_busy_ms"] is None and st["gpu_busy_frac"] is None
        assert st["graph_launch_ms"] is None  # no CUDA graph replays on a CPU device
        assert st["context"] > doc["settings"]["prompt_len"]
        # one target forward: a token per row plain, 1 + K per row when verifying
        assert st["tokens"] == r["batch"] * (1 + (k if r["mode"] == "spec" else 0))
        # experts counted from the router's actual choices, one count per MoE layer
        cfg = M3Config.from_dict(doc["geometry"]["target"])
        assert rf["experts_source"] == "measured"
        assert len(rf["experts_per_moe_layer"]) == sum(cfg.is_moe(i) for i in range(cfg.num_hidden_layers))
        assert all(cfg.num_experts_per_tok <= e <= min(cfg.num_local_experts, st["tokens"] * cfg.num_experts_per_tok)
                   for e in rf["experts_per_moe_layer"])
        assert rf["bytes_per_step"] == pytest.approx(rf["bytes"]["total"] + (rf["draft_bytes"] or {"total": 0})["total"])
        assert rf["mbu"] == pytest.approx(rf["bytes_per_step"] / (st["step_ms"] / 1e3) / doc["bandwidth"]["bytes_per_s"])


def test_compare_hf_same_weights(tiny_doc):
    """transformers generates on the very same tensors: in fp32 its greedy tokens are m3eagle's."""
    doc, _ = tiny_doc
    hf = doc["compare_hf"]
    assert hf["batch"] == 1 and hf["tok_s"]["median"] > 0
    assert hf["greedy_prefix_match"] == hf["max_tokens"] == 3
    assert hf["ratio"] == pytest.approx(hf["m3eagle_tok_s"] / hf["tok_s"]["median"])


def test_table_on_stderr(tiny_doc):
    doc, err = tiny_doc
    assert "m3eagle bench: tiny" in err and "roofline tok/s" in err and "transformers generate" in err
    assert "{" not in err.split("m3eagle bench: tiny", 1)[1]  # the JSON never lands on stderr


def test_json_file_and_plain_only(tmp_path, one_thread):
    f = tmp_path / "b.json"
    rc, out, err = _run(TINY + ["--batch-sizes", "1", "--num-draft-tokens", "0", "--json", str(f)])
    assert rc == 0, err
    assert out == ""  # --json FILE takes the document off stdout
    doc = json.loads(f.read_text())
    assert [r["mode"] for r in doc["results"]] == ["plain"] and doc["speedup"] == [] and doc["compare_hf"] is None


# ---- bytes per step, by hand ---------------------------------------------------------------------


def _small() -> M3Config:
    return M3Config.from_dict(dict(
        vocab_size=10, hidden_size=4, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=2,
        dense_intermediate_size=3, num_local_experts=4, num_experts_per_tok=2, intermediate_size=2,
        shared_intermediate_size=1, index_n_heads=1, index_head_dim=2, index_block_size=2, index_topk_blocks=1,
        layer_types=["full_attention", "minimax_m3_sparse"], mlp_layer_types=["dense", "sparse"]))


def test_decode_step_bytes_by_hand():
    # batch 3, context 5, 3 tokens, bf16 (2 bytes), 3 distinct experts chosen in the MoE layer.
    b = roofline.decode_step_bytes(_small(), batch=3, context=5, dtype_bytes=2, tokens=3, experts=[3])
    want = {
        "embedding": 3 * 4 * 2,                      # 3 rows of H=4
        "attention": 2 * (16 + 8 + 8 + 16) * 2,      # per layer q 4x4, k 4x2, v 4x2, o 4x4; 2 layers
        "indexer": (4 * 2 + 4 * 2) * 2,              # sparse layer: index q 4x(1x2), index k 4x2
        "norms": (4 + 2 * (2 * 4 + 2 * 2) + 2 * 2) * 2,  # final + per layer (2 layernorms, q/k norm) + index q/k norm
        "dense_mlp": 3 * 4 * 3 * 2,                  # gate, up, down of 4x3
        "router": (4 * 4 + 4) * 4,                   # fp32 weight [E=4, H] + bias [E]
        "shared_experts": 3 * 4 * 1 * 2,
        "routed_experts": 3 * (3 * 4 * 2) * 2,       # 3 experts of gate/up/down 4x2
        "lm_head": 10 * 4 * 2,
        "kv_cache": 3 * 5 * 8 + 3 * 2 * 8,           # full: 3 rows x 5 tokens x (K+V 1x2 x 2B); sparse: window 2x1
        "index_k_cache": 3 * 5 * 2 * 2,              # every index key of the context, Di=2
    }
    assert {k: v for k, v in b.items() if k != "total"} == want
    assert b["total"] == sum(want.values()) == 940


def test_expected_experts_and_defaults():
    assert roofline.expected_distinct_experts(4, 2, 3) == pytest.approx(3.5)  # 4 * (1 - (1/2)^3)
    assert roofline.expected_distinct_experts(32, 4, 1) == pytest.approx(4)
    assert roofline.expected_distinct_experts(32, 4, 10_000) == pytest.approx(32)
    b = roofline.decode_step_bytes(_small(), batch=3, context=5, dtype_bytes=2)  # uniform routing, 3 tokens
    assert b["routed_experts"] == pytest.approx(3.5 * 3 * 4 * 2 * 2)


def test_draft_step_bytes_by_hand():
    cfg = Eagle3Config(hidden_size=4, num_attention_heads=2, num_key_value_heads=1, head_dim=2, intermediate_size=3,
                       vocab_size=10, draft_vocab_size=6, aux_layer_ids=(0, 1, 2))
    b = roofline.draft_step_bytes(cfg, batch=3, context=5, k=2, dtype_bytes=2)
    assert b["fc"] == 12 * 4 * 2                            # fc [H, 3 aux x H]
    assert b["layer"] == 2 * (8 * 8 + 4 * 4 + 3 * 4 * 3 + 4 * 4) * 2  # K=2 x (qkv from 2H, o, MLP, 4 norms)
    assert b["lm_head"] == 2 * 6 * 4 * 2
    assert b["kv_cache"] == 2 * 3 * 5 * 1 * 2 * 2 * 2
    assert b["total"] == 96 + 528 + 96 + 240


def test_named_geometries_match_the_issue():
    mini, _ = geometries.m3_mini()
    big, _ = geometries.m3_8b()
    assert roofline.param_counts(mini) == {"params": 2_379_407_168, "active_params": 617_799_488}
    c = roofline.param_counts(big)
    assert 9.9e9 < c["params"] < 10.1e9 and 4.0e9 < c["active_params"] < 4.2e9
    assert 7.9e9 < roofline.decode_step_bytes(big, 1, 160, 2, experts=4)["total"] < 8.2e9  # ~8 GB per bf16 step


def test_resolve_errors_name_the_option(tmp_path):
    with pytest.raises(ValueError, match="--geometry"):
        geometries.resolve("m3-huge")
    with pytest.raises(ValueError, match="--draft"):
        geometries.resolve("m3-mini", draft=str(tmp_path))
    g = geometries.resolve(str(geometries.ASSETS / "target"), load_format="dummy")
    assert g.load_format == "dummy" and g.draft is None


# ---- load_format="dummy" -------------------------------------------------------------------------


def test_dummy_weights():
    from m3eagle.loader.dummy import dummy_eagle3, dummy_target

    t, d = geometries.tiny()
    a = dummy_target(t, torch.bfloat16, "cpu", seed=0)
    b = dummy_target(t, torch.bfloat16, "cpu", seed=0)
    c = dummy_target(t, torch.bfloat16, "cpu", seed=5)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)  # seeded
    assert not torch.equal(sa["layers.0.self_attn.q_proj.weight"], sc["layers.0.self_attn.q_proj.weight"])
    moe = a.layers[1].mlp
    assert moe.gate.weight.dtype == torch.float32 and not moe.gate.e_score_correction_bias.any()
    assert moe.experts.gate_up_proj.dtype == torch.bfloat16
    assert 0.015 < moe.experts.gate_up_proj.float().std() < 0.025
    assert not a.norm.weight.any() and not a.layers[0].self_attn.q_norm.weight.any()  # Gemma: scale 1 + 0
    assert not any(t.is_meta for t in a.state_dict().values())
    h = dummy_eagle3(d, torch.float32, "cpu")
    assert torch.equal(h.norm.weight, torch.ones_like(h.norm.weight))  # Llama norm: scale w = 1
    ids = torch.arange(d.draft_vocab_size) + h.d2t
    assert ids.min() >= 0 and ids.max() < d.vocab_size and ids.unique().numel() == d.draft_vocab_size
    assert h.t2d.sum() == d.draft_vocab_size and h.t2d[ids].all()


def test_llm_load_format(one_thread):
    from m3eagle import LLM, SamplingParams

    t, d = geometries.tiny()
    with pytest.raises(ValueError, match="load_format"):
        LLM(t, device="cpu", num_draft_tokens=0)  # a config has no weights to read
    with pytest.raises(ValueError, match="load_format"):
        LLM(geometries.ASSETS / "target", device="cpu", num_draft_tokens=0, load_format="safetensors")
    llm = LLM(t.to_hf_text_dict(), d.to_dict(), device="cpu", load_format="dummy", max_model_len=64)  # dicts work
    assert llm.tokenizer is None and llm.config.num_draft_tokens == 3
    assert llm.draft.embed_tokens.weight.data_ptr() == llm.target.embed_tokens.weight.data_ptr()
    out = llm.generate([list(range(3, 30))], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    emb = LLM(geometries.ASSETS / "target", device="cpu", num_draft_tokens=0, load_format="dummy")
    assert emb.tokenizer is not None  # config and tokenizer from the directory, weights random


def test_hf_twin_shares_storage():
    from m3eagle.bench.offline import hf_twin
    from m3eagle.loader.dummy import dummy_target

    t, _ = geometries.tiny()
    m = dummy_target(t, torch.float32, "cpu")
    hf = hf_twin(m)
    assert hf.model.embed_tokens.weight.data_ptr() == m.embed_tokens.weight.data_ptr()
    assert hf.model.layers[1].mlp.experts.gate_up_proj.data_ptr() == m.layers[1].mlp.experts.gate_up_proj.data_ptr()


def test_text_prompts(monkeypatch, tmp_path):
    from tokenizers import Tokenizer

    from m3eagle.bench import offline

    class Tok:  # what make_prompts needs of a tokenizer: encode(text) -> ids
        t = Tokenizer.from_file(str(geometries.ASSETS / "target" / "tokenizer.json"))

        def encode(self, text: str) -> list[int]:
            return self.t.encode(text, add_special_tokens=False).ids

    tok = Tok()
    prompts, src = offline.make_prompts(tok, 8192, n=3, length=20, seed=0)
    assert src == "stdlib text" and [len(p) for p in prompts] == [20, 20, 20]
    short = tmp_path / "short.py"
    short.write_text("x = 1\n" * 4)
    monkeypatch.setattr(offline, "held_out_files", lambda: [short])
    with pytest.raises(ValueError, match="--prompt-len"):
        offline.make_prompts(tok, 8192, n=3, length=20, seed=0)


def test_union_of_intervals():
    from m3eagle.bench.offline import _union_us

    assert _union_us([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4
    assert _union_us([]) == 0


def test_top_kernels_groups_by_short_name_per_step():
    from m3eagle.bench.offline import top_kernels

    spans = [("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>"
              "(cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8::Params)", 10.0),
             ("void cutlass::Kernel2<other_config>(Params)", 20.0),
             ("_fused_moe_kernel", 5.0), ("_fused_moe_kernel", 7.0), ("Memcpy DtoH (Device -> Pinned)", 1.0)]
    rows = top_kernels(spans, steps=2)
    assert rows[0] == {"name": "cutlass::Kernel2", "calls_per_step": 1.0, "us_per_step": 15.0}
    assert rows[1] == {"name": "_fused_moe_kernel", "calls_per_step": 1.0, "us_per_step": 6.0}
    assert rows[2]["name"] == "Memcpy DtoH" and rows[2]["us_per_step"] == 0.5


def test_msa_step_benchmark_runs_on_cpu():
    """benchmarks/msa_step.py end to end on the Triton interpreter (tiny geometry, one context and shape):
    the script builds the models, times steps and one sparse layer through the engine's own ops, and checks
    the selection and attention against the reference. It once broke silently when a model signature
    changed; this keeps it running."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "benchmarks/msa_step.py", "--device", "cpu", "--tiny", "--smoke"],
                         cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["check"]["ok"] and doc["steps"] and doc["layer"]
    layer = doc["layer"][0]
    assert layer["qkv_rope_with_index_us"] > 0 and layer["indexer_us"] > 0
