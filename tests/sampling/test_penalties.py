"""History-dependent sampling (sampling/penalties.py) and the SamplingParams added with it, on CPU:
repetition / presence / frequency penalties, min_tokens and min_p change the target distribution, and
speculation still reproduces it exactly (greedy token for token, sampled by chi-square with K=3); top-N and
prompt logprobs; n samples sharing the prompt's pages; every bad value names its field.

The engine tests use the embedded trained pair (acceptance ~2.7 of 4 at K=3), so verify rows really carry
accepted drafts whose penalty contributions matter; transformers 5.17 is the oracle for the model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from m3eagle import LLM, Logprob, SamplingParams
from m3eagle.engine.llm_engine import sample_seed
from m3eagle.sampling.params import SamplingParamsError
from m3eagle.sampling.penalties import PenaltyState, PenaltyTensors, penalize_reference
from m3eagle.sampling.sampler import SALT_DRAFT, SamplingTensors, probs_from_logits, sample_from_probs
from m3eagle.sampling.verify import verify
from tests.sampling.test_sampling import passes_chi_square, reference_probs

TARGET = Path(__file__).resolve().parents[2] / "m3eagle" / "assets" / "default" / "target"
PROMPTS = ["def add(a, b):", "import os\n", "class Foo:\n    def __init__(self):"]
NEW = 24

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def spec():
    return LLM(device="cpu", num_draft_tokens=3, max_model_len=128)


@pytest.fixture(scope="module")
def plain():
    return LLM(device="cpu", num_draft_tokens=0, max_model_len=128)


@pytest.fixture(scope="module")
def hf():
    from transformers import MiniMaxM3VLForCausalLM

    return MiniMaxM3VLForCausalLM.from_pretrained(str(TARGET), dtype=torch.float32).eval()


def ids_of(llm: LLM, prompts: list[str], sp: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


def hf_generate(hf, prompt_ids: list[int], **kw) -> list[int]:
    x = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = hf.generate(x, do_sample=False, pad_token_id=0, **kw)
    return out[0, x.shape[1]:].tolist()


# ------------------------------------------------------------------------------------------------
# greedy: transformers and speculation agree
# ------------------------------------------------------------------------------------------------


def test_repetition_penalty_matches_transformers_with_and_without_speculation(spec, plain, hf):
    sp = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, repetition_penalty=1.3)
    want = [hf_generate(hf, spec.encode(p), max_new_tokens=NEW, repetition_penalty=1.3, eos_token_id=None)
            for p in PROMPTS]
    assert ids_of(plain, PROMPTS, sp) == want
    spec.reset_stats()
    assert ids_of(spec, PROMPTS, sp) == want
    assert spec.stats()["num_accepted"] > 0  # drafts were accepted: their penalty contributions were used
    unpenalised = ids_of(plain, PROMPTS, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    assert unpenalised != want


@pytest.mark.parametrize("kw", [dict(presence_penalty=1.2), dict(frequency_penalty=0.8),
                                dict(presence_penalty=-0.5, frequency_penalty=0.6, repetition_penalty=1.1)])
def test_presence_frequency_penalties_are_lossless_under_speculation(spec, plain, kw):
    sp = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, **kw)
    base = ids_of(plain, PROMPTS, sp)
    assert ids_of(spec, PROMPTS, sp) == base
    assert base != ids_of(plain, PROMPTS, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    # the reference definition, one position at a time, on the target's own logits
    for p, out in zip(PROMPTS[:1], base[:1]):
        prompt = spec.encode(p)
        seq = torch.tensor([prompt + out])
        with torch.no_grad():
            logits = spec.target.compute_logits(spec.target.forward_seq(seq)[0][0])
        for i, t in enumerate(out):
            ref = penalize_reference(logits[len(prompt) - 1 + i], prompt, out[:i], kw.get("presence_penalty", 0.0),
                                     kw.get("frequency_penalty", 0.0), kw.get("repetition_penalty", 1.0))
            assert ref.argmax().item() == t


@pytest.mark.parametrize("k", [0, 3])
def test_min_tokens_holds_back_stops_like_min_new_tokens(spec, plain, hf, k):
    """A stop token the model would emit early (its 2nd output token) and EOS are held back for min_tokens
    tokens, as transformers' min_new_tokens holds back its eos ids; after that the stop ends the output."""
    llm = spec if k else plain
    prompt = PROMPTS[1]
    free = ids_of(plain, [prompt], SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))[0]
    stop = free[1]
    early = ids_of(llm, [prompt], SamplingParams(temperature=0, max_tokens=NEW, stop_token_ids=[stop]))[0]
    assert early == free[:2]
    # plus 40 more stop ids nothing emits: the whole list travels in the step's packed buffers
    stops = [stop] + [t for t in range(4000, 4100) if t not in free][:40]
    sp = SamplingParams(temperature=0, max_tokens=NEW, stop_token_ids=stops, min_tokens=6)
    out = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    eos = list(llm.target.cfg.eos_token_ids)
    want = hf_generate(hf, llm.encode(prompt), max_new_tokens=NEW, min_new_tokens=6, eos_token_id=[*stops, *eos])
    assert out.token_ids == want and len(out.token_ids) > 6
    assert stop not in out.token_ids[:6]
    if out.finish_reason == "stop":
        assert out.token_ids[-1] in stops


