"""Serving defects and small features, each against a real in-process server (the
official openai client, or httpx / raw sockets where the wire matters):

- lone surrogates / invalid UTF-8 in prompts and chat content: an OpenAI-shaped 400 naming the field, the
  keep-alive connection kept;
- chat_template_kwargs: add_generation_prompt / continue_final_message honoured, colliding keys a 400;
- the request-body limit (413 before parsing) and tokenization off the event loop (/health stays fast);
- shutdown past --shutdown-timeout: 503 / a final error event, and 503 for new requests while draining;
- echo + logprobs: the first prompt token's text and the text offsets;
- --api-key, /tokenize, /detokenize, /version, lists of prompts, stop_reason.
"""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import openai
import pytest

from m3eagle import LLM
from m3eagle.entrypoints.server import OpenAIServer, ServerThread
from tests.entrypoints import test_server as _ts
from tests.entrypoints.test_server import MAX_TOKENS, MODEL, PROMPTS, client, http, wait_idle

served = _ts.served  # test_server's module-scoped server fixture: one embedded-model server for this module


def _is_openai_error(body, status: int | None = None) -> bool:
    return isinstance(body, dict) and set(body) == {"error"} and {"message", "type", "param", "code"} <= set(
        body["error"]) and (status is None or body["error"]["code"] in (status, body["error"]["code"]))


# ---- 1. lone surrogates and invalid UTF-8 ----------------------------------------------------------------


