"""Host bookkeeping for KV pages and request rows: NumPy only, self-checking."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class TokenCapacity(NamedTuple):
    num_pages: int  # usable pages (the dummy page 0 excluded)
    page_size: int

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size


class FreeList:
    """LIFO free list of ids 1..size-1 (id 0 is the padding dummy and is never handed out): recently freed
    ids are reused first (warm in cache). Freeing id 0, an unknown id or a free one raises."""

    unit, size_name = "id", "size"  # for messages

    def __init__(self, size: int):
        if size < 2:
            raise ValueError(f"{self.size_name}={size} must be >= 2 ({self.unit} 0 is reserved)")
        self.size = size
        self._free = list(range(size - 1, 0, -1))
        self._is_free = set(self._free)  # catches double frees in O(1)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Pops `n` ids; raises RuntimeError when fewer are free (callers check `can_allocate`)."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} {self.unit}s, {len(self._free)} free")
        if n == 0:
            return []
        ids = self._free[-n:]
        del self._free[-n:]
        self._is_free.difference_update(ids)
        return ids

    def free(self, ids: list[int]) -> None:
        """Returns `ids`; raises ValueError (freeing none of them) on id 0, an unknown or a free id."""
        bad = [i for i in ids if not 0 < i < self.size or i in self._is_free]
        if bad or len(set(ids)) != len(ids):
            raise ValueError(f"cannot free {self.unit}s {ids}: {bad or 'a repeat'} dummy/unknown/free")
        self._free.extend(ids)
        self._is_free.update(ids)

    def free_ids(self) -> list[int]:
        return list(self._free)


class PageAllocator(FreeList):
    """Free list of KV pages 1..num_pages-1 (page 0 is the padding dummy and never handed out)."""

    unit, size_name = "page", "num_pages"

    @property
    def num_pages(self) -> int:
        return self.size

    def free_pages(self) -> list[int]:
        return self.free_ids()


class ReqToTokenPool:
    """Rows of a page table, one per running request; row 0 is the padding dummy (all page 0).

    A row's pages cover its tokens in order: token i lives in page `table[row, i // page_size]`. Its first
    `num_borrowed_of[row]` pages belong to the prefix cache (memory/radix_cache.py), which lends them while
    the request holds a lock; the row owns, and frees, only the pages after them.
    """

    def __init__(self, max_requests: int, max_pages_per_request: int, pages: PageAllocator, page_size: int):
        self.page_size = page_size
        self.pages = pages
        self.table = np.zeros((max_requests + 1, max_pages_per_request), np.int32)
        self.num_pages_of = np.zeros(max_requests + 1, np.int32)
        self.num_borrowed_of = np.zeros(max_requests + 1, np.int32)
        self._free_rows = list(range(max_requests, 0, -1))
        self._used_rows: set[int] = set()

    @property
    def max_requests(self) -> int:
        return self.table.shape[0] - 1

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def pages_needed(self, row: int, num_tokens: int) -> int:
        """Extra pages `row` needs to hold `num_tokens` tokens in total."""
        return max(0, -(-num_tokens // self.page_size) - int(self.num_pages_of[row]))

    def can_allocate_row(self) -> bool:
        return bool(self._free_rows)

    def allocate_row(self) -> int:
        if not self._free_rows:
            raise RuntimeError("no free request rows")
        row = self._free_rows.pop()
        self._used_rows.add(row)
        return row

    def borrow(self, row: int, pages: list[int]) -> None:
        """Starts the empty `row` with the prefix cache's `pages` (its first tokens' K/V, read-only)."""
        if self.num_pages_of[row]:
            raise ValueError(f"row {row} already holds {self.num_pages_of[row]} pages")
        self.table[row, : len(pages)] = pages
        self.num_pages_of[row] = self.num_borrowed_of[row] = len(pages)

    def lend(self, row: int, cached_pages: list[int]) -> None:
        """The prefix cache now holds `row`'s first len(cached_pages) pages' tokens in `cached_pages`: the
        row borrows them from here on. Its own pages there either went to the cache (the same ids) or were
        duplicates, which the caller frees (the row no longer lists them)."""
        n = len(cached_pages)
        if n > self.num_pages_of[row] or n < self.num_borrowed_of[row]:
            raise ValueError(f"row {row}: cannot lend {n} pages of {self.num_pages_of[row]} "
                             f"({self.num_borrowed_of[row]} already borrowed)")
        self.table[row, :n] = cached_pages
        self.num_borrowed_of[row] = n

    def own_pages(self, row: int) -> list[int]:
        """The pages `row` owns (after the borrowed ones)."""
        return self.table[row, self.num_borrowed_of[row] : self.num_pages_of[row]].tolist()

    def reserve(self, row: int, num_tokens: int) -> bool:
        """Grows `row` to hold `num_tokens` tokens; returns False (changing nothing) if pages run out."""
        need = self.pages_needed(row, num_tokens)
        if need == 0:
            return True
        start = int(self.num_pages_of[row])
        if start + need > self.table.shape[1]:
            raise ValueError(f"{num_tokens=} exceeds the per-request page table "
                             f"({self.table.shape[1]} pages)")
        if not self.pages.can_allocate(need):
            return False
        self.table[row, start : start + need] = self.pages.allocate(need)
        self.num_pages_of[row] = start + need
        return True

    def truncate(self, row: int, num_tokens: int) -> int:
        """Frees the pages `row` owns past those its first `num_tokens` tokens need (speculative decoding's
        drafts that were not kept); borrowed pages stay. Returns how many were freed."""
        keep = max(-(-num_tokens // self.page_size), int(self.num_borrowed_of[row]))
        end = int(self.num_pages_of[row])
        if end <= keep:
            return 0
        self.pages.free(self.table[row, keep:end].tolist())
        self.table[row, keep:end] = 0
        self.num_pages_of[row] = keep
        return end - keep

    def free_row(self, row: int) -> None:
        """Returns the row and the pages it owns (borrowed ones stay the prefix cache's)."""
        if row not in self._used_rows:
            raise ValueError(f"row {row} is not allocated")
        self.pages.free(self.own_pages(row))
        self.table[row] = 0
        self.num_pages_of[row] = self.num_borrowed_of[row] = 0
        self._used_rows.remove(row)
        self._free_rows.append(row)

    def check_integrity(self, cached_pages: set[int] | frozenset[int] = frozenset()) -> None:
        """Raises AssertionError unless free + owned + `cached_pages` (the prefix cache's) == every page,
        with no page owned twice, and every borrowed page is a cached one."""
        in_use = [p for r in self._used_rows for p in self.own_pages(r)]
        borrowed = {p for r in self._used_rows for p in self.table[r, : self.num_borrowed_of[r]].tolist()}
        assert borrowed <= cached_pages, f"rows borrow pages the cache lacks: {borrowed - cached_pages}"
        free = self.pages.free_pages()
        everything = in_use + free + sorted(cached_pages)
        assert len(everything) == len(set(everything)), "a page is owned twice"
        assert sorted(everything) == list(range(1, self.pages.num_pages)), (
            f"pages lost or invented: {len(in_use)} in use + {len(free)} free + {len(cached_pages)} cached "
            f"!= {self.pages.num_pages - 1}"
        )
        assert not (self.table[0] != 0).any(), "dummy row 0 was written"
        for r in set(range(1, self.max_requests + 1)) - self._used_rows:
            assert self.num_pages_of[r] == 0 and self.num_borrowed_of[r] == 0 and not self.table[r].any(), (
                f"free row {r} still holds pages")
        assert len(self._used_rows) + len(self._free_rows) == self.max_requests, "rows lost"


class SnapshotAllocator(FreeList):
    """Free list of recurrent-state snapshot slots 1..num_slots-1 (slot 0 is the padding dummy).

    A slot indexes a device pool of SSM + conv states kept at prefix boundaries by the radix cache
    (`memory.radix_cache`), separate from the per-request `RecurrentStatePool` slots.
    """

    unit, size_name = "snapshot slot", "num_slots"

    @property
    def num_slots(self) -> int:
        return self.size

    def free_slots(self) -> list[int]:
        return self.free_ids()

    def check_integrity(self, in_use: list[int] | None = None) -> None:
        """Raises AssertionError unless the free list is duplicate-free and in range; given the slots in use
        elsewhere, also that in-use + free == every slot 1..num_slots-1, none counted twice."""
        assert len(self._free) == len(self._is_free) == len(set(self._free)), "a slot is free twice"
        assert set(self._free) == self._is_free, "free list and free set disagree"
        assert all(0 < s < self.num_slots for s in self._free), "slot 0 or an unknown slot is free"
        if in_use is not None:
            everything = list(in_use) + self._free
            assert len(everything) == len(set(everything)), "a slot is both in use and free, or used twice"
            assert sorted(everything) == list(range(1, self.num_slots)), (
                f"slots lost or invented: {len(in_use)} in use + {len(self._free)} free "
                f"!= {self.num_slots - 1}"
            )
