"""Prefix caching above the engine: the flag from LLM(...) and the command line to EngineConfig, LLM.reset_prefix_cache,
and the server's side of it -- usage.prompt_tokens_details.cached_tokens (non-streamed and in the streamed usage
chunk, both endpoints, read by the official openai client), POST /reset_prefix_cache (behind the API key), the
m3eagle:prefix_cache_{queries,hits}_total counters and the hit rate in the stats log line. The servers run the
embedded model on CPU."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import httpx
import pytest

from m3eagle import LLM, SamplingParams
from m3eagle.entrypoints.server import OpenAIServer, ServerThread
from tests.entrypoints.test_server import MODEL, client, http, metric

# Distinct texts of a few hundred tokens (at 16 tokens a page, several full pages to cache), one per test, so a
# test never hits what another one left cached. Requests ignore EOS and ask for 2 tokens: each one decodes past
# its prompt step.
_SOURCE = (Path(sysconfig.get_paths()["stdlib"]) / "os.py").read_text()
TEXTS = [_SOURCE[i * 700:(i + 1) * 700] for i in range(10)]
ARGS = {"max_tokens": 2, "temperature": 0, "ignore_eos": True}


def _llm(enable_prefix_caching: bool | None = None) -> LLM:
    kw = {} if enable_prefix_caching is None else {"enable_prefix_caching": enable_prefix_caching}
    return LLM(device="cpu", max_num_seqs=8, max_model_len=512, **kw)


@pytest.fixture(scope="module")
def llm_on(one_thread) -> LLM:
    """An LLM with prefix caching on (the default); `cached` serves it, so offline tests of it come first."""
    return _llm()


@pytest.fixture(scope="module")
def cached(llm_on):
    """A server over `llm_on`."""
    llm = llm_on
    with ServerThread(OpenAIServer(llm, log_interval=0)) as st:
        yield st
    assert llm.engine.is_idle_and_clean() and llm.engine.owner is None


@pytest.fixture(scope="module")
def llm_off(one_thread) -> LLM:
    return _llm(False)


@pytest.fixture(scope="module")
def uncached(llm_off):
    """A server over `llm_off`, built with enable_prefix_caching=False."""
    llm = llm_off
    with ServerThread(OpenAIServer(llm, log_interval=0)) as st:
        yield st


def _complete(st: ServerThread, prompt: str, **body) -> dict:
    status, out = http(st, "POST", "/v1/completions", {"prompt": prompt, **ARGS, **body})
    assert status == 200, out
    return out


def _stream_usage(st: ServerThread, path: str, body: dict) -> dict:
    """The usage object of a streamed call's usage chunk (stream_options.include_usage)."""
    body = {**body, **ARGS, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", st.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"] == []
    return last["usage"]


