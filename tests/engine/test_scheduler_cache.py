"""Host-side bookkeeping without a model: the page allocator, the token-budget scheduler (chunked prefill,
FCFS admission, preemption by recompute, NeedSync under overlap) and the attention metadata derivation
(positions / cache slots, the overlap hook, the trash page). CPU, milliseconds."""

from __future__ import annotations

import random

import pytest
import torch

from m3eagle.engine.input_builder import build_step_input
from m3eagle.engine.request import Request, Status
from m3eagle.engine.scheduler import NeedSync, ScheduledBatch, Scheduler
from m3eagle.kernels.attention.metadata import (
    TRASH_PAGE,
    build_metadata,
    derive_positions_and_slots,
    gather_slots,
)
from m3eagle.kvcache.page_pool import OutOfPages, PagePool
from m3eagle.sampling.params import SamplingParams

CPU = torch.device("cpu")


# ------------------------------------------------------------------------------------------------
# PagePool
# ------------------------------------------------------------------------------------------------


def test_pool_allocate_free_never_hands_out_trash():
    """Pages are distinct, never the trash page, and all come back after free."""
    pool = PagePool(9, 4)
    assert pool.num_usable == 8 and pool.num_free == 8
    a = pool.allocate("a", 3)
    b = pool.allocate("b", 5)
    assert TRASH_PAGE not in a + b and len(set(a + b)) == 8
    assert pool.num_free == 0
    with pytest.raises(OutOfPages):
        pool.allocate("c", 1)
    pool.check_integrity({"a": a, "b": b})
    pool.free("a", a)
    pool.free("b", b)
    assert pool.num_free == pool.num_usable
    pool.check_integrity({})


def test_pool_pages_for_and_minimum_size():
    pool = PagePool(4, 4)
    assert [pool.pages_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError, match="num_pages"):
        PagePool(1, 4)


def test_pool_free_by_wrong_owner_raises():
    pool = PagePool(5, 2)
    a = pool.allocate("a", 2)
    with pytest.raises(RuntimeError, match="owned by 'a'"):
        pool.free("b", a)


def test_pool_integrity_detects_a_leaked_page():
    """A page the allocator handed out that no live table holds is a leak."""
    pool = PagePool(6, 4)
    a = pool.allocate("a", 2)
    pool.allocate("gone", 1)  # its request vanished without freeing
    with pytest.raises(AssertionError, match="leaked"):
        pool.check_integrity({"a": a})


def test_pool_integrity_detects_a_double_owned_page():
    """A page in two tables that the allocator did not share between them."""
    pool = PagePool(6, 4)
    a = pool.allocate("a", 2)
    b = pool.allocate("b", 1)
    with pytest.raises(AssertionError, match="in 'b''s table but allocator says 'a'"):
        pool.check_integrity({"a": a, "b": b + [a[0]]})


def test_pool_shared_pages_are_reference_counted():
    """n samples share their prompt's pages: a shared page stays allocated until its last owner frees it."""
    pool = PagePool(6, 4)
    a = pool.allocate("a", 2)
    pool.share("b", a[:1])
    pool.check_integrity({"a": a, "b": a[:1]})
    with pytest.raises(AssertionError, match="owned by 'a' and 'b'"):
        pool.check_integrity({"a": a, "b": []})
    pool.free("a", a)
    assert pool.num_free == 4
    pool.check_integrity({"b": a[:1]})
    pool.free("b", a[:1])
    assert pool.num_free == 5
    pool.check_integrity({})


def test_pool_integrity_detects_foreign_and_free_pages_in_a_table():
    pool = PagePool(6, 4)
    a = pool.allocate("a", 2)
    free_page = next(iter(pool._free))
    with pytest.raises(AssertionError, match="allocator says"):
        pool.check_integrity({"a": a + [free_page]})
    pool._free.append(a[0])  # corrupt: owned and on the free list
    with pytest.raises(AssertionError, match="both free and owned"):
        pool.check_integrity({"a": a})


def test_pool_integrity_detects_trash_on_the_free_list():
    pool = PagePool(4, 4)
    pool._free.append(TRASH_PAGE)
    with pytest.raises(AssertionError, match="trash"):
        pool.check_integrity({})


# ------------------------------------------------------------------------------------------------
# Scheduler (K = 0 unless stated; steps are "processed" by hand: every sampling row emits one token)
# ------------------------------------------------------------------------------------------------


