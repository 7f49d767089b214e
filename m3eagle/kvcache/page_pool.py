"""Page allocator shared by every KV pool (target layers, index-K, draft layer).

All pools are indexed by the same slots (`slot = page * page_size + offset`), so one allocator and one
page table per request serve them all. Page 0 is the trash page (see attention/metadata.py).

Pages are reference-counted by owner: the n samples of one prompt share the prompt's full pages
(`share`), and a page returns to the free list when its last owner frees it. A shared page is never
written again: it holds positions below every owner's first own position.
"""

from __future__ import annotations

from collections import deque

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

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, owner: str, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._owners[p] = [owner]
        return pages

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
        for p in pages:
            owners = self._owners[p]
            owners.remove(owner)
            if not owners:
                del self._owners[p]
                self._free.append(p)

    def _who(self, page: int) -> str:
        return " and ".join(map(repr, self._owners.get(page, []))) or "nobody"

    def reset(self) -> None:
        """Every page free again (the engine's fault recovery, once no request holds pages)."""
        self._free = deque(range(1, self.num_pages))
        self._owners = {}

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
        if TRASH_PAGE in free or TRASH_PAGE in seen:
            raise AssertionError("the trash page was handed out")
        leaked = set(range(1, self.num_pages)) - free - set(seen)
        if leaked:
            raise AssertionError(f"leaked pages {sorted(leaked)[:10]} (owners {[self._owners.get(p) for p in leaked][:5]})")
        if free & set(seen):
            raise AssertionError(f"pages both free and owned: {sorted(free & set(seen))[:10]}")
