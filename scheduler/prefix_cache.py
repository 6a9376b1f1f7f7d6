"""The scheduler's side of the radix prefix cache (memory/radix_cache.py): one per data-parallel rank.

A running request holds a lock on the tree node its cached prefix ends at (`Req.prefix_node`) and its page
table row borrows that prefix's pages (memory/allocator.py `ReqToTokenPool.borrow`). Its computed tokens go
into the tree when its prompt is done (so requests that arrive while it decodes share it), and again when
it finishes, is aborted or is retracted (so the next turn of a conversation, and the retracted request's
own recompute, start from them). Pages the tree holds unlocked are free memory that has not been given
back yet: `make_room` evicts them, least recently used first, before the scheduler retracts anyone.

Only whole pages are cached (see memory/radix_cache.py): a prefix that ends inside a page is matched up to
its last whole page and the request recomputes the rest into a page of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from memory import PageAllocator, ReqToTokenPool
from memory.radix_cache import MatchResult, RadixCache, RadixNode


class RankPrefixCache:
    """The tree of one rank, with that rank's page allocator and page table."""

    def __init__(self, pages: PageAllocator, table: ReqToTokenPool):
        self.tree = RadixCache(table.page_size)
        self.pages, self.table = pages, table

    def match(self, tokens: Sequence[int]) -> MatchResult:
        """The longest cached whole-page prefix of `tokens`, locked: the caller `unlock`s `result.node` when
        it does not admit the request, or hands it to `borrow`."""
        m = self.tree.match_prefix(tokens)
        self.tree.lock(m.node)
        return m

    def unlock(self, node: RadixNode) -> None:
        self.tree.unlock(node)

    def borrow(self, row: int, m: MatchResult) -> None:
        """Starts the empty `row` with the matched prefix's pages (still locked by `m.node`)."""
        self.table.borrow(row, m.pages)

    def make_room(self, num_pages: int) -> bool:
        """Evicts unlocked cached pages until `num_pages` are free, if the tree can give that many; returns
        whether they are free now."""
        missing = num_pages - self.pages.num_free
        if missing > 0 and self.tree.evictable_pages >= missing:
            self.pages.free(self.tree.evict(missing).pages)
        return self.pages.can_allocate(num_pages)

    def insert(self, row: int, tokens: Sequence[int], node: RadixNode, *, keep: bool) -> RadixNode:
        """Caches the whole pages of `tokens` (the first tokens of `row`, their K/V computed) and moves the
        lock from `node` to where they end (`keep`), or releases it (the request is leaving). The row then
        borrows those pages; its own pages for tokens the tree already held are freed. Returns the node
        now locked (the root when `keep` is False)."""
        num_pages = len(tokens) // self.page_size
        r = self.tree.insert(tokens, self.table.table[row, :num_pages].tolist())
        self.table.lend(row, r.pages)
        self.pages.free(r.duplicate_pages)
        if keep:
            self.tree.lock(r.node)
        self.tree.unlock(node)
        return r.node if keep else self.tree.root

    def flush(self) -> int:
        """Empties the tree (refused, raising RuntimeError, while any request holds a lock); returns the
        number of pages given back."""
        freed = self.tree.flush()
        self.pages.free(freed.pages)
        return len(freed.pages)

    @property
    def page_size(self) -> int:
        return self.tree.page_size

    @property
    def root(self) -> RadixNode:
        return self.tree.root

    def check_integrity(self, num_locks: int) -> None:
        """The tree's own checks, its pages disjoint from the free list, the table's accounting with the
        tree's pages, and `num_locks` (one per running request) held."""
        self.tree.check_integrity(free_pages=self.pages.free_pages())
        self.table.check_integrity(cached_pages=self.tree.cached_pages)
        assert self.tree.num_locks == num_locks, f"{self.tree.num_locks} locks held for {num_locks} requests"
