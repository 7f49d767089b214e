"""Speculative decoding under the overlap scheduler, CPU:

- lossless: greedy with K drafts (random head; trained head on a predictable target) gives exactly the
  greedy tokens without speculation, for a mixed batch with chunked prefill and forced preemption;
  the trained head clears an acceptance floor and beats the random head;
- overlap on == overlap off: greedy and seeded sampling, requests arriving mid-run, preemption (NeedSync),
  stop strings, max_tokens reached inside a verify row;
- the overlap correction hook re-derives exactly the metadata a from-scratch build gives for the true
  lengths, for random rejection patterns;
- rejection sampling through the engine keeps the target distribution.
Every LLM a test builds is checked for leaked pages when the test ends.
"""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from m3eagle import LLM, SamplingParams
from m3eagle.engine.input_builder import build_step_input
from m3eagle.engine.request import Request
from m3eagle.engine.scheduler import ScheduledBatch, ScheduledRow
from m3eagle.kernels.attention.metadata import TRASH_PAGE, build_metadata
from tests.helpers.engine_utils import Counters, assert_clean, chi2_sf, greedy
from tests.helpers.spec_utils import predictable_target, random_head, trained_head

MIXED_LENS = (3, 70, 12, 40, 5, 25, 64, 8, 33, 17, 50, 6, 9, 45, 28, 14, 61, 4)
NEW = 23


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 96, (n,), generator=g).tolist() for n in MIXED_LENS]


@pytest.fixture(scope="module")
def setups(tiny_model, tmp_path_factory):
    """name -> (target dir, Eagle3 head dir): a random head on the random tiny target, and a head
    briefly trained on a target trained on a permutation language (acceptance well above zero)."""
    d = tiny_model[0]
    root = tmp_path_factory.mktemp("spec")
    pred = predictable_target(d, root / "pred_target")
    return {"random": (d, random_head(d, root / "random_head")),
            "trained": (pred, trained_head(pred, root / "trained_head"))}


@pytest.fixture(scope="module")
def baseline(setups, prompts):
    """Greedy without speculation, one-shot prefill, per setup (the lossless reference)."""
    out = {}
    for name, (target, _) in setups.items():
        llm = LLM(target, device="cpu", page_size=16, max_model_len=128, max_num_tokens=2048)
        out[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(NEW))]
        assert_clean(llm)
    return out


def spec_llm(make_llm, setups, name: str, k: int, overlap: bool, **kw) -> LLM:
    target, head = setups[name]
    return make_llm(target, draft=head if k else None, num_draft_tokens=k, overlap=overlap, **kw)


