"""CPU tests of the training pipeline: the pieces, and corpus -> tokenizer -> target -> head -> eval end to
end on a minute-sized corpus with a tiny model."""

from __future__ import annotations

import json
import re
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from m3eagle.training import arithmetic, corpus, tokenizer
from m3eagle.training.common import sample_batch
from m3eagle.training.draft import DraftTrainConfig, aux_layer_ids, shift_left, train_draft
from m3eagle.training.evaluate import (
    AcceptanceStats,
    EvalConfig,
    accuracy,
    equal_fraction,
    run_eval,
    stdlib_code_prompts,
)
from m3eagle.training.target import (
    ForwardStats,
    TargetTrainConfig,
    init_weights,
    model_config,
    train_forward,
    train_target,
)

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------------
# Arithmetic
# ------------------------------------------------------------------------------------------------


def test_arithmetic_is_seeded_and_its_solutions_are_correct():
    a = list(arithmetic.generate(300, seed=5))
    assert a == list(arithmetic.generate(300, seed=5))
    assert a != list(arithmetic.generate(300, seed=6))
    for p in a:
        # Every stated equation holds, and the last line is the answer.
        for x, op, y, z in re.findall(r"(\d+) ([-+*/]) (\d+) = (\d+)", p.solution):
            assert eval(f"{x} {op} {y}") == int(z)
        assert arithmetic.parse_answer(p.solution) == p.answer >= 0
        assert p.text.startswith(p.prompt)


def test_heldout_arithmetic_never_repeats_a_training_question():
    train = {p.question for p in arithmetic.generate(2000, seed=0)}
    held = arithmetic.heldout_problems(200, seed=99, train_seed=0, train_n=2000)
    assert len(held) == 200 and not train & {p.question for p in held}


def test_accuracy_and_equality_scoring():
    probs = list(arithmetic.generate(3, seed=1))
    texts = [f" ... #### {probs[0].answer}", "no answer", f"#### {probs[2].answer + 1}"]
    assert accuracy(probs, texts) == pytest.approx(1 / 3)
    assert equal_fraction([[1, 2], [3]], [[1, 2], [4]]) == 0.5


def test_acceptance_stats_match_the_engine_definitions():
    s = AcceptanceStats(k=3)
    for a in (3, 0, 1, 2):
        s.add(a)
    d = s.as_dict()
    assert d["mean_acceptance_length"] == 1 + 6 / 4
    assert d["acceptance_rate"] == 6 / 12
    assert d["per_position_rates"] == [0.75, 0.5, 0.25]  # P(accepted > j), per verify step


# ------------------------------------------------------------------------------------------------
# Corpus
# ------------------------------------------------------------------------------------------------


def test_vendored_stdlib_paths_are_excluded():
    assert corpus.is_vendored_stdlib(("setuptools", "_distutils", "core.py"))
    assert corpus.is_vendored_stdlib(("tomli", "_parser.py"))
    assert corpus.is_vendored_stdlib(("pip", "_vendor", "tomli", "_parser.py"))
    assert corpus.is_vendored_stdlib(("typing_extensions.py",))
    assert not corpus.is_vendored_stdlib(("pydantic", "dataclasses.py"))
    assert not corpus.is_vendored_stdlib(("numpy", "core", "numeric.py"))


def _fake_site(tmp: Path) -> Path:
    """A site-packages with a few real pure-Python packages (pytest's own dependencies, always
    installed where the tests run), a stdlib copy, a vendored backport and a duplicate."""
    site = tmp / "site"
    for mod in ("packaging", "pluggy", "iniconfig"):
        src = Path(__import__(mod).__file__).parent
        shutil.copytree(src, site / mod, ignore=shutil.ignore_patterns("__pycache__"))
    stdlib_file = corpus.stdlib_dir() / "textwrap.py"
    shutil.copy(stdlib_file, site / "textwrap_copy.py")
    (site / "tomli").mkdir()
    (site / "tomli" / "__init__.py").write_text("x = 1\n")
    shutil.copy(site / "packaging" / "version.py", site / "dup_version.py")
    return site


