"""The single-controller loop: admit, batch (prefill chunks + decode tokens), run, finish, retract."""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable

import numpy as np

from memory import PageAllocator, ReqToTokenPool
from runtime.batch_builder import SeqWork, build_step_batch
from runtime.runner import ModelRunner
from scheduler.outputs import collect_outputs
from scheduler.request import FinishReason, Req, ReqOutput
from scheduler.stop import check_finished


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int
    chunked_prefill_size: int  # prefill tokens (block-padded) per step
    max_context_len: int
    max_queued_requests: int = 4096
    num_continuous_decode_steps: int = 1

    def __post_init__(self):
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests={self.max_running_requests} must be >= 1")


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_queued_requests`; the caller should retry later (HTTP 503)."""


class Scheduler:
    """Owns every request between arrival and finish. Not thread-safe: one thread drives `step`."""

    def __init__(self, runner: ModelRunner, cfg: SchedulerConfig, eos_ids: frozenset[int],
                 decode: Callable[[list[int]], str] | None = None):
        self.runner = runner
        self.cfg = cfg
        self.eos_ids = eos_ids
        self.decode = decode
        rc = runner.cfg
        self.page_size = rc.page_size
        self.pages = PageAllocator(rc.num_pages)
        self.req_to_token = ReqToTokenPool(cfg.max_running_requests, rc.buckets.max_pages, self.pages, rc.page_size)
        self.waiting: collections.deque[Req] = collections.deque()
        self.running: list[Req] = []  # admitted, in admission order
        self.num_steps = 0
        self.num_retractions = 0
        self.num_finished = 0

    # ---- requests in and out -----------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        return (self.pages.num_pages - 1) * self.page_size

    def validate(self, req: Req) -> None:
        """Raises ValueError if `req` can never run here (too long for the context or the pool)."""
        n = len(req.prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        limit = min(self.cfg.max_context_len, self.capacity_tokens)
        if n + req.params.max_new_tokens > limit:
            raise ValueError(
                f"prompt ({n} tokens) + max_new_tokens ({req.params.max_new_tokens}) = "
                f"{n + req.params.max_new_tokens} exceeds the limit of {limit} tokens "
                f"(context length {self.cfg.max_context_len}, KV pool {self.capacity_tokens})"
            )

    def add_request(self, req: Req) -> None:
        self.validate(req)
        if len(self.waiting) >= self.cfg.max_queued_requests:
            raise QueueFullError(f"{len(self.waiting)} requests already waiting")
        self.waiting.append(req)

    def abort(self, rid: str, message: str = "aborted") -> Req | None:
        """Finishes `rid` with reason abort wherever it is, returning its pages; None if unknown."""
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                break
        else:
            req = next((r for r in self.running if r.rid == rid), None)
            if req is None:
                return None
            self._release(req)
            self.running.remove(req)
        req.finish_reason = FinishReason("abort", message=message)
        req.finish_time = time.perf_counter()
        return req

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _release(self, req: Req) -> None:
        if req.row is not None:
            self.req_to_token.free_row(req.row)
            req.row = None

    def check_integrity(self) -> None:
        self.req_to_token.check_integrity()
        rows = [r.row for r in self.running]
        assert None not in rows and len(set(rows)) == len(rows), "running requests must own distinct rows"

    # ---- one iteration -----------------------------------------------------------------------

    def step(self) -> list[ReqOutput]:
        """Schedules and runs one batch; returns what each touched request produced (may be empty)."""
        works, reqs = self._schedule()
        while not works and self.running:
            # Prefills stuck waiting for pages that only they hold: preempt the youngest.
            self._retract(max(self.running, key=lambda r: r.admitted_at))
            works, reqs = self._schedule()
        if not works:
            return []
        self.num_steps += 1
        multi = self._multi_step_count(reqs)
        if multi > 1:
            return self._run_multi(works, reqs, multi)
        want_input = any(r.wants_input_logprobs and not w.is_decode for w, r in zip(works, reqs))
        batch, layout = build_step_batch(works, self.runner.cfg, self.req_to_token.table, want_input)
        out = self.runner.step(batch, layout.shape)
        return collect_outputs(self, works, reqs, layout, out, multi=None)

    def finish_token(self, req: Req) -> None:
        """Bookkeeping after a token was appended: stop checks, freeing what finished."""
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        reason = None
        if req.grammar is not None:
            token = req.output_ids[-1]
            if not req.grammar.accept_token(token):  # cannot happen while the mask is applied
                reason = FinishReason("abort", message=f"token {token} violates the response format")
            elif req.grammar.is_terminated():  # the structured output is complete
                reason = FinishReason("stop", matched=token)
        reason = reason or check_finished(req, self.eos_ids, self.cfg.max_context_len,
                                          self.decode if req.params.stop else None)
        if reason is not None:
            req.finish_reason = reason
            req.finish_time = time.perf_counter()
            self._release(req)
            self.running.remove(req)
            self.num_finished += 1

    # ---- scheduling --------------------------------------------------------------------------

    def _schedule(self) -> tuple[list[SeqWork], list[Req]]:
        decoding = [r for r in self.running if not r.in_prefill]
        while decoding and not self._reserve_all(decoding, 1):
            # Out of pages: preempt the youngest request (decoding or not) until the rest fit.
            victim = max(self.running, key=lambda r: r.admitted_at)
            self._retract(victim)
            if victim in decoding:
                decoding.remove(victim)
        works = [self._work(r, r.seq_len - 1, 1, is_decode=True) for r in decoding]
        reqs = list(decoding)

        bs = self.runner.cfg.buckets.prefill_block_size
        blocks_left = min(self.cfg.chunked_prefill_size // bs, self.runner.cfg.buckets.max_prefill_blocks)
        prefilling = [r for r in self.running if r.in_prefill]
        while blocks_left > 0:
            if prefilling:
                req = prefilling.pop(0)
            elif self.waiting and len(self.running) < self.cfg.max_running_requests:
                req = self.waiting[0]
            else:
                break
            remaining = req.seq_len - req.num_computed
            n = min(remaining, blocks_left * bs)
            if req.row is None and not self._admit(req, n, headroom=len(decoding)):
                break
            if req.row is not None and not self.req_to_token.reserve(req.row, req.num_computed + n):
                break  # continue this prefill next step, once decode requests free pages
            works.append(self._work(req, req.num_computed, n, is_decode=False))
            reqs.append(req)
            blocks_left -= -(-n // bs)
        return works, reqs

    def _admit(self, req: Req, n: int, headroom: int) -> bool:
        """Moves the head of the queue to running if a row and pages for its first chunk are free.

        `headroom` pages stay free for the running decode requests' next tokens, so admitting
        does not immediately force a retraction.
        """
        need = -(-n // self.page_size)
        if not self.req_to_token.can_allocate_row() or not self.pages.can_allocate(need + headroom):
            return False
        self.waiting.popleft()
        req.row = self.req_to_token.allocate_row()
        self.req_to_token.reserve(req.row, n)
        req.num_computed = 0
        req.admitted_at = self.num_steps
        self.running.append(req)
        return True

    def _reserve_all(self, reqs: list[Req], steps: int) -> bool:
        need = sum(self.req_to_token.pages_needed(r.row, r.num_computed + steps) for r in reqs)
        if not self.pages.can_allocate(need):
            return False
        for r in reqs:
            self.req_to_token.reserve(r.row, r.num_computed + steps)
        return True

    def _retract(self, req: Req) -> None:
        """Preempts `req`: frees its pages; it rejoins the queue front and later recomputes its tokens."""
        self._release(req)
        self.running.remove(req)
        req.num_computed = 0
        req.num_retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(req)

    def _work(self, req: Req, start: int, n: int, *, is_decode: bool) -> SeqWork:
        ids = req.all_ids
        p = req.params
        targets = None
        if req.wants_input_logprobs and not is_decode:
            targets = np.asarray((ids[start + 1 : start + n + 1] + [0])[:n], np.int32)
        suppress, allowed = (), None
        if req.grammar is not None:
            if start + n == req.seq_len:  # this step samples: only what the grammar allows next
                allowed = np.zeros(self.runner.cfg.mask_words, np.int32)
                req.grammar.fill_bitmask(allowed)
        elif len(req.output_ids) < p.min_new_tokens:
            suppress = tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(sorted(self.eos_ids)))
        return SeqWork(
            row=req.row, token_ids=np.asarray(ids[start : start + n], np.int32), start_pos=start,
            is_decode=is_decode, params=p, seed=req.seed, reset_penalties=start == 0,
            num_prompt_tokens=len(req.prompt_ids), want_top_logprobs=req.top_logprobs_num > 0,
            logprob_targets=targets, suppress_ids=suppress, allowed_mask=allowed,
        )

    def _multi_step_count(self, reqs: list[Req]) -> int:
        n = self.cfg.num_continuous_decode_steps
        if n <= 1 or self.waiting or any(r.in_prefill for r in self.running) or len(reqs) != len(self.running):
            return 1
        if any(len(r.output_ids) < r.params.min_new_tokens or r.grammar is not None for r in reqs):
            return 1  # per-token host decisions (stop suppression, grammar masks) need single steps
        # Pages for the tokens the later steps write; fall back to one step if they are not free.
        return n if self._reserve_all(reqs, n) else 1

    def _run_multi(self, works: list[SeqWork], reqs: list[Req], n: int) -> list[ReqOutput]:
        batch, layout = build_step_batch(works, self.runner.cfg, self.req_to_token.table, False)
        locs = np.zeros((n, layout.shape.decode), np.int32)
        for w, row in zip(works, layout.seq_rows):
            col = row - layout.shape.prefill_blocks
            pos = w.start_pos + 1 + np.arange(n - 1)
            pages = self.req_to_token.table[w.row]
            locs[: n - 1, col] = pages[pos // self.page_size] * self.page_size + pos % self.page_size
        out = self.runner.multi_step(batch, layout.shape, locs)
        return collect_outputs(self, works, reqs, layout, out, multi=n)
