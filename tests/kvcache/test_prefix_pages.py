"""The page pool's prefix cache and the page keys, without a model: registration, lookup of the longest
cached prefix, acquisition of held and evictable pages, LRU eviction (a prefix's tail before its head,
never-cached pages before cached ones), reset, and the integrity check catching a broken cache."""

from __future__ import annotations

import pytest

from m3eagle.engine.prefix_keys import page_key, page_keys
from m3eagle.engine.request import Request
from m3eagle.kvcache.page_pool import OutOfPages, PagePool
from m3eagle.sampling.params import SamplingParams


def req(rid: str, prompt: list[int], out: list[int] = ()) -> Request:
    r = Request(rid, list(prompt), SamplingParams(max_tokens=4), 0, 0)
    r.output_token_ids = list(out)
    return r


def keys(prompt: list[int], n: int, ps: int = 4) -> list[bytes]:
    return page_keys(req("k", prompt), n, ps)


def test_keys_chain_over_the_prefix_and_the_next_token():
    """Equal keys need equal tokens before and inside the page and an equal token after it (the draft
    head's KV at a page's last position reads the next token)."""
    base = list(range(1, 14))  # 13 tokens: 3 full pages of 4 with a known next token
    assert len(keys(base, 3)) == 3
    assert keys(base, 3) == keys(base + [99], 3)  # tokens past the next one do not matter
    other_next = base[:8] + [77] + base[9:]  # token 8 is page 1's next token and page 2's first
    k0, k1 = keys(base, 3), keys(other_next, 3)
    assert k0[0] == k1[0] and k0[1] != k1[1] and k0[2] != k1[2]
    head_differs = [5] + base[1:]
    assert all(a != b for a, b in zip(keys(base, 3), keys(head_differs, 3)))  # chained: one token changes all
    with pytest.raises(ValueError, match="need token 12"):
        keys(base[:12], 3)  # the third page's next token is unknown


def test_keys_span_prompt_and_output():
    """A preempted request's keys read its outputs as tokens after its prompt."""
    toks = list(range(1, 14))
    assert page_keys(req("a", toks[:6], toks[6:]), 3, 4) == keys(toks, 3)
    r = req("b", toks[:6], toks[6:9])
    first = page_keys(r, 1, 4)
    r.output_token_ids += toks[9:]
    assert page_keys(r, 3, 4)[:1] == first and page_keys(r, 3, 4) == keys(toks, 3)


def test_page_key_is_sha256_of_its_parts():
    import hashlib
    from array import array

    parent = b"\x01" * 32
    want = hashlib.sha256(parent + array("q", [1, 2, 3, 4]).tobytes() + (5).to_bytes(8, "little")).digest()
    assert page_key(parent, [1, 2, 3, 4], 5) == want


def test_register_lookup_acquire_and_evict_lru():
    pool = PagePool(7, 4)  # 6 usable
    ka = [bytes([1, i]) for i in range(3)]
    a = pool.allocate("a", 3)
    for p, k in zip(a, ka):
        pool.register(p, k)
    assert pool.lookup(ka) == a and pool.lookup(ka[:2] + [b"x"]) == a[:2] and pool.lookup([b"x"] + ka) == []
    pool.acquire("b", a[:2])  # a held page is shared
    pool.free("a", a)
    assert pool.num_free == 6 - 2  # a[2] evictable (counts as free), a[:2] still b's
    pool.free("b", a[:2])
    assert pool.num_free == 6 and pool.num_cached == 3
    pool.check_integrity({})
    # never-cached pages go first, then cached ones, the prefix's tail (freed first) before its head
    fresh = pool.allocate("c", 3)
    assert not set(fresh) & set(a) and pool.num_cached == 3
    got = pool.allocate("c", 2)
    assert got == [a[2], a[1]] and pool.num_evictions == 2
    assert pool.lookup(ka) == a[:1]  # only the head is still cached
    pool.acquire("d", a[:1])  # evictable -> held again, no longer evictable
    with pytest.raises(OutOfPages):
        pool.allocate("c", 1)
    pool.check_integrity({"c": fresh + got, "d": a[:1]})


def test_register_keeps_the_first_page_per_key():
    pool = PagePool(5, 4)
    p, q = pool.allocate("a", 1) + pool.allocate("b", 1)
    pool.register(p, b"k")
    pool.register(q, b"k")  # the same prefix computed twice at once: q stays uncached
    pool.free("b", [q])
    assert pool.num_cached == 1 and pool.lookup([b"k"]) == [p]
    with pytest.raises(RuntimeError, match="owned by nobody"):
        pool.register(q, b"other")
    with pytest.raises(RuntimeError, match="not cached or already held"):
        pool.acquire("a", [p])  # a holds it already
    pool.check_integrity({"a": [p]})


def test_reset_cache_and_reset():
    pool = PagePool(5, 4)
    a = pool.allocate("a", 2)
    pool.register(a[0], b"0")
    pool.register(a[1], b"1")
    pool.free("a", a[1:])  # a[1] evictable
    pool.reset_cache()
    assert pool.num_cached == 0 and pool.lookup([b"0"]) == [] and pool.num_free == 3
    pool.check_integrity({"a": a[:1]})
    pool.free("a", a[:1])
    pool.check_integrity({})
    pool.register(pool.allocate("x", 1)[0], b"y")
    pool.reset()
    assert pool.num_cached == 0 and pool.num_free == 4
    pool.check_integrity({})


def test_integrity_catches_a_broken_cache():
    pool = PagePool(5, 4)
    a = pool.allocate("a", 1)
    pool.register(a[0], b"0")
    pool.free("a", a)
    pool._free.append(a[0])  # evictable and free at once
    with pytest.raises(AssertionError, match="evictable pages also free"):
        pool.check_integrity({})
    pool._free.pop()
    del pool._by_key[b"0"]
    with pytest.raises(AssertionError, match="key maps disagree"):
        pool.check_integrity({})
