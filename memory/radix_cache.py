"""Radix tree of cached token prefixes, one edge unit per KV page: the host side of the prefix cache.

The tree never frees anything: every call that gives up pages or snapshot slots returns their ids and the
caller hands them back to its `PageAllocator` / `SnapshotAllocator` (so one tree per DP rank works with that
rank's allocators, and tests can drive it without any). A node owns the KV pages of its key; a request only
borrows them while it holds a lock. How a scheduler uses it (one tree per rank):

- Admission: `m = cache.match_prefix(prompt[:-1])` (leave at least one token to compute: the last prompt
  token's logits are needed), then at once `cache.lock(m.node)`. The request's page-table row starts with
  `m.pages` (borrowed: the row must never free them) and prefill starts at token `m.num_tokens`. A hybrid
  model first copies snapshot `m.snapshot` into the request's state slot.
- Short of pages: `ev = cache.evict(missing)`, then `pages.free(ev.pages)` and `snapshots.free(ev.snapshots)`,
  before any retraction; `cache.evictable_pages` says beforehand whether eviction can cover the need.
- Caching while it runs (prefill done, a chunk boundary): `r = cache.insert(tokens, row_pages)` with the
  tokens whose KV is written; `pages.free(r.duplicate_pages)` (another request cached those tokens first)
  and write `r.pages`, the tree's, over the row's first pages; then `cache.lock(r.node)` before anything
  can evict (the new pages are the tree's, unlocked, from the moment `insert` returns) and
  `cache.unlock(old_node)`. Every whole page of `tokens` in the row is now borrowed.
- Finish or retraction: the same insert (prompt + output but the last sampled token, whose KV is not
  written) and freeing of duplicates, `cache.unlock(old_node)`, then free only the row's pages past
  `len(r.pages)` (the partial last page). A retracted request's recompute then hits its own tokens.
- Hybrid models: after an insert, snapshot the state after exactly `r.node`'s last token (a page boundary)
  into a fresh slot and call `cache.set_snapshot(r.node, slot)`, freeing the slot if that returns False.
  Without a snapshot the node's pages stay cached, but a hybrid match cannot end there.
- `/flush_cache`: `cache.flush()` (refused while any lock is held) and free what it returns.
- Tests and debug builds call `cache.check_integrity(pages.free_pages(), snapshots.free_slots())`.

Only whole pages are cached. A prefix that ends inside a page matches up to its last whole page, and the
request recomputes the remaining (< page_size) tokens into a page of its own; `insert` ignores a partial
last page, which stays the caller's. Sharing a partly filled page instead would let every request that
continues it write its own next tokens into the same page, so it would need a device copy-on-write of the
page; recomputing at most page_size - 1 tokens is cheap and keeps each page single-writer: a cached page is
never written again.

Hybrid (recurrent) models need the SSM + conv state after a prefix, not just its KV: with
`needs_snapshots=True` a match ends at the deepest matched node that carries a snapshot (a slot of a
separate device pool, see `SnapshotAllocator`); `MatchResult.branch_tokens` says how far the tree's
pages went regardless, which is where a request should snapshot its state for the next one. A snapshot is
pinned only by pinning locks on its own node (held until the request's state is loaded from it); ancestors'
snapshots stay droppable by `evict_snapshots`, since
a request needs only the state it starts from. A model without attention layers has no pages: its tree is
built with `paged=False`, its nodes hold snapshots only, and `evict_nodes` bounds it.
"""

from __future__ import annotations

import heapq
from typing import NamedTuple, Sequence

import numpy as np


class RadixNode:
    """An edge of the tree: `key` (a whole number of pages of tokens) and the KV `pages` that hold them.

    A handle stays valid until the node is evicted, which cannot happen while it is locked. Splits never
    invalidate one: they insert a new parent above it, so a handle always ends at the same token.
    """

    __slots__ = ("key", "pages", "parent", "children", "ref", "holds", "pins", "snapshot", "last_access",
                 "id")

    def __init__(self, key: tuple[int, ...], pages: tuple[int, ...], parent: RadixNode | None,
                 last_access: int, id: int):
        self.key = key  # len(key) == len(pages) * page_size
        self.pages = pages  # a tuple: never changed in place, and untracked by the garbage collector
        self.parent = parent  # None for the root and for evicted nodes
        self.children: dict[tuple[int, ...], RadixNode] = {}  # by the first page of the child's key
        self.ref = 0  # locks on this node or any descendant: not evictable while > 0
        self.holds = 0  # locks on this node itself
        self.pins = 0  # of those, the ones that also pin its snapshot
        self.snapshot: int | None = None  # slot of the recurrent state after this node's last token
        self.last_access = last_access  # the tree's clock at the last match or insert through this node
        self.id = id  # creation order, to break LRU ties deterministically

    def __repr__(self) -> str:
        head = ", ".join(map(str, self.key[:8])) + (", ..." if len(self.key) > 8 else "")
        return (f"RadixNode(id={self.id}, key=({head}), pages={self.pages}, ref={self.ref}, "
                f"holds={self.holds}, pins={self.pins}, snapshot={self.snapshot})")


