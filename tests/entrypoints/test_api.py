"""The user-facing API shaped like vLLM's: RequestOutput / CompletionOutput / metrics (stop_reason,
cumulative_logprob), LLM.chat with the model's chat template, the m3eagle logger's level (env var and
--log-level), and the CLI's warning for --max-tokens beyond max_model_len. CPU, embedded model."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import subprocess
import sys

import pytest

from m3eagle import LLM, CompletionOutput, RequestMetrics, RequestOutput, SamplingParams
from m3eagle.entrypoints.chat import ChatTemplate
from m3eagle.entrypoints.cli import build_parser, main
from m3eagle.entrypoints.logging_setup import ENV_LEVEL, init_logging
from m3eagle.loader.assets import default_model_paths
from tests.helpers.engine_utils import m3eagle_records

PROMPTS = ["def add(a, b):", "import os\n", "class Foo:"]


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", num_draft_tokens=3, max_model_len=128)


@pytest.fixture(scope="module")
def ref(llm):
    return llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)


@pytest.fixture
def records():
    with m3eagle_records() as got:
        yield got


# ---- output structure ---------------------------------------------------------------------------------


def test_output_structure(llm, ref):
    for p, o in zip(PROMPTS, ref):
        assert isinstance(o, RequestOutput) and isinstance(o.metrics, RequestMetrics)
        assert isinstance(o.request_id, str) and o.prompt == p and o.prompt_token_ids == llm.encode(p)
        assert o.prompt_logprobs is None and o.finished is True
        assert len(o.outputs) == 1
        c = o.outputs[0]
        assert isinstance(c, CompletionOutput) and c.index == 0
        assert len(c.token_ids) == 16 and all(isinstance(t, int) for t in c.token_ids)
        assert isinstance(c.text, str) and c.text
        assert c.finish_reason == "length" and c.stop_reason is None and c.error is None
        assert c.logprobs is None and c.cumulative_logprob is None  # not requested
        m = o.metrics
        assert m.num_verify_steps > 0 and 0 <= m.num_accepted <= m.num_drafted
        assert len(m.drafted_per_position) == len(m.accepted_per_position) == 3
        assert sum(m.drafted_per_position) == m.num_drafted and sum(m.accepted_per_position) == m.num_accepted
    assert not hasattr(ref[0], "token_ids") and not hasattr(ref[0], "num_drafted")  # no flat duplicates


def test_cumulative_logprob_is_the_sum(llm, ref):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    for o, r in zip(outs, ref):
        c = o.outputs[0]
        assert c.token_ids == r.outputs[0].token_ids
        lps = [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)]
        assert len(lps) == len(c.token_ids) and all(lp <= 0 for lp in lps)
        assert math.isclose(c.cumulative_logprob, sum(lps), rel_tol=1e-9, abs_tol=1e-9)


def test_stop_reason_stop_string_and_stop_token(llm, ref):
    full = ref[0].outputs[0]
    stop_str = full.text[4:7]
    cut = full.text.find(stop_str)
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    outs = llm.generate([PROMPTS[0]] * 2,
                        [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop_str, "@@never@@"]),
                         SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop_id])],
                        use_tqdm=False)
    by_str, by_id = outs[0].outputs[0], outs[1].outputs[0]
    assert by_str.finish_reason == "stop" and by_str.stop_reason == stop_str and by_str.text == full.text[:cut]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == stop_id
    assert by_id.token_ids == full.token_ids[: first + 1]


def test_spec_stats_read_the_metrics(llm, ref):
    llm.reset_stats()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    st = llm.stats()
    assert st["num_requests"] == 3 and st["num_generated_tokens"] == sum(len(o.outputs[0].token_ids) for o in outs)
    assert st["num_drafted"] == sum(o.metrics.num_drafted for o in outs) > 0
    assert st["num_accepted"] == sum(o.metrics.num_accepted for o in outs)


# ---- chat ---------------------------------------------------------------------------------------------


def test_chat_renders_the_models_template(llm):
    conv = [{"role": "user", "content": "What is 2 + 3?"}]
    text = ChatTemplate.from_model_dir(llm.model_path).render(conv, True)
    assert text.startswith("Question: What is 2 + 3?")
    sp = SamplingParams(temperature=0, max_tokens=8)
    got = llm.chat(conv, sp, use_tqdm=False)
    want = llm.generate(text, sp, use_tqdm=False)
    assert len(got) == 1 and got[0].prompt == text
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    two = llm.chat([conv, [{"role": "user", "content": "Name a color."}]], sp, use_tqdm=False)
    assert len(two) == 2 and two[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert two[1].prompt.startswith("Question: Name a color.")


def test_chat_without_template_names_the_file(tmp_path):
    target, _ = default_model_paths()
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        shutil.copy(target / f, tmp_path / f)
    conf = json.loads((target / "tokenizer_config.json").read_text())
    del conf["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(conf))
    llm = LLM(model=tmp_path, device="cpu", num_draft_tokens=0, max_model_len=64)
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        llm.chat([{"role": "user", "content": "hi"}])


# ---- logging ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_log_level_from_env():
    code = ("import logging, m3eagle; from m3eagle.entrypoints.logging_setup import init_logging; init_logging(); "
            "lg = logging.getLogger('m3eagle'); print(lg.level, len(lg.handlers))")
    for env, want in (("DEBUG", logging.DEBUG), ("warning", logging.WARNING), (None, logging.INFO)):
        e = {k: v for k, v in os.environ.items() if k != ENV_LEVEL}
        if env is not None:
            e[ENV_LEVEL] = env
        out = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, check=True)
        assert out.stdout.split() == [str(want), "1"], out  # one handler however often init_logging runs


def test_log_level_flag():
    logger = logging.getLogger("m3eagle")
    before = logger.level
    assert build_parser().parse_args(["--log-level", "debug", "generate", "x"]).log_level == "DEBUG"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--log-level", "loud", "generate", "x"])
    try:  # the level is set before the command runs (this one fails fast on its --json path)
        assert main(["--log-level", "error", "bench", "--geometry", "tiny", "--json", "/no/such/dir/b.json"]) == 2
        assert logger.level == logging.ERROR
    finally:
        logger.setLevel(before)
    n = len(logger.handlers)
    init_logging()
    assert len(logger.handlers) == n


def test_model_load_and_kv_pool_are_logged(records):
    LLM(device="cpu", num_draft_tokens=0, max_model_len=64)
    msgs = [r.getMessage() for r in records if r.levelno == logging.INFO]
    assert any(m.startswith("loaded target") and "parameters" in m and "float32" in m for m in msgs), msgs
    assert any(m.startswith("KV pool:") and "pages" in m and "tokens" in m and "MiB" in m for m in msgs), msgs


def test_every_cli_flag_has_help():
    def walk(parser: argparse.ArgumentParser, path: str):
        for act in parser._actions:
            if isinstance(act, argparse._SubParsersAction):
                for name, sub in act.choices.items():
                    yield from walk(sub, f"{path} {name}")
            else:
                yield path, act

    missing = [f"{path} {act.option_strings or act.dest}" for path, act in walk(build_parser(), "m3eagle")
               if not act.help]
    assert not missing, missing


def test_max_tokens_beyond_max_model_len_warns_once(records, capsys):
    rc = main(["generate", "def f(x):", "class A:", "--device", "cpu", "--num-draft-tokens", "0",
               "--max-model-len", "32", "--max-tokens", "100", "--ignore-eos", "--json"])
    assert rc == 0
    warns = [r.getMessage() for r in records if r.levelno == logging.WARNING and "--max-tokens" in r.getMessage()]
    assert len(warns) == 1 and "max_model_len=32" in warns[0]
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["finish_reason"] for x in lines[:2]] == ["length", "length"]
    assert all(x["stop_reason"] is None for x in lines[:2])


def test_warmup_runs_every_chunk_class_and_leaves_no_trace():
    """LLM(warmup=True) runs dummy prompts of each power-of-two chunk size (one row, and several rows
    splitting it) through the engine before returning -- with speculation, so verify and draft steps run
    too -- and then leaves it as a fresh engine: all pages free, speculation counters and step count back
    to zero, and the same tokens as an LLM built without it. It refuses an engine with requests."""
    from tests.helpers.engine_utils import assert_clean

    kw = dict(device="cpu", max_num_tokens=64, max_model_len=256, max_num_seqs=4)
    warm = LLM(warmup=True, **kw)
    eng = warm.engine
    assert eng.warmup_shapes() == [(1, 16), (2, 8), (1, 32), (4, 8), (1, 64), (4, 16)]
    assert eng.num_steps == 0 and eng.counters.num_drafts == 0 and eng.counters.num_accepted_tokens == 0
    assert_clean(warm)
    info = eng.warmup()  # again, by hand: it reports what it ran
    assert info["steps"] >= len(info["shapes"]) and eng.num_steps == 0
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["def add(a, b):", "import os\n"]
    cold = LLM(**kw)
    assert [o.outputs[0].token_ids for o in warm.generate(prompts, sp)] == \
        [o.outputs[0].token_ids for o in cold.generate(prompts, sp)]
    assert eng.counters.num_drafts > 0  # counting resumed with real requests
    eng.add_request([5, 6, 7], sp)
    with pytest.raises(RuntimeError, match="idle engine"):
        eng.warmup()
    while eng.has_work():
        eng.step()
    assert_clean(warm)
