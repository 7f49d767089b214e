"""Offline input defects: text that UTF-8 cannot encode, SamplingParams
fields changed after construction, chat messages with a None / int content -- each a RequestError /
SamplingParamsError naming what is wrong, never a TypeError from inside the tokenizer or the step -- and
LLM.get_tokenizer(). CPU, embedded model."""

from __future__ import annotations

import pytest

from m3eagle import LLM, SamplingParams
from m3eagle.engine.llm_engine import RequestError
from m3eagle.entrypoints.cli import main
from m3eagle.sampling.params import SamplingParamsError


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", max_model_len=128)


def test_lone_surrogates_are_a_request_error(llm):
    for prompts in ("ab\ud800", ["ok", "x\udcff"]):
        with pytest.raises(RequestError, match="surrogate"):
            llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(RequestError, match=r"messages\[1\]\.content"):
        llm.chat([{"role": "user", "content": "hi"}, {"role": "user", "content": "\ud800"}], use_tqdm=False)
    assert llm.engine.is_idle_and_clean()


def test_cli_lone_surrogate_is_one_line_and_exit_2(capsys):
    # undecodable command-line bytes reach Python as lone surrogates (surrogateescape)
    rc = main(["generate", "def f\udcff", "--device", "cpu", "--max-tokens", "1", "--max-model-len", "64"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert lines[-1].startswith("m3eagle: error: ") and "surrogate" in lines[-1], err


@pytest.mark.parametrize("field, value", [("temperature", float("nan")), ("n", 0), ("seed", 2**70),
                                          ("top_p", 0.0), ("max_tokens", 0), ("stop", [""])])
def test_fields_changed_after_construction_are_validated_on_submit(llm, field, value):
    sp = SamplingParams(max_tokens=2)
    setattr(sp, field, value)
    with pytest.raises(SamplingParamsError, match=field):
        llm.generate("def f():", sp, use_tqdm=False)
    with pytest.raises(SamplingParamsError, match=field):
        llm.generate(["a", "b"], [SamplingParams(max_tokens=1), sp], use_tqdm=False)
    assert llm.engine.is_idle_and_clean()


@pytest.mark.parametrize("content, kind", [(None, "None"), (3, "int"), ([{"type": "image"}], "part")])
def test_chat_content_none_or_int_is_a_request_error(llm, content, kind):
    with pytest.raises(RequestError, match=r"messages\[1\]\.content") as e:
        llm.chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": content}], use_tqdm=False)
    assert not isinstance(e.value, TypeError)
    with pytest.raises(RequestError, match=r"conversations\[1\]\.messages\[0\]\.content"):
        llm.chat([[{"role": "user", "content": "ok"}], [{"role": "user", "content": content}]], use_tqdm=False)


def test_chat_template_kwargs_offline(llm):
    msgs = [{"role": "user", "content": "hello"}]
    sp = SamplingParams(max_tokens=1, temperature=0)
    with_gen = llm.chat(msgs, sp, use_tqdm=False)[0]
    without = llm.chat(msgs, sp, use_tqdm=False, add_generation_prompt=False)[0]
    assert len(without.prompt_token_ids) < len(with_gen.prompt_token_ids)
    cont = llm.chat(msgs + [{"role": "assistant", "content": "def f"}], sp, use_tqdm=False,
                    add_generation_prompt=False, continue_final_message=True)[0]
    assert cont.prompt.endswith("def f")
    with pytest.raises(RequestError, match="tools"):
        llm.chat(msgs, sp, use_tqdm=False, tools=[])


def test_get_tokenizer(llm):
    tok = llm.get_tokenizer()
    assert tok is llm.tokenizer and tok.decode(tok.encode("def f():")) == "def f():"
    bare = LLM.__new__(LLM)
    bare.tokenizer, bare.model_path = None, None
    with pytest.raises(ValueError, match="no tokenizer"):
        bare.get_tokenizer()
