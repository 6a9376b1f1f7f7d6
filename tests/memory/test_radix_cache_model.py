"""Radix prefix cache (host side): random inserts, matches, locks, snapshots and evictions against a plain
dictionary model of the same contents (hypothesis state machines; tests/memory/test_radix_cache.py has the
hand cases)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from memory.allocator import PageAllocator, SnapshotAllocator
from memory.radix_cache import RadixCache, RadixNode

PAGE = 2
# 3 symbols, 2 per page: random prefixes are shared a lot; a few fixed prompts come back again and again.
PROMPTS = [[0, 0, 1, 1, 2, 2, 0, 0], [0, 0, 1, 1, 2, 2, 1, 1, 0], [0, 0, 1, 1], [1] * 6, [1] * 10 + [2]]
TOKENS = st.one_of(st.sampled_from(PROMPTS), st.lists(st.integers(0, 2), max_size=11))


class CacheMachine(RuleBasedStateMachine):
    """The model: cached whole-page prefix -> page of its last page (None on an unpaged tree; prefix-closed),
    prefix -> snapshot slot, prefix -> time of last use, and the locks held (node, the prefix it ends at)."""

    needs_snapshots = False
    paged = True

    def __init__(self):
        super().__init__()
        self.cache = RadixCache(PAGE, needs_snapshots=self.needs_snapshots, paged=self.paged)
        self.pages = PageAllocator(16)
        self.slots = SnapshotAllocator(6)
        self.model: dict[tuple, int | None] = {}
        self.snaps: dict[tuple, int] = {}
        self.used: dict[tuple, int] = {}
        self.clock = 0
        self.locks: list[tuple[RadixNode, tuple]] = []

    # model helpers

    def prefixes(self, tokens) -> list[tuple]:
        return [tuple(tokens[:i]) for i in range(PAGE, len(tokens) // PAGE * PAGE + 1, PAGE)]

    def model_held(self, tokens) -> list[tuple]:
        """The cached whole-page prefixes of `tokens`, with a snapshot or not."""
        held = []
        for p in self.prefixes(tokens):
            if p not in self.model:
                break
            held.append(p)
        return held

    def model_match(self, tokens) -> list[tuple]:
        matched = self.model_held(tokens)
        if self.needs_snapshots:
            while matched and matched[-1] not in self.snaps:
                matched.pop()
        return matched

    def pages_of(self, prefixes) -> list[int]:
        return [self.model[p] for p in prefixes] if self.paged else []

    def touch(self, prefixes) -> None:
        self.clock += 1
        for p in prefixes:
            self.used[p] = self.clock

    def locked(self) -> set[tuple]:
        return {lp[:i] for _, lp in self.locks for i in range(PAGE, len(lp) + 1, PAGE)}

    def tree_contents(self) -> tuple[dict[tuple, int | None], dict[tuple, int]]:
        """What the tree holds, read off its nodes, in the model's terms."""
        contents, snaps, stack = {}, {}, [((), self.cache.root)]
        while stack:
            prefix, node = stack.pop()
            for i in range(len(node.key) // PAGE):
                contents[prefix + node.key[: (i + 1) * PAGE]] = node.pages[i] if self.paged else None
            prefix += node.key
            if node.snapshot is not None:
                snaps[prefix] = node.snapshot
            stack.extend((prefix, child) for child in node.children.values())
        return contents, snaps

    def evict(self, n: int, nodes: bool = False) -> None:
        """`cache.evict(n)` (pages), or `cache.evict_nodes(n)`, checked against the model."""
        evictable_pages, num_nodes = self.cache.evictable_pages, self.cache.num_nodes
        out = self.cache.evict_nodes(n) if nodes else self.cache.evict(n)
        contents, _ = self.tree_contents()
        gone = [p for p in self.model if p not in contents]
        assert sorted(out.pages) == sorted(self.pages_of(gone)) and not set(gone) & self.locked()
        assert sorted(out.snapshots) == sorted(self.snaps[p] for p in gone if p in self.snaps)
        if nodes:
            removed = num_nodes - self.cache.num_nodes
            assert removed <= n and (removed == n or set(contents) <= self.locked()), "stopped early"
        else:
            assert len(out.pages) >= min(n, evictable_pages), "stopped early"
        for p in gone:
            del self.model[p]
            self.snaps.pop(p, None)
        assert all(p[:-PAGE] in self.model for p in self.model if len(p) > PAGE), "evicted a non-leaf"
        parents = {p[:-PAGE] for p in self.model}
        rest = [self.used[p] for p in self.model if p not in self.locked() and p not in parents]  # leaves
        assert not gone or not rest or max(self.used[p] for p in gone) <= min(rest), "not LRU"
        self.pages.free(out.pages)
        self.slots.free(out.snapshots)

    def snapshot_and_keep(self, node: RadixNode, prefixes: list[tuple], snapshot: bool, keep: bool) -> None:
        """After an insert of `prefixes` ending at `node`: maybe snapshot there, maybe keep a lock on it."""
        if self.needs_snapshots and snapshot and prefixes and self.slots.can_allocate(1):
            [slot] = self.slots.allocate(1)
            taken = self.cache.set_snapshot(node, slot)
            assert taken == (prefixes[-1] not in self.snaps)
            if taken:
                self.snaps[prefixes[-1]] = slot
            else:
                self.slots.free([slot])
        if keep and prefixes and len(self.locks) < 4:
            self.cache.lock(node)
            self.locks.append((node, prefixes[-1]))

    # rules

    @rule(tokens=TOKENS, fresh=st.booleans(), keep=st.booleans(), snapshot=st.booleans())
    def insert(self, tokens, fresh, keep, snapshot):
        """A request computes `tokens`: reusing a match (locked meanwhile) unless `fresh`."""
        borrowed, held = [], None
        if not fresh:
            m = self.cache.match_prefix(tokens)
            expected = self.model_match(tokens)
            self.touch(expected)
            assert m.branch_tokens == len(self.model_held(tokens)) * PAGE
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
            self.snapshot_and_keep(r.node, prefixes, snapshot, keep)
        if held is not None:
            self.cache.unlock(held)

    @rule(tokens=TOKENS, keep=st.booleans())
    def match(self, tokens, keep):
        m = self.cache.match_prefix(tokens)
        expected = self.model_match(tokens)
        self.touch(expected)
        assert m.pages == self.pages_of(expected) and m.num_tokens == len(expected) * PAGE
        assert m.branch_tokens == len(self.model_held(tokens)) * PAGE
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

    @precondition(lambda self: self.needs_snapshots and self.locks and self.slots.can_allocate(1))
    @rule(data=st.data())
    def snapshot_a_locked_node(self, data):
        """A running request saves its state at the prefix it holds (the snapshot is pinned at once)."""
        node, prefix = self.locks[data.draw(st.integers(0, len(self.locks) - 1))]
        [slot] = self.slots.allocate(1)
        taken = self.cache.set_snapshot(node, slot)
        assert taken == (prefix not in self.snaps)
        if taken:
            self.snaps[prefix] = slot
        else:
            self.slots.free([slot])

    @precondition(lambda self: self.paged)
    @rule(n=st.integers(0, 6))
    def evict_pages(self, n):
        self.evict(n)

    @rule(n=st.integers(0, 3))
    def evict_nodes(self, n):
        self.evict(n, nodes=True)

    @rule(n=st.integers(0, 3))
    def evict_snapshots(self, n):
        pinned = {lp for _, lp in self.locks}
        droppable = [p for p in self.snaps if p not in pinned]
        out = self.cache.evict_snapshots(n)
        gone = [p for p, slot in self.snaps.items() if slot in out]
        assert len(gone) == len(out) == min(n, len(droppable)) and not set(gone) & pinned
        # Leaves' snapshots first (a prefix with a longer cached one after it is shared), then LRU.
        def key(p):
            return any(len(q) > len(p) and q[: len(p)] == p for q in self.model), self.used[p]

        rest = [key(p) for p in droppable if p not in gone]
        assert not gone or not rest or max(key(p) for p in gone) <= min(rest), "not leaves first, then LRU"
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
        assert sorted(out.pages) == sorted(self.pages_of(self.model))
        assert sorted(out.snapshots) == sorted(self.snaps.values())
        self.pages.free(out.pages)
        self.slots.free(out.snapshots)
        self.model.clear()
        self.snaps.clear()

    @invariant()
    def agrees_with_the_model(self):
        self.cache.check_integrity(self.pages.free_pages(), self.slots.free_slots())
        contents, snaps = self.tree_contents()
        assert contents == self.model and snaps == self.snaps
        assert self.cache.num_cached_tokens == len(self.model) * PAGE
        # Nothing is held outside the tree between steps: every page and slot is cached or free.
        if self.paged:
            assert sorted(list(contents.values()) + self.pages.free_pages()) == list(range(1, 16))
        else:
            assert self.cache.num_cached_pages == self.cache.evictable_pages == 0
        self.slots.check_integrity(in_use=list(snaps.values()))
        assert self.cache.snapshot_slots == frozenset(snaps.values())
        locked = self.locked()
        assert self.cache.evictable_pages == self.paged * sum(p not in locked for p in self.model)
        pinned = {lp for _, lp in self.locks}
        assert self.cache.evictable_snapshots == sum(p not in pinned for p in self.snaps)
        assert self.cache.num_locks == len(self.locks)


class HybridCacheMachine(CacheMachine):
    needs_snapshots = True


class UnpagedCacheMachine(CacheMachine):
    """A tree of a model without attention layers: nodes hold snapshots and no pages."""

    needs_snapshots = True
    paged = False

    @rule(tokens=TOKENS, fresh=st.booleans(), keep=st.booleans(), snapshot=st.booleans())
    def insert(self, tokens, fresh, keep, snapshot):
        """A request computes `tokens`, holding a lock on its match meanwhile unless `fresh`."""
        held = None
        if not fresh:
            m = self.cache.match_prefix(tokens)
            self.touch(self.model_match(tokens))
            held = m.node
            self.cache.lock(held)
        prefixes = self.prefixes(tokens)
        num_cached = sum(p in self.model for p in prefixes)
        r = self.cache.insert(tokens)
        assert r.num_cached_tokens == num_cached * PAGE and r.duplicate_pages == r.pages == []
        self.model.update(dict.fromkeys(p for p in prefixes if p not in self.model))
        self.touch(prefixes)
        self.snapshot_and_keep(r.node, prefixes, snapshot, keep)
        if held is not None:
            self.cache.unlock(held)


SETTINGS = settings(max_examples=150, stateful_step_count=40, deadline=None, database=None)
TestRadixCacheProperties = CacheMachine.TestCase
TestRadixCacheProperties.settings = SETTINGS
TestHybridRadixCacheProperties = HybridCacheMachine.TestCase
TestHybridRadixCacheProperties.settings = SETTINGS
TestUnpagedRadixCacheProperties = UnpagedCacheMachine.TestCase
TestUnpagedRadixCacheProperties.settings = SETTINGS
