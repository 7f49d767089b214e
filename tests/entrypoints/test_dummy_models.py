"""--load-format dummy on generate / serve (vLLM's): a named geometry or a config directory with random weights,
text in and out through --tokenizer (or the embedded tokenizer where the geometry's vocabulary covers it)."""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from m3eagle.bench import geometries
from m3eagle.entrypoints.cli import _model_of, main
from m3eagle.entrypoints.llm import LLM
from m3eagle.loader.assets import ASSETS
from m3eagle.sampling.params import SamplingParams


def _one_line_error(capsys, argv: list[str]) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.strip()][-1]


def test_a_named_geometry_gets_its_random_head_and_the_embedded_tokenizer():
    # m3-mini's 32000-id vocabulary covers the embedded tokenizer's 8192: text goes in and comes out through it,
    # and the geometry takes the tokenizer's vocabulary, so every sampled id decodes to text
    a = argparse.Namespace(load_format="dummy", model="m3-mini", draft=None, tokenizer=None)
    t, h = geometries.m3_mini()
    model, head, tok = _model_of(a)
    assert tok == str(ASSETS / "target")
    assert model == replace(t, vocab_size=8192)
    assert head == replace(h, vocab_size=8192, draft_vocab_size=8192)
    a.tokenizer = "/somewhere"
    assert _model_of(a) == (t, h, "/somewhere")  # another tokenizer: the geometry as it is
    # without --load-format dummy a name is a directory or a Hub id, as before
    a = argparse.Namespace(load_format="auto", model="m3-mini", draft=None, tokenizer=None)
    assert _model_of(a) == ("m3-mini", None, None)


def test_a_geometry_whose_vocabulary_the_tokenizer_overflows_takes_token_ids_only(capsys):
    # tiny has 512 ids: the embedded tokenizer would emit ids past them, so no tokenizer is attached and text is
    # refused with the fix
    err = _one_line_error(capsys, ["generate", "--load-format", "dummy", "--model", "tiny", "--device", "cpu",
                                   "def f(x):", "--max-tokens", "2"])
    assert "token-id lists" in err and "--tokenizer" in err


def test_draft_with_a_named_geometry_is_refused(capsys):
    err = _one_line_error(capsys, ["generate", "--load-format", "dummy", "--model", "tiny", "--draft", "x",
                                   "--device", "cpu", "hi"])
    assert "--draft" in err and "tiny" in err


def test_a_config_directory_with_dummy_weights_reads_no_safetensors(tmp_path: Path):
    # vLLM's dummy format: only config.json is read, so a directory without weights serves random ones
    cfg = json.loads((ASSETS / "target" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(model=str(tmp_path), load_format="dummy", num_draft_tokens=0, device="cpu",
              tokenizer=str(ASSETS / "target"), max_model_len=64, num_pages=16)
    out = llm.generate("def f(x):", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert llm.get_tokenizer().encode("def f(x):") == out[0].prompt_token_ids  # text went through tokenizer=
    assert llm.tokenizer_path == ASSETS / "target"


def test_tokenizer_overrides_the_model_directory_and_carries_the_chat_template(tmp_path: Path):
    # a model directory with its own weights but no tokenizer: tokenizer= supplies text and the chat template
    model = tmp_path / "model"
    shutil.copytree(ASSETS / "target", model)
    (model / "tokenizer.json").unlink()
    (model / "tokenizer_config.json").unlink()
    with pytest.raises(ValueError, match="tokenizer="):
        LLM(model=str(model), num_draft_tokens=0, device="cpu", tokenizer=str(tmp_path / "nowhere"))
    bare = LLM(model=str(model), num_draft_tokens=0, device="cpu", max_model_len=64, num_pages=16)
    with pytest.raises(ValueError, match="tokenizer.json"):
        bare.generate("def f", use_tqdm=False)
    llm = LLM(model=str(model), num_draft_tokens=0, device="cpu", tokenizer=str(ASSETS / "target"),
              max_model_len=64, num_pages=16)
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    plain = LLM(model=str(ASSETS / "target"), num_draft_tokens=0, device="cpu", max_model_len=64, num_pages=16)
    assert llm.generate("def f(x):", sp, use_tqdm=False)[0].outputs[0].token_ids == \
        plain.generate("def f(x):", sp, use_tqdm=False)[0].outputs[0].token_ids
    chat = llm.chat([{"role": "user", "content": "hi"}], sp, use_tqdm=False)
    assert len(chat[0].outputs[0].token_ids) == 4


def test_named_geometries_resolve_to_their_configs():
    t, h = geometries.m3_mini()
    geo = geometries.resolve("m3-mini")
    assert geo.model == t and geo.draft == h and geo.load_format == "dummy"