# ------------------------------------------------------------------------------------------------
# sampled: rejection sampling against the penalised target, K=3 (chi-square)
# ------------------------------------------------------------------------------------------------

B, K, V = 24000, 3, 6
RAW = torch.tensor([[1.0, 0.5, 0.0, 1.2, -0.5, 0.8],
                    [0.3, 1.1, 0.6, -0.2, 0.9, 0.4],
                    [0.8, 0.0, 1.3, 0.5, 0.2, -0.4],
                    [0.1, 0.7, 0.4, 0.9, -0.3, 1.0]])
Q = torch.tensor([[0.10, 0.30, 0.10, 0.30, 0.10, 0.10],
                  [0.20, 0.20, 0.25, 0.05, 0.20, 0.10],
                  [0.15, 0.15, 0.30, 0.20, 0.10, 0.10]])
PROMPT, OUTPUT = [0, 2, 2], [3, 1, 3]  # the history before the verify row
PEN = dict(presence=0.6, frequency=0.4, repetition=1.5, min_tokens=5, stop=(5,))
TEMP = 0.9


def _history_state(n: int) -> PenaltyState:
    """Every slot holds the same history (as record_inputs / record_outputs would leave it)."""
    st = PenaltyState(n + 1, V, eos_ids=[], dump_slot=n, device=torch.device("cpu"))
    st.in_prompt[:, PROMPT] = True
    for t in OUTPUT:
        st.counts[:, t] += 1
    st.stop_mask[:, list(PEN["stop"])] = True
    return st


def _target(history_out: list[int], pos: int) -> torch.Tensor:
    """The penalised target distribution at verify position `pos` given the output so far (reference)."""
    logits = penalize_reference(RAW[pos], PROMPT, OUTPUT + history_out, PEN["presence"], PEN["frequency"], PEN["repetition"],
                                PEN["min_tokens"], PEN["stop"])
    return reference_probs(logits, TEMP, 0, 1.0)


