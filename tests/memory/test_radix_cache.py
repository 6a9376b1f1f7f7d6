"""Radix prefix cache (host side): hand cases (tests/memory/test_radix_cache_model.py checks random operations
against a plain dictionary model)."""

from __future__ import annotations

import numpy as np
import pytest

from memory.allocator import SnapshotAllocator
from memory.radix_cache import RadixCache

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


def test_evict_snapshots_drops_unpinned_leaf_snapshots_lru_then_shared_ones_and_keeps_pages():
    cache = RadixCache(2, needs_snapshots=True)
    nodes = [cache.insert([t] * 4, [10 + 2 * i, 11 + 2 * i]).node for i, t in enumerate([5, 6, 7])]
    for slot, node in enumerate(nodes, start=1):
        cache.set_snapshot(node, slot)
    parent = cache.insert([5, 5], [10]).node  # splits 5555; its snapshot stays at the end (slot 1)
    cache.set_snapshot(parent, 4)
    cache.lock(nodes[0])  # pins slot 1 only: its ancestor's slot 4 stays droppable
    cache.match_prefix([7, 7, 7, 7])
    assert cache.evictable_snapshots == 3
    # Leaves first: 6666 is the oldest, then 7777; (5,5), older, has a child (shared), so it goes last.
    assert cache.evict_snapshots(2) == [2, 3]
    assert cache.evict_snapshots(5) == [4]  # slot 1 is pinned
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


def test_branch_tokens_reach_past_the_last_snapshot_in_whole_pages():
    cache = RadixCache(2, needs_snapshots=True)
    cache.insert(A + [5, 5], [10, 11, 12, 13])  # one node, no snapshot
    m = cache.match_prefix(A + [7, 7])
    assert (m.num_tokens, m.node, m.branch_tokens) == (0, cache.root, 6)  # ends inside the node
    assert cache.num_nodes == 1  # a hybrid match that cannot end there does not split the node
    mid = cache.insert([1, 1, 2, 2], [10, 11]).node
    cache.set_snapshot(mid, 1)
    m = cache.match_prefix(A + [5, 5, 6])
    assert (m.pages, m.num_tokens, m.node, m.snapshot, m.branch_tokens) == ([10, 11], 4, mid, 1, 8)
    assert cache.match_prefix(A + [5]).branch_tokens == 6  # a partial last page does not count
    assert cache.match_prefix([9, 9]).branch_tokens == 0
    cache.check_integrity()


def test_branch_tokens_equal_num_tokens_without_snapshots():
    cache = RadixCache(2)
    cache.insert(A, [10, 11, 12])
    got = [(m.num_tokens, m.branch_tokens) for m in map(cache.match_prefix, (A, B, [1, 1, 2], [9, 9]))]
    assert got == [(6, 6), (4, 4), (2, 2), (0, 0)]


def test_num_cached_tokens_counts_every_key_through_splits_and_evictions():
    cache = RadixCache(2)
    cache.insert(A, [10, 11, 12])
    cache.insert(B, [10, 11, 13])
    assert cache.num_cached_tokens == 8  # (1,1,2,2) -> (3,3) | (4,4)
    cache.match_prefix([1, 1, 9, 9])  # a split moves tokens between nodes, caches none
    assert (cache.num_nodes, cache.num_cached_tokens) == (4, 8)
    cache.evict(1)
    assert cache.num_cached_tokens == 6
    cache.flush()
    assert cache.num_cached_tokens == 0
    unpaged = RadixCache(2, needs_snapshots=True, paged=False)
    unpaged.insert(A)
    unpaged.insert(B)
    assert (unpaged.num_cached_tokens, unpaged.num_cached_pages) == (8, 0)
    unpaged.evict_nodes(1)
    assert unpaged.num_cached_tokens == 6
    unpaged.check_integrity()


def test_insert_reports_the_tokens_already_cached():
    cache = RadixCache(2, needs_snapshots=True, paged=False)
    assert cache.insert(A).num_cached_tokens == 0
    assert cache.insert(A + [5, 5]).num_cached_tokens == 6
    assert cache.insert([1, 1, 9, 9]).num_cached_tokens == 2  # ends inside A's node: split after a page
    assert cache.insert(A[:5]).num_cached_tokens == 4  # the partial last page is ignored
    r = cache.insert([7])
    assert r.num_cached_tokens == 0 and r.node is cache.root
    assert cache.num_cached_tokens == 10 and cache.num_snapshots == 0  # held with or without snapshots
    cache.check_integrity()


def test_snapshot_slots_are_the_slots_the_tree_owns():
    cache = RadixCache(2, needs_snapshots=True)
    a = cache.insert(A, [10, 11, 12]).node
    b = cache.insert(B, [10, 11, 13]).node
    mid = cache.insert([1, 1, 2, 2], [10, 11]).node
    for node, slot in ((a, 1), (b, 2), (mid, 3)):
        assert cache.set_snapshot(node, slot)
    assert not cache.set_snapshot(a, 4)  # the caller keeps slot 4
    with pytest.raises(ValueError):
        cache.set_snapshot(a, 2)  # b's
    assert cache.snapshot_slots == frozenset({1, 2, 3}) and cache.num_snapshots == 3
    cache.match_prefix(B)  # a is now the least recently used
    assert cache.evict_snapshots(1) == [1] and cache.snapshot_slots == {2, 3}
    assert cache.evict(1) == ([12], [])  # a, without its snapshot now
    assert cache.evict(1) == ([13], [2]) and cache.snapshot_slots == {3}
    assert cache.flush().snapshots == [3] and cache.snapshot_slots == frozenset()


