"""The engine end to end on CPU (no speculation; see test_overlap.py for K > 0): paging, chunking, batching
and preemption never change greedy output; seeded sampling reproduces across batch compositions; stop
token ids, EOS, max_tokens, max_model_len, stop strings (with a tiny tokenizer), logprobs against
transformers, abort. Every LLM a test builds is checked for leaked pages when the test ends."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from m3eagle import LLM, SamplingParams
from tests.helpers.engine_utils import Counters, assert_clean, chi2_sf, greedy

PROMPT_LENS = (3, 70, 12, 40, 5, 25, 33, 7)
NEW = 20


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 96, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def one_shot(model_dir, prompts):
    """Reference: each prompt alone, prefilled in one step, big pages."""
    llm = LLM(model_dir, device="cpu", page_size=16, max_model_len=128, max_num_tokens=1024)
    out = [llm.generate([p], greedy(NEW))[0].outputs[0].token_ids for p in prompts]
    assert_clean(llm)
    return out


def build_tokenizer(path: Path) -> None:
    """A 96-id tokenizer for the tiny vocab: ids 0-2 are special (<pad>, <s>, </s>), ids 3..95 are the
    printable characters chr(33)..chr(125), one character per token; decoding concatenates."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    vocab.update({chr(33 + i): 3 + i for i in range(93)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<pad>", "<s>", "</s>"])
    tok.save(str(path / "tokenizer.json"))


@pytest.fixture(scope="module")
def tok_dir(model_dir, tmp_path_factory):
    """The tiny checkpoint plus tokenizer.json."""
    d = tmp_path_factory.mktemp("tiny_tok") / "m"
    shutil.copytree(model_dir, d)
    build_tokenizer(d)
    return d


def decode(tok_dir: Path, ids: list[int]) -> str:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tok_dir / "tokenizer.json")).decode(ids, skip_special_tokens=True)


# ------------------------------------------------------------------------------------------------
# paging, chunking, batching, preemption
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 3, 4, 16])
@pytest.mark.parametrize("mode", ["batched", "chunked", "preempted"])
def test_paged_runs_equal_one_shot(make_llm, model_dir, prompts, one_shot, page_size, mode):
    """Greedy tokens do not depend on page size, token budget (chunked prefill), batch composition or
    recompute after preemption."""
    table_pages = -(-(128 + 2) // page_size) + 1  # one max_model_len sequence
    kw = {"batched": dict(max_num_tokens=1024), "chunked": dict(max_num_tokens=5),
          "preempted": dict(max_num_tokens=48, num_pages=table_pages + 1 + table_pages // 4)}[mode]
    llm = make_llm(model_dir, page_size=page_size, **kw)
    counters = Counters(llm)
    outs = llm.generate(prompts, greedy(NEW))
    assert [o.outputs[0].token_ids for o in outs] == one_shot
    assert (counters.preempted > 0) == (mode == "preempted")


def test_max_num_seqs_limits_concurrency(make_llm, model_dir, prompts, one_shot):
    llm = make_llm(model_dir, max_num_seqs=2, max_num_tokens=32)
    peak = [0]
    orig = llm.engine.step

    def step():
        peak[0] = max(peak[0], len(llm.engine.scheduler.running))
        return orig()

    llm.engine.step = step
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(NEW))] == one_shot
    assert peak[0] <= 2


def test_request_metrics_timeline_and_queue_time(make_llm, model_dir, prompts):
    """Two sequences at a time force the third request to wait until one of the first two has finished: its
    queue time spans that one's whole generation. Every request's times are in order; n > 1 reports the earliest
    first scheduling and token and the latest token of its samples."""
    llm = make_llm(model_dir, max_num_seqs=2)
    a, b, c = (o.metrics for o in llm.generate(prompts[:3], greedy(NEW)))
    for m in (a, b, c):
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time
    first_done = min(a.last_token_time, b.last_token_time)
    assert c.first_scheduled_time >= first_done  # admitted only once a slot was free
    assert c.time_in_queue >= first_done - c.arrival_time > 0
    (o,) = llm.generate(prompts[3], SamplingParams(n=2, max_tokens=NEW, temperature=1.0, seed=3), use_tqdm=False)
    m = o.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time


def test_token_times_follow_every_step_tight_output_path_included(make_llm, model_dir, prompts):
    """A steady row's tokens take the output processor's tight path (no per-row `_process_row`); the request's
    token times still move with every step that hands its tokens out, so an abort mid-stream or a request
    read while running has them current."""
    llm = make_llm(model_dir)
    eng = llm.engine
    req = eng.add_request(list(prompts[1]), greedy(NEW))
    stamped = 0
    while eng.has_work() or eng.has_output():
        t0 = time.monotonic()
        deltas = eng.step()
        if any(d.request_id == req.request_id and d.token_ids for d in deltas):
            assert t0 <= req.last_token_time <= time.monotonic()
            stamped += 1
    assert stamped >= 3 and req.first_token_time <= req.last_token_time  # several steps, the steady ones too


def test_repeated_generate_calls_reuse_the_engine(make_llm, model_dir, prompts, one_shot):
    llm = make_llm(model_dir, max_num_tokens=16, num_pages=60)
    for _ in range(2):
        assert [o.outputs[0].token_ids for o in llm.generate(prompts[:4], greedy(NEW))] == one_shot[:4]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts[4:], greedy(NEW))] == one_shot[4:]


