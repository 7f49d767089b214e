"""The embedded default model (m3eagle/assets/default): it is there, small, loadable by m3eagle and by
transformers, shaped as specified, used by `LLM()` with speculation on, lossless, and its head still
drafts well on held-out stdlib code (an acceptance floor)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ASSETS = Path(__file__).resolve().parents[2] / "m3eagle" / "assets" / "default"
TARGET, DRAFT = ASSETS / "target", ASSETS / "draft"


pytestmark = pytest.mark.usefixtures("one_thread")


def test_artefacts_are_present_and_small():
    files = {p.relative_to(ASSETS).as_posix(): p.stat().st_size for p in ASSETS.rglob("*") if p.is_file()}
    for f in ("target/config.json", "target/model.safetensors", "target/tokenizer.json",
              "draft/config.json", "draft/model.safetensors"):
        assert f in files, f
    assert sum(files.values()) <= 25_000_000


def test_target_is_a_tiny_minimax_m3_with_active_sparsity():
    from m3eagle.loader.checkpoint import load_target

    m = load_target(TARGET)
    c = m.cfg
    assert not c.is_sparse(0) and not c.is_moe(0)  # dense, full attention first
    assert all(c.is_sparse(i) and c.is_moe(i) for i in range(1, c.num_hidden_layers))
    assert c.index_block_size * c.index_topk_blocks <= 64  # sparse beyond ~64 tokens of context
    assert sum(p.numel() for p in m.parameters()) <= 12_000_000
    assert 4096 <= c.vocab_size <= 8192
    # The router is stored fp32 (the public M3 layout); everything else bf16.
    from safetensors import safe_open

    with safe_open(str(TARGET / "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert all(v == "F32" for k, v in dtypes.items() if k.endswith("mlp.gate.weight"))
    assert {v for k, v in dtypes.items() if "mlp.gate." not in k} == {"BF16"}


def test_target_matches_transformers():
    from transformers import MiniMaxM3VLForCausalLM

    from m3eagle.loader.checkpoint import load_target

    m = load_target(TARGET)
    hf = MiniMaxM3VLForCausalLM.from_pretrained(str(TARGET), dtype=torch.float32).eval()
    ids = torch.randint(0, m.cfg.vocab_size, (1, 160), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = m.compute_logits(m.forward_seq(ids)[0])
        theirs = hf(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_tokenizer_loads_in_transformers_and_round_trips():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TARGET))
    text = "def add(a, b):\n    return a + 12\n"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.eos_token_id == 0


def test_head_loads_against_the_target():
    from m3eagle.loader.checkpoint import load_target
    from m3eagle.loader.eagle3 import load_eagle3

    m = load_target(TARGET)
    head = load_eagle3(DRAFT, m.cfg)
    assert not head.cfg.has_embed  # shares the target's table
    assert head.cfg.draft_vocab_size < m.cfg.vocab_size and int(head.t2d.sum()) == head.cfg.draft_vocab_size
    assert len(set(head.cfg.aux_layer_ids)) == 3


def _prompts(n: int):
    from m3eagle.training.evaluate import stdlib_code_prompts
    from m3eagle.training.tokenizer import load_tokenizer

    return [p.ids for p in stdlib_code_prompts(load_tokenizer(TARGET), n, seed=1234)]


def test_default_llm_speculates_losslessly_above_an_acceptance_floor():
    from m3eagle import LLM, SamplingParams

    prompts = _prompts(16)
    sp = SamplingParams(temperature=0.0, max_tokens=48)
    llm = LLM(device="cpu")  # no model: the embedded target and head, speculation on
    assert llm.draft is not None and llm.config.num_draft_tokens == 3
    spec = llm.generate(prompts, sp)
    base = LLM(device="cpu", num_draft_tokens=0).generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in base]
    stats = llm.stats()
    # Measured 2.55 on these 16 prompts (2.69 on `m3eagle eval`'s 128, 2.70 on all 336 eligible stdlib
    # files of Python 3.11); the floor
    # leaves room for numerics elsewhere, and still fails if the head and target drift apart.
    assert stats["mean_acceptance_length"] >= 2.0, stats
    assert stats["per_position_rates"][0] >= 0.5, stats


def test_default_model_solves_some_heldout_arithmetic():
    from m3eagle import LLM, SamplingParams
    from m3eagle.training import arithmetic

    probs = arithmetic.heldout_problems(8, seed=1235, train_seed=0, train_n=40_000)
    outs = LLM(device="cpu").generate([p.prompt for p in probs], SamplingParams(temperature=0.0, max_tokens=128))
    correct = sum(arithmetic.parse_answer(o.outputs[0].text or "") == p.answer for p, o in zip(probs, outs))
    assert correct >= 4  # measured 86% on 100 held-out problems