def make_req(rid: str, n: int, arrival: int = 0, max_tokens: int = 64) -> Request:
    req = Request(rid, list(range(3, 3 + n)), SamplingParams(temperature=0, max_tokens=max_tokens), 0, arrival)
    req.proj_known = req.num_known
    return req


def launch(s: Scheduler) -> ScheduledBatch:
    batch = s.schedule()
    s.commit(batch)
    return batch


def process(batch: ScheduledBatch, only: set[str] | None = None, num_new: dict[str, int] | None = None,
            ) -> None:
    """What LLMEngine._process does to the host state, with 1 + accepted tokens per sampling row."""
    for row in batch.rows:
        req = row.req
        if only is not None and req.request_id not in only:
            continue
        req.inflight_rows.remove(row)
        start = req.num_computed  # host truth, not the row's projected start
        if row.samples:
            n = (num_new or {}).get(req.request_id, 1)
            req.num_computed = start + row.num_tokens - row.num_drafts + n - 1
            req.output_token_ids += [7] * n
        else:
            req.num_computed = start + row.num_tokens
        req.reproject()


def step(s: Scheduler) -> ScheduledBatch:
    batch = launch(s)
    process(batch)
    return batch


def test_scheduler_respects_the_token_budget_and_chunks_prompts():
    """Every step schedules at most max_num_tokens tokens; each request's rows are contiguous runs that
    start where its KV ends; every prompt is eventually fully computed."""
    pool = PagePool(64, 4)
    s = Scheduler(pool, max_num_tokens=16, max_num_seqs=8, num_draft_tokens=0, max_pages_per_seq=16)
    reqs = [make_req(f"r{i}", n, i) for i, n in enumerate((10, 23, 3, 17, 9))]
    for r in reqs:
        s.add(r)
    for _ in range(12):
        before = {r.request_id: r.num_computed for r in reqs}
        batch = step(s)
        assert 0 < batch.num_tokens <= 16
        for row in batch.rows:
            assert row.start == before[row.req.request_id]
    assert all(r.num_computed >= len(r.prompt_token_ids) for r in reqs)


def test_scheduler_chunked_prefill_then_decode():
    """A 30-token prompt under an 8-token budget: chunks 8, 8, 8, 6 (only the last samples), then
    one-token decode rows."""
    pool = PagePool(32, 4)
    s = Scheduler(pool, max_num_tokens=8, max_num_seqs=4, num_draft_tokens=0, max_pages_per_seq=16)
    r = make_req("r", 30)
    s.add(r)
    rows = [step(s).rows[0] for _ in range(6)]
    assert [(x.start, x.num_tokens, x.samples) for x in rows] == [
        (0, 8, False), (8, 8, False), (16, 8, False), (24, 6, True), (30, 1, True), (31, 1, True)]
    assert rows[0].tokens == r.prompt_token_ids[:8] and rows[0].next_token == r.prompt_token_ids[8]
    assert len(r.pages) == pool.pages_for(32)


def test_scheduler_fcfs_running_first_and_no_overtaking():
    """Running rows come first; waiting requests are admitted in arrival order, and a small later
    request never jumps a head-of-line request that does not fit."""
    pool = PagePool(6, 4)  # 5 usable pages
    s = Scheduler(pool, max_num_tokens=64, max_num_seqs=8, num_draft_tokens=0, max_pages_per_seq=5)
    r0 = make_req("r0", 12, 0)
    s.add(r0)
    step(s)
    r1, r2 = make_req("r1", 16, 1), make_req("r2", 2, 2)
    s.add(r1)
    s.add(r2)
    batch = step(s)
    assert [x.req.request_id for x in batch.rows] == ["r0"]
    assert list(s.waiting) == [r1, r2]
    # plenty of pages: both are admitted, in order, after the running row
    pool2 = PagePool(64, 4)
    s2 = Scheduler(pool2, max_num_tokens=64, max_num_seqs=8, num_draft_tokens=0, max_pages_per_seq=16)
    a, b, c = make_req("a", 5, 0), make_req("b", 7, 1), make_req("c", 3, 2)
    s2.add(a)
    step(s2)
    s2.add(b)
    s2.add(c)
    assert [x.req.request_id for x in step(s2).rows] == ["a", "b", "c"]


def test_scheduler_max_num_seqs_caps_running():
    pool = PagePool(64, 4)
    s = Scheduler(pool, max_num_tokens=64, max_num_seqs=2, num_draft_tokens=0, max_pages_per_seq=16)
    for i in range(4):
        s.add(make_req(f"r{i}", 3, i))
    assert [x.req.request_id for x in step(s).rows] == ["r0", "r1"]
    assert len(s.waiting) == 2


