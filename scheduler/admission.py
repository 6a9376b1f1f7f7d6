"""Admission and the prefix cache's use, the part of the scheduler (scheduler.py) that moves requests from
the queue to running: the queue head goes, in order (of arrival, or with `--schedule-policy lpm` the longest
cached prefix first), onto the data-parallel rank the load-balance policy picks, with its longest cached
prefix borrowed from the rank's radix tree (RankPrefixCache) so its prefill starts after it; a request whose
prefix a running prefill is about to cache waits for it. Also what the scheduler asks of the cache: room
(evicting unlocked pages), prompts cached as they are computed, its size for /get_server_info, and a
flush."""

from __future__ import annotations

from typing import TYPE_CHECKING

from runtime.batch_builder import SeqWork
from scheduler.request import Req

if TYPE_CHECKING:
    from scheduler.scheduler import _RankPlan

LPM_MAX_WAITING = 128  # `--schedule-policy lpm` sorts the queue up to this many waiting requests


class Admission:
    """Scheduler methods (mixed into scheduler.Scheduler, whose state they use: the queue, the running
    requests, each rank's page tables and prefix cache)."""

    def _admit_waiting(self, plans: list[_RankPlan]) -> None:
        """Admits the queue head, in order (`_order_by_prefix` first under lpm), onto the rank the
        load-balance policy picks, while one has room. A request whose prefix a running prefill is about to
        cache waits for it (up to one step's worth of requests per rank are held back), keeping its place in
        the queue."""
        bs = self.runner.cfg.buckets.prefill_block_size
        held: list[Req] = []
        if self.cfg.schedule_policy == "lpm" and len(self.waiting) > 1 and self._pick_rank(plans) is not None:
            self._order_by_prefix()
        try:
            while self.waiting:
                if len(held) < self.cfg.max_running_requests * self.dp_size and self._awaits_prefill(
                        self.waiting[0], plans):
                    held.append(self.waiting.popleft())
                    continue
                rank = self._pick_rank(plans)
                if rank is None:
                    return
                req, plan = self.waiting[0], plans[rank]
                n = self._admit(req, rank, plan.blocks_left * bs, headroom=plan.headroom)
                if not n:
                    plan.open = False
                    continue
                self._add_prefill(plan, req, n)
        finally:
            self.waiting.extendleft(reversed(held))

    def _order_by_prefix(self) -> None:
        """`--schedule-policy lpm` (SGLang's longest prefix match): the queue sorted by how many of each
        request's tokens a rank's tree holds, most first; ties, and requests that were retracted (which come
        first, as they do in arrival order), keep their order. Requests whose prefix is cached run while it
        is, ahead of ones that would compute theirs: a burst of conversations over a few shared prompts
        starts each group's followers as soon as its first has cached the prompt, instead of after every
        other group's first. A peek per waiting request and step (~20 us at 1.4 k tokens): over
        LPM_MAX_WAITING waiting (SGLang's limit) the queue keeps arrival order."""
        if len(self.waiting) > LPM_MAX_WAITING or self.rank_caches[0] is None:
            return

        def key(req: Req) -> tuple[bool, int]:
            return req.num_retractions == 0, -self._held_by_a_tree(self._matchable(req))

        ordered = sorted(self.waiting, key=key)
        self.waiting.clear()
        self.waiting.extend(ordered)

    def _awaits_prefill(self, req: Req, plans: list[_RankPlan]) -> bool:
        """Whether a running prefill will cache enough of `req`'s prefix (RankPrefixCache.will_cache)."""
        prefilling = [r for r in self.running if r.in_prefill]
        if not prefilling or self.rank_caches[0] is None:
            return False
        tokens = self._matchable(req)
        cached = self._held_by_a_tree(tokens)
        # How far each request's state is computed once this step's planned chunks run.
        planned = {id(r): w.start_pos + len(w.token_ids) for p in plans for w, r in zip(p.works, p.reqs)}
        return any(self.rank_caches[r.dp_rank].will_cache(r, tokens, cached,
                                                          planned.get(id(r), r.num_computed))
                   for r in prefilling)

    def _pick_rank(self, plans: list[_RankPlan]) -> int | None:
        """The rank for the next admission among those with prefill budget, a free row and pages so far."""
        ready = [k for k, p in enumerate(plans) if p.open and p.blocks_left > 0
                 and len(self._running_on(k)) < self.cfg.max_running_requests]
        if not ready:
            return None
        if self.cfg.load_balance_method == "shortest_queue":
            return min(ready, key=lambda k: (len(self._running_on(k)), k))
        if self.cfg.load_balance_method == "cache_aware":
            req = self.waiting[0]
            tokens = self._matchable(req)
            cached = {k: self.rank_caches[k].tree.peek(tokens) if self.rank_caches[k] else 0 for k in ready}
            return min(ready, key=lambda k: (-cached[k], len(self._running_on(k)), k))
        return min(ready, key=lambda k: (k - self._next_rank) % self.dp_size)  # round_robin

    def _admit(self, req: Req, rank: int, max_tokens: int, headroom: int) -> int:
        """Moves the head of the queue to running on `rank` if a row and pages for its first chunk (at most
        `max_tokens` after its cached prefix) are free; returns the chunk's length, 0 if not admitted.

        `headroom` pages stay free for the rank's running decode requests' next tokens, so admitting
        does not immediately force a retraction.
        """
        table, prefix = self.rank_tables[rank], self.rank_caches[rank]
        if not table.can_allocate_row():
            return 0
        match = prefix.match(self._matchable(req)) if prefix is not None else None
        cached = match.num_tokens if match is not None else 0
        if match is not None and self.snapshot_unit:
            req.state_load = match.snapshot or 0
            req.save_points = prefix.save_points(req, match)
        n = self._chunk_len(rank, req, cached, min(req.seq_len - cached, max_tokens))
        if not self._make_room(rank, -(-n // self.page_size) + headroom):
            if match is not None:
                prefix.unlock(match.node)
            return 0
        self.waiting.popleft()
        req.dp_rank = rank
        req.row = table.allocate_row()
        if match is not None:
            prefix.borrow(req.row, match)
            req.prefix_node, req.prefix_pinned = match.node, True
        table.reserve(req.row, cached + n)
        req.num_computed = cached
        if req.num_retractions == 0:
            req.cached_tokens = min(cached, len(req.prompt_ids))
            self.num_cached_prompt_tokens += req.cached_tokens
            self.num_computed_prompt_tokens += len(req.prompt_ids) - req.cached_tokens
        req.admitted_at = self.num_steps
        self.running.append(req)
        self.num_admitted_per_rank[rank] += 1
        self._next_rank = (rank + 1) % self.dp_size
        return n

    def _matchable(self, req: Req) -> list[int]:
        """The tokens of `req` a cached prefix may cover (`_match_limit`)."""
        return req.all_ids[: self._match_limit(req)]

    def _held_by_a_tree(self, tokens: list[int]) -> int:
        """The most of `tokens` (a prefix) any rank's tree holds."""
        return max(c.tree.peek(tokens) for c in self.rank_caches)

    def _match_limit(self, req: Req) -> int:
        """How many of the request's tokens a cached prefix may cover: all but the last (its logits are
        needed), none before a wanted prompt logprob (prompt token i's comes from position i - 1), and none
        with penalties (they count the tokens the request feeds itself)."""
        if req.params.uses_penalties:
            return 0
        limit = req.seq_len - 1
        if req.wants_input_logprobs:
            limit = min(limit, max(0, req.logprob_start_len - 1))
        return limit

    def _chunk_len(self, rank: int, req: Req, start: int, n: int) -> int:
        """A prefill chunk of at most `n` tokens from `start` on `rank` (recurrent models: cut at a save
        point)."""
        return self.rank_caches[rank].chunk_len(req, start, n) if self.snapshot_unit else n

    def _track_slot(self, req: Req) -> int:
        return self.rank_caches[req.dp_rank].track_slot(req)

    def _make_room(self, rank: int, num_pages: int) -> bool:
        """Whether `num_pages` pages are free on `rank`, after evicting unlocked cached ones if needed."""
        prefix = self.rank_caches[rank]
        if prefix is None:
            return self.rank_pages[rank].can_allocate(num_pages)
        return prefix.make_room(num_pages)

    def _cache_prompt(self, req: Req, w: SeqWork) -> None:
        """Caches a running request's prompt once it is computed, so that requests arriving while it
        decodes share it; with snapshots, every prefill chunk that saved one, with it."""
        prefix = self.rank_caches[req.dp_rank] if req.row is not None else None
        if prefix is None:
            return
        if self.snapshot_unit:
            if w.save_snapshot and not w.is_decode:
                req.prefix_node, taken = prefix.insert(req.row, req.all_ids[: req.track_pos], req.prefix_node,
                                                       keep=True, snapshot=prefix.tracked(req),
                                                       pinned=req.prefix_pinned)
                if taken:
                    req.track_slot = None
            return
        whole_pages = len(req.prompt_ids) // self.page_size
        if (req.num_computed >= len(req.prompt_ids)
                and self.rank_tables[req.dp_rank].num_borrowed_of[req.row] < whole_pages):
            req.prefix_node, _ = prefix.insert(req.row, req.prompt_ids, req.prefix_node, keep=True,
                                               pinned=req.prefix_pinned)

    def prefix_cache_info(self) -> dict:
        """The prefix cache's size and hit counts (for /get_server_info)."""
        if self.rank_caches[0] is None:
            return {"enabled": False, "reason": self.prefix_cache_off_reason}
        trees = [prefix.tree for prefix in self.rank_caches]
        return {
            "enabled": True,
            "nodes": sum(t.num_nodes for t in trees),
            "cached_tokens": sum(t.num_cached_tokens for t in trees),
            "evictable_tokens": sum(t.evictable_pages for t in trees) * self.page_size,
            "cached_prompt_tokens": self.num_cached_prompt_tokens,
            "computed_prompt_tokens": self.num_computed_prompt_tokens,
            **({"state_snapshots": sum(t.num_snapshots for t in trees),
                "state_snapshot_slots": self.dp_size * self.runner.cfg.state_snapshots}
               if self.snapshot_unit else {}),
        }

    def flush_cache(self) -> int:
        """Empties every rank's prefix cache; returns the pages given back. Raises RuntimeError while requests
        are waiting or running (they may hold cached pages), and when there is no cache."""
        if self.rank_caches[0] is None:
            raise RuntimeError(f"the prefix cache is off ({self.prefix_cache_off_reason})")
        if self.live:
            raise RuntimeError(f"cannot flush the prefix cache while {len(self.live)} requests are waiting "
                               "or running")
        return sum(prefix.flush() for prefix in self.rank_caches)
