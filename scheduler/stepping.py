"""The scheduler's steps from plan to outputs (scheduler.py mixes these methods in): a request's work for
the step (`SeqWork`: its tokens, logprob targets, allowed-token masks, snapshot saves and the fixes its last
verify step left), the step's batch, running it (one step, or several decode steps in one call when nothing
needs the host in between), and collecting what it produced into each request: tokens, logprobs, accepted
drafts, stop checks. A failure is pinned on the requests that cause it where it can be (`RequestsFailed`)."""

from __future__ import annotations

import time

import numpy as np

from runtime.batch_builder import Layout, SeqWork, build_dp_step_batch
from scheduler.draft_model import ModelDrafter
from scheduler.outputs import append_tokens, fetch_outputs
from scheduler.request import Req, ReqOutput

# Steps chained without drafting after a step whose drafts were declined, before one is scheduled
# synchronously to weigh drafts again (a speculator's overlap: `_may_overlap`)
UNDRAFTED_CHAIN = 16


class RequestsFailed(Exception):
    """Scheduling, building or running a step failed because of `reqs` (all of the step's requests when the
    failure cannot be narrowed down); `step` aborts them and schedules again without them."""

    def __init__(self, reqs: list[Req], error: BaseException):
        super().__init__(str(error))
        self.reqs, self.error = reqs, error


