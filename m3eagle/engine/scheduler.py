"""Token-budget scheduler (vLLM v1's model): no prefill or decode phase, only runs of new tokens.

Each request wants its KV to catch up with its known tokens, plus K drafts once it is caught up. A prompt
chunk, a decode row (1 token) and a verify row (1 + K tokens) are all rows of new tokens on a cached
prefix. Running requests go first (FCFS); waiting requests are admitted while budget and pages last.
When pages run out, the newest running request is preempted by recompute: its pages are freed and it
re-enters the waiting queue with its tokens so far.

While a step is in flight (overlap), the scheduler plans on projected lengths (every draft accepted),
which are upper bounds; the device corrects them. A plan that would have to preempt a request still in
flight is refused (`NeedSync`): the engine drains the pipeline and plans again.

Samples of n (SamplingParams.n) wait behind their parent (sample 0) until it has launched the prompt's full
pages, then share them (`_fork`) and compute only the rest: the last partial page and the last prompt token,
whose draft KV depends on the token each sample draws.

Prefix caching (`prefix_caching`): full pages whose KV is final -- below the request's host-true computed
length, which no step in flight or later writes again -- are registered in the pool under their chained
keys (prefix_keys.py) when the scheduler next sees the request, and before its pages are freed. A
request being admitted first looks up its known tokens' keys and takes the longest cached prefix, then
computes only the rest, exactly like a sample of n after a fork: target K/V, index-K and the draft
head's KV all live in the same slots, so the pages carry all of them. Requests whose processing reads
the prompt itself (prompt logprobs, a repetition penalty's prompt mask) take no hits; they still
register their pages.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from m3eagle.engine.prefix_keys import page_keys
from m3eagle.engine.request import Request, Status
from m3eagle.kvcache.page_pool import PagePool


class NeedSync(Exception):
    """The plan needs the in-flight step's results first (e.g. to preempt a request it holds)."""


# eq=False: identity: rows are removed from a request's in-flight list by `is`, not by value. A row is
# immutable once planned, so its sizes are computed once: they are read several times per row per step.
# The __init__ is written out (no __post_init__): the scheduler makes one row per request per step.
@dataclass(eq=False, slots=True, init=False)
class ScheduledRow:
    req: Request
    start: int  # first position (host-projected)
    tokens: list[int] | tuple[int, ...]  # host-known ids (placeholders where `gather` is set); read-only
    num_drafts: int  # drafts appended to this row (0, K, or a draft tree's narrow width: Scheduler.narrow_drafts)
    samples: bool  # the row reaches the end of the known tokens -> sample / verify
    gather: bool  # first token + drafts come from the device slot buffers
    correct: bool  # the previous sampling step is still in flight -> correct kv_len on device
    next_token: int  # for non-sampling rows: the known token after the chunk (draft step 0 shift)
    num_tokens: int  # len(tokens)
    kv_len: int  # start + num_tokens

    def __init__(self, req: Request, start: int, tokens: list[int], num_drafts: int, samples: bool, gather: bool,
                 correct: bool, next_token: int) -> None:
        self.req, self.start, self.tokens, self.num_drafts = req, start, tokens, num_drafts
        self.samples, self.gather, self.correct, self.next_token = samples, gather, correct, next_token
        self.num_tokens = n = len(tokens)
        self.kv_len = start + n


@dataclass
class ScheduledBatch:
    rows: list[ScheduledRow]
    preempted: list[Request]
    # Sub-steps this plan runs back to back on the device (a multi-step iteration, num_scheduler_steps):
    # the rows' pages cover all of them, and the engine commits the batch that many times (one scaled fold).
    steps: int = 1

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)