@pytest.fixture(scope="module")
def penalised_run():
    st = SamplingTensors(temperature=torch.full((B,), TEMP), top_k=torch.zeros(B, dtype=torch.int64),
                         top_p=torch.ones(B), seed=torch.arange(B, dtype=torch.int64) + 5000,
                         greedy=torch.zeros(B, dtype=torch.bool))
    prompt_len = len(PROMPT)
    # the row's last accepted token sits at position prompt_len + len(OUTPUT) - 1 (it is OUTPUT[-1])
    pos = (prompt_len + len(OUTPUT) - 1 + torch.arange(K + 1))[None].expand(B, -1).contiguous()
    q = Q[None].expand(B, -1, -1).contiguous()
    drafts = torch.stack([sample_from_probs(q[:, j], st.seed, pos[:, j], SALT_DRAFT) for j in range(K)], 1)
    rows = torch.arange(B)
    pt = PenaltyTensors(presence=torch.full((B,), PEN["presence"]), frequency=torch.full((B,), PEN["frequency"]),
                        repetition=torch.full((B,), PEN["repetition"]),
                        min_tokens=torch.full((B,), PEN["min_tokens"]), prompt_len=torch.full((B,), prompt_len),
                        ignore_eos=torch.ones(B, dtype=torch.bool), reset=torch.zeros(B, dtype=torch.bool),
                        src_slot=torch.full((B,), B), stop_ids=torch.zeros(0, dtype=torch.int64),
                        stop_rows=torch.zeros(0, dtype=torch.int64))
    state = _history_state(B)
    logits = state.apply(RAW[None].expand(B, -1, -1).contiguous(), pt, rows, drafts, torch.full((B,), K), pos)
    new, num_new = verify(logits, drafts, torch.full((B,), K), st, pos, q)
    state.record_outputs(new, num_new, rows)
    return dict(drafts=drafts, new=new, num_new=num_new, state=state)


def test_penalised_logits_equal_the_reference_per_position(penalised_run):
    """Position j is penalised with the history plus drafts d_1..d_j (and min_tokens by output index)."""
    r = penalised_run
    for b in range(5):
        d = r["drafts"][b].tolist()
        for j in range(K + 1):
            want = penalize_reference(RAW[j], PROMPT, OUTPUT + d[:j], PEN["presence"], PEN["frequency"],
                                      PEN["repetition"], PEN["min_tokens"], PEN["stop"])
            st = _history_state(1)
            pt = PenaltyTensors(*(torch.tensor([x]) for x in (PEN["presence"], PEN["frequency"], PEN["repetition"],
                                                             PEN["min_tokens"], len(PROMPT), True, False, 1)),
                                stop_ids=torch.zeros(0, dtype=torch.int64), stop_rows=torch.zeros(0, dtype=torch.int64))
            pos = torch.tensor([[len(PROMPT) + len(OUTPUT) - 1 + i for i in range(K + 1)]])
            got = st.apply(RAW[None].clone(), pt, torch.tensor([0]), torch.tensor([d]), torch.tensor([K]), pos)[0, j]
            torch.testing.assert_close(got, want)


def test_penalised_rejection_sampling_follows_the_penalised_target(penalised_run):
    """Each emitted token follows the penalised target given the tokens before it: the first from p_0, the
    one after an accepted d_1 = x from p_1(. | x), after (x, y) from p_2(. | x, y). Position 0 and 1 still hold
    back the stop token 5 (min_tokens=5 with 3 tokens out); positions 2 and 3 may emit it."""
    r = penalised_run
    new, num_new, d = r["new"], r["num_new"], r["drafts"]
    assert passes_chi_square(new[:, 0], _target([], 0))
    assert (new[:, 0] != 5).all() and (new[num_new >= 2, 1] != 5).all()
    # condition on an accepted draft not yet in the output, so that counting it changes the target visibly
    acc = d[num_new >= 2, 0]
    x = max((0, 2, 4), key=lambda t: int((acc == t).sum()))
    sel = (num_new >= 2) & (d[:, 0] == x)
    assert sel.sum() > 1000
    assert passes_chi_square(new[sel, 1], _target([x], 1))
    # negative control: the same tokens against the target that forgets the accepted draft
    assert not passes_chi_square(new[sel, 1], _target([], 1))
    sel2 = (num_new >= 3) & (d[:, 0] == x)
    y = torch.mode(d[sel2, 1]).values.item()
    sel2 &= d[:, 1] == y
    assert sel2.sum() > 300
    assert passes_chi_square(new[sel2, 2], _target([x, y], 2))
    assert (new[sel2, 2] == 5).any()  # min_tokens reached: the stop token is back