# ------------------------------------------------------------------------------------------------
# sampling
# ------------------------------------------------------------------------------------------------


def sampled(i: int, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.9, "top_k": 30, "top_p": 0.95, "max_tokens": NEW, "seed": 100 + i,
                             "ignore_eos": True, **kw})


def test_seeded_sampling_reproduces_across_batches(make_llm, model_dir, prompts):
    """Same seed -> same tokens, whatever else is in the batch, in what order, under what budget."""
    params = [sampled(i) for i in range(len(prompts))]
    a = [o.outputs[0].token_ids for o in make_llm(model_dir, max_num_tokens=1024).generate(prompts, params)]
    b = [o.outputs[0].token_ids for o in make_llm(model_dir, page_size=3, max_num_tokens=7).generate(
        prompts[::-1], params[::-1])][::-1]
    assert a == b
    solo = make_llm(model_dir, page_size=16, max_num_tokens=64)
    for i in (1, 4):
        assert solo.generate([prompts[i]], params[i])[0].outputs[0].token_ids == a[i]
    mixed = [prompts[0], prompts[3], prompts[5]]
    c = make_llm(model_dir, max_num_tokens=9, num_pages=45).generate(
        mixed + prompts[:1], [params[0], greedy(NEW), params[5], sampled(0)])
    assert c[0].outputs[0].token_ids == a[0] and c[2].outputs[0].token_ids == a[5] and c[3].outputs[0].token_ids == a[0]


def test_different_or_no_seed_changes_the_sample(make_llm, model_dir, prompts):
    llm = make_llm(model_dir, max_num_tokens=256)
    a = [o.outputs[0].token_ids for o in llm.generate(prompts, [sampled(i) for i in range(len(prompts))])]
    b = [o.outputs[0].token_ids for o in llm.generate(prompts, [sampled(i + 50) for i in range(len(prompts))])]
    c = [o.outputs[0].token_ids for o in llm.generate(prompts, sampled(0, seed=None))]
    d = [o.outputs[0].token_ids for o in llm.generate(prompts, sampled(0, seed=None))]
    assert a != b and c != d


def exact_joint(model_dir, prompt: list[int], depth: int, top_k: int, temperature: float,
                ) -> dict[tuple[int, ...], float]:
    """Exact probability of every continuation of `depth` tokens under temperature + top-k sampling,
    from the contiguous forward of each prefix."""
    from m3eagle.loader.checkpoint import load_target

    m = load_target(model_dir)
    out: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(depth):
        nxt = {}
        for prefix, pr in out.items():
            with torch.no_grad():
                h = m.forward_seq(torch.tensor([prompt + list(prefix)]))[0][0, -1:]
                p = torch.softmax(m.compute_logits(h)[0].double() / temperature, -1)
            top = p.topk(top_k)
            for t, v in zip(top.indices.tolist(), (top.values / top.values.sum()).tolist()):
                nxt[prefix + (t,)] = pr * v
        out = nxt
    return out


