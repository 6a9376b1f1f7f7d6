"""The scheduler's side of the radix prefix cache (memory/radix_cache.py): one per data-parallel rank.

A running request holds a lock on the tree node its cached prefix ends at (`Req.prefix_node`) and its page
table row borrows that prefix's pages (memory/allocator.py `ReqToTokenPool.borrow`). Its computed tokens go
into the tree when its prompt is done (so requests that arrive while it decodes share it), and again when
it finishes, is aborted or is retracted (so the next turn of a conversation, and the retracted request's
own recompute, start from them). Pages the tree holds unlocked are free memory that has not been given
back yet: `make_room` evicts them, least recently used first, before the scheduler retracts anyone.

Only whole pages are cached (see memory/radix_cache.py): a prefix that ends inside a page is matched up to
its last whole page and the request recomputes the rest into a page of its own.

Models with recurrent layers (SSM, linear attention; alone or in a hybrid) also need the state after a
prefix, which no page holds: the tree keeps snapshots of it (slots of `MemoryPools.snapshots`, handed out by
a `SnapshotAllocator`) and a match ends at the deepest snapshot. The step copies states on device
(`StepBatch.state_loads` / `state_saves`): a hit copies its snapshot into the request's state slot before
the request's first chunk, and a request saves its state into a slot of its own (its *track* slot,
`Req.track_slot`, holding the state after `Req.track_pos` tokens) whenever a step leaves it at a page
boundary. The scheduler makes prefill chunks end at the boundaries worth keeping (`Req.save_points`):
where the tree's pages for the prompt end without a snapshot (a branch point: the next request sharing
that prefix will match all of it), the prompt's last page boundary (the same prompt again), and any
boundary a chunk would otherwise end just past. Each such chunk end is inserted with its snapshot at once;
in decode the track slot follows the last page boundary and joins the tree when the request leaves. A
model without attention layers has no pages: its tree is unpaged, with `page_size` tokens per unit.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from memory import PageAllocator, ReqToTokenPool, SnapshotAllocator
from memory.radix_cache import MatchResult, RadixCache, RadixNode
from scheduler.request import Req

# A waiting request is held back for a prefill that will cache at least this many more of its tokens than the
# tree holds now (and at least one whole unit): SGLang's in-batch prefix caching uses 32 tokens.
MIN_SHARED_GAIN = 32


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


class RankPrefixCache:
    """The tree of one rank, with that rank's page allocator and page table (and snapshot allocator).

    `unit`: tokens per tree edge unit, the table's page size for a model with KV pages; a model without
    attention layers (`paged=False`) gives its own, as its pages only count tokens."""

    def __init__(self, pages: PageAllocator, table: ReqToTokenPool,
                 snapshots: SnapshotAllocator | None = None, *, paged: bool = True, unit: int | None = None):
        self.paged = paged
        self.tree = RadixCache(table.page_size if paged else unit, needs_snapshots=snapshots is not None,
                               paged=paged)
        self.pages, self.table, self.snapshots = pages, table, snapshots
        # An unpaged tree is bounded by its node count instead of by pages.
        self.max_nodes = 8 * snapshots.num_slots + 1024 if snapshots is not None else 0

    def match(self, tokens: Sequence[int]) -> MatchResult:
        """The longest cached whole-page prefix of `tokens`, locked: the caller `unlock`s `result.node` when
        it does not admit the request, or hands it to `borrow`."""
        m = self.tree.match_prefix(tokens)
        self.tree.lock(m.node)
        return m

    def unlock(self, node: RadixNode, *, pinned: bool = True) -> None:
        self.tree.unlock(node, pinned=pinned)

    def unpin(self, node: RadixNode) -> None:
        """The request locking `node` has loaded its snapshot: keep its prefix, free its snapshot to go."""
        self.tree.unpin(node)

    def borrow(self, row: int, m: MatchResult) -> None:
        """Starts the empty `row` with the matched prefix's pages (still locked by `m.node`)."""
        self.table.borrow(row, m.pages)

    def make_room(self, num_pages: int) -> bool:
        """Evicts unlocked cached pages until `num_pages` are free, if the tree can give that many; returns
        whether they are free now."""
        missing = num_pages - self.pages.num_free
        if self.paged and missing > 0 and self.tree.evictable_pages >= missing:
            self._give_back(self.tree.evict(missing))
        return self.pages.can_allocate(num_pages)

    def insert(self, row: int, tokens: Sequence[int], node: RadixNode, *, keep: bool,
               snapshot: tuple[int, int] | None = None, pinned: bool = False) -> tuple[RadixNode, bool]:
        """Caches the whole pages of `tokens` (the first tokens of `row`, their K/V computed) and moves the
        lock from `node` (`pinned`: a lock that still pins its snapshot) to where they end (`keep`; a lock
        that pins nothing: the request runs on its own state), or releases it (the request is leaving). The
        row then borrows those pages; its own pages for tokens the tree already held are freed.

        `snapshot` (slot, tokens): a snapshot slot holding the state after that many tokens; the tree takes it
        when they are exactly the cached prefix and it has no snapshot there yet. Returns the node now locked
        (the root when `keep` is False) and whether the tree took the slot (else it stays the caller's)."""
        if self.paged:
            num_pages = len(tokens) // self.page_size
            r = self.tree.insert(tokens, self.table.table[row, :num_pages].tolist())
            self.table.lend(row, r.pages)
            self.pages.free(r.duplicate_pages)
        else:
            r = self.tree.insert(tokens)
        taken = False
        if snapshot is not None and snapshot[1] == len(tokens) // self.page_size * self.page_size > 0:
            taken = self.tree.set_snapshot(r.node, snapshot[0])
        if keep:
            self.tree.lock(r.node, pin=False)
        self.tree.unlock(node, pinned=pinned)
        if not self.paged and self.tree.num_nodes > self.max_nodes:
            self._give_back(self.tree.evict_nodes(self.tree.num_nodes - self.max_nodes))
        return (r.node if keep else self.tree.root), taken

    def new_snapshot(self) -> int:
        """A free snapshot slot, dropping one of the tree's unpinned snapshots if none is free (a leaf's,
        least recently used, before a shared prefix's); 0 when every slot is pinned (the caller then keeps
        no snapshot)."""
        if not self.snapshots.can_allocate(1):
            self.snapshots.free(self.tree.evict_snapshots(1))
        return self.snapshots.allocate(1)[0] if self.snapshots.can_allocate(1) else 0

    def free_snapshot(self, slot: int) -> None:
        self.snapshots.free([slot])

    def will_cache(self, prefilling: Req, tokens: Sequence[int], cached: int, computed: int) -> bool:
        """Whether the running `prefilling` request's prompt, once computed, will leave at least
        MIN_SHARED_GAIN (and one unit) more of `tokens` in this tree than the `cached` tokens it holds now;
        then the waiting request with `tokens` is better held back than computing them a second time
        alongside (a burst of requests with one system prompt, `n > 1`).

        Attention KV is cached when the prompt is done. A recurrent state exists only where a chunk ends, so
        the shared boundary becomes one of `prefilling`'s save points if its prefill, `computed` tokens once
        the step being planned has run, has not reached it (otherwise the state there is not saved, and
        nothing is gained)."""
        u = self.page_size
        shared = common_prefix_len(tokens, prefilling.prompt_ids) // u * u
        if self.snapshots is not None:  # a state at most at the prompt's last page boundary (a save point)
            shared = min(shared, (len(prefilling.prompt_ids) - 1) // u * u)
        if shared - cached < max(MIN_SHARED_GAIN, u):
            return False
        if self.snapshots is not None:
            if shared <= computed:
                return False
            prefilling.save_points = tuple(sorted({*prefilling.save_points, shared}))
        return True

    # --- where a recurrent model's states are saved --------------------------------------------------------

    def save_points(self, req: Req, match: MatchResult) -> tuple[int, ...]:
        """Where the request's prefill should stop to snapshot its state: where the tree's pages for its
        tokens end without a snapshot (the prefix it shares with a cached request, which the next request
        sharing it can then match whole) and the last page boundary a repeat of its prompt can match."""
        u = self.page_size
        points = {match.branch_tokens, (len(req.prompt_ids) - 1) // u * u}
        return tuple(sorted(p for p in points if p > match.num_tokens))

    def chunk_len(self, req: Req, start: int, n: int) -> int:
        """A prefill chunk of `n` tokens from `start`, cut to end at the first of `req.save_points` inside
        it, or, when it does not end the sequence, at its last page boundary (a state worth saving)."""
        u = self.page_size
        end = start + n
        for p in req.save_points:
            if start < p < end:
                return p - start
        if end < req.seq_len and end % u and end // u * u > start:
            return end // u * u - start
        return n

    def track_slot(self, req: Req) -> int:
        """The request's own snapshot slot (allocated on first use; 0 when none can be had)."""
        if req.track_slot is None:
            slot = self.new_snapshot()
            if not slot:
                return 0
            req.track_slot = slot
        return req.track_slot

    @staticmethod
    def tracked(req: Req) -> tuple[int, int] | None:
        """The request's snapshot slot and the tokens its state covers, for `insert`; None without one."""
        return None if req.track_slot is None else (req.track_slot, req.track_pos)

    def flush(self) -> int:
        """Empties the tree (refused, raising RuntimeError, while any request holds a lock); returns the
        number of pages given back."""
        freed = self.tree.flush()
        self._give_back(freed)
        return len(freed.pages)

    def _give_back(self, evicted) -> None:
        self.pages.free(evicted.pages)
        if self.snapshots is not None:
            self.snapshots.free(evicted.snapshots)

    @property
    def page_size(self) -> int:
        return self.tree.page_size

    @property
    def root(self) -> RadixNode:
        return self.tree.root

    def check_integrity(self, num_locks: int, track_slots: Sequence[int] = ()) -> None:
        """The tree's own checks, its pages disjoint from the free list, the table's accounting with the
        tree's pages, `num_locks` (one per running request) held, and every snapshot slot either free,
        the tree's, or one of `track_slots` (the running requests')."""
        self.tree.check_integrity(free_pages=self.pages.free_pages(),
                                  free_snapshots=self.snapshots.free_slots() if self.snapshots else None)
        self.table.check_integrity(cached_pages=self.tree.cached_pages)
        assert self.tree.num_locks == num_locks, f"{self.tree.num_locks} locks held for {num_locks} requests"
        if self.snapshots is not None:
            self.snapshots.check_integrity(in_use=[*self.tree.snapshot_slots, *track_slots])
        else:
            assert not track_slots, "track slots without a snapshot pool"