def test_corpus_excludes_the_stdlib_and_duplicates(tmp_path, monkeypatch):
    site = _fake_site(tmp_path)
    monkeypatch.setattr(corpus, "site_packages_dirs", lambda: [site])
    meta = corpus.build(tmp_path / "c", corpus.CorpusConfig(max_code_bytes=10**9, arith_problems=10))
    docs = list(corpus.read_jsonl(tmp_path / "c" / "code.jsonl"))
    paths = {d["path"] for d in docs}
    assert "textwrap_copy.py" not in paths  # byte-identical to a stdlib file
    assert not any(p.startswith("tomli") for p in paths)  # a stdlib backport
    assert len({d["text"] for d in docs}) == len(docs)  # deduplicated
    assert ("dup_version.py" in paths) != ("packaging/version.py" in paths)
    assert meta["code_files"] == len(docs) > 10
    assert len(list(corpus.read_jsonl(tmp_path / "c" / "arithmetic.jsonl"))) == 10


def test_stdlib_code_prompts_are_seeded_stdlib_function_cuts():
    tok = tokenizer.load_tokenizer(Path(__file__).resolve().parents[2] / "m3eagle/assets/default/target")
    a = stdlib_code_prompts(tok, 5, seed=3)
    assert a == stdlib_code_prompts(tok, 5, seed=3)
    for p in a:
        assert (corpus.stdlib_dir() / p.file).is_file() and not p.file.startswith("test")
        assert 48 <= len(p.ids) <= 192


# ------------------------------------------------------------------------------------------------
# Training forward
# ------------------------------------------------------------------------------------------------