def chi_square_passes(counts: dict, probs: dict, alpha: float = 1e-3) -> bool:
    """Pearson chi-square of observed continuations against exact probabilities; anything observed
    outside the support fails outright."""
    assert set(counts) <= set(probs), f"sampled outside the support: {set(counts) - set(probs)}"
    n = sum(counts.values())
    x = sum((counts.get(k, 0) - n * p) ** 2 / (n * p) for k, p in probs.items())
    df = len(probs) - 1
    return chi2_sf(x, df) > alpha


def sample_continuations(llm: LLM, prompt: list[int], n: int, depth: int, top_k: int, temperature: float,
                         ) -> dict[tuple[int, ...], int]:
    params = [SamplingParams(temperature=temperature, top_k=top_k, max_tokens=depth, seed=s, ignore_eos=True)
              for s in range(n)]
    counts: dict[tuple[int, ...], int] = {}
    for o in llm.generate([prompt] * n, params):
        counts[tuple(o.outputs[0].token_ids)] = counts.get(tuple(o.outputs[0].token_ids), 0) + 1
    return counts


def test_sampling_follows_the_model_distribution(make_llm, model_dir, prompts):
    """temperature > 0 really samples: over 1200 seeds, the first three tokens (27 continuations under
    top-k 3) occur with the exact probabilities the model assigns (chi-square, p > 0.001)."""
    probs = exact_joint(model_dir, prompts[2], depth=3, top_k=3, temperature=1.0)
    llm = make_llm(model_dir, max_model_len=24, max_num_seqs=400, max_num_tokens=4096, num_pages=2600)
    counts = sample_continuations(llm, prompts[2], 1200, depth=3, top_k=3, temperature=1.0)
    assert len(counts) > 9
    assert chi_square_passes(counts, probs)


def test_top_k_1_sampling_equals_greedy(make_llm, model_dir, prompts, one_shot):
    llm = make_llm(model_dir, max_num_tokens=32)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sampled(0, top_k=1))] == one_shot


# ------------------------------------------------------------------------------------------------
# stopping
# ------------------------------------------------------------------------------------------------


def test_max_tokens(make_llm, model_dir, prompts, one_shot):
    llm = make_llm(model_dir, max_num_tokens=32)
    outs = llm.generate(prompts, [greedy(1 + i) for i in range(len(prompts))])
    for i, o in enumerate(outs):
        assert o.outputs[0].token_ids == one_shot[i][: 1 + i] and o.outputs[0].finish_reason == "length"


def test_stop_token_ids(make_llm, model_dir, prompts, one_shot):
    """Generation stops at the first stop token, which is returned last; finish_reason 'stop'."""
    llm = make_llm(model_dir, max_num_tokens=32)
    stops = [ref[4] for ref in one_shot]
    outs = llm.generate(prompts, [greedy(NEW, stop_token_ids=[s]) for s in stops])
    for o, ref, s in zip(outs, one_shot, stops):
        cut = ref.index(s) + 1
        assert o.outputs[0].token_ids == ref[:cut] and o.outputs[0].finish_reason == "stop"
    # a stop id that never appears changes nothing
    never = next(t for t in range(3, 96) if all(t not in ref for ref in one_shot))
    outs = llm.generate(prompts, greedy(NEW, stop_token_ids=[never]))
    assert [o.outputs[0].token_ids for o in outs] == one_shot


@pytest.fixture(scope="module")
def eos_dir(model_dir, one_shot, tmp_path_factory):
    """The tiny checkpoint with eos_token_id set to tokens its greedy continuations actually produce."""
    d = tmp_path_factory.mktemp("tiny_eos") / "m"
    shutil.copytree(model_dir, d)
    conf = json.loads((d / "config.json").read_text())
    conf["eos_token_id"] = [one_shot[0][5], one_shot[2][7]]
    (d / "config.json").write_text(json.dumps(conf))
    # transformers' generate takes EOS from generation_config.json when there is one; so does m3eagle
    gen = json.loads((d / "generation_config.json").read_text())
    gen["eos_token_id"] = conf["eos_token_id"]
    (d / "generation_config.json").write_text(json.dumps(gen))
    return d