class Stepping:
    """Scheduler methods (mixed into scheduler.Scheduler, whose state they use: the runner, each rank's page
    tables and prefix cache, the speculator)."""

    def _collect(self, works: list[SeqWork], reqs: list[Req], layout: Layout, host: dict,
                 multi: int | None) -> list[ReqOutput]:
        """Each request's tokens, logprobs and stop checks from a step's outputs (`append_tokens`). A failure
        while finishing one request (a grammar or stop-string check raising) aborts that request only."""
        results = []
        for w, req, row, start in zip(works, reqs, layout.seq_rows, layout.token_starts):
            try:
                req.state_load = 0  # loaded, if it was to be
                if req.prefix_pinned:
                    self.rank_caches[req.dp_rank].unpin(req.prefix_node)
                    req.prefix_pinned = False
                if w.save_snapshot and multi is None:
                    req.track_pos = w.start_pos + len(w.token_ids)
                before = self.speculator.counts_of(req) if w.draft is not None else None
                result = append_tokens(req, w, row, start, host, multi, self.finish_token)
                if w.draft is not None:
                    accepted = self.speculator.count(req, before)
                    if req.row is not None:  # pages reserved for drafts that were not kept go back
                        self.rank_tables[req.dp_rank].truncate(req.row, req.seq_len)
                        if accepted and w.draft_state_slot:  # the state after the last accepted draft
                            req.state_fix = w.draft_state_slot + accepted - 1
                        if w.params.uses_penalties:  # counted by the step's penalty update, then rejected
                            req.penalty_uncount = tuple(int(t) for t in w.draft[accepted:])
                        if self.speculator.model_drafter is not None:
                            ModelDrafter.after_verify(req, w.start_pos, accepted)
                if not req.finished:
                    self._cache_prompt(req, w)
            except Exception as e:
                result = self.fail(req, e)
            if result is not None:
                results.append(result)
        if self.speculator is not None and self.speculator.cfg.adaptive and not layout.shape.prefill_blocks:
            # what drafts are weighed against
            seconds = (time.perf_counter() - self._step_started) / (multi or 1)
            verify = any(w.draft is not None for w in works)
            self.speculator.step_times.record((layout.shape.decode, layout.shape.pages, verify), seconds)
        return results

    def _build(self, works: list[SeqWork], reqs: list[Req], want_input_logprobs: bool):
        """The step's batch; on failure, raises RequestsFailed for the works that fail alone (or all)."""
        def build(ws: list[SeqWork], rs: list[Req]):
            return build_dp_step_batch(ws, [r.dp_rank for r in rs], self.runner.cfg,
                                       [t.table for t in self.rank_tables], want_input_logprobs)

        try:
            return build(works, reqs)
        except Exception as e:
            culprits = []
            for w, r in zip(works, reqs):
                try:
                    build([w], [r])
                except Exception:
                    culprits.append(r)
            raise RequestsFailed(culprits or list(reqs), e) from e

    def _run(self, works: list[SeqWork], reqs: list[Req], multi: int | None, step, *args) -> dict:
        """Runs `step(*args)` (a runner step) and fetches its outputs to the host. A failure there cannot be
        pinned on one request: all of the step's requests fail."""
        try:
            return fetch_outputs(works, reqs, step(*args), multi)
        except Exception as e:
            raise RequestsFailed(list(reqs), e) from e

    # ---- the overlap schedule -----------------------------------------------------------------
    # A decode-only step is dispatched and left in flight (`_inflight`); the next `_step` schedules, builds
    # and dispatches the step after it before collecting it, so the host's work for a step runs while the
    # device runs the step before. The new step feeds each request a placeholder for the token still in
    # flight (Req.tokens), which the program replaces by the token the previous step left in the pools
    # (PenaltyPool.last_ids; device order makes that step finish first). A request that finishes with the
    # step collected has computed one token more in the next one, which is dropped; its pages and row are
    # freed at once, which is safe because the device runs the step in flight before any later step that
    # reuses them, and only K/V of tokens before its end is cached.
    # Steps run synchronously (dispatched and collected in one `_step`) wherever the host needs a step's
    # tokens to build the next: admissions waiting, prefills running, grammars, speculative drafts, snapshot
    # saves of a recurrent model's state, a request's last token (its length or the context), pages that
    # would have to be taken from a running request, multi-step decode, a multi-host mesh.
    # With speculative decoding, a step whose drafts the measured step times declined (a batch where a
    # verify step costs more than its drafts would save) is left in flight like any other, and the steps
    # chained after it do not draft, up to UNDRAFTED_CHAIN of them; then a step is scheduled synchronously
    # again, which weighs drafts afresh. `bench.speculative --batch 32` (SmolLM2, int8 flags, AMD Zen 5):
    # ngram against plain 0.96-0.97x when a speculator kept every step synchronous, 1.02-1.04x since.

    def _may_overlap(self, works: list[SeqWork], reqs: list[Req]) -> bool:
        """Whether the decode step of `works` can be left in flight (a decode work has no logprob targets)."""
        if self.speculator is not None and not (
                self._verifies_none
                and all(w.draft is None and not w.state_fix and not w.penalty_uncount for w in works)):
            return False
        return (self.cfg.overlap_schedule and self.cfg.num_continuous_decode_steps <= 1
                and self.runner.on_step is None and len(reqs) == len(self.running)
                and all(w.is_decode and not w.save_snapshot and not w.load_snapshot for w in works))

    def _may_chain(self, reqs: list[Req]) -> bool:
        """Whether the step after the one in flight (over `reqs`) can be scheduled before that one's tokens
        are known: every running request decodes in both, nothing else waits, no request's token in flight
        can be its last, and the pages for one more token each are free (nothing to preempt). (`reqs` passed
        `_may_overlap`: none has a snapshot to load or pinned, or a verify step's fixes.)"""
        if (not self.cfg.overlap_schedule or self.waiting or len(reqs) != len(self.running)
                or any(r.finished for r in reqs)
                or (self.speculator is not None and self._undrafted_chain >= UNDRAFTED_CHAIN)):
            return False
        u = self.snapshot_unit
        for r in reqs:
            if (r.grammar is not None or len(r.output_ids) + r.inflight >= r.params.max_new_tokens
                    or r.seq_len + 1 >= self.cfg.max_context_len or (u and r.seq_len % u == 0)):
                return False
        return self._reserve_all(reqs, 1)

    def _dispatch(self, works: list[SeqWork], reqs: list[Req], batch, layout: Layout) -> None:
        try:
            out = self.runner.step(batch, layout.shape)
        except Exception as e:
            raise RequestsFailed(list(reqs), e) from e
        for w, req in zip(works, reqs):
            req.inflight += 1
            req.num_computed = w.start_pos + 1
        self._inflight = (works, reqs, layout, out)

    def _step_overlapped(self) -> list[ReqOutput]:
        """Dispatches the next step if it may go ahead, then collects the one in flight."""
        works, reqs, layout, out = self._inflight
        self._inflight = None
        failure = None  # the next step's scheduling, build or dispatch failed: after collecting this one
        if self._may_chain(reqs):
            try:
                nxt_works, nxt_reqs = self._schedule(drafts=False)
                if nxt_works:
                    batch, nxt_layout = self._build(nxt_works, nxt_reqs, False)
                    self._dispatch(nxt_works, nxt_reqs, batch, nxt_layout)
                    self.num_steps += 1
                    self.num_overlapped_steps += 1
                    self._undrafted_chain += 1
            except RequestsFailed as f:
                if self.runner.pools_lost():
                    raise f.error
                failure = f
        for req in reqs:
            req.inflight -= 1
        keep = [i for i, req in enumerate(reqs) if not req.finished]  # (finished or aborted since)
        results = []
        if keep:
            works, reqs = [works[i] for i in keep], [reqs[i] for i in keep]
            layout = Layout(layout.shape, [layout.seq_rows[i] for i in keep],
                            [layout.token_starts[i] for i in keep])
            host = self._run(works, reqs, None, lambda: out)
            results = self._collect(works, reqs, layout, host, multi=None)
        if failure is not None:
            results += [self.fail(req, failure.error) for req in failure.reqs if not req.finished]
        return results

    def _work(self, req: Req, start: int, n: int, *, is_decode: bool) -> SeqWork:
        try:
            return self._make_work(req, start, n, is_decode)
        except Exception as e:
            raise RequestsFailed([req], e) from e

    def _make_work(self, req: Req, start: int, n: int, is_decode: bool) -> SeqWork:
        p = req.params
        targets = None
        if req.wants_input_logprobs and not is_decode:
            targets = np.asarray((req.tokens(start + 1, start + n + 1) + [0])[:n], np.int32)
        allowed = None
        if req.grammar is not None:
            if start + n == req.seq_len:  # this step samples: only what the grammar allows next
                allowed = np.zeros(self.runner.cfg.mask_words, np.int32)
                req.grammar.fill_bitmask(allowed)
        elif len(req.output_ids) + req.inflight < p.min_new_tokens:
            allowed = self._stop_mask(req)
        u = self.snapshot_unit
        return SeqWork(
            row=req.row, token_ids=np.asarray(req.tokens(start, start + n), np.int32), start_pos=start,
            is_decode=is_decode, params=p, seed=req.seed, reset_penalties=start == 0,
            num_prompt_tokens=len(req.prompt_ids), want_top_logprobs=req.top_logprobs_num > 0,
            logprob_targets=targets, allowed_mask=allowed, load_snapshot=req.state_load,
            save_snapshot=self._track_slot(req) if u and (start + n) % u == 0 else 0,
            **self._take_fixes(req),
        )

    @staticmethod
    def _take_fixes(req: Req) -> dict:
        """What its last verify step left to set right before its next work runs: the state fix and the
        penalty uncounts (every running request decodes in each step, so they are applied before any later
        step's draft rows reuse the scratch slot or count again)."""
        fixes = dict(state_fix=req.state_fix, penalty_uncount=req.penalty_uncount)
        req.state_fix, req.penalty_uncount = 0, ()
        return fixes

    def _stop_mask(self, req: Req) -> np.ndarray:
        """The mask that holds `req`'s stop and EOS ids back (while min_new_tokens holds)."""
        p = req.params
        return self._mask_without(p.stop_token_ids + (() if p.ignore_eos else tuple(self.eos_ids)))

    def _mask_without(self, token_ids: tuple[int, ...]) -> np.ndarray:
        """i32[mask_words] allowing all but `token_ids` (bit t % 32 of word t // 32, as grammars set it)."""
        mask = np.full(self.runner.cfg.mask_words, 0xFFFFFFFF, np.uint32)
        ids = np.asarray(token_ids, np.int64)
        np.bitwise_and.at(mask, ids >> 5, ~(np.uint32(1) << (ids & 31).astype(np.uint32)))
        return mask.view(np.int32)

    def _multi_step_count(self, reqs: list[Req]) -> int:
        n = self.cfg.num_continuous_decode_steps
        if (n <= 1 or self.waiting or any(r.in_prefill for r in self.running)
                or len(reqs) != len(self.running)):
            return 1
        if any(len(r.output_ids) < r.params.min_new_tokens or r.grammar is not None for r in reqs):
            return 1  # per-token host decisions (stop suppression, grammar masks) need single steps
        # Pages for the tokens the later steps write; fall back to one step if they are not free.
        return n if self._reserve_all(reqs, n) else 1

    def _run_multi(self, works: list[SeqWork], reqs: list[Req], n: int) -> list[ReqOutput]:
        batch, layout = self._build(works, reqs, False)
        # Decode-only: a work's (global) sequence row is its column in the ranks' concatenated sections.
        locs = np.zeros((n, self.dp_size * layout.shape.decode), np.int32)
        saves = np.zeros((*locs.shape, 2), np.int32)  # step i saves the state after token start_pos + i
        tracked = {}
        for w, req, row in zip(works, reqs, layout.seq_rows):
            col = row - layout.shape.prefill_blocks
            pos = w.start_pos + 1 + np.arange(n - 1)
            pages = self.rank_tables[req.dp_rank].table[w.row]
            locs[: n - 1, col] = pages[pos // self.page_size] * self.page_size + pos % self.page_size
            for i in range(n) if self.snapshot_unit else ():
                if (w.start_pos + i + 1) % self.snapshot_unit == 0 and (slot := self._track_slot(req)):
                    saves[i, col] = (w.row, slot)
                    tracked[req.rid] = w.start_pos + i + 1
        host = self._run(works, reqs, n, self.runner.multi_step, batch, layout.shape, locs, saves)
        for req in reqs:
            req.track_pos = tracked.get(req.rid, req.track_pos)
        return self._collect(works, reqs, layout, host, multi=n)