def _cached_tokens(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


# ---- offline, and the flag on its way to EngineConfig --------------------------------------------------------


def test_llm_reset_prefix_cache(llm_on):
    """LLM.reset_prefix_cache: the next run of the same prompt is computed again. (Before `cached` serves this LLM.)"""
    llm = llm_on
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    first, second = (llm.generate(TEXTS[0], sp, use_tqdm=False)[0] for _ in range(2))
    assert first.num_cached_tokens == 0 and second.num_cached_tokens > 0
    assert llm.reset_prefix_cache() is True
    assert llm.generate(TEXTS[0], sp, use_tqdm=False)[0].num_cached_tokens == 0


def test_llm_flag_reaches_engine_config(llm_on, llm_off):
    assert llm_on.config.enable_prefix_caching is True and llm_on.engine.cfg.enable_prefix_caching is True  # default
    assert llm_off.config.enable_prefix_caching is False and llm_off.engine.cfg.enable_prefix_caching is False


@pytest.mark.parametrize("argv", [["generate", "x"], ["serve", "--port", "0"], ["bench", "--geometry", "tiny"]])
def test_cli_flag_reaches_the_engine(monkeypatch, argv):
    """--enable-prefix-caching is on unless --no-enable-prefix-caching, on every engine command (bench builds a
    Runtime itself)."""
    from m3eagle.entrypoints import cli

    seen = []

    class Fake:
        def __init__(self, *args, **kw):
            seen.append(kw["enable_prefix_caching"])
            raise RuntimeError("stop here")

    monkeypatch.setattr("m3eagle.entrypoints.llm.LLM", Fake)  # what _make_llm imports when it runs
    monkeypatch.setattr("m3eagle.engine.runtime.Runtime", Fake)  # what the bench imports when it runs
    for extra in ([], ["--enable-prefix-caching"], ["--no-enable-prefix-caching"]):
        assert cli.main(argv + ["--device", "cpu"] + extra) == 2  # the fake's error, as one line
    assert seen == [True, True, False]


# ---- the server ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_completions_usage_cached_tokens(cached):
    st = cached
    first, second = _complete(st, TEXTS[1]), _complete(st, TEXTS[1])
    assert _cached_tokens(first["usage"]) == 0
    n = _cached_tokens(second["usage"])
    assert 0 < n < second["usage"]["prompt_tokens"]
    assert second["choices"][0]["text"] == first["choices"][0]["text"]  # cached KV, same greedy tokens
    # streamed: the usage chunk carries it too
    assert _cached_tokens(_stream_usage(st, "/v1/completions", {"prompt": TEXTS[1]})) == n
    # a list of prompts: the sum over them
    both = _complete(st, [TEXTS[1], TEXTS[2]])
    assert _cached_tokens(both["usage"]) == n


@pytest.mark.slow
def test_chat_usage_cached_tokens(cached):
    st = cached
    body = {"messages": [{"role": "user", "content": TEXTS[3]}], **ARGS}
    usages = []
    for _ in range(2):
        status, out = http(st, "POST", "/v1/chat/completions", body)
        assert status == 200, out
        usages.append(out["usage"])
    assert _cached_tokens(usages[0]) == 0 and _cached_tokens(usages[1]) > 0
    assert _cached_tokens(_stream_usage(st, "/v1/chat/completions", body)) == _cached_tokens(usages[1])


@pytest.mark.slow
def test_no_details_with_caching_off(uncached):
    st = uncached
    for _ in range(2):
        usage = _complete(st, TEXTS[4])["usage"]
        assert "prompt_tokens_details" not in usage and usage["prompt_tokens"] > 0
    assert "prompt_tokens_details" not in _stream_usage(st, "/v1/completions", {"prompt": TEXTS[4]})
    assert metric(st, "m3eagle:prefix_cache_hits_total") == 0
    line = st.server.metrics.log_line()
    assert line is not None and "Prefix cache" not in line


@pytest.mark.slow
def test_reset_prefix_cache_route(cached):
    st = cached
    _complete(st, TEXTS[5])
    assert _cached_tokens(_complete(st, TEXTS[5])["usage"]) > 0
    status, _ = http(st, "POST", "/reset_prefix_cache")
    assert status == 200
    assert _cached_tokens(_complete(st, TEXTS[5])["usage"]) == 0
    # behind the API key when the server has one, as the /v1 routes are
    st.server.api_key = "s3cret"
    try:
        assert http(st, "POST", "/reset_prefix_cache")[0] == 401
        r = httpx.post(st.url + "/reset_prefix_cache", headers={"Authorization": "Bearer s3cret"}, timeout=60)
        assert r.status_code == 200
    finally:
        st.server.api_key = None


@pytest.mark.slow
def test_prometheus_counters_and_log_line(cached):
    st = cached
    eng, m = st.server.engine, st.server.metrics
    q0, h0 = metric(st, "m3eagle:prefix_cache_queries_total"), metric(st, "m3eagle:prefix_cache_hits_total")
    eq0, eh0 = eng.prefix_cache_queries, eng.prefix_cache_hits
    m.log_line()  # a fresh stats window
    usages = [_complete(st, TEXTS[6])["usage"] for _ in range(2)]
    dq = metric(st, "m3eagle:prefix_cache_queries_total") - q0
    dh = metric(st, "m3eagle:prefix_cache_hits_total") - h0
    assert dh == sum(_cached_tokens(u) for u in usages) > 0
    assert dq == sum(u["prompt_tokens"] for u in usages)
    assert (dq, dh) == (eng.prefix_cache_queries - eq0, eng.prefix_cache_hits - eh0)  # fed from the engine's totals
    line = m.log_line()
    assert line is not None and f"Prefix cache hit rate: {dh / dq * 100:.1f}%" in line


def test_counters_survive_an_engine_restart_of_its_totals(llm_on):
    """The engine restarts its totals after a warm-up: the Prometheus counters never go down (a negative
    increment would raise), and count from the new totals on."""
    from m3eagle.entrypoints.server.metrics import PrefixCacheCounts, ServerMetrics

    m = ServerMetrics(llm_on.engine, "x", 512)  # a registry of its own
    base = PrefixCacheCounts.of(llm_on.engine)
    m.observe_prefix_cache(PrefixCacheCounts(base.queries + 100, base.hits + 40))
    m.observe_prefix_cache(PrefixCacheCounts(30, 10))  # restarted
    m.rebase_prefix_cache(PrefixCacheCounts(0, 0))
    m.observe_prefix_cache(PrefixCacheCounts(5, 5))
    got = [m.registry.get_sample_value(f"m3eagle:prefix_cache_{name}_total", {"model_name": "x"})
           for name in ("queries", "hits")]
    assert got == [135, 55]


@pytest.mark.slow
def test_official_client_reads_cached_tokens(cached):
    c = client(cached)
    kw = {"max_tokens": 2, "temperature": 0, "extra_body": {"ignore_eos": True}}
    prompt = TEXTS[7]
    first, second = (c.completions.create(model=MODEL, prompt=prompt, **kw) for _ in range(2))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    msgs = [{"role": "user", "content": TEXTS[8]}]
    chats = [c.chat.completions.create(model=MODEL, messages=msgs, **kw) for _ in range(2)]
    assert [r.usage.prompt_tokens_details.cached_tokens > 0 for r in chats] == [False, True]
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, **kw, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == chats[1].usage.prompt_tokens_details.cached_tokens