def test_eos_and_ignore_eos(make_llm, eos_dir, prompts, one_shot):
    llm = make_llm(eos_dir, max_num_tokens=32)
    eos = {one_shot[0][5], one_shot[2][7]}
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW))
    for o, ref in zip(outs, one_shot):
        hits = [i for i, t in enumerate(ref) if t in eos]
        if hits:
            assert o.outputs[0].token_ids == ref[: hits[0] + 1] and o.outputs[0].finish_reason == "stop"
        else:
            assert o.outputs[0].token_ids == ref and o.outputs[0].finish_reason == "length"
    outs = llm.generate(prompts, greedy(NEW))
    assert [o.outputs[0].token_ids for o in outs] == one_shot


def test_max_model_len_ends_with_length(make_llm, model_dir, prompts, one_shot):
    """Prompt + output never exceed max_model_len."""
    llm = make_llm(model_dir, max_model_len=40, max_num_tokens=16)
    outs = llm.generate([prompts[3][:30], prompts[0]], greedy(100))
    assert len(outs[0].outputs[0].token_ids) == 10 and outs[0].outputs[0].finish_reason == "length"
    assert len(outs[1].outputs[0].token_ids) == 40 - len(prompts[0]) and outs[1].outputs[0].token_ids[:NEW] == one_shot[0]


def test_abort_frees_pages_and_spares_the_others(make_llm, model_dir, prompts, one_shot):
    llm = make_llm(model_dir, max_num_tokens=16, num_pages=50)
    eng = llm.engine
    reqs = [eng.add_request(p, greedy(NEW)) for p in prompts]
    for _ in range(10):
        eng.step()
    eng.abort(reqs[1].request_id)
    eng.abort(reqs[6].request_id)
    while eng.has_work():
        eng.step()
    for i, r in enumerate(reqs):
        if i in (1, 6):
            assert r.finish_reason == "abort" and r.output_token_ids == one_shot[i][: len(r.output_token_ids)]
        else:
            assert r.output_token_ids == one_shot[i] and r.finish_reason == "length"


# ------------------------------------------------------------------------------------------------
# logprobs
# ------------------------------------------------------------------------------------------------


def test_logprobs_match_transformers(make_llm, tiny_model, prompts, one_shot):
    """One logprob per returned token (logprobs=0: the sampled token's alone, rank 1 under greedy), each <= 0
    and equal to log_softmax of transformers' logits at that position (raw logits, greedy) within 1e-4."""
    d, hf = tiny_model
    llm = make_llm(d, max_num_tokens=16)
    outs = llm.generate(prompts, greedy(NEW, logprobs=0))
    for o, ref in zip(outs, one_shot):
        c = o.outputs[0]
        assert c.token_ids == ref and len(c.logprobs) == len(c.token_ids)
        assert all(list(d) == [t] and d[t].rank == 1 and d[t].logprob <= 0 for t, d in zip(c.token_ids, c.logprobs))
        seq = torch.tensor([o.prompt_token_ids + o.outputs[0].token_ids])
        with torch.no_grad():
            lp = torch.log_softmax(hf(seq).logits[0].float(), -1)
        n = len(o.prompt_token_ids)
        want = lp[torch.arange(n - 1, seq.shape[1] - 1), torch.tensor(o.outputs[0].token_ids)]
        got = [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)]
        torch.testing.assert_close(torch.tensor(got), want, atol=1e-4, rtol=0)
    assert all(o.outputs[0].logprobs is None for o in llm.generate(prompts[:2], greedy(NEW)))


def test_logprobs_stop_with_the_tokens(make_llm, model_dir, prompts, one_shot):
    llm = make_llm(model_dir, max_num_tokens=16)
    outs = llm.generate(prompts, [greedy(NEW, logprobs=0, stop_token_ids=[r[3]]) for r in one_shot])
    assert all(len(o.outputs[0].logprobs) == len(o.outputs[0].token_ids) for o in outs)


# ------------------------------------------------------------------------------------------------
# text: tokenizer, detokenization, stop strings
# ------------------------------------------------------------------------------------------------


def first_stop(tok_dir: Path, tokens: list[int], stops: list[str]) -> tuple[list[int], str]:
    """Expected (token_ids, text) for stop strings: tokens up to the one that completes the first stop
    string; text cut before that stop string."""
    for n in range(1, len(tokens) + 1):
        text = decode(tok_dir, tokens[:n])
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return tokens[:n], text[: min(hits)]
    return tokens, decode(tok_dir, tokens)