def test_scheduler_preempts_newest_by_recompute_to_the_front_of_waiting():
    """When a running request needs a page and none is free, the newest running request loses its pages,
    resets to 0 computed tokens, and re-enters the *front* of the waiting queue with its outputs so far."""
    pool = PagePool(9, 4)  # 8 usable
    s = Scheduler(pool, max_num_tokens=64, max_num_seqs=8, num_draft_tokens=0, max_pages_per_seq=8)
    r0, r1 = make_req("r0", 16, 0), make_req("r1", 16, 1)
    s.add(r0)
    s.add(r1)
    step(s)  # both prefilled: 4 pages each, 17 known tokens each
    assert pool.num_free == 0
    r2 = make_req("r2", 2, 2)
    s.add(r2)
    batch = step(s)  # r0 needs a 5th page
    assert batch.preempted == [r1]
    assert [x.req.request_id for x in batch.rows] == ["r0"]
    assert list(s.waiting) == [r1, r2]
    assert r1.status is Status.WAITING and r1.pages == [] and r1.num_computed == 0 and r1.slot == -1
    assert r1.output_token_ids == [7]
    pool.check_integrity(s.table_snapshot())
    # once r0 finishes, r1 recomputes prompt + its output token in one row
    s.finish(r0, "length")
    batch = step(s)
    row = next(x for x in batch.rows if x.req is r1)
    assert row.start == 0 and row.tokens == r1.prompt_token_ids + [7] and row.samples


def test_scheduler_needsync_when_the_victim_is_in_flight():
    """Under overlap the scheduler must not preempt a request whose step is still running: it raises
    NeedSync and leaves the victim's pages alone."""
    pool = PagePool(9, 4)
    s = Scheduler(pool, max_num_tokens=64, max_num_seqs=8, num_draft_tokens=0, max_pages_per_seq=8)
    r0, r1 = make_req("r0", 16, 0), make_req("r1", 16, 1)
    s.add(r0)
    s.add(r1)
    batch = launch(s)
    process(batch, only={"r0"})  # r1's row is still in flight
    pages = list(r1.pages)
    with pytest.raises(NeedSync):
        s.schedule()
    assert r1.pages == pages and r1 in s.running
    process(batch, only={"r1"})
    assert step(s).preempted == [r1]


def test_scheduler_spec_rows_reserve_draft_pages_and_gather():
    """With K drafts: the first row of a request samples from host tokens; the next one is a gathered
    verify row of 1 + K tokens whose pages cover kv_len + K - 1 (draft steps 1..K-1 write past the row),
    and it is marked `correct` exactly when the previous sampling step is still in flight."""
    k = 3
    pool = PagePool(64, 4)
    s = Scheduler(pool, max_num_tokens=64, max_num_seqs=4, num_draft_tokens=k, max_pages_per_seq=16)
    r = make_req("r", 6)
    s.add(r)
    b1 = launch(s)
    row = b1.rows[0]
    assert (row.num_tokens, row.num_drafts, row.gather, row.correct) == (6, 0, False, False)
    b2 = launch(s)  # overlap: planned while b1 is in flight, on projected lengths
    row = b2.rows[0]
    assert (row.start, row.num_tokens, row.num_drafts, row.gather, row.correct) == (6, 1 + k, k, True, True)
    assert len(r.pages) >= pool.pages_for(row.kv_len + k - 1)
    process(b1)
    process(b2, num_new={"r": 2})
    assert r.num_computed == 6 + 2 and r.num_known == 6 + 1 + 2
    b3 = launch(s)
    row = b3.rows[0]
    assert (row.start, row.num_tokens, row.gather, row.correct) == (8, 1 + k, True, False)


def test_scheduler_verify_row_needs_budget_for_all_drafts():
    """A gathered row gets drafts only when the remaining budget holds 1 + K tokens; otherwise it is a
    plain one-token decode row (still gathered)."""
    k = 3
    pool = PagePool(64, 4)
    s = Scheduler(pool, max_num_tokens=10, max_num_seqs=4, num_draft_tokens=k, max_pages_per_seq=16)
    a, b = make_req("a", 2), make_req("b", 30)
    s.add(a)
    step(s)  # a prefilled and sampled once; b gets 8 prompt tokens
    s.add(b)
    rows = step(s).rows
    assert [(x.req.request_id, x.num_tokens, x.num_drafts) for x in rows] == [("a", 4, 3), ("b", 6, 0)]
    s2 = Scheduler(PagePool(64, 4), max_num_tokens=3, max_num_seqs=4, num_draft_tokens=k,
                   max_pages_per_seq=16)
    c = make_req("c", 2)
    s2.add(c)
    step(s2)
    row = step(s2).rows[0]
    assert (row.num_tokens, row.num_drafts, row.gather) == (1, 0, True)


