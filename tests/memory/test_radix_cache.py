"""Radix prefix cache (host side): hand cases, then random operations against a plain dictionary model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from memory.allocator import PageAllocator, SnapshotAllocator
from memory.radix_cache import RadixCache, RadixNode

# page_size 2 throughout: tokens (1, 1, 2, 2, 3) are the whole pages (1, 1), (2, 2) and a partial page (3,).
A = [1, 1, 2, 2, 3, 3]
B = [1, 1, 2, 2, 4, 4]


def test_shared_prefix_is_matched_and_split_at_a_page_boundary():
    cache = RadixCache(2)
    assert cache.insert(A, [10, 11, 12]).num_cached_tokens == 0
    assert cache.num_nodes == 1
    r = cache.insert(B, [10, 11, 13])  # borrows A's first two pages, as a request that matched them would
    assert r.num_cached_tokens == 4 and r.duplicate_pages == []
    assert cache.num_nodes == 3 and cache.num_cached_pages == 4  # (1,1,2,2) -> (3,3) | (4,4)
    m = cache.match_prefix(A + [5, 5])
    assert m.pages == [10, 11, 12] and m.num_tokens == 6
    assert cache.match_prefix(B).pages == [10, 11, 13]
    assert cache.match_prefix([1, 1, 9, 9]).pages == [10]  # splits (1,1,2,2) after its first page
    assert cache.num_nodes == 4
    assert cache.match_prefix([7, 7, 1, 1]).node is cache.root
    cache.check_integrity()


def test_a_handle_survives_splits_above_it():
    cache = RadixCache(2)
    node = cache.insert(A, [10, 11, 12]).node
    cache.lock(node)
    cache.match_prefix([1, 1, 2, 2])  # splits node's key: a new parent holds (1,1,2,2)
    assert node.key == (3, 3) and node.pages == (12,) and node.parent.pages == (10, 11)
    assert cache.match_prefix(A).node is node
    assert cache.evictable_pages == 0
    cache.check_integrity()
    cache.unlock(node)
    assert cache.evictable_pages == 3
    cache.check_integrity()


def test_a_partial_last_page_is_neither_cached_nor_matched():
    cache = RadixCache(2)
    r = cache.insert([1, 1, 2, 2, 3], [10, 11, 12])  # page 12 holds one token: it stays the caller's
    assert r.duplicate_pages == [] and cache.num_cached_pages == 2 and r.node.key == (1, 1, 2, 2)
    m = cache.match_prefix([1, 1, 2, 2, 3])
    assert m.pages == [10, 11] and m.num_tokens == 4
    assert cache.match_prefix([1, 1, 2]).num_tokens == 2
    assert cache.insert([1], [99]).node is cache.root  # less than a page: nothing to cache
    assert cache.peek(np.array([1, 1, 2, 2, 3, 3])) == 4
    cache.check_integrity(free_pages=[12, 99])


def test_insert_returns_the_callers_duplicates_and_keeps_its_own_pages():
    cache = RadixCache(2)
    cache.insert(A, [10, 11, 12])
    # Another request computed A (+ one more page) with pages of its own: the first three are duplicates.
    r = cache.insert(A + [5, 5], [20, 21, 22, 23])
    assert r.num_cached_tokens == 6 and r.duplicate_pages == [20, 21, 22] and r.pages == [10, 11, 12, 23]
    assert cache.match_prefix(A + [5, 5]).pages == [10, 11, 12, 23]
    # Mixed: borrowed pages equal to the tree's are not duplicates.
    r = cache.insert(A, [10, 31, 12])
    assert r.duplicate_pages == [31] and r.num_cached_tokens == 6
    cache.check_integrity(free_pages=[20, 21, 22, 31])


def test_insert_rejects_bad_pages_without_changing_anything():
    cache = RadixCache(2)
    cache.insert(A, [10, 11, 12])
    for tokens, pages in [(A, [10, 11]), (B, [0, 11, 13]), (B, [10, 13, 13]), (B, [10, 11, 12]),
                          ([5, 5, 6, 6], [14, 11])]:
        with pytest.raises(ValueError):
            cache.insert(tokens, pages)
    assert cache.num_cached_pages == 3 and cache.match_prefix(B).pages == [10, 11]
    cache.check_integrity()


def test_locks_block_eviction_down_to_the_root():
    cache = RadixCache(2)
    a = cache.insert(A, [10, 11, 12]).node
    b = cache.insert(B, [10, 11, 13]).node
    cache.lock(b)
    assert cache.evictable_pages == 1 and cache.num_locks == 1
    assert cache.evict(10) == ([12], [])  # only A's own page; B's path is locked
    assert cache.num_cached_pages == 3 and cache.evict(10).pages == []
    with pytest.raises(ValueError):
        cache.lock(a)  # evicted: the handle is dead
    cache.unlock(b)
    with pytest.raises(ValueError):
        cache.unlock(b)  # no lock left
    assert sorted(cache.evict(10).pages) == [10, 11, 13]  # the leaf, then its parent left childless
    assert cache.num_nodes == 0
    cache.check_integrity()


def test_eviction_takes_least_recently_used_leaves_first():
    cache = RadixCache(2)
    for i, first in enumerate([5, 6, 7]):
        cache.insert([first] * 4, [10 + 2 * i, 11 + 2 * i])  # 5555 -> 10,11; 6666 -> 12,13; 7777 -> 14,15
    cache.match_prefix([5, 5, 5, 5])  # 5555 is now the most recently used
    assert cache.evict(1).pages == [12, 13]  # whole node: at least one page
    assert cache.evict(2).pages == [14, 15]
    cache.insert([5, 5, 5, 5, 8, 8], [10, 11, 16])
    cache.insert([5, 5, 5, 5, 9, 9], [10, 11, 17])
    cache.match_prefix([5, 5, 5, 5, 8, 8, 1])  # (8,8) is now younger than (9,9)
    assert cache.evict(1).pages == [17]
    assert cache.evict(1).pages == [16]
    assert cache.evict(1).pages == [10, 11]  # the parent, a leaf now
    cache.check_integrity()


def test_the_lru_heap_stays_bounded_under_repeated_touches():
    cache = RadixCache(2)
    cache.insert([5, 5], [10])
    cache.insert([6, 6], [11])
    for _ in range(3000):  # each touch of an evictable leaf pushes an entry; stale ones get dropped
        cache.match_prefix([5, 5])
    assert len(cache._lru) < 1100
    cache.check_integrity()
    assert cache.evict(1).pages == [11]


def test_hybrid_match_ends_at_the_deepest_snapshot():
    cache = RadixCache(2, needs_snapshots=True)
    cache.insert(A, [10, 11, 12])
    assert cache.match_prefix(A).node is cache.root  # KV but no snapshot: no usable prefix
    mid = cache.insert([1, 1, 2, 2], [10, 11]).node  # splits A at the end of its second page
    assert cache.set_snapshot(mid, 3)
    assert not cache.set_snapshot(mid, 4)  # already has one: the caller keeps (and frees) slot 4
    m = cache.match_prefix(A + [7, 7])
    assert (m.pages, m.node, m.snapshot) == ([10, 11], mid, 3)
    leaf = cache.insert(A, [10, 11, 12]).node
    cache.set_snapshot(leaf, 5)
    assert cache.match_prefix(A).snapshot == 5 and cache.match_prefix([1, 1, 2, 2, 3, 4]).snapshot == 3
    assert cache.peek(A) == 6 and cache.peek([1, 1, 2, 2, 3, 4]) == 4
    assert cache.evict(1) == ([12], [5])  # the leaf's snapshot goes with its pages
    cache.check_integrity(free_snapshots=[4, 5])
    with pytest.raises(ValueError):
        RadixCache(2).set_snapshot(RadixCache(2).insert(A, [1, 2, 3]).node, 1)  # KV-only tree


def test_evict_snapshots_drops_unpinned_snapshots_lru_and_keeps_pages():
    cache = RadixCache(2, needs_snapshots=True)
    nodes = [cache.insert([t] * 4, [10 + 2 * i, 11 + 2 * i]).node for i, t in enumerate([5, 6, 7])]
    for slot, node in enumerate(nodes, start=1):
        cache.set_snapshot(node, slot)
    parent = cache.insert([5, 5], [10]).node  # splits 5555; its snapshot stays at the end (slot 1)
    cache.set_snapshot(parent, 4)
    cache.lock(nodes[0])  # pins slot 1 only: its ancestor's slot 4 stays droppable
    cache.match_prefix([7, 7, 7, 7])
    assert cache.evictable_snapshots == 3
    assert cache.evict_snapshots(2) == [2, 4]  # 6666 is oldest; then (5,5), touched before 7777
    assert cache.evict_snapshots(5) == [3]  # slot 1 is pinned
    assert cache.num_cached_pages == 6 and cache.match_prefix([6, 6, 6, 6]).num_tokens == 0
    assert cache.match_prefix([5, 5, 5, 5]).snapshot == 1
    cache.check_integrity()


def test_flush_refuses_while_locked_then_returns_everything():
    cache = RadixCache(2, needs_snapshots=True)
    node = cache.insert(A, [10, 11, 12]).node
    cache.set_snapshot(node, 7)
    cache.lock(node)
    with pytest.raises(RuntimeError, match="1 locks are held"):
        cache.flush()
    assert cache.num_cached_pages == 3
    cache.unlock(node)
    assert cache.flush() == ([10, 11, 12], [7])
    assert cache.num_cached_pages == cache.num_nodes == cache.num_snapshots == 0
    cache.check_integrity()


def test_check_integrity_catches_a_page_owned_twice():
    cache = RadixCache(2)
    cache.insert(A, [10, 11, 12])
    cache.insert(B, [10, 11, 13])
    leaf = cache.match_prefix(B).node
    leaf.pages = (12,)
    with pytest.raises(AssertionError, match="owned by two nodes"):
        cache.check_integrity()
    leaf.pages = (13,)
    cache.check_integrity()
    with pytest.raises(AssertionError, match="both cached and free"):
        cache.check_integrity(free_pages=[13])


def test_snapshot_allocator_never_hands_out_slot_zero_and_refuses_double_frees():
    slots = SnapshotAllocator(4)
    got = slots.allocate(3)
    assert sorted(got) == [1, 2, 3] and not slots.can_allocate(1)
    with pytest.raises(RuntimeError):
        slots.allocate(1)
    slots.free(got[:1])
    for bad in ([got[0]], [0], [4], [got[1], got[1]]):
        with pytest.raises(ValueError):
            slots.free(bad)
    slots.check_integrity(in_use=got[1:])
    with pytest.raises(AssertionError):
        slots.check_integrity(in_use=got)


# --- random operations against a dictionary model --------------------------------------------------------

PAGE = 2
# 3 symbols, 2 per page: random prefixes are shared a lot; a few fixed prompts come back again and again.
PROMPTS = [[0, 0, 1, 1, 2, 2, 0, 0], [0, 0, 1, 1, 2, 2, 1, 1, 0], [0, 0, 1, 1], [1] * 6, [1] * 10 + [2]]
TOKENS = st.one_of(st.sampled_from(PROMPTS), st.lists(st.integers(0, 2), max_size=11))


class CacheMachine(RuleBasedStateMachine):
    """The model: cached whole-page prefix -> page of its last page (prefix-closed), prefix -> snapshot slot,
    prefix -> time of last use, and the locks held (node, the prefix it ends at)."""

    needs_snapshots = False

    def __init__(self):
        super().__init__()
        self.cache = RadixCache(PAGE, needs_snapshots=self.needs_snapshots)
        self.pages = PageAllocator(16)
        self.slots = SnapshotAllocator(6)
        self.model: dict[tuple, int] = {}
        self.snaps: dict[tuple, int] = {}
        self.used: dict[tuple, int] = {}
        self.clock = 0
        self.locks: list[tuple[RadixNode, tuple]] = []

    # model helpers

    def prefixes(self, tokens) -> list[tuple]:
        return [tuple(tokens[:i]) for i in range(PAGE, len(tokens) // PAGE * PAGE + 1, PAGE)]

    def model_match(self, tokens) -> list[tuple]:
        matched = []
        for p in self.prefixes(tokens):
            if p not in self.model:
                break
            matched.append(p)
        if self.needs_snapshots:
            while matched and matched[-1] not in self.snaps:
                matched.pop()
        return matched

    def touch(self, prefixes) -> None:
        self.clock += 1
        for p in prefixes:
            self.used[p] = self.clock

    def locked(self) -> set[tuple]:
        return {lp[:i] for _, lp in self.locks for i in range(PAGE, len(lp) + 1, PAGE)}

    def evict(self, n: int) -> None:
        before = self.cache.evictable_pages
        out = self.cache.evict(n)
        gone = [p for p, page in self.model.items() if page in out.pages]
        assert len(gone) == len(out.pages) and not set(gone) & self.locked()
        assert len(out.pages) >= min(n, before), "stopped early"
        assert sorted(out.snapshots) == sorted(self.snaps[p] for p in gone if p in self.snaps)
        for p in gone:
            del self.model[p]
            self.snaps.pop(p, None)
        assert all(p[:-PAGE] in self.model for p in self.model if len(p) > PAGE), "evicted a non-leaf"
        parents = {p[:-PAGE] for p in self.model}
        rest = [self.used[p] for p in self.model if p not in self.locked() and p not in parents]  # leaves
        assert not gone or not rest or max(self.used[p] for p in gone) <= min(rest), "not LRU"
        self.pages.free(out.pages)
        self.slots.free(out.snapshots)

    # rules

    @rule(tokens=TOKENS, fresh=st.booleans(), keep=st.booleans(), snapshot=st.booleans())
    def insert(self, tokens, fresh, keep, snapshot):
        """A request computes `tokens`: reusing a match (locked meanwhile) unless `fresh`."""
        borrowed, held = [], None
        if not fresh:
            m = self.cache.match_prefix(tokens)
            expected = self.model_match(tokens)
            self.touch(expected)
            borrowed, held = m.pages, m.node
            self.cache.lock(held)
        need = -(-len(tokens) // PAGE) - len(borrowed)
        if not self.pages.can_allocate(need):
            self.evict(need - self.pages.num_free)
        if self.pages.can_allocate(need):
            own = self.pages.allocate(need)
            pages = borrowed + own
            prefixes = self.prefixes(tokens)
            dup = [pg for p, pg in zip(prefixes, pages) if p in self.model and self.model[p] != pg]
            num_cached = sum(p in self.model for p in prefixes)
            r = self.cache.insert(tokens, pages)
            assert r.duplicate_pages == dup and r.num_cached_tokens == num_cached * PAGE
            for p, pg in zip(prefixes, pages):
                self.model.setdefault(p, pg)
            assert r.pages == [self.model[p] for p in prefixes]
            self.touch(prefixes)
            self.pages.free(dup + pages[len(prefixes):])  # the duplicates and the partial last page
            if self.needs_snapshots and snapshot and prefixes and self.slots.can_allocate(1):
                [slot] = self.slots.allocate(1)
                taken = self.cache.set_snapshot(r.node, slot)
                assert taken == (prefixes[-1] not in self.snaps)
                if taken:
                    self.snaps[prefixes[-1]] = slot
                else:
                    self.slots.free([slot])
            if keep and prefixes and len(self.locks) < 4:
                self.cache.lock(r.node)
                self.locks.append((r.node, prefixes[-1]))
        if held is not None:
            self.cache.unlock(held)

    @rule(tokens=TOKENS, keep=st.booleans())
    def match(self, tokens, keep):
        m = self.cache.match_prefix(tokens)
        expected = self.model_match(tokens)
        self.touch(expected)
        assert m.pages == [self.model[p] for p in expected] and m.num_tokens == len(expected) * PAGE
        assert m.snapshot == (self.snaps.get(expected[-1]) if expected else None)
        assert self.cache.peek(tokens) == m.num_tokens
        if keep and expected and len(self.locks) < 4:
            self.cache.lock(m.node)
            self.locks.append((m.node, expected[-1]))

    @precondition(lambda self: self.locks and len(self.locks) < 6)
    @rule(data=st.data())
    def lock_again(self, data):
        """A second request holding the same prefix."""
        self.locks.append(self.locks[data.draw(st.integers(0, len(self.locks) - 1))])
        self.cache.lock(self.locks[-1][0])

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        node, _ = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.cache.unlock(node)

    @rule(n=st.integers(0, 6))
    def evict_pages(self, n):
        self.evict(n)

    @rule(n=st.integers(0, 3))
    def evict_snapshots(self, n):
        pinned = {lp for _, lp in self.locks}
        droppable = [p for p in self.snaps if p not in pinned]
        out = self.cache.evict_snapshots(n)
        gone = [p for p, slot in self.snaps.items() if slot in out]
        assert len(gone) == len(out) == min(n, len(droppable)) and not set(gone) & pinned
        rest = [self.used[p] for p in droppable if p not in gone]
        assert not gone or not rest or max(self.used[p] for p in gone) <= min(rest), "not LRU"
        for p in gone:
            del self.snaps[p]
        self.slots.free(out)

    @precondition(lambda self: len(self.model) >= 6)
    @rule()
    def flush(self):
        if self.locks:
            with pytest.raises(RuntimeError):
                self.cache.flush()
            return
        out = self.cache.flush()
        assert sorted(out.pages) == sorted(self.model.values())
        assert sorted(out.snapshots) == sorted(self.snaps.values())
        self.pages.free(out.pages)
        self.slots.free(out.snapshots)
        self.model.clear()
        self.snaps.clear()

    @invariant()
    def agrees_with_the_model(self):
        self.cache.check_integrity(self.pages.free_pages(), self.slots.free_slots())
        contents, snaps, stack = {}, {}, [((), self.cache.root)]
        while stack:
            prefix, node = stack.pop()
            for i, page in enumerate(node.pages):
                contents[prefix + node.key[: (i + 1) * PAGE]] = page
            prefix += node.key
            if node.snapshot is not None:
                snaps[prefix] = node.snapshot
            stack.extend((prefix, child) for child in node.children.values())
        assert contents == self.model and snaps == self.snaps
        # Nothing is held outside the tree between steps: every page and slot is cached or free.
        assert sorted(list(contents.values()) + self.pages.free_pages()) == list(range(1, 16))
        self.slots.check_integrity(in_use=list(snaps.values()))
        locked = self.locked()
        assert self.cache.evictable_pages == sum(p not in locked for p in self.model)
        pinned = {lp for _, lp in self.locks}
        assert self.cache.evictable_snapshots == sum(p not in pinned for p in self.snaps)
        assert self.cache.num_locks == len(self.locks)


class HybridCacheMachine(CacheMachine):
    needs_snapshots = True


SETTINGS = settings(max_examples=150, stateful_step_count=40, deadline=None, database=None)
TestRadixCacheProperties = CacheMachine.TestCase
TestRadixCacheProperties.settings = SETTINGS
TestHybridRadixCacheProperties = HybridCacheMachine.TestCase
TestHybridRadixCacheProperties.settings = SETTINGS