def test_text_is_the_detokenized_output(make_llm, tok_dir, prompts, one_shot):
    llm = make_llm(tok_dir, max_num_tokens=32)
    outs = llm.generate(prompts, greedy(NEW))
    for o, ref in zip(outs, one_shot):
        assert o.outputs[0].token_ids == ref and o.outputs[0].text == decode(tok_dir, ref)
    text = decode(tok_dir, prompts[2])
    by_text = llm.generate(text, greedy(NEW))[0]
    assert by_text.prompt_token_ids == prompts[2] and by_text.outputs[0].token_ids == one_shot[2]
    assert by_text.prompt == text


def test_deferred_text_equals_streamed_text(make_llm, tok_dir, prompts, one_shot):
    """generate() reads only finished outputs, so its requests without stop strings decode their text once
    at the end (FinalTextDetokenizer) instead of token by token. The result must be the streamed text: the
    same prompts through add_request's default (incremental) path give identical text, as does
    tokenizer.decode; a deferred request's deltas carry no text until its last, which carries all of it;
    an aborted deferred request still gets the text of the tokens it has."""
    from m3eagle.engine.detokenizer import FinalTextDetokenizer, IncrementalDetokenizer

    llm = make_llm(tok_dir, max_num_tokens=32)
    eng = llm.engine
    streamed = [eng.add_request(list(p), greedy(NEW)) for p in prompts]
    deferred = [eng.add_request(list(p), greedy(NEW), stream_text=False) for p in prompts]
    with_stop = eng.add_request(list(prompts[0]), greedy(NEW, stop=["\x01never"]), stream_text=False)
    assert all(type(r.detok) is IncrementalDetokenizer for r in streamed + [with_stop])
    assert all(type(r.detok) is FinalTextDetokenizer for r in deferred)
    texts: dict[str, list[str]] = {r.request_id: [] for r in deferred}
    while eng.has_work():
        for d in eng.step():
            if d.request_id in texts:
                texts[d.request_id].append(d.text)
    for s, d, ref in zip(streamed, deferred, one_shot):
        assert s.output_token_ids == d.output_token_ids == ref
        assert d.text == s.text == decode(tok_dir, ref) and d.text
        chunks = texts[d.request_id]
        assert all(c == "" for c in chunks[:-1]) and chunks[-1] == d.text
    assert with_stop.text == streamed[0].text
    # generate() takes the deferred path and returns the same text
    assert [o.outputs[0].text for o in llm.generate(prompts, greedy(NEW))] == [s.text for s in streamed]
    # abort: the deferred text of what was generated so far
    r = eng.add_request(list(prompts[1]), greedy(64), stream_text=False)
    while len(r.output_token_ids) < 3:
        eng.step()
    eng.abort(r.request_id)
    while eng.has_work():
        eng.step()
    assert r.finish_reason == "abort" and r.text == decode(tok_dir, r.output_token_ids) and r.text


@pytest.mark.parametrize("budget", [64, 5])
def test_stop_strings(make_llm, tok_dir, prompts, one_shot, budget):
    """The output ends with the token that completes the first stop string; .text excludes the stop
    string; nothing after it is returned; finish_reason 'stop'."""
    llm = make_llm(tok_dir, max_num_tokens=budget)
    full = [decode(tok_dir, r) for r in one_shot]
    stops = [[t[8:10]] for t in full[:4]] + [[t[12:13], t[5:7]] for t in full[4:7]] + [["\x01never"]]
    outs = llm.generate(prompts, [greedy(NEW, stop=s) for s in stops])
    for o, ref, s in zip(outs, one_shot, stops):
        want_ids, want_text = first_stop(tok_dir, ref, s)
        assert o.outputs[0].token_ids == want_ids
        assert o.outputs[0].text == want_text and not any(x in o.outputs[0].text for x in s)
        assert o.outputs[0].finish_reason == ("stop" if any(x in decode(tok_dir, ref) for x in s) else "length")
    assert outs[-1].outputs[0].finish_reason == "length" and outs[-1].outputs[0].text == full[-1]
