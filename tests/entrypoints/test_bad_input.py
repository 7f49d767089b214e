"""Inputs users can get wrong: every one raises a typed exception whose message names the option (or the
prompt) and hints at the fix -- never a bare assert, a torch error deep in a kernel, a silently ignored
setting, or a message that points at the wrong knob. A refused request leaves the engine serving."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from m3eagle import LLM, SamplingParams
from m3eagle.config import ConfigError, M3Config
from m3eagle.engine.llm_engine import RequestError
from m3eagle.loader.checkpoint import CheckpointError
from m3eagle.sampling.params import SamplingParamsError


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, device="cpu", page_size=4, max_model_len=64, max_num_tokens=64)


def assert_clean(llm: LLM) -> None:
    eng = llm.engine
    eng.check_integrity()
    assert not eng.has_work() and not eng.scheduler.waiting and not eng.scheduler.running
    assert eng.pool.num_free == eng.pool.num_usable


# ------------------------------------------------------------------------------------------------
# SamplingParams
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, option", [
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": "1"}, "temperature"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": float("nan")}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 3.0}, "max_tokens"),
    ({"seed": -1}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["ok", 3]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [1.0]}, "stop_token_ids"),
])
def test_sampling_params_reject_bad_values(kw, option):
    with pytest.raises(SamplingParamsError, match=option):
        SamplingParams(**kw)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_sampling_params_reject_non_finite_temperature(value):
    """A NaN temperature turns every probability into NaN (and inf makes the distribution uniform); both
    must be refused where the request is made, naming the option."""
    with pytest.raises(SamplingParamsError, match="temperature"):
        SamplingParams(temperature=value)


def test_sampling_params_normalise():
    p = SamplingParams(top_k=-1, stop="x")
    assert p.top_k == 0 and p.stop == ["x"]
    assert SamplingParams(temperature=0).greedy


# ------------------------------------------------------------------------------------------------
# LLM options
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, option", [
    ({"page_size": 0}, "page_size"),
    ({"num_draft_tokens": 3}, "draft"),
    ({"num_draft_tokens": -1}, "num_draft_tokens"),
    ({"num_draft_tokens": 9, "draft": "HEAD"}, "num_draft_tokens"),
    ({"num_draft_tokens": 2.0, "draft": "HEAD"}, "num_draft_tokens"),
    ({"max_num_tokens": 3, "num_draft_tokens": 3, "draft": "HEAD"}, "max_num_tokens"),
    ({"dtype": "int8"}, "dtype"),
    ({"attention_backend": "nope"}, "attention_backend"),
    ({"max_model_len": 10**6}, "max_model_len"),
    ({"num_pages": 1}, "num_pages"),
    ({"num_pages": 5}, "num_pages"),
    ({"num_scheduler_steps": 0}, "num_scheduler_steps"),
    ({"num_scheduler_steps": 2.0}, "num_scheduler_steps"),
    ({"num_scheduler_steps": "eight"}, "num_scheduler_steps"),
    ({"num_scheduler_steps": True}, "num_scheduler_steps"),
])
def test_llm_rejects_bad_options(model_dir, head_dir, kw, option):
    kw = {k: (head_dir if v == "HEAD" else v) for k, v in kw.items()}
    with pytest.raises(ValueError, match=option):
        LLM(model_dir, device="cpu", **kw)


@pytest.mark.parametrize("kw, option", [
    ({"max_num_tokens": 0}, "max_num_tokens"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_model_len": -3}, "max_model_len"),
])
def test_llm_rejects_non_positive_sizes_naming_the_option(model_dir, kw, option):
    """Non-positive sizes fail at construction with the option named -- not later, at generate time, as
    'raise num_pages' (max_num_tokens=0) or as a num_pages complaint (max_num_seqs=0, max_model_len<0)."""
    with pytest.raises(ValueError, match=option):
        LLM(model_dir, device="cpu", page_size=4, **kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda(model_dir):
    with pytest.raises(ValueError, match="device='cuda'"):
        LLM(model_dir, device="cuda")


def test_missing_model_directory(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        LLM(tmp_path / "nowhere", device="cpu")


# ------------------------------------------------------------------------------------------------
# requests
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt, params, match", [
    ([], None, "empty"),
    ([3, 96], None, r"\[96\].*vocabulary"),
    ([3, -1], None, "vocabulary"),
    ([3, 4.0], None, "must be ints.*float"),
    ([5] * 64, None, "max_model_len"),
    ([3, 4], SamplingParams(stop_token_ids=[500]), "stop_token_ids"),
    ([3, 4], "greedy", "SamplingParams"),
])
def test_bad_requests_are_refused_and_nothing_runs(llm, prompt, params, match):
    """The whole generate() call is validated before anything is scheduled: the error names the prompt
    index and the problem; the engine stays empty and serves the next call."""
    good = SamplingParams(temperature=0, max_tokens=3)
    with pytest.raises(RequestError, match=match) as err:
        llm.generate([[7, 8, 9], prompt], [good, good if params is None else params])
    assert "prompt 1" in str(err.value)
    assert_clean(llm)
    assert len(llm.generate([7, 8, 9], good)[0].outputs[0].token_ids) == 3
    assert_clean(llm)


def test_params_list_length_mismatch(llm):
    with pytest.raises(ValueError, match="2 prompts"):
        llm.generate([[3, 4], [5]], [SamplingParams()])
    assert_clean(llm)


def test_text_prompt_without_tokenizer(llm):
    with pytest.raises(ValueError, match="tokenizer.json"):
        llm.generate("hello", SamplingParams(max_tokens=2))
    assert_clean(llm)


def test_stop_strings_without_tokenizer_are_refused(llm):
    """Stop strings need a tokenizer to be detected. Without tokenizer.json they would be silently
    ignored (generation runs to max_tokens); the request must be refused instead."""
    with pytest.raises(RequestError, match="stop"):
        llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=8, stop=["x"]))
    assert_clean(llm)


def test_refused_add_request_leaves_running_requests_alone(model_dir):
    """A bad request arriving mid-run raises RequestError; the requests already running finish with the
    same tokens they would have produced alone."""
    llm = LLM(model_dir, device="cpu", page_size=4, max_model_len=64, max_num_tokens=8)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [[9, 21, 33, 4], [50, 51, 52, 53, 54, 55, 56, 57, 58, 59]]
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    eng = llm.engine
    reqs = [eng.add_request(p, params) for p in prompts]
    eng.step()
    eng.step()
    for bad in ([], [1000], [3] * 64):
        with pytest.raises(RequestError):
            eng.add_request(bad, params)
    while eng.has_work():
        eng.step()
    assert [r.output_token_ids for r in reqs] == ref
    assert_clean(llm)


# ------------------------------------------------------------------------------------------------
# configs and checkpoints
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("edit, option", [
    ({"rope_parameters": {"rope_type": "no_such_rope", "rope_theta": 1e4, "factor": 4.0}}, "rope_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"sparse_score_type": "mean"}, "sparse_score_type"),
    ({"index_use_value": True}, "sparse_use_index_value"),
    ({"layer_types": ["full_attention"] * 3}, "layer_types"),
    ({"layer_types": ["full_attention", "sliding", "full_attention", "full_attention"]}, "layer_types"),
    ({"mlp_layer_types": ["dense", "moe", "dense", "dense"]}, "mlp_layer_types"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"index_n_heads": 3}, "index_n_heads"),
])
def test_config_rejects_unsupported_values(model_dir, edit, option):
    d = json.loads((model_dir / "config.json").read_text())
    d.update(edit)
    with pytest.raises(ConfigError, match=option):
        M3Config.from_dict(d)


def test_vl_config_without_text_config():
    with pytest.raises(ConfigError, match="text_config"):
        M3Config.from_dict({"model_type": "minimax_m3_vl"})


def test_unsupported_config_fails_at_llm_construction(model_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(model_dir, d)
    conf = json.loads((d / "config.json").read_text())
    conf["hidden_act"] = "relu"
    (d / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ConfigError, match="hidden_act"):
        LLM(d, device="cpu")