class Scheduler:
    def __init__(self, pool: PagePool, max_num_tokens: int, max_num_seqs: int, num_draft_tokens: int,
                 max_pages_per_seq: int, prefix_caching: bool = False):
        self.pool = pool
        self.prefix_caching = prefix_caching
        # vLLM's counters: prompt tokens looked up in the cache at admission, and how many were found.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.k = num_draft_tokens
        self.max_pages_per_seq = max_pages_per_seq
        self._lookahead = max(num_draft_tokens - 1, 0)  # draft steps 1..K-1 write this far past a row
        self._page_size = pool.page_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots = list(range(max_num_seqs))[::-1]
        # The steady state's plan skips the general loop (`_schedule_steady`); tests turn it off to hold the
        # two equal (tests/engine/test_host_fast_paths.py).
        self.fast_path = True
        # Draft trees (draft_tree.verify_width): a step of more than tree_max_batch rows verifies only the first
        # narrow_drafts nodes of each tree (stored best first, every prefix closed under ancestors). None: every
        # verify row carries K drafts.
        self.tree_max_batch: int | None = None
        self.narrow_drafts = num_draft_tokens

    # ---- queue management --------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def head(self) -> Request | None:
        """The oldest waiting request (the next to be admitted), or None."""
        return self.waiting[0] if self.waiting else None

    def queued(self) -> list[Request]:
        """Every request the scheduler holds: waiting, then running (finished ones awaiting a free too)."""
        return [*self.waiting, *self.running]

    def reset(self, waiting: list[Request]) -> None:
        """Forget all running state and queue exactly `waiting`, in that order (the engine's rollback after
        a fault: every request holds nothing now and is recomputed from its accepted tokens)."""
        self.waiting.clear()
        self.waiting.extend(waiting)
        self.running.clear()
        self.free_slots[:] = list(range(self.max_num_seqs))[::-1]

    def has_work(self) -> bool:
        return bool(self.waiting) or any(not r.finished for r in self.running)

    def finish(self, req: Request, reason: str) -> None:
        """Mark finished; pages go back now, or once the step in flight that uses them completes."""
        req.status, req.finish_reason = Status.FINISHED, reason
        if req in self.waiting:
            self.waiting.remove(req)
        if req.inflight:
            req.pending_free = True
        else:
            self.release(req)

    def release(self, req: Request) -> None:
        if req.pages:
            if self.prefix_caching:
                self._register(req)
            self.pool.free(req.request_id, req.pages)
            req.pages, req.num_registered = [], 0
        if req.slot >= 0:
            self.free_slots.append(req.slot)
            req.slot = -1
        req.pending_free = False
        if req in self.running:
            self.running.remove(req)

    def _preempt(self, req: Request) -> None:
        if self.prefix_caching:  # its pages stay findable: the readmission (or anyone) may hit them
            self._register(req)
        self.pool.free(req.request_id, req.pages)
        req.pages, req.num_registered = [], 0
        self.free_slots.append(req.slot)
        req.slot = -1
        req.status = Status.WAITING
        req.num_computed = req.proj_computed = 0
        req.proj_known = req.num_known
        req.slot_valid = False
        req.fork_src, req.fork_len = None, 0
        self.running.remove(req)
        self.waiting.appendleft(req)

    def _fork(self, req: Request) -> list[int] | None:
        """The parent's pages a sample of n can share, [] for none, or None to wait a step for the parent.

        Shared: the full pages below the last prompt token. Those hold only prompt positions, written once by
        the parent in a step launched before this one (so, in stream order, before this sample reads them),
        and their draft KV was fed prompt tokens only. The last prompt token and what follows differ per
        sample. A parent that is gone (finished, preempted later) leaves the sample to prefill alone."""
        if req.group is None or req.index == 0 or req.num_computed:
            return []
        parent = req.group.members[0]
        shared = (len(req.prompt_token_ids) - 1) // self.pool.page_size
        if shared == 0 or parent.finished or parent.status is not Status.RUNNING:
            return []
        if parent.proj_computed < shared * self.pool.page_size:  # not launched yet (or admitted just now)
            return None
        return parent.pages[:shared]

    # ---- prefix cache --------------------------------------------------------------------------
    def _register(self, req: Request) -> None:
        """Register req's full pages whose KV is final: every position below its host-true computed length
        (steps in flight write only at or past it), with the token after the page known."""
        ps = self._page_size
        full = min(req.num_computed // ps, len(req.pages), (req.num_known - 1) // ps)
        if full <= req.num_registered:
            return
        keys = page_keys(req, full, ps)
        for p in range(req.num_registered, full):
            self.pool.register(req.pages[p], keys[p])
        req.num_registered = full

    def _cache_hit(self, req: Request) -> list[int] | None:
        """The cached pages a request being admitted can take: the longest cached prefix of its known tokens,
        leaving at least its last token to compute (its row samples). None: it does not look."""
        p = req.params
        if p.prompt_logprobs is not None or p.repetition_penalty != 1.0:
            return None
        ps = self._page_size
        n = min((req.num_known - 1) // ps, self.max_pages_per_seq)
        return self.pool.lookup(page_keys(req, n, ps)) if n > 0 else []

    def _count_lookup(self, req: Request, hit: list[int] | None) -> None:
        """Counted once the request is admitted (a request that waits for room looks again next step)."""
        n = len(hit or ()) * self._page_size
        if req.num_cached_tokens is None:  # the first admission: what the user's request found
            req.num_cached_tokens = min(n, len(req.prompt_token_ids))
        if hit is not None:
            self.prefix_cache_queries += req.num_known
            self.prefix_cache_hits += n

    def reset_prefix_cache(self) -> None:
        """Forget every cached page; pages held by requests stay theirs and are not registered again."""
        self.pool.reset_cache()
        for req in self.running:
            req.num_registered = len(req.pages)

    # ---- planning ----------------------------------------------------------------------------
    def _pages_needed(self, req: Request, kv_len: int) -> int:
        # Draft steps 1..K-1 write K-1 positions past the row; reserve them too.
        end, held = kv_len + self._lookahead, len(req.pages)
        if end <= held * self._page_size:  # the steady row: its pages already cover it
            return 0
        return max(0, min(self.pool.pages_for(end), self.max_pages_per_seq) - held)

    def _plan_row(self, req: Request, budget: int) -> ScheduledRow | None:
        start = req.proj_computed
        n_known = req.proj_known - start
        if n_known == 1 and req.slot_valid and budget > 0:  # the steady state: token (+ drafts) from the slot
            nd = self.k if budget > self.k else 0
            return ScheduledRow(req, start, [0] * (1 + nd), nd, True, True, bool(req.inflight_rows), 0)
        n = min(n_known, budget)
        if n <= 0:
            return None
        samples = n == n_known
        ids = req.all_token_ids
        return ScheduledRow(req, start, ids[start:start + n], 0, samples, False, False, 0 if samples else ids[start + n])

    def schedule(self, steps: int = 1) -> ScheduledBatch:
        """The next step's rows: `_schedule_steady` when it applies, else the general plan (`_schedule`).
        steps > 1 asks for a multi-step iteration, which only the steady plan makes (with fewer sub-steps
        where a row would outgrow its page table); otherwise the plan is one step."""
        batch = None
        if self.fast_path and not self.waiting:
            batch = self._schedule_steady(steps) if steps > 1 else None
            if batch is None:
                batch = self._schedule_steady()
        if batch is None:
            batch = self._schedule()
        if self.tree_max_batch is not None and len(batch.rows) > self.tree_max_batch:
            self._narrow(batch.rows)
        return batch

    def _narrow(self, rows: list[ScheduledRow]) -> None:
        """Each row carrying K drafts carries the first narrow_drafts instead (its token and page reservations stay
        the larger ones: room to spare). Only gathered rows carry drafts, so their ids are placeholders."""
        k, nd = self.k, self.narrow_drafts
        if nd >= k:
            return
        ids = (0,) * (nd + 1)
        for row in rows:
            if row.num_drafts == k:
                row.tokens, row.num_drafts, row.num_tokens, row.kv_len = ids, nd, nd + 1, row.start + nd + 1

    def _schedule_steady(self, steps: int = 1) -> ScheduledBatch | None:
        """The steady state's plan without the general loop, or None where it does not apply: nothing waits,
        every running request continues on its slot buffers (one known token: last emitted + K drafts), all
        of them fit the token budget with K drafts each, and the pages they need are free. Then the general
        plan would give each request exactly this row, allocate the same pages in the same order, and
        preempt nobody. Decides before it mutates: None leaves everything as it was.

        steps > 1: the same rows for up to that many sub-steps (`_iteration_steps`), each request's pages
        reserved for all of them (with every draft accepted); None when not even two are worth running."""
        k1 = self.k + 1
        running = self.running
        if len(running) * k1 > self.max_num_tokens:
            return None
        if steps > 1:
            steps = self._iteration_steps(steps, k1)
            if steps < 2:
                return None
        rows: list[ScheduledRow] = []
        grow: list[tuple[Request, int]] = []
        running_, k, edge = Status.RUNNING, self.k, steps * k1 + self._lookahead
        ahead = (steps - 1) * k1  # the last sub-step's row ends this far past the first one's
        new_row, ids = object.__new__, (0,) * k1  # the ids are placeholders: one tuple for the step's rows
        page_size, num_grow, caching = self._page_size, 0, self.prefix_caching
        for req in running:
            if req.status is not running_:  # finished, its pages waiting for the step in flight
                continue
            if caching and req.num_computed >= (req.num_registered + 1) * page_size:
                self._register(req)
            start = req.proj_computed
            if req.proj_known - start != 1 or not req.slot_valid:
                return None
            # ScheduledRow(req, start, ids, k, True, True, bool(req.inflight_rows), 0), without the call
            row = new_row(ScheduledRow)
            row.req, row.start, row.tokens, row.num_drafts, row.samples, row.gather = req, start, ids, k, True, True
            row.correct, row.next_token, row.num_tokens, row.kv_len = bool(req.inflight_rows), 0, k1, start + k1
            if start + edge > len(req.pages) * page_size:  # `_pages_needed`'s steady test, inlined
                need = self._pages_needed(req, row.kv_len + ahead)
                if need:
                    grow.append((req, need))
                    num_grow += need
            rows.append(row)
        if num_grow > self.pool.num_free:
            return None
        for req, need in grow:
            req.pages += self.pool.allocate(req.request_id, need)
        return ScheduledBatch(rows, [], steps)

    def _iteration_steps(self, steps: int, k1: int) -> int:
        """How many of `steps` sub-steps a multi-step iteration of the running requests runs. A request may
        reach its output limit (or a stop) inside the iteration: its later sub-steps run and the host drops
        their tokens, as it drops a step in flight under overlap. But no more sub-steps than the request
        with the most left could use if every draft were accepted (ceil(left / (1 + K))): past that, all of
        them are probably done (the rest, if drafts were rejected, take the next iteration), and none that
        would carry the furthest row past its page table (max_model_len plus the speculative slack)."""
        top, use = 0, 0
        for r in self.running:
            if r.status is not Status.RUNNING:
                continue
            top = max(top, r.proj_computed)
            st = r.stops
            left = steps * k1 if st is None else len(r.prompt_token_ids) + st.limit - r.proj_known
            use = max(use, -(-left // k1))
        fit = (self.max_pages_per_seq * self._page_size - self._lookahead - top) // k1
        return min(steps, use, fit)

    def _schedule(self) -> ScheduledBatch:
        """The general plan: running requests first (FCFS), preempting the newest when pages run out, then
        waiting ones while budget, pages and slots last."""
        budget = self.max_num_tokens
        rows: list[ScheduledRow] = []
        preempted: list[Request] = []
        running_, waiting_ = Status.RUNNING, Status.WAITING
        for req in list(self.running):
            # Finished, or preempted earlier in this loop: back to WAITING (a membership test of `running`
            # was O(rows^2)).
            if req.status is not running_:
                continue
            if self.prefix_caching and req.num_computed >= (req.num_registered + 1) * self._page_size:
                self._register(req)
            row = self._plan_row(req, budget)
            if row is None:
                continue
            need = self._pages_needed(req, row.kv_len)
            if need:
                while need > self.pool.num_free:
                    victim = next((r for r in reversed(self.running) if not r.finished), None)
                    if victim is None:
                        break
                    if victim.inflight:
                        raise NeedSync()
                    self._preempt(victim)
                    preempted.append(victim)
                    if victim is req:
                        break
                if req.status is waiting_:  # preempted itself to make room
                    continue
                req.pages += self.pool.allocate(req.request_id, need)
            rows.append(row)
            budget -= row.num_tokens
            if budget <= 0:
                break
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            req.proj_known = req.num_known
            shared = self._fork(req)
            if shared is None:
                break  # FCFS: the sample waits for its parent's prompt, and so does everyone behind it
            hit: list[int] | None = None
            if shared:
                self.pool.share(req.request_id, shared)
                req.pages, req.fork_src = list(shared), req.group.members[0]
                req.num_computed = req.proj_computed = req.fork_len = len(shared) * self.pool.page_size
            elif self.prefix_caching and (hit := self._cache_hit(req)):
                self.pool.acquire(req.request_id, hit)
                req.pages, req.num_registered = list(hit), len(hit)
                req.num_computed = req.proj_computed = req.fork_len = len(hit) * self.pool.page_size
            row = self._plan_row(req, budget)
            need = self._pages_needed(req, row.kv_len) if row is not None else 0
            if row is None or need > self.pool.num_free:
                if shared or hit:  # not admitted: give the shared or cached pages back
                    self.pool.free(req.request_id, req.pages)
                    req.pages, req.fork_src, req.num_registered = [], None, 0
                    req.num_computed = req.proj_computed = req.fork_len = 0
                break
            if self.prefix_caching and not shared:
                self._count_lookup(req, hit)
            self.waiting.popleft()
            req.status = Status.RUNNING
            if req.first_scheduled_time is None:  # queue time ends at the first admission, not a re-admission
                req.first_scheduled_time = time.monotonic()
            req.slot = self.free_slots.pop()
            req.pages = req.pages + self.pool.allocate(req.request_id, need)
            self.running.append(req)
            rows.append(row)
            budget -= row.num_tokens
        return ScheduledBatch(rows, preempted)

    def commit(self, batch: ScheduledBatch, times: int = 1) -> None:
        """The batch was launched `times` times (a multi-step iteration's sub-steps): project every row's
        effect (all drafts accepted) that often. Repeats are for gather rows only (the steady plan's): their
        folds add up, so `times` of them are one fold scaled."""
        if times == 1:
            for row in batch.rows:  # Request.project inlined (once per row per step)
                req = row.req
                req.inflight_rows.append(row)
                req.proj_computed = (req.proj_computed if row.gather else row.start) + row.num_tokens
                if row.samples:
                    req.proj_known += 1 + row.num_drafts
                    req.slot_valid = True
            return
        if not all(row.gather and row.samples for row in batch.rows):  # checked before anything changes
            raise ValueError("only steady rows (gathered, sampling) can be committed more than once")
        for row in batch.rows:
            req = row.req
            req.inflight_rows += [row] * times
            req.proj_computed += times * row.num_tokens
            req.proj_known += times * (1 + row.num_drafts)
            req.slot_valid = True

    def table_snapshot(self) -> dict[str, list[int]]:
        """Request id -> pages held, for every running request (finished ones awaiting a free included)."""
        return {r.request_id: list(r.pages) for r in self.running if r.pages}
