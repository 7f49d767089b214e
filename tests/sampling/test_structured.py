"""Structured output's pieces: StructuredOutputsParams validation, the grammar compiler and its errors, the
torch bitmask against xgrammar's, a sequence's matcher (advance / rollback / sync), the K+1 verify masks of a
step, and rejection sampling against the masked target (exact distribution, chi-square)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import xgrammar as xgr

from m3eagle.engine.structured_step import GrammarStep
from m3eagle.loader.assets import default_model_paths
from m3eagle.loader.tokenizer import load_tokenizer
from m3eagle.sampling.params import SamplingParams, SamplingParamsError, StructuredOutputsParams
from m3eagle.sampling.sampler import SamplingTensors
from m3eagle.sampling.structured import (
    GrammarCompiler,
    GrammarError,
    allowed_from_bitmask,
    apply_bitmask,
    full_bitmask,
    tokenizer_info,
)
from m3eagle.sampling.verify import verify
from tests.helpers.engine_utils import chi2_sf

V = 8192


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_model_paths()[0])


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok.tok, V, [0])


def _allowed(matcher_or_grammar, vocab: int = V) -> set[int]:
    bm = full_bitmask(1, vocab)
    matcher_or_grammar.fill(bm, 0)
    return set(torch.nonzero(allowed_from_bitmask(bm, vocab)[0]).flatten().tolist())


# ---- params -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, field", [
    ({}, "set exactly one"), ({"regex": "a", "choice": ["x"]}, "set exactly one"),
    ({"choice": []}, "structured_outputs.choice"), ({"choice": ["a", 3]}, "structured_outputs.choice"),
    ({"json": "{not json"}, "structured_outputs.json"), ({"json": 3}, "structured_outputs.json"),
    ({"regex": ""}, "structured_outputs.regex"), ({"grammar": 5}, "structured_outputs.grammar"),
])
def test_params_name_the_bad_field(kw, field):
    with pytest.raises(SamplingParamsError, match=field):
        StructuredOutputsParams(**kw)


def test_sampling_params_take_a_dict_and_refuse_min_tokens():
    sp = SamplingParams(structured_outputs={"json": '{"type": "object"}'})
    assert sp.structured_outputs.kind == "json" and sp.structured_outputs.json == {"type": "object"}
    with pytest.raises(SamplingParamsError, match="unknown keys"):
        SamplingParams(structured_outputs={"schema": {}})
    with pytest.raises(SamplingParamsError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs={"regex": "a+"})
    sp = SamplingParams()
    sp.structured_outputs = {"choice": []}  # assigned later: validate() sees it
    with pytest.raises(SamplingParamsError, match="choice"):
        sp.validate()


# ---- compiler -----------------------------------------------------------------------------------------


def test_tokenizer_info_detects_what_xgrammar_detects(tok):
    ours = tokenizer_info(tok.tok, V, [0])
    theirs = xgr.TokenizerInfo._detect_metadata_from_hf(tok.tok.to_str())
    assert ours.vocab_type == theirs["vocab_type"] == xgr.VocabType.BYTE_LEVEL
    assert ours.add_prefix_space == theirs["add_prefix_space"]
    assert ours.decoded_vocab[tok.encode(" Z")[0]] == b" Z"  # byte-level "\u0120Z" decoded


@pytest.mark.parametrize("so, field", [
    (StructuredOutputsParams(regex="("), "regex"), (StructuredOutputsParams(json={"type": "foo"}), "json"),
    (StructuredOutputsParams(grammar="root ::= undefined_rule"), "grammar"),
    (StructuredOutputsParams(grammar='start ::= "a"'), "grammar"),
])
def test_compile_errors_name_the_field(compiler, so, field):
    with pytest.raises(GrammarError, match=rf"^structured_outputs\.{field} cannot be compiled: \w") as e:
        compiler.compile(so)
    assert e.value.field == field and "/project/" not in str(e.value)


def test_compile_cache_and_choice(compiler, tok):
    a = compiler.compile(StructuredOutputsParams(choice=["yes", "no"]))
    assert compiler.compile(StructuredOutputsParams(choice=["yes", "no"])) is a
    g = compiler.matcher(a)
    assert {tok.decode([t]) for t in _allowed(g)} <= {"y", "n", "no", "ye", "yes"}
    assert g.advance(tok.encode("no")) == 1 and _allowed(g) == {0}  # only EOS once the choice is complete
    assert g.accept(0) and g.terminated and _allowed(g) == set(range(V))  # terminated: any mask will do


def test_matcher_advance_rollback_sync(compiler, tok):
    g = compiler.matcher(compiler.compile(StructuredOutputsParams(regex="[0-9]{2,4}-[a-z]+")))
    start = _allowed(g)
    digits = tok.encode("12")
    assert g.advance(digits) == len(digits) and g.num_tokens == len(digits)
    mid = _allowed(g)
    assert g.advance(tok.encode("Z")) == 0 and g.num_tokens == len(digits)  # refused: nothing changes
    g.rollback(len(digits))
    assert _allowed(g) == start and g.num_tokens == 0
    g.sync(digits)  # catch up with an output
    assert _allowed(g) == mid
    g.advance(tok.encode("3"))
    g.sync(digits)  # a fault left a speculative token accepted: back to the output
    assert g.num_tokens == len(digits) and _allowed(g) == mid


# ---- masks ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [64, 8200, 95])
def test_apply_bitmask_equals_xgrammar(vocab):
    g = torch.Generator().manual_seed(vocab)
    bm = torch.randint(-2**31, 2**31 - 1, (5, (vocab + 31) // 32), generator=g, dtype=torch.int64).to(torch.int32)
    bm[3] = 0  # a row that allows nothing is left unmasked
    logits = torch.randn(5, vocab, generator=g)
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, bm)
    want[3] = logits[3]
    torch.testing.assert_close(apply_bitmask(logits, bm), want, rtol=0, atol=0)
    assert (apply_bitmask(logits, bm) == float("-inf")).any()  # (the test reads something)


def _row(grammar, out, num_drafts, samples=True):
    return SimpleNamespace(req=SimpleNamespace(grammar=grammar, output_token_ids=out), samples=samples,
                           num_drafts=num_drafts)


def test_verify_masks_walk_the_drafts_and_roll_back(compiler, tok):
    """Mask row j is the state after the first j drafts; a draft the grammar refuses ends the walk (the rows
    after it repeat its mask); every matcher is back at its output afterwards; other rows allow everything."""
    cg = compiler.compile(StructuredOutputsParams(regex="[0-9]+-[a-z]+"))
    k = 3
    ok, bad = compiler.matcher(cg), compiler.matcher(cg)
    out = tok.encode("12")
    ok.drafts = tok.encode("3-a")[:k]
    assert len(ok.drafts) == 3
    bad.drafts = [tok.encode("-")[0], tok.encode("Z")[0], tok.encode("b")[0]]  # the 2nd is outside the grammar
    rows = [_row(ok, out, k), _row(None, [], k), _row(bad, out, k), _row(compiler.matcher(cg), [], 0)]
    step = GrammarStep(rows, 5, k, V, torch.device("cpu"))
    masks = step.verify_mask  # [5, K+1, W]
    assert masks.shape == (5, k + 1, (V + 31) // 32)
    ref = compiler.matcher(cg)
    ref.advance(out)
    for j in range(k + 1):
        assert _allowed(SimpleNamespace(fill=lambda bm, r, m=masks[0, j]: bm[r].copy_(m))) == _allowed(ref)
        if j < k:
            ref.accept(ok.drafts[j])
    assert (masks[1] == -1).all() and (masks[4] == -1).all()  # unconstrained and padding rows
    assert torch.equal(masks[2, 2], masks[2, 1]) and torch.equal(masks[2, 3], masks[2, 1])  # walk ended at d_2
    assert not torch.equal(masks[2, 0], masks[2, 1])  # digits or "-", then letters only
    assert torch.equal(masks[3, 1], masks[3, 0])  # no drafts: position 0 repeated
    assert ok.num_tokens == bad.num_tokens == len(out)  # rolled back to the output


def test_draft_masks_follow_emitted_tokens_and_drafts(compiler, tok):
    cg = compiler.compile(StructuredOutputsParams(regex="[0-9]+-[a-z]+"))
    g = compiler.matcher(cg)
    g.sync(tok.encode("1"))
    step = GrammarStep([_row(g, tok.encode("1"), 0)], 1, 2, V, torch.device("cpu"))
    step.emitted = torch.tensor([tok.encode("2-") + [0]]), torch.tensor([2])
    m0 = step.draft_mask(0, torch.zeros(1, 2, dtype=torch.int64))
    allowed = set(torch.nonzero(allowed_from_bitmask(m0, V)[0]).flatten().tolist())
    assert tok.encode("a")[0] in allowed and tok.encode("3")[0] not in allowed  # after "12-": letters only
    drafts = torch.tensor([[tok.encode("b")[0], 0]])
    m1 = step.draft_mask(1, drafts)
    assert 0 in set(torch.nonzero(allowed_from_bitmask(m1, V)[0]).flatten().tolist())  # EOS may end it now
    step.finish(drafts)
    assert g.drafts == drafts[0].tolist() and g.num_tokens == 1


# ---- rejection sampling against the masked target -----------------------------------------------------------


def test_constrained_rejection_sampling_is_the_masked_target():
    """K=1 with a draft distribution q that puts most of its mass on tokens the grammar forbids (as an unmasked
    head would): the first emitted token follows the masked, renormalised target exactly (chi-square over
    40,000 seeds), and a forbidden token is never emitted."""
    v, n = 6, 40_000
    p_logits = torch.tensor([0.3, 1.2, -0.5, 0.8, 0.1, 1.5])
    allowed = torch.tensor([False, True, False, True, True, False])
    bm = torch.zeros(1, 1, dtype=torch.int32)
    for i in torch.nonzero(allowed).flatten().tolist():
        bm[0, 0] |= 1 << i
    q = torch.tensor([0.3, 0.1, 0.25, 0.05, 0.1, 0.2])
    seeds = torch.arange(n, dtype=torch.int64)
    drafts = torch.multinomial(q, n, replacement=True, generator=torch.Generator().manual_seed(0))[:, None]
    logits = apply_bitmask(p_logits.expand(n, 2, v).clone(), bm.expand(n, 2, 1))
    st = SamplingTensors(temperature=torch.ones(n), top_k=torch.zeros(n, dtype=torch.int64), top_p=torch.ones(n),
                         seed=seeds, greedy=torch.zeros(n, dtype=torch.bool))
    positions = torch.tensor([[5, 6]]).expand(n, 2)
    tokens, _ = verify(logits, drafts, torch.ones(n, dtype=torch.int64), st, positions, q.expand(n, 1, v).clone())
    first = tokens[:, 0]
    assert allowed[first].all()
    want = torch.softmax(p_logits.masked_fill(~allowed, float("-inf")), -1)
    counts = torch.bincount(first, minlength=v).double()
    idx = torch.nonzero(allowed).flatten()
    exp = want[idx].double() * n
    chi2 = (((counts[idx] - exp) ** 2) / exp).sum().item()
    assert chi2_sf(chi2, len(idx) - 1) > 1e-3