def test_scheduler_finish_releases_pages_only_after_the_step_in_flight():
    pool = PagePool(16, 4)
    s = Scheduler(pool, max_num_tokens=64, max_num_seqs=4, num_draft_tokens=0, max_pages_per_seq=8)
    r = make_req("r", 5)
    s.add(r)
    batch = launch(s)
    s.finish(r, "abort")
    assert r.pending_free and r.pages and pool.num_free < pool.num_usable
    r.inflight_rows.remove(batch.rows[0])
    s.release(r)
    assert pool.num_free == pool.num_usable and not s.has_work()


# ------------------------------------------------------------------------------------------------
# Attention metadata
# ------------------------------------------------------------------------------------------------


def scratch_positions_and_slots(q_lens, kv_lens, table, page_size):
    pos, slots = [], []
    for b, (q, kv) in enumerate(zip(q_lens, kv_lens)):
        for c in range(q):
            p = kv - q + c
            pos.append(p)
            col = min(p // page_size, len(table[b]) - 1)
            slots.append(table[b][col] * page_size + p % page_size)
    return pos, slots


def random_layout(seed: int, page_size: int):
    """Random rows with disjoint shuffled pages and a trailing trash column (as the engine builds)."""
    rng = random.Random(seed)
    b = rng.randint(1, 6)
    q_lens = [rng.randint(1, 9) for _ in range(b)]
    kv_lens = [q + rng.randint(0, 40) for q in q_lens]
    held = [-(-kv // page_size) + rng.randint(0, 1) for kv in kv_lens]
    width = max(held) + 1
    pages = list(range(1, sum(held) + 1))
    rng.shuffle(pages)
    table = torch.full((b, width), TRASH_PAGE, dtype=torch.int64)
    for i, h in enumerate(held):
        table[i, :h] = torch.tensor(pages[:h])
        pages = pages[h:]
    return q_lens, kv_lens, table


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("page_size", [1, 3, 4, 16])
def test_derive_positions_and_slots_matches_scratch(seed, page_size):
    q_lens, kv_lens, table = random_layout(seed, page_size)
    meta = build_metadata(q_lens, torch.tensor(kv_lens), table, page_size, CPU, max(kv_lens))
    pos, slots = scratch_positions_and_slots(q_lens, kv_lens, table.tolist(), page_size)
    assert meta.positions.tolist() == pos
    assert meta.slot_mapping.tolist() == slots
    tok_row = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    tok_col = torch.cat([torch.arange(q) for q in q_lens])
    p2, s2 = derive_positions_and_slots(torch.tensor(kv_lens), torch.tensor(q_lens), tok_row, tok_col, table,
                                        page_size)
    assert p2.tolist() == pos and s2.tolist() == slots
    # every written slot is on one of the row's own pages
    for t, s in enumerate(slots):
        assert s // page_size in table[tok_row[t]].tolist() and s // page_size != TRASH_PAGE
    # padded query layout
    for b, q in enumerate(q_lens):
        assert meta.q_valid[b].sum().item() == q
        assert meta.positions[meta.q_index[b, :q]].tolist() == list(range(kv_lens[b] - q, kv_lens[b]))


@pytest.mark.parametrize("seed", range(4))
def test_with_lengths_is_identity_and_idempotent(seed):
    """The overlap hook depends only on the lengths it is given: same lengths -> the same metadata;
    applying it twice equals applying it once; it equals a from-scratch build with those lengths."""
    ps = 4
    q_lens, kv_lens, table = random_layout(seed, ps)
    meta = build_metadata(q_lens, torch.tensor(kv_lens), table, ps, CPU, max(kv_lens))
    same = meta.with_lengths(meta.kv_lens)
    assert torch.equal(same.positions, meta.positions) and torch.equal(same.slot_mapping, meta.slot_mapping)
    rng = random.Random(seed)
    shorter = torch.tensor([kv - rng.randint(0, min(3, kv - q)) for q, kv in zip(q_lens, kv_lens)])
    once = meta.with_lengths(shorter)
    twice = once.with_lengths(shorter)
    assert torch.equal(once.positions, twice.positions) and torch.equal(once.slot_mapping, twice.slot_mapping)
    scratch = build_metadata(q_lens, shorter, table, ps, CPU, max(kv_lens))
    assert torch.equal(once.positions, scratch.positions)
    assert torch.equal(once.slot_mapping, scratch.slot_mapping)
    assert torch.equal(once.kv_lens, shorter)
    # back to the original lengths restores the original metadata
    back = once.with_lengths(meta.kv_lens)
    assert torch.equal(back.slot_mapping, meta.slot_mapping)


@pytest.mark.parametrize("overhang_row", [0, 1, 2])
def test_page_boundary_overhang_goes_to_the_trash_page(overhang_row):
    """A row whose true length is page-aligned (it holds exactly those pages) but whose optimistic length
    claims one more slot must map that slot to TRASH_PAGE -- for an inner row and for the last row --
    never to another row's page. Key-side lookups past the held pages land there too."""
    ps = 4
    held = [[5, 2], [7, 3, 9], [4, 1]]  # 8, 12, 8 slots
    width = 4  # one trash column past the widest row, as the engine's table
    table = torch.full((3, width), TRASH_PAGE, dtype=torch.int64)
    for i, pages in enumerate(held):
        table[i, : len(pages)] = torch.tensor(pages)
    true_kv = [len(p) * ps for p in held]  # page-aligned
    q_lens = [4, 4, 4]
    opt_kv = list(true_kv)
    opt_kv[overhang_row] += 1
    meta = build_metadata(q_lens, torch.tensor(opt_kv), table, ps, CPU, max(opt_kv))
    slots = meta.slot_mapping.view(3, 4)
    for b in range(3):
        pages = (slots[b] // ps).tolist()
        if b == overhang_row:
            assert pages[-1] == TRASH_PAGE and slots[b, -1].item() == TRASH_PAGE * ps
            assert set(pages[:-1]) <= set(held[b])
        else:
            assert set(pages) <= set(held[b])
    keys = gather_slots(meta, max(opt_kv) + ps)  # [B, L]
    for b in range(3):
        own = keys[b, : true_kv[b]] // ps
        assert set(own.tolist()) <= set(held[b])
        assert (keys[b, true_kv[b]:] // ps == TRASH_PAGE).all()
    # the correction back to the true lengths writes only the row's own pages
    fixed = meta.with_lengths(torch.tensor(true_kv))
    for t, s in enumerate(fixed.slot_mapping.tolist()):
        assert s // ps in held[t // 4]


def test_overhang_past_the_table_width_clamps_to_trash():
    """Even an optimistic length several pages past the table maps to trash, not to a held page."""
    ps = 4
    table = torch.tensor([[3, 6, TRASH_PAGE], [2, 5, TRASH_PAGE]])
    meta = build_metadata([8, 2], torch.tensor([8 + 6, 8]), table, ps, CPU, 14)  # positions 6..13
    row0 = (meta.slot_mapping[:8] // ps).tolist()
    assert row0 == [6, 6] + [TRASH_PAGE] * 6
    assert (meta.slot_mapping[8:] // ps).tolist() == [5, 5]


def test_step_input_table_keeps_a_trash_column_for_a_full_request():
    """Through the engine's input builder: a request holding max_pages_per_seq pages (the whole table but
    the last column) with an optimistic length one slot past them writes that slot to the trash page."""
    from m3eagle.engine.scheduler import ScheduledRow

    ps, width = 4, 5  # max_pages_per_seq = width - 1
    reqs = []
    for i, pages in enumerate(([1, 2, 3, 4], [5, 6, 7, 8])):
        r = make_req(f"r{i}", 16)
        r.pages, r.slot = pages, i
        reqs.append(r)
    rows = [ScheduledRow(reqs[0], 13, [0, 0, 0, 0], 3, True, True, True, 0),  # kv_len 17: one slot over
            ScheduledRow(reqs[1], 12, [0, 0, 0, 0], 3, True, True, True, 0)]  # kv_len 16: exact
    inp = build_step_input(ScheduledBatch(rows, []), ps, width, CPU)
    meta = inp.meta.with_lengths(inp.meta.kv_lens)  # what execute() derives on the device
    pages = (meta.slot_mapping // ps).tolist()
    assert pages[:4] == [4, 4, 4, TRASH_PAGE]
    assert pages[4:] == [8, 8, 8, 8]
    assert inp.meta.page_table[:, -1].tolist() == [TRASH_PAGE, TRASH_PAGE]