def pages_for_one_seq(k: int, page_size: int = 4, max_model_len: int = 128) -> int:
    return -(-(max_model_len + 2 * (k + 1)) // page_size) + 1


# ------------------------------------------------------------------------------------------------
# lossless speculation
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("name", ["random", "trained"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_greedy_speculation_is_lossless(make_llm, setups, baseline, prompts, name, k, overlap):
    """Invariant 2: 18 prompts of 3..70 tokens, 16-token budget (chunked prefill), a pool of barely two
    sequences, and a preemption forced every 7th plan: greedy with K drafts == greedy without, token for
    token."""
    llm = spec_llm(make_llm, setups, name, k, overlap, max_num_tokens=16,
                   num_pages=pages_for_one_seq(k) + 14)
    c = Counters(llm, force_every=7)
    outs = llm.generate(prompts, greedy(NEW))
    assert [o.outputs[0].token_ids for o in outs] == baseline[name]
    assert c.preempted > 0
    stats = llm.stats()
    assert stats["num_drafted"] > 0 and stats["num_generated_tokens"] == NEW * len(prompts)
    if name == "trained":  # invariant 6: a damaged draft path shows as low acceptance
        assert stats["acceptance_rate"] >= {1: 0.3, 3: 0.2, 5: 0.12}[k]
        assert stats["mean_acceptance_length"] >= {1: 1.3, 3: 1.6, 5: 1.6}[k]
    else:
        assert stats["acceptance_rate"] < 0.1


def test_trained_head_beats_random_head(make_llm, setups, prompts):
    """At K = 3 the trained head's acceptance is above the floor and well above the random head's."""
    rates = {}
    for name in ("random", "trained"):
        llm = spec_llm(make_llm, setups, name, 3, False, max_num_tokens=256)
        llm.generate(prompts, greedy(NEW))
        rates[name] = llm.stats()["acceptance_rate"]
    assert rates["trained"] >= 0.2 and rates["random"] < rates["trained"] / 3


# ------------------------------------------------------------------------------------------------
# overlap on == overlap off
# ------------------------------------------------------------------------------------------------


def on_off(make_llm, setups, name, k, prompts, params, **kw):
    outs = []
    for overlap in (False, True):
        llm = spec_llm(make_llm, setups, name, k, overlap, **kw)
        outs.append(llm.generate(prompts, params))
    return outs


@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("name", ["random", "trained"])
def test_overlap_on_off_identical_greedy(make_llm, setups, baseline, prompts, name, k):
    off, on = on_off(make_llm, setups, name, k, prompts, greedy(NEW), max_num_tokens=24)
    assert [o.outputs[0].token_ids for o in off] == [o.outputs[0].token_ids for o in on] == baseline[name]
    counts = [[(o.metrics.num_drafted, o.metrics.num_accepted) for o in x] for x in (off, on)]
    assert counts[0] == counts[1]


def seeded(n: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=NEW, seed=i, ignore_eos=True) for i in range(n)]


@pytest.mark.parametrize("k", [0, 3])
def test_overlap_on_off_identical_seeded_sampling(make_llm, setups, prompts, k):
    """Seeded sampling (rejection sampling when K > 0) gives the same tokens with overlap on and off, and
    in another batch order (same drafting pattern: the budget never truncates a verify row)."""
    params = seeded(8)
    off, on = on_off(make_llm, setups, "trained", k, prompts[:8], params, max_num_tokens=24)
    assert [o.outputs[0].token_ids for o in off] == [o.outputs[0].token_ids for o in on]
    other = spec_llm(make_llm, setups, "trained", k, True, max_num_tokens=512).generate(
        prompts[:8][::-1], params[::-1])[::-1]
    assert [o.outputs[0].token_ids for o in other] == [o.outputs[0].token_ids for o in on]


_NOT_PATHWISE = pytest.mark.xfail(strict=False, reason=(
    "seeded speculative sampling is not pathwise reproducible: whether a row verifies drafts depends on "
    "the batch (token budget, preemption); a row without drafts samples with SALT_SAMPLE where a verify "
    "row uses SALT_ACCEPT + the residual, so the same seed gives other tokens. Needs coupled "
    "verification (accept d_j iff it equals the target's own seeded sample at that position). Not strict: "
    "whether this workload happens to diverge depends on the triton build's rounding."))


@pytest.mark.parametrize("k", [0, pytest.param(3, marks=_NOT_PATHWISE)])
def test_seeded_sampling_independent_of_batch_mates(make_llm, setups, prompts, k):
    """m3eagle/sampling/sampler.py promises a seeded request reproduces its output whatever else shares
    its batch. Alone vs behind another running request under a 6-token budget (its verify rows lose
    their drafts) vs in a pool small enough to preempt it: the same tokens."""
    params = seeded(8)
    alone = spec_llm(make_llm, setups, "trained", k, True, max_num_tokens=512)
    ref = alone.generate([prompts[1]], params[1])[0]
    crowded = spec_llm(make_llm, setups, "trained", k, True, max_num_tokens=6)
    undrafted = []  # request ids of continuing rows planned without drafts
    schedule = crowded.engine.scheduler.schedule

    def spy(*args):
        batch = schedule(*args)
        undrafted.extend(r.req.request_id for r in batch.rows if r.gather and r.num_drafts == 0)
        return batch

    crowded.engine.scheduler.schedule = spy
    long_runner = SamplingParams(temperature=0.9, max_tokens=90, seed=99, ignore_eos=True)
    got = crowded.generate([prompts[0], prompts[1]], [long_runner, params[1]])[1]
    if k:
        assert got.request_id in undrafted  # the budget really took drafts away from it
    assert got.outputs[0].token_ids == ref.outputs[0].token_ids
    small = spec_llm(make_llm, setups, "trained", k, True, max_num_tokens=24,
                     num_pages=pages_for_one_seq(k) + 8)
    c = Counters(small, force_every=5)
    outs = small.generate(prompts[:8], params)
    assert c.preempted > 0
    assert outs[1].outputs[0].token_ids == ref.outputs[0].token_ids


@pytest.mark.parametrize("name", ["random", "trained"])
def test_overlap_preemption_needsync(make_llm, setups, baseline, prompts, name):
    """A tiny pool under overlap forces preemptions of requests with a step in flight (NeedSync, then a
    drained re-plan); output still equals the baseline and equals overlap off."""
    k = 3
    kw = dict(max_num_tokens=32, num_pages=pages_for_one_seq(k) + 4)
    llms = [spec_llm(make_llm, setups, name, k, ov, **kw) for ov in (False, True)]
    counters = [Counters(x, force_every=6) for x in llms]
    outs = [[o.outputs[0].token_ids for o in x.generate(prompts, greedy(NEW))] for x in llms]
    assert outs[0] == outs[1] == baseline[name]
    assert counters[1].needsync > 0 and counters[1].preempted > 0


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_requests_arriving_mid_run(make_llm, setups, baseline, prompts, k, overlap):
    """New prompts join while others decode (engine.add_request between engine.step calls): every
    request still gets exactly its baseline tokens."""
    llm = spec_llm(make_llm, setups, "trained", k, overlap, max_num_tokens=20, num_pages=80)
    eng = llm.engine
    reqs = {i: eng.add_request(prompts[i], greedy(NEW)) for i in range(3)}
    nxt, steps = 3, 0
    while eng.has_work() or nxt < len(prompts):
        eng.step()
        steps += 1
        if steps % 2 == 0 and nxt < len(prompts):
            reqs[nxt] = eng.add_request(prompts[nxt], greedy(NEW))
            nxt += 1
    assert [reqs[i].output_token_ids for i in range(len(prompts))] == baseline["trained"]


def test_max_tokens_inside_a_verify_row(make_llm, setups, baseline, prompts):
    """max_tokens not a multiple of K + 1: the row that crosses it is cut, exactly max_tokens tokens come
    back, overlap on == off, and the cut really happened mid-row (more tokens emitted than needed)."""
    k = 3
    max_tokens = [5, 6, 7, 9, 10, 11, 13, 14] * 3
    params = [greedy(m) for m in max_tokens[: len(prompts)]]
    results, cuts = [], []
    for overlap in (False, True):
        llm = spec_llm(make_llm, setups, "trained", k, overlap, max_num_tokens=64)
        eng, append = llm.engine, llm.engine._append

        def spy(req, tokens, lps, append=append):
            left = req.params.max_tokens - len(req.output_token_ids)
            cuts.append(len(tokens) > left > 0)
            return append(req, tokens, lps)

        eng._append = spy
        results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert results[0] == results[1]
    assert results[0] == [ref[: p.max_tokens] for ref, p in zip(baseline["trained"], params)]
    assert any(cuts)


def tokenizer_dir(target, tmp_path):
    """A copy of `target` with a one-character-per-token tokenizer for its 96 ids (0-2 special)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    d = tmp_path / "with_tok"
    shutil.copytree(target, d)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    vocab.update({chr(33 + i): 3 + i for i in range(93)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<pad>", "<s>", "</s>"])
    tok.save(str(d / "tokenizer.json"))
    return d, tok


@pytest.mark.parametrize("k", [0, 3])
def test_stop_strings_and_ids_with_overlap(make_llm, setups, baseline, prompts, tmp_path, k):
    """Stops are seen one step late under overlap; tokens past a stop are discarded, so outputs, texts and
    finish reasons equal overlap off and the non-speculative reference."""
    target, head = setups["trained"]
    d, tok = tokenizer_dir(target, tmp_path)
    ref = baseline["trained"]
    params = []
    for i, r in enumerate(ref):
        text = tok.decode(r, skip_special_tokens=True)
        stop = {"stop": [text[6 + i % 5: 8 + i % 5]]} if i % 3 else {"stop_token_ids": [r[3 + i % 7]]}
        params.append(greedy(NEW, **stop))
    outs = []
    for overlap in (False, True):
        llm = make_llm(d, draft=head if k else None, num_draft_tokens=k, overlap=overlap, max_num_tokens=24)
        outs.append(llm.generate(prompts, params))
    for x, y in zip(*outs):
        a, b = x.outputs[0], y.outputs[0]
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (b.token_ids, b.text, b.finish_reason,
                                                                          b.stop_reason)
    for o, r, p in zip(outs[1], ref, params):
        assert o.outputs[0].finish_reason == "stop" and r[: len(o.outputs[0].token_ids)] == o.outputs[0].token_ids
        if p.stop:
            n = next(n for n in range(1, len(r) + 1) if p.stop[0] in tok.decode(r[:n], skip_special_tokens=True))
            assert len(o.outputs[0].token_ids) == n and p.stop[0] not in o.outputs[0].text
        else:
            assert o.outputs[0].token_ids == r[: r.index(p.stop_token_ids[0]) + 1]


def test_abort_under_overlap_frees_pages(make_llm, setups, baseline, prompts):
    llm = spec_llm(make_llm, setups, "trained", 3, True, max_num_tokens=16, num_pages=60)
    eng = llm.engine
    reqs = [eng.add_request(p, greedy(NEW)) for p in prompts]
    for _ in range(8):
        eng.step()
    eng.abort(reqs[0].request_id)
    eng.abort(reqs[-1].request_id)
    eng.step()
    eng.abort(reqs[2].request_id)
    while eng.has_work():
        eng.step()
    for i, r in enumerate(reqs):
        want = baseline["trained"][i]
        assert r.output_token_ids == want[: len(r.output_token_ids)]
        assert (r.finish_reason == "abort") == (i in (0, 2, len(reqs) - 1))


# ------------------------------------------------------------------------------------------------
# the correction hook
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_overlap_correction_matches_from_scratch_metadata(make_llm, setups, seed):
    """For random rejection patterns of the step in flight, ModelRunner._apply_overlap_correction gathers
    [last emitted token, drafts] into verify rows and yields the positions / slots / KV lengths that
    build_metadata gives for the true lengths; rows without correction are untouched."""
    k, ps = 3, 4
    llm = spec_llm(make_llm, setups, "random", k, True, max_num_seqs=8)
    runner = llm.engine.runner
    rng = random.Random(seed)
    pages = list(range(1, llm.engine.pool.num_pages))
    rng.shuffle(pages)
    rows, true_kv, want_ids = [], [], []
    for b in range(rng.randint(2, 7)):
        kind = rng.choice(["verify_corrected", "verify_processed", "prefill_chunk", "decode_corrected"])
        true_start = rng.randint(1, 40)
        req = Request(f"r{b}", list(range(3, 3 + true_start + 1)), greedy(NEW), b, b)
        req.slot = b
        nd = 0 if kind == "decode_corrected" else k
        if kind in ("verify_corrected", "decode_corrected"):
            prev_k = rng.choice([0, k])  # the step in flight was a plain sample or a verify row
            num_new = rng.randint(1, prev_k + 1)
            runner.slot_num_new[b] = num_new
            runner.slot_dev[b] = num_new - (prev_k + 1)
            opt_start = true_start + (prev_k + 1 - num_new)
            correct = True
        else:
            num_new = rng.randint(1, k + 1)
            runner.slot_num_new[b] = num_new
            runner.slot_dev[b] = num_new - (k + 1)
            opt_start, correct = true_start, False
        runner.slot_tokens[b] = torch.randint(3, 96, (k + 1,))
        runner.slot_drafts[b] = torch.randint(3, 96, (k,))
        if kind == "prefill_chunk":
            toks = [rng.randint(3, 95) for _ in range(rng.randint(1, 9))]
            row = ScheduledRow(req, opt_start, toks, 0, False, False, False, 5)
            want_ids += toks
        else:
            row = ScheduledRow(req, opt_start, [0] * (1 + nd), nd, True, True, correct, 0)
            last = runner.slot_tokens[b, num_new - 1].item()
            want_ids += [last] + runner.slot_drafts[b, :nd].tolist()
        need = -(-(row.kv_len + k - 1) // ps)
        req.pages, pages = pages[:need], pages[need:]
        rows.append(row)
        true_kv.append(true_start + row.num_tokens)
    width = llm.engine.table_width
    inp = build_step_input(ScheduledBatch(rows, []), ps, width, torch.device("cpu"))
    ids, meta = runner._apply_overlap_correction(inp)
    assert ids.tolist() == want_ids
    scratch = build_metadata([r.num_tokens for r in rows], torch.tensor(true_kv), inp.meta.page_table, ps,
                             torch.device("cpu"), inp.meta.max_kv)
    assert meta.kv_lens.tolist() == true_kv
    assert torch.equal(meta.positions, scratch.positions)
    assert torch.equal(meta.slot_mapping, scratch.slot_mapping)
    assert not (meta.slot_mapping // ps == TRASH_PAGE).any()
    again = meta.with_lengths(meta.kv_lens)  # idempotent
    assert torch.equal(again.slot_mapping, meta.slot_mapping) and torch.equal(again.positions, meta.positions)


# ------------------------------------------------------------------------------------------------
# rejection sampling through the engine
# ------------------------------------------------------------------------------------------------


def test_speculative_sampling_keeps_the_target_distribution(make_llm, setups):
    """Invariant 3 end to end: with K = 3 drafts (tokens 2 and 3 come out of verify rows: accepted drafts,
    residual resamples or bonus tokens), the joint distribution of the first three sampled tokens over
    1200 seeds matches the target's exact top-3 probabilities (chi-square, p > 0.001)."""
    from m3eagle.loader.checkpoint import load_target

    target, _ = setups["trained"]
    prompt = [7, 19, 33, 50, 61, 12]
    m = load_target(target)
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(3):
        nxt = {}
        for prefix, pr in probs.items():
            with torch.no_grad():
                h = m.forward_seq(torch.tensor([prompt + list(prefix)]))[0][0, -1:]
                p = torch.softmax(m.compute_logits(h)[0].double(), -1)
            top = p.topk(3)
            for t, v in zip(top.indices.tolist(), (top.values / top.values.sum()).tolist()):
                nxt[prefix + (t,)] = pr * v
        probs = nxt
    llm = spec_llm(make_llm, setups, "trained", 3, True, max_model_len=24, max_num_seqs=400,
                   max_num_tokens=4096, num_pages=2600)
    n = 1200
    params = [SamplingParams(temperature=1.0, top_k=3, max_tokens=3, seed=s, ignore_eos=True) for s in range(n)]
    counts: dict[tuple[int, ...], int] = {}
    for o in llm.generate([prompt] * n, params):
        counts[tuple(o.outputs[0].token_ids)] = counts.get(tuple(o.outputs[0].token_ids), 0) + 1
    assert llm.stats()["num_accepted"] > 0.05 * n  # drafts really were accepted
    assert set(counts) <= set(probs)
    x = sum((counts.get(t, 0) - n * p) ** 2 / (n * p) for t, p in probs.items())
    df = len(probs) - 1
    assert chi2_sf(x, df) > 1e-3