def test_train_forward_equals_forward_seq_with_sparse_attention():
    from m3eagle.models.minimax_m3 import MiniMaxM3

    cfg = model_config("tiny", 300)
    m = MiniMaxM3(cfg)
    init_weights(m, 0)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() < 2:
                p.normal_(0, 0.2)  # exercise the Gemma (1 + w) scales
    ids = torch.randint(0, 300, (2, 150))  # > index_topk_blocks * index_block_size: sparse is active
    with torch.no_grad():
        ref, _ = m.forward_seq(ids)
        out = train_forward(m, ids, sparse=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_indexer_loss_trains_only_the_indexer():
    from m3eagle.models.minimax_m3 import MiniMaxM3

    m = MiniMaxM3(model_config("tiny", 300))
    init_weights(m, 0)
    stats = ForwardStats([], [])
    train_forward(m, torch.randint(0, 300, (2, 80)), stats=stats)
    assert len(stats.index_kl) == 3 and all(k.item() >= 0 for k in stats.index_kl)
    torch.stack(stats.index_kl).sum().backward()
    for name, p in m.named_parameters():
        has_grad = p.grad is not None and p.grad.abs().sum() > 0
        assert has_grad == (".indexer." in name), name


def test_batches_are_a_pure_function_of_seed_and_step():
    toks = np.arange(10_000, dtype=np.uint16)
    a = sample_batch(toks, 4, 16, 0, 7, torch.device("cpu"))
    assert torch.equal(a, sample_batch(toks, 4, 16, 0, 7, torch.device("cpu")))
    assert not torch.equal(a, sample_batch(toks, 4, 16, 0, 8, torch.device("cpu")))
    assert torch.equal(a[:, 1:], a[:, :1] + torch.arange(1, 17))  # contiguous windows


def test_shift_and_aux_ids():
    x = torch.arange(6).view(1, 6)
    assert shift_left(x, 2).tolist() == [[2, 3, 4, 5, 0, 0]]
    assert aux_layer_ids(6) == (1, 3, 5) and aux_layer_ids(12) == (2, 6, 9)


# ------------------------------------------------------------------------------------------------
# End to end
# ------------------------------------------------------------------------------------------------

TINY_TARGET = TargetTrainConfig(preset="tiny", steps=40, batch_size=8, seq_len=128, lr=3e-3, warmup=5,
                                log_every=5, eval_every=20, save_every=20, eval_batches=2)
TINY_DRAFT = DraftTrainConfig(steps=30, batch_size=8, seq_len=128, lr=3e-3, warmup=5, ttt_steps=3,
                              draft_vocab_size=256, intermediate_size=96, log_every=5, eval_every=15,
                              save_every=15, eval_batches=2)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """corpus -> tokenizer -> target -> head on a ~1 MB corpus; returns the run directory."""
    tmp = tmp_path_factory.mktemp("pipeline")
    site = _fake_site(tmp)
    orig = corpus.site_packages_dirs
    corpus.site_packages_dirs = lambda: [site]
    try:
        corpus.build(tmp / "corpus", corpus.CorpusConfig(max_code_bytes=600_000, arith_problems=1500))
    finally:
        corpus.site_packages_dirs = orig
    tokenizer.build(tmp / "corpus", tmp / "tok", tokenizer.TokenizerConfig(vocab_size=512, val_fraction=0.05))
    torch.manual_seed(0)
    target = train_target(tmp / "tok", tmp / "target", TINY_TARGET)
    draft = train_draft(tmp / "tok", target, tmp / "draft", TINY_DRAFT)
    return tmp, target, draft


def _log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_pipeline_losses_decrease(pipeline):
    tmp, _, _ = pipeline
    t = _log(tmp / "target" / "log.jsonl")
    assert t[-1]["loss"] < t[0]["loss"] - 1.0
    vals = [r["val_loss"] for r in t if "val_loss" in r]
    assert vals[-1] < vals[0]
    d = _log(tmp / "draft" / "log.jsonl")
    assert d[-1]["loss"] < d[0]["loss"]


def test_pipeline_artefacts_load_in_m3eagle_and_transformers(pipeline):
    from transformers import MiniMaxM3VLForCausalLM

    from m3eagle.loader.checkpoint import load_target
    from m3eagle.loader.eagle3 import load_eagle3

    _, target, draft = pipeline
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in target.iterdir()}
    m = load_target(target)
    head = load_eagle3(draft, m.cfg)
    assert not head.cfg.has_embed and head.cfg.draft_vocab_size == 256
    assert head.t2d.sum() == 256 and head.t2d[0]  # EOS is always draftable
    hf = MiniMaxM3VLForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    ids = torch.randint(0, m.cfg.vocab_size, (1, 100))
    with torch.no_grad():
        ours = m.compute_logits(m.forward_seq(ids)[0])
        theirs = hf(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_pipeline_resumes_where_it_stopped(pipeline, tmp_path, monkeypatch):
    """An interrupted run, restarted, ends with the weights of the uninterrupted one."""
    from m3eagle.training import target as target_mod

    tmp, final, _ = pipeline
    cfg = replace(TINY_TARGET, steps=12, save_every=6, eval_every=100)
    whole = train_target(tmp / "tok", tmp_path / "whole", cfg)
    real = target_mod.sample_batch

    def crash_at_8(tokens, batch, seq, seed, step, device):
        if step == 8 and seed == cfg.seed:
            raise KeyboardInterrupt
        return real(tokens, batch, seq, seed, step, device)

    monkeypatch.setattr(target_mod, "sample_batch", crash_at_8)
    with pytest.raises(KeyboardInterrupt):
        train_target(tmp / "tok", tmp_path / "cut", cfg)
    monkeypatch.setattr(target_mod, "sample_batch", real)
    resumed = train_target(tmp / "tok", tmp_path / "cut", cfg)
    from safetensors.torch import load_file

    a, b = load_file(str(whole / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_draft_continues_from_a_checkpoint_with_self_distillation(pipeline, tmp_path):
    from m3eagle.loader.checkpoint import load_target
    from m3eagle.loader.eagle3 import load_eagle3

    tmp, target, draft = pipeline
    cfg = replace(TINY_DRAFT, steps=3, init_from=str(draft), self_distill_rows=8, self_distill_batch=4,
                  self_distill_prompt=16, self_distill_gen=8, eval_every=100)
    out = train_draft(tmp / "tok", target, tmp_path / "cont", cfg)
    pool = np.load(tmp_path / "cont" / "self_distill.npy")
    assert pool.shape == (8, 24)
    tcfg = load_target(target).cfg
    a, b = load_eagle3(draft, tcfg), load_eagle3(out, tcfg)
    assert torch.equal(a.d2t, b.d2t)  # the vocabulary mapping is kept
    assert not torch.equal(a.fc.weight, b.fc.weight)  # and training moved the weights


def test_pipeline_eval_is_lossless(pipeline):
    _, target, draft = pipeline
    cfg = EvalConfig(code_prompts=3, code_max_tokens=12, arith_problems=3, arith_max_tokens=16,
                     ppl_tokens=600, ppl_seq_len=128, ks=(1, 3), spec_k_arith=3, device="cpu")
    r = run_eval(target, draft, cfg)
    assert r["code"]["lossless"] == {"K=1": 1.0, "K=3": 1.0}
    assert r["arithmetic"]["lossless"] == 1.0 and r["arithmetic"]["accuracy_equal"]
    assert r["perplexity_stdlib"]["perplexity"] > 1.0
    acc = r["code"]["acceptance"]["K=3"]
    rates = acc["per_position_rates"]
    assert len(rates) == 3
    # Chain verification: a draft is accepted only after every earlier one was, so per-position rates
    # never rise; and with every verify step drafting K, MAL = 1 + the sum of the per-position rates.
    assert rates[0] >= rates[1] >= rates[2]
    assert acc["mean_acceptance_length"] == pytest.approx(1 + sum(rates), abs=2e-4)  # MAL is rounded to 4 places


def test_cli_registers_every_stage():
    import argparse

    from m3eagle.training.cli import add_training_subcommands

    p = argparse.ArgumentParser()
    add_training_subcommands(p.add_subparsers(dest="cmd"))
    for cmd in ("corpus", "tokenizer", "train-target", "train-draft", "eval", "train-all"):
        assert p.parse_args([cmd]).cmd == cmd
    assert p.parse_args(["average-heads", "a", "b", "--out", "c"]).heads == ["a", "b"]
    args = p.parse_args(["train-target", "--steps", "5", "--preset", "tiny"])
    assert args.steps == 5 and args.preset == "tiny"
    from m3eagle.training.cli import _override
    from m3eagle.training.draft import DraftTrainConfig

    args = p.parse_args(["train-draft", "--self-distill-rows", "64", "--self-distill-batch", "8", "--ttt-steps", "3",
                         "--step-decay", "0.9", "--draft-vocab-size", "6144"])
    cfg = _override(DraftTrainConfig(), args)  # every DraftTrainConfig knob the CLI offers reaches the config
    assert (cfg.self_distill_rows, cfg.self_distill_batch, cfg.ttt_steps, cfg.step_decay, cfg.draft_vocab_size) \
        == (64, 8, 3, 0.9, 6144)


def test_average_heads_is_the_weight_mean_and_refuses_mismatches(tmp_path):
    """`average-heads`: float tensors are the element-wise mean (computed in fp32), integer tensors (the
    draft vocabulary maps) are kept and must agree; another config, tensor set or vocabulary is refused."""
    from safetensors.torch import load_file, save_file

    from m3eagle.training.cli import average_heads

    cfg = {"draft_vocab_size": 4, "hidden_size": 2}
    gen = torch.Generator().manual_seed(0)
    w = [torch.randn(3, 2, generator=gen).to(torch.bfloat16) for _ in range(3)]
    d2t = torch.tensor([0, 1, 5, 2])
    dirs = []
    for i, wi in enumerate(w):
        d = tmp_path / f"h{i}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        save_file({"fc.weight": wi, "d2t": d2t}, str(d / "model.safetensors"))
        dirs.append(d)
    out = average_heads(dirs, tmp_path / "soup")
    got = load_file(str(out / "model.safetensors"))
    want = ((w[0].float() + w[1].float() + w[2].float()) / 3).to(torch.bfloat16)
    assert torch.equal(got["fc.weight"], want) and torch.equal(got["d2t"], d2t)
    assert json.loads((out / "config.json").read_text()) == cfg

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(cfg))
    save_file({"fc.weight": w[0], "d2t": d2t.flip(0)}, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="integer tensor 'd2t' differs"):
        average_heads([dirs[0], bad], tmp_path / "x")
    save_file({"fc.weight": w[0]}, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="'d2t' is missing"):
        average_heads([dirs[0], bad], tmp_path / "x")
    (bad / "config.json").write_text(json.dumps({**cfg, "hidden_size": 3}))
    with pytest.raises(ValueError, match="config.json differs"):
        average_heads([dirs[0], bad], tmp_path / "x")
    with pytest.raises(ValueError, match="at least two"):
        average_heads([dirs[0]], tmp_path / "x")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-x", *sys.argv[1:]]))