@pytest.mark.slow
def test_lone_surrogate_and_invalid_utf8_are_a_400_on_a_kept_connection(served):
    st, _ = served
    with httpx.Client(base_url=st.url, timeout=60, trust_env=False) as c:
        body = '{"prompt": "ab\\ud800cd", "max_tokens": 2}'  # JSON's own escape: a lone surrogate
        r = c.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        assert _is_openai_error(r.json()) and r.json()["error"]["param"] == "prompt"
        assert r.headers.get("connection", "").lower() != "close"
        r = c.post("/v1/chat/completions", content='{"messages": [{"role": "user", "content": "hi"}, '
                   '{"role": "user", "content": "\\udfff"}], "max_tokens": 2}',
                   headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "messages[1].content"
        r = c.post("/v1/completions", content=b'{"prompt": "ab\xff\xfe", "max_tokens": 2}',
                   headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and _is_openai_error(r.json()), r.text
        r = c.post("/v1/completions", content=json.dumps({"prompt": ["ok", "x\ud800"], "max_tokens": 2}),
                   headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        # the same connection serves on
        r = c.post("/v1/completions", json={"prompt": "def f():", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text


# ---- 2. chat_template_kwargs ------------------------------------------------------------------------------


@pytest.mark.slow
def test_chat_template_kwargs(served):
    st, _ = served
    c = client(st)
    msgs = [{"role": "user", "content": "hello"}]
    plain = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0)
    no_gen = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0,
                                       extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
    assert no_gen.usage.prompt_tokens < plain.usage.prompt_tokens
    cont = c.chat.completions.create(
        model=MODEL, messages=msgs + [{"role": "assistant", "content": "def f"}], max_tokens=2, temperature=0,
        extra_body={"chat_template_kwargs": {"continue_final_message": True, "add_generation_prompt": False}})
    assert cont.choices[0].message.content is not None
    for key in ("messages", "tools"):
        code, err = http(st, "POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": 2,
                                                               "chat_template_kwargs": {key: []}})
        assert code == 400 and _is_openai_error(err) and err["error"]["param"] == "chat_template_kwargs", err
        assert key in err["error"]["message"]
    code, err = http(st, "POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": 2,
                                                           "chat_template_kwargs": {"add_generation_prompt": 3}})
    assert code == 400 and "add_generation_prompt" in err["error"]["message"], err
    # the rendered prompt /tokenize reports follows add_generation_prompt too
    a = httpx.post(st.url + "/tokenize", json={"messages": msgs}).json()["count"]
    b = httpx.post(st.url + "/tokenize", json={"messages": msgs, "add_generation_prompt": False}).json()["count"]
    assert a == plain.usage.prompt_tokens and b == no_gen.usage.prompt_tokens


# ---- 3. body limit, tokenization off the event loop ---------------------------------------------------------


@pytest.mark.slow
def test_body_limit_is_a_413_before_parsing(served):
    st, _ = served
    old = st.server.max_request_body_bytes
    st.server.max_request_body_bytes = 4096
    try:
        big = json.dumps({"prompt": "x" * 5000, "max_tokens": 1})
        code, err = http(st, "POST", "/v1/completions", big)
        assert code == 413 and _is_openai_error(err), err
        # chunked (no Content-Length): counted as it arrives

        def chunks():
            for i in range(0, len(big), 1000):
                yield big[i:i + 1000].encode()

        r = httpx.post(st.url + "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and _is_openai_error(r.json()), r.text
        code, _ = http(st, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 1})
        assert code == 200
    finally:
        st.server.max_request_body_bytes = old


def _held_request(st, monkeypatch, obj, attr: str, holds, body: dict, while_held) -> httpx.Response:
    """POST `body` to /v1/completions with `obj.attr` held (forced, not timed) at its first call whose argument
    `holds` accepts; run `while_held(client)` during the hold (within its 30 s), check the request is still
    waiting then, release it, and return its response."""
    started, release = threading.Event(), threading.Event()
    real = getattr(obj, attr)

    def held(arg):
        if not started.is_set() and holds(arg):
            started.set()
            assert release.wait(30), "never released"
        return real(arg)

    monkeypatch.setattr(obj, attr, held)
    result = {}
    th = threading.Thread(target=lambda: result.update(r=httpx.post(st.url + "/v1/completions", json=body,
                                                                    timeout=60)))
    th.start()
    try:
        assert started.wait(30), f"the request never reached {attr}"
        with httpx.Client(base_url=st.url, timeout=5, trust_env=False) as c:  # well inside the 30 s hold
            while_held(c)
        assert th.is_alive() and not release.is_set()  # answered while the request was still held
    finally:
        release.set()
        th.join(60)
    return result["r"]


@pytest.mark.slow
def test_health_answers_while_a_prompt_is_tokenized(served, monkeypatch):
    """Tokenization runs off the event loop: with the tokenizer held mid-request, /health still answers; the
    held request completes once released."""
    st, _ = served
    r = _held_request(st, monkeypatch, st.server.llm.tokenizer, "encode_releasing_gil", lambda text: "HOLD" in text,
                      {"prompt": "HOLD def f():", "max_tokens": 2},
                      lambda c: c.get("/health").raise_for_status())
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.slow
def test_health_answers_while_a_grammar_compiles(served, monkeypatch):
    """A new schema's grammar compiles off the event loop: with the compile held, /health and an unconstrained
    request still answer; the constrained request completes, valid, once released."""
    st, _ = served

    def during(c: httpx.Client) -> None:
        c.get("/health").raise_for_status()
        r = c.post("/v1/completions", json={"prompt": "def f():", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text

    r = _held_request(st, monkeypatch, st.server.engine, "compile_grammar", lambda params: True,
                      {"prompt": "x =", "max_tokens": 3, "temperature": 0, "guided_regex": "7[0-9][0-9]"}, during)
    assert r.status_code == 200, r.text
    assert re.fullmatch("7[0-9][0-9]", r.json()["choices"][0]["text"])


def test_the_gil_releasing_encode_equals_encode(served):
    tok = served[0].server.llm.tokenizer
    text = "def add(a, b):\n    return a + b  # ünïcödé\n" * 50
    assert tok.encode_releasing_gil(text) == tok.encode(text)


# ---- 6. shutdown past --shutdown-timeout; 503 while draining --------------------------------------------------


@pytest.mark.slow
def test_shutdown_past_the_timeout_answers_503_and_error_events(one_thread):
    llm = LLM(device="cpu", max_num_seqs=8, max_model_len=256)
    orig = llm.engine.step

    def slow_step():  # a long generation: well past the shutdown timeout
        time.sleep(0.05)
        return orig()

    llm.engine.step = slow_step
    st = ServerThread(OpenAIServer(llm, log_interval=0), shutdown_timeout=1.5).start()
    body = {"prompt": "def f():", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    out: dict = {}

    def plain():
        out["plain"] = httpx.post(st.url + "/v1/completions", json=body, timeout=60)

    def streamed():
        with httpx.stream("POST", st.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            out["events"] = [line for line in r.iter_lines() if line.startswith("data: ")]

    threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    while st.server.engine_loop.num_in_flight < 2:
        assert time.monotonic() - t0 < 30
        time.sleep(0.02)
    stopper = threading.Thread(target=st.stop)
    stopper.start()
    time.sleep(0.3)
    # draining: a new connection is answered, with an OpenAI-shaped 503
    r = httpx.post(st.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=10)
    assert r.status_code == 503 and _is_openai_error(r.json()), r.text
    assert httpx.get(st.url + "/health", timeout=10).status_code == 503
    for t in threads:
        t.join(30)
    stopper.join(30)
    assert out["plain"].status_code == 503 and _is_openai_error(out["plain"].json()), out["plain"].text
    events = out["events"]
    assert events[-1] == "data: [DONE]" and "error" in json.loads(events[-2].removeprefix("data: ")), events[-3:]
    assert llm.engine.is_idle_and_clean()


# ---- 7. echo + logprobs ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_echo_logprobs_first_token_and_offsets(served):
    st, _ = served
    tok = st.server.llm.tokenizer
    prompt = "def add(a, b):"
    ids = tok.encode(prompt)
    r = client(st).completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                      logprobs=1)
    lp = r.choices[0].logprobs
    assert lp.tokens[0] == tok.decode(ids[:1]) and lp.token_logprobs[0] is None
    assert "".join(lp.tokens[:len(ids)]) == prompt
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert r.choices[0].text.startswith(prompt)


# ---- 10. --api-key ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_api_key(served, monkeypatch):
    from m3eagle.entrypoints.server.app import resolve_api_key

    st, _ = served
    st.server.api_key = "s3cret"
    try:
        with pytest.raises(openai.AuthenticationError) as e:
            client(st).models.list()
        assert e.value.status_code == 401
        body = e.value.response.json()
        assert _is_openai_error(body) and body["error"]["type"] == "invalid_request_error"
        code, _ = http(st, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 1})
        assert code == 401
        good = openai.OpenAI(base_url=st.url + "/v1", api_key="s3cret", max_retries=0, timeout=60)
        assert good.completions.create(model=MODEL, prompt="x", max_tokens=1).choices
        assert http(st, "GET", "/health")[0] == 200 and http(st, "GET", "/metrics")[0] == 200
    finally:
        st.server.api_key = None
    monkeypatch.setenv("M3EAGLE_API_KEY", "from-env")
    assert resolve_api_key(None) == "from-env" and resolve_api_key("flag") == "flag"
    monkeypatch.delenv("M3EAGLE_API_KEY")
    assert resolve_api_key(None) is None


def test_serve_options_parse():
    from m3eagle.entrypoints.cli import build_parser

    a = build_parser().parse_args(["serve", "--api-key", "k", "--max-request-body-bytes", "1024"])
    assert a.api_key == "k" and a.max_request_body_bytes == 1024
    a = build_parser().parse_args(["serve"])
    assert a.api_key is None and a.max_request_body_bytes == 16 * 2**20


# ---- 11. /tokenize, /detokenize, /version -------------------------------------------------------------------


@pytest.mark.slow
def test_tokenize_detokenize_version(served):
    from m3eagle.version import __version__

    st, _ = served
    tok = st.server.llm.tokenizer
    code, r = http(st, "POST", "/tokenize", {"model": MODEL, "prompt": "def add(a, b):"})
    assert code == 200 and r["tokens"] == tok.encode("def add(a, b):") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == st.server.max_model_len
    code, d = http(st, "POST", "/detokenize", {"model": MODEL, "tokens": r["tokens"]})
    assert code == 200 and d == {"prompt": "def add(a, b):"}
    code, m = http(st, "POST", "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert code == 200 and m["count"] == len(m["tokens"]) > 1
    assert http(st, "GET", "/version") == (200, {"version": __version__})
    code, err = http(st, "POST", "/detokenize", {"tokens": [10**9]})
    assert code == 400 and _is_openai_error(err) and err["error"]["param"] == "tokens"
    code, err = http(st, "POST", "/tokenize", {"model": "nope", "prompt": "x"})
    assert code == 404 and _is_openai_error(err)


# ---- 12. lists of prompts; 13. stop_reason ----------------------------------------------------------------------


@pytest.mark.slow
def test_list_of_prompts(served):
    st, ref = served

    c = client(st)
    prompts = PROMPTS[:3]
    r = c.completions.create(model=MODEL, prompt=prompts, max_tokens=MAX_TOKENS, temperature=0, n=2)
    assert [ch.index for ch in r.choices] == list(range(6))
    for ch in r.choices:
        assert ch.text == ref[prompts[ch.index // 2]].outputs[0].text
    ids = [st.server.llm.tokenizer.encode(p) for p in prompts]
    r2 = c.completions.create(model=MODEL, prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    assert [ch.text for ch in r2.choices] == [ref[p].outputs[0].text for p in prompts]
    assert r2.usage.prompt_tokens == sum(len(x) for x in ids)
    texts = [""] * 6
    finished = set()
    for chunk in c.completions.create(model=MODEL, prompt=prompts, max_tokens=MAX_TOKENS, temperature=0, n=2,
                                      stream=True):
        for ch in chunk.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == set(range(6))
    assert texts == [ref[prompts[i // 2]].outputs[0].text for i in range(6)]
    wait_idle(st)


@pytest.mark.slow
def test_stop_reason(served):
    st, ref = served

    p = PROMPTS[0]
    full = ref[p].outputs[0].text
    stop = full.strip()[:2]
    assert stop
    code, r = http(st, "POST", "/v1/completions", {"prompt": p, "max_tokens": 8, "temperature": 0, "stop": [stop]})
    assert code == 200 and r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["stop_reason"] == stop
    code, r = http(st, "POST", "/v1/completions", {"prompt": p, "max_tokens": 2, "temperature": 0,
                                                    "ignore_eos": True})
    assert r["choices"][0]["finish_reason"] == "length" and r["choices"][0]["stop_reason"] is None
    code, r = http(st, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                         "max_tokens": 2, "ignore_eos": True})
    assert "stop_reason" in r["choices"][0]
    last = None
    with httpx.stream("POST", st.url + "/v1/completions", json={"prompt": p, "max_tokens": 8, "temperature": 0,
                                                                "stop": [stop], "stream": True, "n": 2}) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    if ch["finish_reason"]:
                        last = ch
                        assert ch["stop_reason"] == stop
    assert last is not None