def test_emitted_tokens_are_counted_once(penalised_run):
    r = penalised_run
    counts = r["state"].counts[:B]
    added = counts - torch.bincount(torch.tensor(OUTPUT), minlength=V)[None]
    assert torch.equal(added.sum(-1), r["num_new"].to(torch.int32))
    b = 0
    n = r["num_new"][b].item()
    assert torch.equal(added[b], torch.bincount(r["new"][b, :n], minlength=V).to(torch.int32))


def test_min_p_drops_tokens_below_min_p_times_the_top():
    logits = torch.tensor([[2.0, 1.5, 0.0, -1.0, 1.9, -3.0]])
    for min_p in (0.0, 0.2, 0.5, 1.0):
        st = SamplingTensors(torch.tensor([0.7]), torch.tensor([0]), torch.tensor([1.0]), torch.tensor([0]),
                             torch.tensor([False]), torch.tensor([min_p]))
        p = torch.softmax(logits[0] / 0.7, -1)
        keep = p >= min_p * p.max()
        torch.testing.assert_close(probs_from_logits(logits, st)[0], torch.where(keep, p, 0) / p[keep].sum())


# ------------------------------------------------------------------------------------------------
# logprobs
# ------------------------------------------------------------------------------------------------


def test_top_logprobs_are_the_penalised_target_log_softmax(spec):
    """logprobs=5 under speculation: per token the sampled one plus the top 5 of log_softmax of the
    penalised logits (ranks 1..5), computed here from the reference definition."""
    kw = dict(repetition_penalty=1.2, presence_penalty=0.3)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5, **kw)
    o = spec.generate(PROMPTS[0], sp, use_tqdm=False)[0]
    c, prompt = o.outputs[0], o.prompt_token_ids
    seq = torch.tensor([prompt + c.token_ids])
    with torch.no_grad():
        logits = spec.target.compute_logits(spec.target.forward_seq(seq)[0][0])
    total = 0.0
    for i, (t, d) in enumerate(zip(c.token_ids, c.logprobs)):
        lsm = torch.log_softmax(penalize_reference(logits[len(prompt) - 1 + i], prompt, c.token_ids[:i],
                                                   kw["presence_penalty"], 0.0, kw["repetition_penalty"]), -1)
        top = lsm.topk(5)
        assert isinstance(d[t], Logprob) and d[t].rank == 1 and list(d)[0] == t
        assert len(d) == 5 and [x.rank for x in d.values()] == [1, 2, 3, 4, 5]
        assert sorted(d) == sorted(top.indices.tolist())
        for tid, x in d.items():
            assert math.isclose(x.logprob, lsm[tid].item(), abs_tol=1e-4)
            assert x.decoded_token == spec.tokenizer.decode([tid])
        total += d[t].logprob
    assert math.isclose(c.cumulative_logprob, total, rel_tol=1e-9)


def test_prompt_logprobs_match_transformers(plain, hf):
    o = plain.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3), use_tqdm=False)[0]
    ids = o.prompt_token_ids
    with torch.no_grad():
        lsm = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    plp = o.prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None
    for p in range(1, len(ids)):
        d = plp[p]
        assert list(d)[0] == ids[p] and math.isclose(d[ids[p]].logprob, lsm[p - 1, ids[p]].item(), abs_tol=1e-4)
        assert d[ids[p]].rank == int((lsm[p - 1] > lsm[p - 1, ids[p]]).sum()) + 1
        top = {x for x, lp in d.items() if lp.rank <= 3}
        assert top == set(lsm[p - 1].topk(3).indices.tolist())


# ------------------------------------------------------------------------------------------------
# n samples
# ------------------------------------------------------------------------------------------------


