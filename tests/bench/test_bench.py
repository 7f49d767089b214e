"""`m3eagle bench` on CPU: a tiny geometry through every code path (plain + spec, the steady-state step
profile, the profiler, --compare-hf), the JSON document's schema, the byte count checked by hand, and
the random-weight loader (load_format="dummy") the large geometries stand on. `m3eagle bench-serve` against a
real in-process streaming server (timings, failures, concurrency, arrivals, acceptance from /metrics), and its
percentiles and Prometheus parsing."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
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


def test_draft_tree_runs_on_the_plain_eager_path(one_thread):
    """--draft-tree: the speculative rows verify the tree's N nodes (num_draft_tokens N), the settings record the
    tree and the verify width rule the engine chose (CPU: the shape rule, 256 // (N + 1) rows), the engine ran
    without overlap or graphs; with --num-draft-tokens too it is refused naming both, and --tree-max-batch
    without a tree names the option."""
    rc, out, err = _run(TINY + ["--batch-sizes", "1", "--draft-tree", "2,2,4"])
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["settings"]["draft_tree"] == "2,2,4" and doc["settings"]["num_draft_tokens"] == 4
    assert doc["settings"]["tree_max_batch"] == 256 // 5
    assert [r["mode"] for r in doc["results"]] == ["plain", "spec"]
    assert doc["results"][1]["num_draft_tokens"] == 4 and doc["env"]["engine_config"]["overlap"] is False
    rc, _, err = _run(TINY + ["--batch-sizes", "1", "--draft-tree", "2,2,4", "--num-draft-tokens", "3"])
    assert rc == 2 and "--draft-tree" in err and "--num-draft-tokens" in err
    rc, _, err = _run(TINY + ["--batch-sizes", "1", "--num-draft-tokens", "0", "--tree-max-batch", "3"])
    assert rc == 2 and "tree_max_batch=3" in err and "draft_tree" in err


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


def test_named_geometries_match_their_definitions():
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


@pytest.mark.slow
def test_msa_step_benchmark_runs_on_cpu():
    """benchmarks/msa_step.py end to end on the Triton interpreter (tiny geometry, one context and shape):
    the script builds the models, times steps and one sparse layer through the engine's own ops, and checks
    the selection and attention against the reference. It once broke silently when a model signature
    changed; this keeps it running."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "benchmarks/msa_step.py", "--device", "cpu", "--tiny", "--smoke"],
                         cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["check"]["ok"] and doc["steps"] and doc["layer"]
    layer = doc["layer"][0]
    assert layer["qkv_rope_with_index_us"] > 0 and layer["indexer_us"] > 0


def test_prefix_ttft_benchmark_runs_on_the_embedded_checkpoint(tmp_path):
    """benchmarks/prefix_ttft.py on the embedded pair (a checkpoint directory, trained weights) on CPU: both
    cache settings run, the waves hit the cached prefix, and the JSON holds every measured TTFT. It once
    crashed on any geometry given as a directory."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    out_json = tmp_path / "pttft.json"
    out = subprocess.run([sys.executable, "benchmarks/prefix_ttft.py", "--geometry", "embedded", "--device", "cpu",
                          "--prefix-len", "64", "--suffix-len", "8", "--output-len", "2", "--concurrency", "2",
                          "--waves", "1", "--json", str(out_json)], cwd=root, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out_json.read_text())
    for setting in ("on", "off"):
        res = doc["results"][setting]
        assert len(res["wave_ttft_ms"]) == 2 and len(res["alone_ttft_ms"]) == 2
        assert all(t > 0 for t in res["wave_ttft_ms"] + res["alone_ttft_ms"])
    assert doc["speedup"]["wave_p50"] > 0


# ---- bench-serve: against a real in-process OpenAI-style server ----------------------------------


class FakeServer:
    """A small OpenAI-compatible streaming server (Starlette on uvicorn, in a thread, on a real socket). Each
    streamed completion sends `events` text events `gap` seconds apart, each carrying `per_event` tokens
    (as one speculative step may), then a usage event and [DONE]. Arrival numbers in `http_500` get an
    HTTP 500, those in `error_event` an error event mid-stream; `first_delta` replaces a chat stream's first
    delta (reasoning or a tool call, no content). Every stream that finishes adds 4 drafts
    (12 draft tokens, 6 accepted: 3 / 2 / 1 at positions 0 / 1 / 2) to the /metrics counters."""

    def __init__(self, gap=0.02, events=3, per_event=2, http_500=(), error_event=(), first_delta=None):
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
        from starlette.routing import Route

        self.gap, self.events, self.per_event = gap, events, per_event
        self.http_500, self.error_event = set(http_500), set(error_event)
        self.arrivals: list[float] = []
        self.bodies: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        self.drafts = 0
        self.peers: dict[str, set] = {"models": set(), "completions": set()}  # the client's (host, port) per route
        import time as _time

        async def models(request):
            self.peers["models"].add(tuple(request.client))
            return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

        async def metrics(request):
            d = self.drafts
            page = ["# HELP fake:spec_decode_num_drafts Verify rows.", "# TYPE fake:spec_decode_num_drafts counter",
                    f'fake:spec_decode_num_drafts_total{{model_name="fake-model"}} {d}',
                    "# TYPE fake:spec_decode_num_draft_tokens counter",
                    f'fake:spec_decode_num_draft_tokens_total{{model_name="fake-model"}} {3 * d}',
                    "# TYPE fake:spec_decode_num_accepted_tokens counter",
                    f'fake:spec_decode_num_accepted_tokens_total{{model_name="fake-model"}} {1.5 * d}',
                    "# TYPE fake:spec_decode_num_accepted_tokens_per_pos counter"]
            page += [f'fake:spec_decode_num_accepted_tokens_per_pos_total{{model_name="fake-model",position="{j}"}} '
                     f"{(3 - j) / 4 * d}" for j in range(3)]
            page += ["# TYPE fake:num_requests_running gauge", "fake:num_requests_running 0"]
            return PlainTextResponse("\n".join(page) + "\n")

        async def completions(request):
            import asyncio as _asyncio

            body = await request.json()
            self.peers["completions"].add(tuple(request.client))
            n = len(self.arrivals)
            self.arrivals.append(_time.perf_counter())
            self.bodies.append(body)
            if n in self.http_500:
                return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
            chat = request.url.path.endswith("/chat/completions")
            prompt_tokens = len(body["prompt"]) if "prompt" in body else 7

            async def stream():
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
                try:
                    for i in range(self.events):
                        await _asyncio.sleep(self.gap)
                        if n in self.error_event and i == 1:
                            yield f"data: {json.dumps({'error': {'message': 'injected error event'}})}\n\n"
                            yield "data: [DONE]\n\n"
                            return
                        piece = "ab"[:self.per_event]
                        choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
                        if chat and i == 0 and first_delta is not None:  # output that is not content comes first
                            choice = {"index": 0, "delta": first_delta}
                        yield f"data: {json.dumps({'choices': [choice]})}\n\n"
                    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": self.events * self.per_event}
                    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                    yield "data: [DONE]\n\n"
                    self.drafts += 4
                finally:
                    self.in_flight -= 1

            return StreamingResponse(stream(), media_type="text/event-stream")

        self.app = Starlette(routes=[Route("/v1/models", models), Route("/metrics", metrics),
                                     Route("/v1/completions", completions, methods=["POST"]),
                                     Route("/v1/chat/completions", completions, methods=["POST"])])

    def __enter__(self):
        import socket
        import threading

        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        import time as _time

        deadline = _time.monotonic() + 20
        while not self.server.started:
            assert _time.monotonic() < deadline, "the fake server did not start"
            _time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


def _bench_serve(url: str, tmp_path: Path, *extra: str) -> tuple[dict, str]:
    f = tmp_path / "serve.json"
    rc, out, err = _run(["bench-serve", "--base-url", url, "--dataset", "random", "--input-len", "16", "--output-len",
                         "6", "--json", str(f), *extra])
    assert rc == 0, err
    assert out == ""
    return json.loads(f.read_text()), err


def test_bench_serve_against_a_server(tmp_path):
    """12 measured requests, 3 at a time, after 2 warm-ups: 2 of them fail (an HTTP 500, an error event), the
    other 10 are timed from their stream's arrival times, and acceptance is the /metrics delta."""
    gap = 0.02
    # arrivals 0 and 1 are the warm-ups; 2 + 3 and 2 + 7 are measured requests that fail
    with FakeServer(gap=gap, http_500={5}, error_event={9}) as srv:
        doc, err = _bench_serve(srv.url, tmp_path, "--num-prompts", "12", "--max-concurrency", "3", "--warmup", "2")
    assert doc["schema"] == "m3eagle.bench_serve/1"
    s, r, acc = doc["settings"], doc["results"], doc["acceptance"]
    assert s["model"] == "fake-model" and s["base_url"] == srv.url and s["request_rate"] is None
    assert len(srv.bodies) == 2 + 12  # warm-ups, then the measured requests
    assert all(b["prompt"] and len(b["prompt"]) == 16 and b["max_tokens"] == 6 and b["ignore_eos"] and b["stream"]
               for b in srv.bodies)
    assert srv.max_in_flight == 3  # --max-concurrency holds
    assert r["completed"] == 10 and r["failed"] == 2
    assert sorted(doc["errors"]) == ["HTTP 500: {\"error\":{\"message\":\"injected failure\"}}", "injected error event"]
    assert r["output_tokens"] == 10 * 6  # usage.completion_tokens, not the 3 events
    assert r["input_tokens"] == 10 * 16
    assert r["output_throughput"] == pytest.approx(r["output_tokens"] / r["duration_s"])
    # the first event comes `gap` after the request; then two gaps of `gap` between the 3 events
    assert r["ttft_ms"]["p50"] >= gap * 1e3 * 0.9
    assert gap * 1e3 * 0.5 <= r["itl_ms"]["p50"] <= gap * 1e3 * 10  # gaps seen by the client jitter around `gap`
    assert r["e2e_ms"]["p50"] >= 3 * gap * 1e3 * 0.9
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        row = r[key]
        assert row["p50"] <= row["p90"] <= row["p99"], key
    # tpot = (e2e - ttft) / 5 output tokens after the first: ~2 gaps / 5
    assert r["tpot_ms"]["p50"] == pytest.approx(2 * gap * 1e3 / 5, rel=0.9)
    assert acc == {"num_drafts": 40, "num_draft_tokens": 120, "num_accepted_tokens": 60, "acceptance_rate": 0.5,
                   "mean_acceptance_length": 2.5, "per_position": [0.75, 0.5, 0.25]}
    assert "TTFT ms" in err and "acceptance: mean length 2.500" in err and "failed 2" in err
    assert "warm-up 2/2" in err
    assert doc["prefix_cache"] is None  # the fake server exports no prefix_cache counters
    assert doc["server_ttft"] is None  # nor a TTFT histogram
    assert doc["client"]["cpu_s"] > 0 and 0 < doc["client"]["utilization"] < 1.5 and "client CPU:" in err
    # the timeline: every measured request in the order sent, the failed ones without a TTFT
    reqs = doc["requests"]
    assert len(reqs) == 12 and sum(q["ok"] for q in reqs) == 10
    assert [q["sent_ms"] for q in reqs] == sorted(q["sent_ms"] for q in reqs) and reqs[0]["sent_ms"] >= 0
    assert all((q["ttft_ms"] is None) == (not q["ok"]) for q in reqs)
    assert all(q["ttft_ms"] >= gap * 1e3 * 0.9 and q["e2e_ms"] >= q["ttft_ms"] and q["output_tokens"] == 6
               and q["prompt_tokens"] == 16 for q in reqs if q["ok"])
    assert reqs[-1]["sent_ms"] >= 3 * gap * 1e3  # 3 at a time: the last ones wait for earlier streams


@pytest.mark.parametrize("processes", ["1", "2"])
def test_bench_serve_opens_its_connections_before_the_measured_window(tmp_path, processes):
    """Every measured request goes over a connection that a GET /v1/models opened ahead of the window (a
    client's first connect and httpx's first-use imports are not the server's TTFT), one per request in
    flight, in one client process or spread over two."""
    with FakeServer(gap=0.005) as srv:
        _bench_serve(srv.url, tmp_path, "--num-prompts", "12", "--max-concurrency", "4", "--warmup", "0",
                     "--client-processes", processes)
    assert len(srv.peers["completions"]) == 4  # one connection per request in flight
    assert srv.peers["completions"] <= srv.peers["models"]


def test_bench_serve_chat_and_poisson_arrivals(tmp_path):
    """Chat requests carry the prompt's text; at --request-rate the arrivals spread out (Poisson), where at the
    default (inf) they all come at once."""
    with FakeServer(gap=0.01, events=2, per_event=1) as srv:
        doc, _ = _bench_serve(srv.url, tmp_path, "--num-prompts", "8", "--warmup", "0", "--request-rate", "40",
                              "--endpoint", "/v1/chat/completions")
        spread = srv.arrivals[-1] - srv.arrivals[0]
    r = doc["results"]
    assert r["completed"] == 8 and r["failed"] == 0 and r["output_tokens"] == 8 * 2
    assert r["input_tokens"] == 8 * 7  # usage.prompt_tokens (a chat prompt grows by its template)
    assert all(isinstance(b["messages"][0]["content"], str) and "prompt" not in b for b in srv.bodies)
    assert doc["settings"]["request_rate"] == 40
    # the client sleeps an exponential gap (seeded: --seed 0 + 1) after sending each request
    rng = random.Random(1)
    assert spread >= 0.9 * sum(rng.expovariate(40) for _ in range(7))
    with FakeServer(gap=0.5, events=2, per_event=1) as srv:  # each stream lasts >= 1 s
        _bench_serve(srv.url, tmp_path, "--num-prompts", "8", "--warmup", "0")
    assert srv.max_in_flight == 8  # at the default rate (inf) and no --max-concurrency, all are sent at once


def test_bench_serve_multiturn_conversations(tmp_path):
    """--dataset multiturn: 8 requests as 2 conversations of 4 turns; a turn is sent only after the previous one
    finished, and carries every earlier user window and the server's streamed reply, then its own window."""
    with FakeServer(gap=0.01, events=2, per_event=2) as srv:
        f = tmp_path / "mt.json"
        rc, _, err = _run(["bench-serve", "--base-url", srv.url, "--dataset", "multiturn", "--turns", "4",
                           "--input-len", "16", "--output-len", "4", "--num-prompts", "8", "--warmup", "0",
                           "--json", str(f)])
    assert rc == 0, err
    doc = json.loads(f.read_text())
    assert doc["settings"]["turns"] == 4 and doc["results"]["completed"] == 8
    convs: dict[str, list[list[dict]]] = {}
    for b in srv.bodies:
        convs.setdefault(b["messages"][0]["content"], []).append(b["messages"])
    assert len(convs) == 2 and srv.max_in_flight <= 2
    for turns in convs.values():
        assert [len(m) for m in turns] == [1, 3, 5, 7]  # user (+ assistant + user) per turn
        for t, msgs in enumerate(turns):
            assert [m["role"] for m in msgs] == ["user", "assistant"] * t + ["user"]
            assert all(m["content"] == "abab" for m in msgs if m["role"] == "assistant")  # the streamed reply
            assert msgs[:-1] == turns[-1][:len(msgs) - 1]  # each turn extends the conversation so far
        assert len({m[-1]["content"] for m in turns}) == 4  # a new window per turn


def test_bench_serve_without_a_server(capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        assert main(["bench-serve", "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is the server running" in err[0]
    assert main(["bench-serve", "--base-url", "localhost:8000", "--num-prompts", "1"]) == 2
    assert "--base-url" in capsys.readouterr().err


# ---- bench-serve: the pieces ---------------------------------------------------------------------


def test_serve_percentiles():
    from m3eagle.bench.serve import percentiles

    # seconds in, milliseconds out; linear interpolation between order statistics
    assert percentiles([0.004, 0.001, 0.003, 0.002]) == pytest.approx({"mean": 2.5, "p50": 2.5, "p90": 3.7,
                                                                        "p99": 3.97})
    assert percentiles([5.0], scale=1) == {"mean": 5.0, "p50": 5.0, "p90": 5.0, "p99": 5.0}
    assert percentiles([]) == {"mean": None, "p50": None, "p90": None, "p99": None}
    row = percentiles([float(x) for x in range(101)], scale=1)
    assert row == {"mean": 50.0, "p50": 50.0, "p90": 90.0, "p99": 99.0}
    assert all(type(v) is float for v in row.values())  # plain floats: the JSON document takes them


def test_serve_spec_counters_from_metrics_text():
    from m3eagle.bench.serve import acceptance, spec_counters

    page = """# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="a"} 10.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="a"} 6.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="a"} 1.7e9
# TYPE vllm:spec_decode_num_draft_tokens counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="a"} 48.0
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="a"} 20.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="a",position="1"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="a",position="0"} 12.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="a",position="0"} 2.0
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{le="+Inf",model_name="a"} 3.0
vllm:e2e_request_latency_seconds_count{model_name="a"} 3.0
vllm:e2e_request_latency_seconds_sum{model_name="a"} 1.5
"""
    c = spec_counters(page)
    assert c == {"drafts": 16.0, "draft_tokens": 48.0, "accepted": 20.0, "per_pos": {0: 14.0, 1: 8.0}}
    assert spec_counters("# TYPE x counter\nx_total 3\n") is None  # no spec_decode counters
    assert spec_counters('{"detail": "Not Found"}') is None  # not Prometheus text
    before = {"drafts": 6.0, "draft_tokens": 18.0, "accepted": 5.0, "per_pos": {0: 4.0, 1: 1.0}}
    acc = acceptance(before, c)
    assert acc == pytest.approx({"num_drafts": 10, "num_draft_tokens": 30, "num_accepted_tokens": 15,
                                 "acceptance_rate": 0.5, "mean_acceptance_length": 2.5, "per_position": [1.0, 0.7]})
    assert acceptance(c, c) is None and acceptance(None, c) is None


def test_serve_base_url():
    from m3eagle.bench.serve import base_url

    assert base_url("http://127.0.0.1:8000") == "http://127.0.0.1:8000"
    assert base_url("http://localhost/") == "http://localhost:80"
    assert base_url("https://example.com/proxy/v/") == "https://example.com:443/proxy/v"
    for bad in ("localhost:8000", "ftp://h:1", "http://"):
        with pytest.raises(ValueError, match="--base-url"):
            base_url(bad)


def test_m3_geometry_has_the_real_layer_shapes():
    """--geometry m3 is MiniMax-M3's text backbone at its real shapes (426B parameters at 60 layers, counted on
    the meta device); --num-layers keeps the first N (3 dense, then MoE) and is refused elsewhere, by name."""
    import torch

    from m3eagle.bench import geometries
    from m3eagle.models.minimax_m3 import MiniMaxM3

    full = geometries.resolve("m3").model
    with torch.device("meta"):
        assert round(sum(p.numel() for p in MiniMaxM3(full).parameters()) / 1e9) == 426
    cut = geometries.resolve("m3", num_layers=4).model
    assert (cut.hidden_size, cut.num_attention_heads, cut.num_key_value_heads, cut.head_dim) == (6144, 64, 4, 128)
    assert (cut.num_local_experts, cut.num_experts_per_tok, cut.intermediate_size, cut.vocab_size) == (128, 4, 3072, 200064)
    assert cut.mlp_layer_types == ("dense",) * 3 + ("sparse",)
    with pytest.raises(ValueError, match="--num-layers is for --geometry m3"):
        geometries.resolve("m3-mini", num_layers=4)
    for bad in (3, 61):
        with pytest.raises(ValueError, match=f"--num-layers {bad}: choose 4..60"):
            geometries.m3(bad)


def test_serve_prefix_cache_counters_from_metrics_text():
    from m3eagle.bench.serve import prefix_cache, prefix_counters

    page = """# TYPE m3eagle:prefix_cache_queries counter
m3eagle:prefix_cache_queries_total{model_name="a"} 1000.0
m3eagle:prefix_cache_queries_created{model_name="a"} 1.7e9
# TYPE m3eagle:prefix_cache_hits counter
m3eagle:prefix_cache_hits_total{model_name="a"} 640.0
# TYPE m3eagle:spec_decode_num_drafts counter
m3eagle:spec_decode_num_drafts_total{model_name="a"} 3.0
"""
    after = prefix_counters(page)
    assert after == {"queries": 1000.0, "hits": 640.0}
    assert prefix_counters("# TYPE x counter\nx_total 3\n") is None
    assert prefix_counters('{"detail": "Not Found"}') is None
    got = prefix_cache({"queries": 200.0, "hits": 40.0}, after)
    assert got == {"queried_tokens": 800, "hit_tokens": 600, "hit_rate": 0.75}
    assert prefix_cache(after, after)["hit_rate"] is None  # nothing looked up in the window
    assert prefix_cache(None, after) is None


def test_serve_server_ttft_from_the_histogram_delta():
    """The server's TTFT histogram over the measured window: the delta of two scrapes, its buckets, and quantiles
    interpolated as Prometheus' histogram_quantile does (checked against hand-computed values)."""
    from m3eagle.bench.serve import histogram_quantile, server_ttft, ttft_buckets

    def page(counts: list[int]) -> str:
        bounds = ["0.005", "0.01", "0.04", "+Inf"]
        lines = ["# TYPE m3eagle:time_to_first_token_seconds histogram"]
        lines += [f'm3eagle:time_to_first_token_seconds_bucket{{le="{b}",model_name="a"}} {c}.0'
                  for b, c in zip(bounds, counts)]
        lines += [f"m3eagle:time_to_first_token_seconds_count{{model_name=\"a\"}} {counts[-1]}.0",
                  "m3eagle:time_to_first_token_seconds_sum{model_name=\"a\"} 1.0"]
        return "\n".join(lines) + "\n"

    before, after = ttft_buckets(page([2, 2, 2, 2])), ttft_buckets(page([2, 12, 100, 102]))
    assert after == {0.005: 2.0, 0.01: 12.0, 0.04: 100.0, float("inf"): 102.0}
    got = server_ttft(before, after)  # the window: 10 in (5, 10] ms, 88 in (10, 40] ms, 2 beyond 40 ms
    assert got["count"] == 100 and got["buckets_ms"] == {"10": 10, "40": 88, "inf": 2}
    assert got["p50"] == pytest.approx(10 + 30 * (50 - 10) / 88)  # inside the (10, 40] bucket
    assert got["p90"] == pytest.approx(10 + 30 * (90 - 10) / 88)
    assert got["p99"] == pytest.approx(40.0)  # in the +inf bucket: the largest finite bound
    assert histogram_quantile(0.5, [(1.0, 4.0), (float("inf"), 4.0)]) == pytest.approx(0.5)  # first bucket from 0
    assert server_ttft(after, after) is None  # nothing in the window
    assert ttft_buckets("# TYPE x counter\nx_total 3\n") is None and ttft_buckets('{"detail": 1}') is None


@pytest.mark.parametrize("first", [{"reasoning_content": "let me see"},
                                   {"tool_calls": [{"index": 0, "id": "c0", "type": "function",
                                                    "function": {"name": "f", "arguments": ""}}]}])
def test_bench_serve_ttft_counts_reasoning_and_tool_calls(tmp_path, first):
    """A chat reply that starts with reasoning or a tool call has produced its first token when that delta
    arrives, not when content first does (vLLM's benchmark counts reasoning the same way): the first of 3 events,
    0.4 s apart, sets TTFT, and only content is kept as the reply's text."""
    with FakeServer(gap=0.4, events=3, per_event=1, first_delta=first) as srv:
        doc, _ = _bench_serve(srv.url, tmp_path, "--num-prompts", "2", "--warmup", "0",
                              "--endpoint", "/v1/chat/completions")
    r = doc["results"]
    assert r["completed"] == 2 and r["failed"] == 0
    assert 0.4 * 0.9 * 1e3 <= r["ttft_ms"]["p99"] < 0.75 * 1e3  # the first event (0.4 s), not the second (0.8 s)


def test_bench_serve_over_client_processes(tmp_path):
    """--client-processes 2: the measured requests go out from two spawned processes that start together, the
    concurrency is split between them (2 + 2 in flight, never more than 4), and their results come back merged in
    send order with both processes' CPU accounted for."""
    with FakeServer(gap=0.05, events=2, per_event=1) as srv:
        doc, err = _bench_serve(srv.url, tmp_path, "--num-prompts", "8", "--max-concurrency", "4", "--warmup", "1",
                                "--client-processes", "2")
    r, cl, reqs = doc["results"], doc["client"], doc["requests"]
    assert r["completed"] == 8 and r["failed"] == 0 and r["output_tokens"] == 8 * 2
    assert len(srv.bodies) == 1 + 8 and 2 < srv.max_in_flight <= 4  # both processes' 2 streams overlapped
    assert cl["processes"] == 2 and cl["cpu_s"] > 0 and "over 2 process(es)" in err
    assert [q["sent_ms"] for q in reqs] == sorted(q["sent_ms"] for q in reqs) and min(q["sent_ms"] for q in reqs) >= 0
    assert all(q["ok"] and q["ttft_ms"] >= 0.05 * 1e3 * 0.9 for q in reqs)
    # the first requests of both processes went out together (one agreed start), within the first streams' 0.1 s
    assert sorted(q["sent_ms"] for q in reqs)[3] < 2 * 0.05 * 1e3
    assert r["duration_s"] >= 2 * 2 * 0.05 * 0.9  # 8 requests, 4 at a time, each 2 events 0.05 s apart


def _bench_two_client_processes() -> tuple[int, str]:
    """bench-serve with two client processes against a fake server: (exit code, stderr)."""
    with FakeServer(gap=0.01, events=1, per_event=1) as srv:
        rc, _, err = _run(["bench-serve", "--base-url", srv.url, "--dataset", "random", "--input-len", "16",
                           "--output-len", "2", "--num-prompts", "4", "--max-concurrency", "4", "--warmup", "0",
                           "--client-processes", "2"])
    return rc, err


def test_bench_serve_client_process_failure_is_reported(tmp_path, monkeypatch):
    """A client process that fails (here: one of its request bodies cannot be sent as JSON) ends the run with one
    error naming the failure, not a hang: the other process still starts and finishes, the parent reports it."""
    from m3eagle.bench import serve

    real = serve.run_in_processes

    def broken(job, bodies, lens, firsts, procs, *rest):
        bodies = list(bodies)
        bodies[firsts[1]] = {"model": "m", "prompt": {1, 2}}  # the second process's first request: a set
        return real(job, bodies, lens, firsts, procs, *rest)

    monkeypatch.setattr(serve, "run_in_processes", broken)
    rc, err = _bench_two_client_processes()
    assert rc != 0 and "a bench-serve client process failed: TypeError" in err


def _exit_at_once(*args) -> None:
    """A client process that dies before reporting anything (module level: the spawned child imports it)."""
    os._exit(3)


def test_bench_serve_client_process_death_is_reported(monkeypatch):
    """A client process that dies without a word (a failed start, a signal) fails the run by name and exit code;
    the parent does not wait for it for ever."""
    from m3eagle.bench import serve

    monkeypatch.setattr(serve, "_client_process", _exit_at_once)
    rc, err = _bench_two_client_processes()
    assert rc != 0 and "exited with code 3 before reporting" in err