class MatchResult(NamedTuple):
    pages: list[int]  # the tree's pages for the matched prefix, in token order (borrowed)
    num_tokens: int  # tokens matched: a whole number of pages (units)
    node: RadixNode  # where the match ends (the root if nothing matched): lock it to keep the prefix
    snapshot: int | None  # node.snapshot (never None on a hybrid tree unless the match is empty)
    # Tokens the tree holds of this prefix with or without a snapshot (>= num_tokens): on a hybrid tree,
    # where a request should snapshot its state so that the next request sharing this prefix matches it all.
    branch_tokens: int = 0


class InsertResult(NamedTuple):
    num_cached_tokens: int  # tokens already in the tree before this insert (a multiple of page_size)
    duplicate_pages: list[int]  # caller's pages for that part the tree did not take: the caller frees them
    pages: list[int]  # the tree's pages for the whole inserted prefix, for the caller's page table
    node: RadixNode  # the node ending at the inserted whole-page prefix (the root if it was empty)


class Evicted(NamedTuple):
    pages: list[int]  # for the PageAllocator
    snapshots: list[int]  # for the SnapshotAllocator


class RadixCache:
    """The tree. Lookups, inserts and locks cost O(depth + tokens / page_size); `evict` O(log nodes) per node
    it removes (amortized), `evict_snapshots` O(snapshots)."""

    def __init__(self, page_size: int, *, needs_snapshots: bool = False, paged: bool = True):
        """`page_size`: tokens per edge unit. `paged=False` (models without attention layers, so without KV
        pages): the nodes hold no pages, only snapshots; `insert` takes no pages and `evict_nodes` bounds
        the tree instead of `evict`."""
        if page_size < 1:
            raise ValueError(f"{page_size=} must be >= 1")
        if not (paged or needs_snapshots):
            raise ValueError("a tree without pages needs snapshots: it would cache nothing")
        self.page_size = page_size
        self.needs_snapshots = needs_snapshots
        self.paged = paged
        self.reset()

    def reset(self) -> None:
        """Forgets every node without returning its pages or slots: only for when those allocators are rebuilt
        too (`flush` gives them back)."""
        self.root = RadixNode((), (), None, 0, 0)
        self._clock = 0
        self._next_id = 1
        self._num_nodes = 0
        self._pages: set[int] = set()  # every page the tree owns
        self._num_tokens = 0  # tokens of all keys
        self._snapshots: dict[int, RadixNode] = {}  # slot -> its node
        self._evictable_pages = 0  # pages of nodes with ref == 0
        self._evictable_leaves: set[RadixNode] = set()  # ref == 0 and no children
        # Min-heap of (last_access, id, node) holding a current entry for every evictable leaf, plus stale
        # entries (skipped when popped, dropped when they outnumber the live ones): `evict` then costs
        # O(log n) per node it removes instead of sorting every leaf on each call.
        self._lru: list[tuple[int, int, RadixNode]] = []
        self._evictable_snapshots = 0  # snapshots of nodes with pins == 0
        self._num_locks = 0

    # --- sizes -------------------------------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @property
    def num_cached_tokens(self) -> int:
        """Tokens the tree holds (of pages, or for an unpaged tree of snapshot units)."""
        return self._num_tokens

    @property
    def num_cached_pages(self) -> int:
        return len(self._pages)

    @property
    def cached_pages(self) -> frozenset[int]:
        """Every page the tree owns."""
        return frozenset(self._pages)

    @property
    def evictable_pages(self) -> int:
        """Pages `evict` can free now (every unlocked node: leaves go first, then their parents)."""
        return self._evictable_pages

    @property
    def num_snapshots(self) -> int:
        return len(self._snapshots)

    @property
    def snapshot_slots(self) -> frozenset[int]:
        """Every snapshot slot the tree owns."""
        return frozenset(self._snapshots)

    @property
    def evictable_snapshots(self) -> int:
        """Snapshots `evict_snapshots` can drop now (those on nodes not locked themselves)."""
        return self._evictable_snapshots

    @property
    def num_locks(self) -> int:
        return self._num_locks

    # --- lookups -----------------------------------------------------------------------------------------

    def match_prefix(self, tokens: Sequence[int] | np.ndarray) -> MatchResult:
        """The longest cached whole-page prefix of `tokens` (hybrid: the longest ending at a snapshot).

        Marks the matched nodes as used now (LRU). May split the last node so the match ends at a node
        boundary; that changes no content and no handle. Lock `result.node` before anything can evict.
        """
        self._clock += 1
        path, partial, num_partial = self._walk(self._aligned(tokens))
        branch = sum(len(node.key) for node in path) + num_partial
        if self.needs_snapshots:
            while path and path[-1].snapshot is None:
                path.pop()
        elif partial is not None:
            path.append(self._split(partial, num_partial))
        for node in path:
            node.last_access = self._clock
        end = path[-1] if path else self.root
        if end in self._evictable_leaves:
            self._push_lru(end)
        pages = [p for node in path for p in node.pages]
        return MatchResult(pages, sum(len(node.key) for node in path), end, end.snapshot, branch)

    def peek(self, tokens: Sequence[int] | np.ndarray) -> int:
        """How many tokens `match_prefix` would match, changing nothing (for routing and metrics)."""
        path, partial, num_partial = self._walk(self._aligned(tokens))
        if self.needs_snapshots:
            while path and path[-1].snapshot is None:
                path.pop()
            num_partial = 0
        return sum(len(node.key) for node in path) + num_partial

    # --- ownership ---------------------------------------------------------------------------------------

    def insert(self, tokens: Sequence[int] | np.ndarray,
               pages: Sequence[int] | np.ndarray | None = None) -> InsertResult:
        """Caches the whole-page prefix of `tokens`; `pages[i]` holds tokens [i*page_size, (i+1)*page_size)
        (an unpaged tree takes no pages).

        The tree takes ownership of the pages of the part it did not hold yet. For the part it held, the
        caller's pages equal to the tree's are the tree's own (borrowed from a match); the others are
        returned in `duplicate_pages` and stay the caller's to free. Pages past the whole-page prefix (a
        partial last page) are ignored. The new pages are unlocked: lock `result.node` before anything can
        evict. Marks the path as used now (LRU).

        Raises ValueError (the contents unchanged) on too few pages, page 0, a page passed twice, or a page
        the tree owns at another position.
        """
        toks = self._aligned(tokens)
        num_pages = len(toks) // self.page_size if self.paged else 0
        if (pages is None) == self.paged:
            raise ValueError("a paged tree takes the tokens' pages, an unpaged one none")
        if self.paged and len(pages) < num_pages:
            raise ValueError(f"{len(pages)=} cannot hold the {num_pages} whole pages of {len(tokens)=}")
        pages = [int(p) for p in pages[:num_pages]] if self.paged else []
        if 0 in pages or len(set(pages)) != num_pages:
            raise ValueError(f"page 0 (the padding dummy) or a page passed twice in {pages}")
        self._clock += 1
        path, partial, num_partial = self._walk(toks)
        if partial is not None:
            path.append(self._split(partial, num_partial))
        cached = [p for node in path for p in node.pages]
        num_cached = sum(len(node.key) for node in path)
        duplicates = [mine for mine, theirs in zip(pages, cached) if mine != theirs]
        new_pages = pages[len(cached):]
        stolen = self._pages.intersection(duplicates + new_pages)
        if stolen:
            raise ValueError(f"pages {sorted(stolen)} already belong to the tree at another position")
        end = path[-1] if path else self.root
        if len(toks) > num_cached:
            leaf = RadixNode(toks[num_cached:], tuple(new_pages), end, self._clock, self._new_id())
            end.children[leaf.key[: self.page_size]] = leaf
            self._evictable_leaves.discard(end)
            self._evictable_leaves.add(leaf)
            self._pages.update(new_pages)
            self._num_tokens += len(leaf.key)
            self._evictable_pages += len(new_pages)
            self._num_nodes += 1
            path.append(leaf)
            end = leaf
        for node in path:
            node.last_access = self._clock
        if end in self._evictable_leaves:
            self._push_lru(end)
        return InsertResult(num_cached, duplicates, cached + new_pages, end)

    def set_snapshot(self, node: RadixNode, slot: int) -> bool:
        """Attaches snapshot `slot` (the recurrent state after `node`'s last token) to `node`.

        Returns True when the tree took the slot, False when `node` already had a snapshot (the tree keeps
        its own; the caller frees `slot`). Raises ValueError on a tree built without `needs_snapshots`, the
        root (its state is the zero initial state), slot 0, or a slot another node owns.
        """
        if not self.needs_snapshots:
            raise ValueError("this RadixCache was built with needs_snapshots=False")
        if not self._path(node):
            raise ValueError("the root needs no snapshot: the state before any token is the initial state")
        slot = int(slot)
        if slot <= 0 or slot in self._snapshots:
            raise ValueError(f"snapshot {slot=} is the dummy slot 0 or already belongs to the tree")
        if node.snapshot is not None:
            return False
        node.snapshot = slot
        self._snapshots[slot] = node
        if node.pins == 0:
            self._evictable_snapshots += 1
        return True

    def lock(self, node: RadixNode, *, pin: bool = True) -> None:
        """Protects `node`'s prefix (its pages and ancestors) from eviction and, with `pin`, its snapshot from
        `evict_snapshots`, until the matching `unlock`. Locking the root does nothing.

        A request pins the snapshot it will start from until its state is loaded (`unpin`), and no longer:
        the slot can then go to whichever prefix needs it while the request runs on its own state."""
        path = self._path(node)
        if not path:
            return
        node.holds += 1
        self._num_locks += 1
        if pin:
            self._pin(node, 1)
        for x in path:
            if x.ref == 0:
                self._evictable_pages -= len(x.pages)
                self._evictable_leaves.discard(x)
            x.ref += 1

    def unpin(self, node: RadixNode) -> None:
        """Turns one pinning `lock(node)` into one that keeps only the prefix; raises ValueError if `node`
        holds none. Locking the root pins nothing, so this does nothing there."""
        if self._path(node):
            if node.pins == 0:
                raise ValueError("unpin of a node that holds no pinning lock")
            self._pin(node, -1)

    def unlock(self, node: RadixNode, *, pinned: bool = True) -> None:
        """Undoes one `lock(node, pin=pinned)` (`pinned` False after `unpin`); raises ValueError if `node`
        holds no such lock."""
        path = self._path(node)
        if not path:
            return
        if node.holds == 0 or (pinned and node.pins == 0) or (not pinned and node.holds == node.pins):
            raise ValueError(f"unlock of a node that holds no {'pinning ' if pinned else 'unpinned '}lock")
        node.holds -= 1
        self._num_locks -= 1
        if pinned:
            self._pin(node, -1)
        for x in path:
            x.ref -= 1
            if x.ref == 0:
                self._evictable_pages += len(x.pages)
                if not x.children:
                    self._evictable_leaves.add(x)
                    self._push_lru(x)

    # --- giving back -------------------------------------------------------------------------------------

    def evict(self, num_pages: int) -> Evicted:
        """Removes unlocked leaves, least recently used first (a parent left childless joins the candidates),
        until at least `num_pages` pages are freed or nothing is evictable. Returns the freed pages and the
        snapshots of the removed nodes, for the caller to give back. An unpaged tree has no pages to free: it
        removes nothing (`evict_nodes` bounds it)."""
        out = Evicted([], [])
        while self.paged and len(out.pages) < num_pages and self._evictable_leaves:
            last_access, _, leaf = heapq.heappop(self._lru)
            if last_access == leaf.last_access and leaf in self._evictable_leaves:  # else a stale entry
                self._remove_leaf(leaf, out)
        return out

    def evict_nodes(self, num_nodes: int) -> Evicted:
        """Removes up to `num_nodes` unlocked leaves, least recently used first (for an unpaged tree, whose
        size is its node count); returns what they held."""
        out = Evicted([], [])
        target = self._num_nodes - num_nodes
        while self._num_nodes > target and self._evictable_leaves:
            last_access, _, leaf = heapq.heappop(self._lru)
            if last_access == leaf.last_access and leaf in self._evictable_leaves:
                self._remove_leaf(leaf, out)
        return out

    def evict_snapshots(self, num_snapshots: int) -> list[int]:
        """Drops up to `num_snapshots` snapshots from nodes not locked themselves: those of leaves first (a
        node with children is a prefix that requests went on from differently: shared), each kind least
        recently used first; their pages stay (a hybrid match can no longer end there). Returns the freed
        slots."""
        if num_snapshots <= 0:
            return []
        candidates = (x for x in self._snapshots.values() if x.pins == 0)
        victims = heapq.nsmallest(num_snapshots, candidates,
                                  key=lambda x: (bool(x.children), x.last_access, x.id))
        slots = [x.snapshot for x in victims]
        for node in victims:
            del self._snapshots[node.snapshot]
            node.snapshot = None
        self._evictable_snapshots -= len(victims)
        return slots

    def flush(self) -> Evicted:
        """Empties the tree and returns every page and snapshot slot it owned; raises RuntimeError, changing
        nothing, while any lock is held (a running request borrows pages)."""
        if self._num_locks:
            raise RuntimeError(f"cannot flush the prefix cache while {self._num_locks} locks are held "
                               "(requests are running)")
        out = Evicted(sorted(self._pages), sorted(self._snapshots))
        self.reset()
        return out

    # --- checks ------------------------------------------------------------------------------------------

    def check_integrity(self, free_pages: Sequence[int] | None = None,
                        free_snapshots: Sequence[int] | None = None) -> None:
        """Raises AssertionError unless the structure and every counter agree with a full recount; given the
        allocators' free lists, also that nothing the tree owns is free."""
        ps = self.page_size
        root = self.root
        assert root.key == () and root.pages == () and root.parent is None and root.snapshot is None
        assert root.ref == 0 and root.holds == 0 and root.pins == 0, "the root is never locked"
        pages: list[int] = []
        num_tokens = 0
        snapshots: dict[int, RadixNode] = {}
        evictable_pages = evictable_snapshots = num_locks = num_nodes = 0
        leaves = set()
        stack = [root]
        while stack:
            node = stack.pop()
            child_refs = 0
            for first, child in node.children.items():
                num_nodes += 1
                assert child.parent is node, "child's parent link is wrong"
                units = len(child.pages) if self.paged else len(child.key) // ps
                assert len(child.key) == units * ps and units and (self.paged or not child.pages), (
                    f"{len(child.key)=} tokens != {len(child.pages)} pages x {ps} (or an empty node)")
                assert first == child.key[:ps], "child keyed by something else than its first page"
                assert child.last_access <= node.last_access or node is root, "a child used after its parent"
                assert child.ref >= child.holds >= child.pins >= 0, (
                    f"{child.ref=} {child.holds=} {child.pins=}")
                pages.extend(child.pages)
                num_tokens += len(child.key)
                if child.snapshot is not None:
                    assert child.snapshot not in snapshots, f"snapshot {child.snapshot} owned twice"
                    snapshots[child.snapshot] = child
                    evictable_snapshots += child.pins == 0
                evictable_pages += len(child.pages) if child.ref == 0 else 0
                if child.ref == 0 and not child.children:
                    leaves.add(child)
                num_locks += child.holds
                child_refs += child.ref
                stack.append(child)
            if node is not root:
                assert node.ref == node.holds + child_refs, (
                    f"{node.ref=} != {node.holds=} + {child_refs=} (locks on the node and below it)")
        assert len(pages) == len(set(pages)), "a page is owned by two nodes"
        assert 0 not in pages, "page 0 (the padding dummy) is cached"
        assert set(pages) == self._pages, "the page set disagrees with the nodes"
        assert num_tokens == self._num_tokens, f"{num_tokens=} != {self._num_tokens=}"
        assert snapshots == self._snapshots, "the snapshot map disagrees with the nodes"
        assert 0 not in snapshots, "snapshot slot 0 (the padding dummy) is cached"
        assert not snapshots or self.needs_snapshots, "snapshots on a tree built without needs_snapshots"
        assert num_nodes == self._num_nodes, f"{num_nodes=} != {self._num_nodes=}"
        assert evictable_pages == self._evictable_pages, f"{evictable_pages=} != {self._evictable_pages=}"
        assert leaves == self._evictable_leaves, "the evictable-leaf set disagrees with the nodes"
        current = {id(x) for last_access, _, x in self._lru if last_access == x.last_access}
        assert all(id(x) in current for x in leaves), "an evictable leaf has no current LRU entry"
        assert evictable_snapshots == self._evictable_snapshots, (
            f"{evictable_snapshots=} != {self._evictable_snapshots=}")
        assert num_locks == self._num_locks, f"{num_locks=} != {self._num_locks=}"
        if free_pages is not None:
            both = self._pages.intersection(free_pages)
            assert not both, f"pages {sorted(both)} are both cached and free"
        if free_snapshots is not None:
            both = set(self._snapshots).intersection(free_snapshots)
            assert not both, f"snapshot slots {sorted(both)} are both cached and free"

    # --- internals ---------------------------------------------------------------------------------------

    def _aligned(self, tokens: Sequence[int] | np.ndarray) -> tuple[int, ...]:
        """`tokens` cut to whole pages, as a tuple (hashable page keys, C-speed slice comparisons)."""
        if isinstance(tokens, np.ndarray):
            tokens = tokens.tolist()
        return tuple(tokens[: len(tokens) // self.page_size * self.page_size])

    def _walk(self, toks: tuple[int, ...]) -> tuple[list[RadixNode], RadixNode | None, int]:
        """The nodes `toks` matches whole, from the root down, then the node where the match ends inside its
        key (None if it ends at a node boundary) and how many of that node's tokens match."""
        ps, n = self.page_size, len(toks)
        node, pos, path = self.root, 0, []
        while pos < n:
            child = node.children.get(toks[pos : pos + ps])
            if child is None:
                break
            key = child.key
            end = pos + len(key)
            if toks[pos:end] == key:
                path.append(child)
                node, pos = child, end
                continue
            matched = ps  # the first page matched: it is the child's dict key
            at = pos + matched
            while at < n and toks[at : at + ps] == key[matched : matched + ps]:
                matched += ps
                at += ps
            return path, child, matched
        return path, None, 0

    def _split(self, node: RadixNode, num_tokens: int) -> RadixNode:
        """Puts a new node holding `node`'s first `num_tokens` tokens (whole pages) between it and its parent;
        returns it. Same pages, locks and access time: nothing a caller can see changes."""
        ps = self.page_size
        cut = num_tokens // ps
        upper = RadixNode(node.key[:num_tokens], node.pages[:cut], node.parent, node.last_access,
                          self._new_id())
        upper.ref = node.ref
        upper.children[node.key[num_tokens : num_tokens + ps]] = node
        node.parent.children[node.key[:ps]] = upper
        node.key, node.pages, node.parent = node.key[num_tokens:], node.pages[cut:], upper
        self._num_nodes += 1
        return upper

    def _remove_leaf(self, leaf: RadixNode, out: Evicted) -> None:
        parent = leaf.parent
        del parent.children[leaf.key[: self.page_size]]
        self._evictable_leaves.remove(leaf)
        if parent is not self.root and parent.ref == 0 and not parent.children:
            self._evictable_leaves.add(parent)
            self._push_lru(parent)
        out.pages.extend(leaf.pages)
        self._pages.difference_update(leaf.pages)
        self._num_tokens -= len(leaf.key)
        self._evictable_pages -= len(leaf.pages)
        self._num_nodes -= 1
        if leaf.snapshot is not None:
            out.snapshots.append(leaf.snapshot)
            del self._snapshots[leaf.snapshot]
            self._evictable_snapshots -= 1
        leaf.parent = None  # marks the handle dead

    def _path(self, node: RadixNode) -> list[RadixNode]:
        """`node` and its ancestors below the root; raises ValueError on an evicted node or another tree's."""
        path = []
        while node is not self.root:
            if node.parent is None:
                raise ValueError("the node was evicted or belongs to another tree")
            path.append(node)
            node = node.parent
        return path

    def _pin(self, node: RadixNode, delta: int) -> None:
        node.pins += delta
        if node.snapshot is not None and node.pins == (1 if delta > 0 else 0):
            self._evictable_snapshots -= delta

    def _push_lru(self, node: RadixNode) -> None:
        heapq.heappush(self._lru, (node.last_access, node.id, node))
        if len(self._lru) > 2 * len(self._evictable_leaves) + 1024:
            self._lru = [(x.last_access, x.id, x) for x in self._evictable_leaves]
            heapq.heapify(self._lru)

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id
