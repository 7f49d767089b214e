"""Engine test helpers shared by several test modules: the page-leak check and a preemption counter."""

from __future__ import annotations

from m3eagle import LLM


def assert_clean(llm: LLM) -> None:
    """Invariant 5: idle engine, every page back in the pool, no page owned twice."""
    eng = llm.engine
    eng.check_integrity()
    assert not eng.has_work()
    assert eng.pool.num_free == eng.pool.num_usable
    assert eng.is_idle_and_clean()


def count_preemptions(llm: LLM) -> list[int]:
    """Wrap the scheduler's preemption so a test can assert it really happened."""
    n = [0]
    sched = llm.engine.scheduler
    orig = sched._preempt

    def counted(req):
        n[0] += 1
        orig(req)

    sched._preempt = counted
    return n
