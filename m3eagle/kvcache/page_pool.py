"""Page allocator shared by every KV pool (target layers, index-K, draft layer).

All pools are indexed by the same slots (`slot = page * page_size + offset`), so one allocator and one
page table per request serve them all. Page 0 is the trash page (see attention/metadata.py).

Pages are reference-counted by owner: the n samples of one prompt share the prompt's full pages
(`share`), and a page returns to the free list when its last owner frees it. A shared page is never
written again: it holds positions below every owner's first own position.

Prefix caching: a full page whose KV is final may be registered under a key (`register`; the scheduler
derives keys from the tokens, see engine/prefix_keys.py). When its last owner frees it, a registered page
is not free but *evictable*: it keeps its KV and key, counts as free for allocation, and a later request
with the same key takes it back (`lookup` + `acquire`). Allocation hands out never-registered pages
first, then evicts registered ones least recently freed first (the tail of a prefix before its head,
since a request's pages are freed tail first).
"""

from __future__ import annotations

from collections import OrderedDict, deque

from m3eagle.kernels.attention.metadata import TRASH_PAGE


class OutOfPages(RuntimeError):
    pass


class PagePool:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: need at least 2 (page 0 is reserved as trash)")
        self.num_pages, self.page_size = num_pages, page_size
        self._free: deque[int] = deque(range(1, num_pages))
        self._owners: dict[int, list[str]] = {}  # page -> its owners (more than one only when shared)
        self._by_key: dict[bytes, int] = {}  # prefix-cache key -> the page holding that KV
        self._key_of: dict[int, bytes] = {}  # registered page -> its key
        self._evictable: OrderedDict[int, None] = OrderedDict()  # registered, ownerless; LRU first
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Pages an allocation may take: free ones and evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Registered pages (held by requests or evictable)."""
        return len(self._key_of)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, owner: str, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfPages(f"need {n} pages, {self.num_free} free")
        pages = [self._free.popleft() if self._free else self._evict() for _ in range(n)]
        for p in pages:
            self._owners[p] = [owner]
        return pages

    def _evict(self) -> int:
        page, _ = self._evictable.popitem(last=False)
        del self._by_key[self._key_of.pop(page)]
        self.num_evictions += 1
        return page

    # ---- prefix cache ---------------------------------------------------------------------------
    def register(self, page: int, key: bytes) -> None:
        """`page` (owned, its KV final) holds the KV that `key` names. A key already cached elsewhere keeps
        its page (two requests that computed the same prefix at once): this one stays unregistered, as
        does a page registered before."""
        if page in self._key_of or key in self._by_key:
            return
        if not self._owners.get(page):
            raise RuntimeError(f"page {page} registered but owned by nobody")
        self._by_key[key] = page
        self._key_of[page] = key

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The pages of the longest cached prefix of `keys` (each key names a page and, chained, its prefix)."""
        pages = []
        for key in keys:
            page = self._by_key.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def acquire(self, owner: str, pages: list[int]) -> None:
        """`owner` holds cached `pages` (from `lookup`): evictable ones are taken back, held ones shared."""
        for p in pages:
            if p not in self._key_of or owner in self._owners.get(p, ()):
                raise RuntimeError(f"page {p} acquired by {owner!r} but it is not cached or already held")
        for p in pages:
            if p in self._evictable:
                del self._evictable[p]
                self._owners[p] = [owner]
            else:
                self._owners[p].append(owner)

    def reset_cache(self) -> None:
        """Forget every key: evictable pages become free, held pages stay held (no longer findable)."""
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._by_key.clear()
        self._key_of.clear()

    def share(self, owner: str, pages: list[int]) -> None:
        """`owner` holds `pages` too (already owned by someone else); each stays allocated until every owner
        has freed it."""
        for p in pages:
            if not self._owners.get(p) or owner in self._owners[p]:
                raise RuntimeError(f"page {p} shared with {owner!r} but owned by {self._who(p)}")
        for p in pages:
            self._owners[p].append(owner)

    def free(self, owner: str, pages: list[int]) -> None:
        for p in pages:
            if owner not in self._owners.get(p, ()):
                raise RuntimeError(f"page {p} freed by {owner!r} but owned by {self._who(p)}")
        for p in reversed(pages):  # tail first: a prefix's last pages are evicted before its first
            owners = self._owners[p]
            owners.remove(owner)
            if not owners:
                del self._owners[p]
                if p in self._key_of:
                    self._evictable[p] = None
                else:
                    self._free.append(p)

    def _who(self, page: int) -> str:
        return " and ".join(map(repr, self._owners.get(page, []))) or "nobody"

    def reset(self) -> None:
        """Every page free again (the engine's fault recovery, once no request holds pages)."""
        self._free = deque(range(1, self.num_pages))
        self._owners = {}
        self._evictable.clear()
        self._by_key.clear()
        self._key_of.clear()

    def check_integrity(self, tables: dict[str, list[int]]) -> None:
        """No page leaked, none in a table the allocator does not know of (a page is in several tables only
        when shared, and then exactly its owners' tables), none both free and owned, trash never handed out.
        `tables` maps every live request id to the pages its table holds."""
        seen: dict[int, list[str]] = {}
        for rid, pages in tables.items():
            for p in pages:
                if rid not in self._owners.get(p, ()):
                    raise AssertionError(f"page {p} in {rid!r}'s table but allocator says {self._who(p)}")
                seen.setdefault(p, []).append(rid)
        for p, rids in seen.items():
            if sorted(rids) != sorted(self._owners[p]):
                raise AssertionError(f"page {p} owned by {self._who(p)} but in the tables of {rids!r}")
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a page is on the free list twice")
        evictable = set(self._evictable)
        both = evictable & (free | set(self._owners))
        if both:
            raise AssertionError(f"evictable pages also free or owned: {sorted(both)[:10]}")
        if any(p not in self._key_of for p in evictable):
            raise AssertionError("an evictable page has no key")
        if len(self._by_key) != len(self._key_of) or any(self._by_key.get(k) != p for p, k in self._key_of.items()):
            raise AssertionError("the prefix cache's key maps disagree")
        if set(self._key_of) & free:
            raise AssertionError("a free page is still registered")
        if TRASH_PAGE in free or TRASH_PAGE in seen or TRASH_PAGE in self._key_of:
            raise AssertionError("the trash page was handed out")
        leaked = set(range(1, self.num_pages)) - free - set(seen) - evictable
        if leaked:
            raise AssertionError(f"leaked pages {sorted(leaked)[:10]} (owners {[self._owners.get(p) for p in leaked][:5]})")
        if free & set(seen):
            raise AssertionError(f"pages both free and owned: {sorted(free & set(seen))[:10]}")
