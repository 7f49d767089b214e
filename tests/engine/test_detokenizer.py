"""Incremental detokenization: DecodeStream text equals a full decode (a trailing
partial character is flushed once at the end); stop strings match across token boundaries, the output
ends at the token that completed one and the text is cut before it; streamed text never shows what a stop
string later cuts; forks are independent; the engine's per-step deltas add up to the final output; and
no full re-decode happens per token (the old path was O(n^2))."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer as HFTokenizer

from m3eagle import LLM, SamplingParams
from m3eagle.engine.detokenizer import IncrementalDetokenizer
from m3eagle.loader.assets import ASSETS
from m3eagle.loader.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(HFTokenizer.from_file(str(ASSETS / "target" / "tokenizer.json")))


@pytest.fixture(scope="module")
def llm(one_thread) -> LLM:
    return LLM(device="cpu", num_draft_tokens=3, max_num_seqs=4, max_num_tokens=64, max_model_len=256)


def run(tok: Tokenizer, ids: list[int], stop: list[str] = ()) -> tuple[IncrementalDetokenizer, int, list[str]]:
    """Feed ids until a stop string completes; returns (detokenizer, tokens used, streamed pieces)."""
    det = IncrementalDetokenizer(tok, stop)
    pieces, sent = [], 0
    for n, t in enumerate(ids, 1):
        stopped = det.add(t)
        if stopped or n == len(ids):
            det.finish(ids[:n])
        end = det.safe_length(stopped or n == len(ids))
        pieces.append(det.text[sent:end])
        sent = max(sent, end)
        if stopped:
            return det, n, pieces
    return det, len(ids), pieces


def test_incremental_text_equals_full_decode(tok):
    """Random ids hit partial UTF-8 characters and special tokens; the streamed pieces are always a prefix
    of the full decode and, flushed at the end, equal it."""
    rng = random.Random(0)
    flushed = 0
    for _ in range(300):
        ids = [rng.randrange(tok.tok.get_vocab_size()) for _ in range(rng.randrange(1, 40))]
        det, n, pieces = run(tok, ids)
        assert n == len(ids)
        full = tok.decode(ids)
        assert det.text == full == "".join(pieces)
        for k in range(1, len(pieces)):
            assert full.startswith("".join(pieces[:k]))
        flushed += "\ufffd" in full
    assert flushed  # the partial-character flush was exercised


def first_stop(tok: Tokenizer, ids: list[int], stops: list[str]) -> tuple[int, str]:
    """The definition: the first prefix of the output whose decode contains a stop string; the text is that
    decode cut before the earliest stop string."""
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n])
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return n, text[: min(hits)]
    return len(ids), tok.decode(ids)


@pytest.mark.parametrize("stops", [["o w"], ["(self"], ["rn x", "def"], [" "], ["return x + y\n"], ["zzz"]])
def test_stop_strings_across_token_boundaries(tok, stops):
    ids = tok.encode("class Foo:\n    def add(self, x, y):\n        return x + y\n\nhello world\n")
    det, n, pieces = run(tok, ids, stops)
    want_n, want_text = first_stop(tok, ids, stops)
    assert n == want_n and det.text == want_text
    assert det.stopped == any(s in tok.decode(ids) for s in stops)
    assert "".join(pieces) == want_text  # nothing streamed that the cut removed
    assert not any(s in det.text for s in stops)


def test_streamed_text_never_shows_what_a_stop_string_cuts(tok):
    """While a stop string could still complete, its possible start is held back: every streamed prefix is a
    prefix of the final (cut) text, though the detokenizer had already decoded past it."""
    ids = tok.encode("abc xyz")
    det = IncrementalDetokenizer(tok, ["c xy"])
    shown, held = [], False
    for t in ids:
        stopped = det.add(t)
        shown.append(det.text[: det.safe_length(stopped)])
        held |= len(det.text) > len(shown[-1])
        if stopped:
            break
    assert det.stopped and det.text == "ab"
    assert held and all("ab".startswith(s) for s in shown)


def test_fork_is_independent(tok):
    ids = tok.encode("def f(x):\n    return x\n")
    det = IncrementalDetokenizer(tok)
    for t in ids[:3]:
        det.add(t)
    fork = det.fork()
    for t in ids[3:]:
        fork.add(t)
    assert det.text == tok.decode(ids[:3]) and fork.text == tok.decode(ids)
    for t in ids[3:]:
        det.add(t)
    assert det.text == fork.text


def test_engine_deltas_add_up_to_the_output(llm):
    """Driving step() by hand: the deltas of each request concatenate to its final tokens and text, the
    finishing delta comes once and carries the output; stop strings cut mid-stream."""
    prompts = ["def add(a, b):", "import os\n", "class Foo:", "for i in range(10):"]
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=s)
              for s in ([], ["\n\n"], ["self"], ["print("])]
    ref = llm.generate(prompts, params)
    eng = llm.engine
    reqs = [eng.add_request(llm.encode(p), sp, p) for p, sp in zip(prompts, params)]
    toks = {r.request_id: [] for r in reqs}
    text = {r.request_id: "" for r in reqs}
    final = {}
    while eng.has_work() or eng.has_output():
        for d in eng.step():
            assert d.request_id not in final
            toks[d.request_id] += d.token_ids
            text[d.request_id] += d.text
            assert d.num_output_tokens == len(toks[d.request_id])
            if d.finished:
                final[d.request_id] = d.output
    for r, o in zip(reqs, ref):
        out = final[r.request_id]
        assert toks[r.request_id] == out.outputs[0].token_ids == o.outputs[0].token_ids
        assert text[r.request_id] == out.outputs[0].text == o.outputs[0].text
        assert out.outputs[0].finish_reason == o.outputs[0].finish_reason
    assert eng.is_idle_and_clean()


def test_no_full_decode_per_token(monkeypatch, llm):
    """The old engine re-decoded the whole output for every token (O(n^2)) whenever stop strings were set;
    now a request decodes in full at most once (a flush at the end)."""
    calls = [0]
    orig = llm.tokenizer.decode

    def counted(ids):
        calls[0] += 1
        return orig(ids)

    monkeypatch.setattr(llm.tokenizer, "decode", counted)
    outs = llm.generate(["def add(a, b):", "class Foo:"],
                        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop=["\x00never"]))
    assert all(len(o.outputs[0].token_ids) == 32 for o in outs)
    assert calls[0] <= len(outs)
