"""The step's bookkeeping (m3eagle/engine/step_ops.py): the Triton launches of step_kernels.py held bit-equal to
the plain torch of step_reference.py (and sampling.verify.greedy_accept) on CPU under the Triton interpreter --
the overlap correction, where a step samples, the commit of its outputs into the slot buffers, greedy acceptance
and the metadata's positions and slots -- and the reference itself checked against what it must do.

NOTE: TRITON_INTERPRET is set before anything imports triton, and it holds for the whole pytest process.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton` (kernels decorate at import)

from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from m3eagle.engine.step_ops import ReferenceStepOps, TritonStepOps, create  # noqa: E402
from m3eagle.kernels.fused import registry  # noqa: E402
from m3eagle.kernels.ops import REFERENCE  # noqa: E402
from tests.helpers.step_cases import chain_case, commit_case, sample_case, step_case  # noqa: E402

TRITON = replace(REFERENCE, fused=registry.create("triton"))
REF_STEP, TRITON_STEP = ReferenceStepOps(), TritonStepOps()


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("k", [0, 1, 3, 5])
@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_overlap_inputs_equal_reference(k, page_size, seed):
    """ids (last tokens and drafts gathered from the slots), corrected kv_lens, positions and slots: one
    Triton kernel, bit-equal to reference.overlap_ids_kv + derive_positions_and_slots."""
    meta, (ids, *rest) = step_case(seed, k, page_size)
    want_ids, want = REF_STEP.overlap_inputs(ids, replace(meta, ops=REFERENCE), *rest)
    got_ids, got = TRITON_STEP.overlap_inputs(ids, replace(meta, ops=TRITON), *rest)
    assert torch.equal(got_ids, want_ids) and torch.equal(got.kv_lens, want.kv_lens)
    assert torch.equal(got.positions, want.positions) and torch.equal(got.slot_mapping, want.slot_mapping)
    assert not torch.equal(want_ids, ids) or k == 0  # the case does gather something
    assert not torch.equal(want.kv_lens, meta.kv_lens)  # ... and corrects something


@pytest.mark.parametrize("k", [0, 1, 3, 5])
@pytest.mark.parametrize("seed", [0, 1])
def test_sample_positions_equal_reference(k, seed):
    """Sampled token indices, their positions and the drafts they verify: bit-equal, rows of 37 kinds."""
    args = sample_case(seed, k)
    want = REF_STEP.sample_positions(*args)
    got = TRITON_STEP.sample_positions(*args)
    for a, b in zip(got, want):
        assert a.shape == b.shape and torch.equal(a, b)
    assert k == 0 or (want[2] != 0).any()


@pytest.mark.parametrize("k", [0, 1, 3, 5])
@pytest.mark.parametrize("draft", [False, True])
@pytest.mark.parametrize("chain", [False, True])
def test_commit_outputs_equal_reference(k, draft, chain):
    """After verification: masked counts, the slots written and their contents (tokens, counts, deviations),
    with a drafter its inputs (last accepted index, ids shifted with the bonus / next token, the position
    table), and with `chain` the step's kv_len / chained inputs advanced in place: bit-equal. The dump row
    has several writers in both paths, so its contents are not compared."""
    for seed in range(3):
        args, tok_row = commit_case(seed, k, draft)
        b = args[1].shape[0]
        ref_bufs = [x.clone() for x in args[11:14]]
        fast_bufs = [x.clone() for x in args[11:14]]
        ref_chain = fast_chain = None
        if chain:
            chained, kv, kv_in, _ = chain_case(seed, b)
            ref_chain = (c := chained.clone(), kv, kv_in.clone(), c)
            fast_chain = (c := chained.clone(), kv, kv_in.clone(), c)
        pt = torch.randint(0, 50, (b, 20), generator=torch.Generator().manual_seed(seed))  # positions run past it
        want = REF_STEP.commit_outputs(*args[:11], *ref_bufs, *args[14:], chain=ref_chain, pages=(pt, 16))
        got = TRITON_STEP.commit_outputs(*args[:11], *fast_bufs, *args[14:], tok_row=tok_row, chain=fast_chain,
                                          pages=(pt, 16))
        assert len(got) == len(want) == 6
        for a, b_ in zip(got, want):
            assert (a is None) == (b_ is None) and (a is None or torch.equal(a, b_))
        if draft:  # the draft steps' slots: the page holding each at position (clamped to the table), + offset
            at = want[4]
            col = (at // 16).clamp(max=19)
            assert torch.equal(want[5], pt[torch.arange(b)[None, :].expand_as(at), col] * 16 + at % 16)
            assert (at // 16 > 19).any()  # the clamp is exercised
        for a, b_, orig in zip(fast_bufs, ref_bufs, args[11:14]):
            assert torch.equal(a[:-1], b_[:-1]) and not torch.equal(b_[:-1], orig[:-1])
        assert draft == (want[3] is not None)
        # what the reference itself must do (the oracle is checked too, not only the kernel against it)
        samples, slots, nd, dev0 = args[2], args[3], args[5], args[13]
        nn = torch.where(samples, args[1], 0)
        want_dev = nn - nd - 1 + torch.where(chained, dev0[slots], 0) if chain else nn - nd - 1
        assert torch.equal(ref_bufs[2][slots[samples]], want_dev[samples])
        if chain:
            for got_chain in (ref_chain, fast_chain):
                assert torch.equal(got_chain[2], torch.where(samples, kv + nn, kv_in))
                assert torch.equal(got_chain[0], chained | samples)


@pytest.mark.parametrize("k", [0, 1, 3, 5])
def test_greedy_accept_equal_reference(k):
    """Greedy verification's acceptance count: drafts that match the argmax for a random prefix (so every
    count 0..num_drafts occurs), then differ; rows with fewer drafts than K."""
    g = gen(k)
    b = 200
    greedy_tok = torch.randint(0, 50, (b, k + 1), generator=g)
    nd = torch.randint(0, k + 1, (b,), generator=g)
    prefix = torch.randint(0, k + 1, (b,), generator=g)
    j = torch.arange(k)
    drafts = torch.where(j[None, :] < prefix[:, None], greedy_tok[:, :k], greedy_tok[:, :k] + 1)
    drafts = torch.where(torch.rand(b, k, generator=g) < 0.1, greedy_tok[:, :k], drafts)  # matches after a miss
    want = REF_STEP.greedy_accept(greedy_tok, drafts, nd)
    got = TRITON_STEP.greedy_accept(greedy_tok, drafts, nd)
    assert torch.equal(got, want)
    assert k == 0 or len(set(want.tolist())) == k + 1  # every count occurs


def test_positions_slots_equal_reference_with_clamps_and_negative_positions():
    """with_lengths' fused op: positions past the table width clamp to its last column; a (never planned)
    negative position still follows torch's floor division."""
    from m3eagle.kernels.attention.metadata import derive_positions_and_slots

    meta, _ = step_case(7, 3, 4)
    kv = meta.kv_lens.clone()
    kv[0], kv[1] = 200, 0  # row 0 past 6 pages of 4; row 1 starts below zero
    args = (kv, meta.q_lens, meta.tok_row, meta.tok_col, meta.page_table, 4)
    want = derive_positions_and_slots(*args)
    got = TRITON_STEP.positions_slots(*args)
    assert (want[0] < 0).any() and (want[0] >= 24).any()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(replace(meta, ops=TRITON).with_lengths(kv).slot_mapping, want[1])


def test_step_ops_are_named_like_the_fused_backend():
    """An engine takes the bookkeeping named like its fused backend; an unknown name is refused with the choices."""
    assert create("reference").name == "reference" and create("triton").name == "triton"
    with pytest.raises(ValueError, match="'reference' or 'triton'"):
        create("cutlass")