def test_n_samples_share_the_prompt_and_are_reproducible(spec, plain, monkeypatch):
    prompt = "def fibonacci(n):\n    if n < 2:\n        return n\n    return"  # longer than a 16-token page
    sp = SamplingParams(temperature=1.0, top_k=40, max_tokens=10, seed=11, n=4, ignore_eos=True)
    pool = plain.engine.pool
    shared = []
    share = pool.share
    monkeypatch.setattr(pool, "share", lambda owner, pages: (shared.append(len(pages)), share(owner, pages)))
    o = plain.generate(prompt, sp, use_tqdm=False)[0]
    assert len(plain.encode(prompt)) > 16 and shared == [len(plain.encode(prompt)) // 16] * 3
    outs = [c.token_ids for c in o.outputs]
    assert [c.index for c in o.outputs] == [0, 1, 2, 3] and len({tuple(t) for t in outs}) == 4
    assert [c.token_ids for c in plain.generate(prompt, sp, use_tqdm=False)[0].outputs] == outs
    # sample i is the n=1 request with sample i's seed: sharing the prompt's pages changed nothing
    for i in (0, 3):
        one = SamplingParams(temperature=1.0, top_k=40, max_tokens=10, seed=sample_seed(11, i), ignore_eos=True)
        assert plain.generate(prompt, one, use_tqdm=False)[0].outputs[0].token_ids == outs[i]
    a = [c.token_ids for c in spec.generate(prompt, sp, use_tqdm=False)[0].outputs]
    assert a == [c.token_ids for c in spec.generate(prompt, sp, use_tqdm=False)[0].outputs]
    assert len({tuple(t) for t in a}) == 4
    assert spec.engine.is_idle_and_clean() and plain.engine.is_idle_and_clean()


@pytest.mark.parametrize("overlap", [False, True])
def test_n_samples_with_penalties_and_preemption(model_dir, make_llm, overlap):
    """Samples that share prompt pages copy the parent's prompt mask (repetition penalty covers the whole
    prompt), also through preemptions in a tiny pool and under overlap; greedy samples of one prompt are
    then identical."""
    from tests.helpers.engine_utils import Counters

    llm = make_llm(model_dir, max_num_tokens=16, num_pages=24, max_num_seqs=4, max_model_len=64, overlap=overlap)
    prompt = list(range(3, 30))
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.5)
    one = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
    counters = Counters(llm)
    o = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.5,
                                              n=3), use_tqdm=False)[0]
    assert counters.preempted > 0
    assert [c.token_ids for c in o.outputs] == [one] * 3
    unpenalised = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert unpenalised[0].outputs[0].token_ids != one


# ------------------------------------------------------------------------------------------------
# text and validation
# ------------------------------------------------------------------------------------------------


def test_include_stop_str_in_output(plain):
    ref = plain.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    text = ref[0].outputs[0].text
    stop = text[4:7]
    kept = plain.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop],
                                                     include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[: text.find(stop) + len(stop)] and kept.stop_reason == stop
    # min_tokens: a stop string does not end the output before min_tokens tokens (vLLM)
    held = plain.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop],
                                                     min_tokens=12), use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= 12 and len(held.token_ids) > len(kept.token_ids)


@pytest.mark.parametrize("kw, field", [
    ({"n": 0}, "n"), ({"n": 1.5}, "n"), ({"n": True}, "n"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"presence_penalty": float("nan")}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"), ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 17, "max_tokens": 16}, "min_tokens"),
    ({"min_tokens": 1.0}, "min_tokens"), ({"min_tokens": 1, "stop_token_ids": list(range(65))}, "min_tokens"),
    ({"min_p": 1.5}, "min_p"), ({"min_p": -0.1}, "min_p"),
    ({"logprobs": True}, "logprobs"), ({"logprobs": -1}, "logprobs"), ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": 30}, "prompt_logprobs"), ({"prompt_logprobs": 2.0}, "prompt_logprobs"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
])
def test_bad_values_name_the_field(kw, field):
    with pytest.raises(SamplingParamsError, match=f"^{field}="):
        SamplingParams(**kw)
