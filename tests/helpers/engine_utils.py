"""Engine test helpers shared by several test modules: greedy sampling parameters, the page-leak check, a
preemption counter, the chi-square survival function of the distribution tests and the m3eagle logger's records."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from m3eagle import LLM, SamplingParams


def greedy(max_tokens: int, *, ignore_eos: bool = True, **kw) -> SamplingParams:
    """Greedy decoding for exactly `max_tokens` tokens (unless a stop ends it, or ignore_eos=False and EOS does)."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos, **kw)


def assert_clean(llm: LLM) -> None:
    """Invariant 5: idle engine, every page back in the pool, no page owned twice."""
    eng = llm.engine
    eng.check_integrity()
    assert not eng.has_work()
    assert eng.pool.num_free == eng.pool.num_usable
    assert eng.is_idle_and_clean()


class Counters:
    """Preemptions and NeedSync retries seen by one engine -- and, with `force_every=N`, a preemption
    forced on every N-th plan, so a test that relies on preemption never depends on luck (how many drafts
    a trained head gets accepted decides how fast pages run out).

    A forced preemption goes through the scheduler's own path: the newest unfinished running request
    that holds KV is preempted by recompute; if it has a step in flight, the plan raises NeedSync (the
    engine drains and plans again), exactly as a natural preemption under overlap would."""

    def __init__(self, llm: LLM, force_every: int = 0):
        from m3eagle.engine.scheduler import NeedSync

        self.preempted = self.needsync = self.plans = 0
        sched = llm.engine.scheduler
        preempt, schedule = sched._preempt, sched.schedule

        def counted_preempt(req):
            self.preempted += 1
            preempt(req)

        def counted_schedule(*args):
            self.plans += 1
            if force_every and self.plans % force_every == 0:
                victim = next((r for r in reversed(sched.running) if not r.finished and r.num_computed), None)
                if victim is not None:
                    if victim.inflight:
                        self.plans -= 1  # plan again once drained, and force it then
                        self.needsync += 1
                        raise NeedSync()
                    sched._preempt(victim)
            try:
                return schedule(*args)
            except NeedSync:
                self.needsync += 1
                raise

        sched._preempt, sched.schedule = counted_preempt, counted_schedule


def chi2_sf(x: float, df: int) -> float:
    """The chi-square survival function P(X >= x) with df degrees of freedom: Q(df / 2, x / 2), the
    regularized upper incomplete gamma, which torch has -- exact, and the tests need no scipy."""
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                   torch.tensor(x / 2, dtype=torch.float64)).item()


@contextlib.contextmanager
def m3eagle_records() -> Iterator[list[logging.LogRecord]]:
    """The m3eagle logger's records inside the block (it does not propagate to the root, so caplog sees nothing)."""
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler, logger = Collect(logging.DEBUG), logging.getLogger("m3eagle")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