def test_evict_nodes_removes_least_recently_used_leaves_then_childless_parents():
    cache = RadixCache(2, needs_snapshots=True)
    cache.insert(A, [10, 11, 12])
    b = cache.insert(B, [10, 11, 13]).node  # (1,1,2,2) -> (3,3) | (4,4)
    c = cache.insert([5, 5], [14]).node
    cache.set_snapshot(b, 1)
    cache.set_snapshot(c, 2)
    cache.match_prefix([5, 5])  # c is the most recently used
    assert cache.evict_nodes(1) == ([12], [])  # (3,3): one node, however few pages
    assert cache.evict_nodes(2) == ([13, 10, 11], [1])  # (4,4), then its parent, older than c
    assert cache.evict_nodes(5) == ([14], [2]) and cache.num_nodes == 0
    cache.check_integrity()


def test_evict_nodes_never_removes_a_locked_path():
    cache = RadixCache(2)
    cache.insert(A, [10, 11, 12])
    b = cache.insert(B, [10, 11, 13]).node
    cache.lock(b)
    assert cache.evict_nodes(3) == ([12], [])  # b and its parent are locked
    assert cache.evict_nodes(1) == ([], []) and cache.num_nodes == 2
    cache.unlock(b)
    assert cache.evict_nodes(0) == ([], []) and cache.evict_nodes(-1) == ([], [])
    assert cache.evict_nodes(2) == ([13, 10, 11], []) and cache.num_nodes == 0
    cache.check_integrity()


def test_an_unpaged_tree_caches_snapshots_without_pages():
    cache = RadixCache(2, needs_snapshots=True, paged=False)
    r = cache.insert(A)
    assert (r.num_cached_tokens, r.duplicate_pages, r.pages, r.node.pages) == (0, [], [], ())
    assert (cache.num_cached_pages, cache.evictable_pages, cache.num_cached_tokens) == (0, 0, 6)
    assert cache.match_prefix(A).node is cache.root  # no snapshot yet
    assert cache.set_snapshot(r.node, 1)
    m = cache.match_prefix(A + [5])
    assert (m.pages, m.num_tokens, m.node, m.snapshot, m.branch_tokens) == ([], 6, r.node, 1, 6)
    assert cache.peek(A) == 6
    cache.check_integrity(free_snapshots=[2, 3])


def test_an_unpaged_tree_takes_no_pages_and_a_paged_one_needs_them():
    with pytest.raises(ValueError, match="needs snapshots"):
        RadixCache(2, paged=False)
    cache = RadixCache(2, needs_snapshots=True, paged=False)
    cache.insert([1, 1])
    for pages in ([10, 11, 12], []):
        with pytest.raises(ValueError):
            cache.insert(A, pages)
    assert (cache.num_nodes, cache.num_cached_tokens) == (1, 2)
    for paged in (RadixCache(2), RadixCache(2, needs_snapshots=True)):
        with pytest.raises(ValueError):
            paged.insert(A)
        assert paged.num_nodes == 0
    cache.check_integrity()


def test_evict_nodes_bounds_an_unpaged_tree_and_returns_its_snapshots():
    cache = RadixCache(2, needs_snapshots=True, paged=False)
    a = cache.insert(A).node
    b = cache.insert(B).node
    for node, slot in ((a, 1), (b, 2), (b.parent, 3)):
        cache.set_snapshot(node, slot)
    cache.lock(a)
    assert cache.evict_nodes(5) == ([], [2])  # a is locked, and so is the parent it shares with b
    assert (cache.num_nodes, cache.num_cached_tokens, cache.snapshot_slots) == (2, 6, {1, 3})
    cache.unlock(a)
    assert cache.evict_nodes(5) == ([], [1, 3]) and cache.num_nodes == cache.num_cached_tokens == 0
    cache.check_integrity()


def test_dropping_an_unpaged_snapshot_keeps_its_node():
    cache = RadixCache(2, needs_snapshots=True, paged=False)
    node = cache.insert(A).node
    cache.set_snapshot(node, 1)
    assert cache.evict_snapshots(1) == [1]
    m = cache.match_prefix(A)
    assert (m.num_tokens, m.branch_tokens, cache.num_nodes) == (0, 6, 1)  # still held, no longer usable
    assert cache.evict_nodes(1) == ([], []) and cache.num_nodes == 0
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


def test_an_unpinned_lock_keeps_the_prefix_but_not_the_snapshot():
    """A request pins the snapshot it starts from only until its state is loaded: after `unpin` its lock
    still keeps the pages, while the snapshot can go to another prefix."""
    cache = RadixCache(2, needs_snapshots=True)
    node = cache.insert([1, 2, 3, 4], [10, 11]).node
    cache.set_snapshot(node, 5)
    cache.lock(node)
    assert cache.evictable_snapshots == 0 and cache.evict_snapshots(1) == []
    cache.unpin(node)
    assert cache.evictable_snapshots == 1 and cache.evictable_pages == 0 and cache.num_locks == 1
    with pytest.raises(ValueError, match="pinning"):
        cache.unpin(node)
    cache.check_integrity()
    assert cache.evict_snapshots(1) == [5] and cache.evict(2) == ([], [])  # the pages stay locked
    with pytest.raises(ValueError, match="pinning"):
        cache.unlock(node)
    cache.unlock(node, pinned=False)
    unpinned = cache.insert([1, 2, 3, 4, 5, 6], [10, 11, 12]).node
    cache.lock(unpinned, pin=False)
    cache.set_snapshot(unpinned, 6)
    assert cache.evictable_snapshots == 1
    cache.unlock(unpinned, pinned=False)
    with pytest.raises(ValueError, match="unpinned"):
        cache.unlock(unpinned, pinned=False)
    cache.check_integrity()
    assert cache.num_locks == 0 and cache.evict(3).pages == [12, 10, 11]
