"""The single-controller loop: admit, batch (prefill chunks + decode tokens), run, finish, retract.

With data parallelism every rank has its own pages and request rows (local ids into its shard of the
pools); a request's `dp_rank` is chosen at admission by the load-balance policy, and one step carries a
section per rank, each scheduled as a single-rank engine would schedule it."""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Callable

import numpy as np

from memory import PageAllocator, ReqToTokenPool, SnapshotAllocator
from runtime.batch_builder import SeqWork
from runtime.runner import ModelRunner
from scheduler.admission import Admission
from scheduler.draft_model import ModelDrafter
from scheduler.prefix_cache import RankPrefixCache
from scheduler.request import FinishReason, Req, ReqOutput
from scheduler.speculative import SpeculativeConfig, Speculator
from scheduler.stepping import RequestsFailed, Stepping
from scheduler.stop import check_finished

LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue", "cache_aware")
SCHEDULE_POLICIES = ("fcfs", "lpm")
logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int  # per data-parallel rank
    chunked_prefill_size: int  # prefill tokens (block-padded) per step and rank
    max_context_len: int
    max_queued_requests: int = 4096
    num_continuous_decode_steps: int = 1
    # Which data-parallel rank admits the next request: the next in turn, the one running fewest, or the one
    # whose prefix cache holds most of its tokens (then the one running fewest).
    load_balance_method: str = "round_robin"
    # The order waiting requests are admitted in: arrival ("fcfs"), or the longest prefix the cache holds
    # first ("lpm", SGLang's; scheduler/admission.py `_order_by_prefix`).
    schedule_policy: str = "fcfs"
    # The radix prefix cache (scheduler/prefix_cache.py). Models with recurrent layers also need snapshot
    # slots (RunnerConfig.state_snapshots); one without attention layers caches every `recurrent_page_size`
    # tokens (its KV-less pages span the whole context).
    prefix_cache: bool = True
    recurrent_page_size: int = 16
    speculative: SpeculativeConfig | None = None  # speculative decoding (scheduler/speculative.py); None: off
    # Build and dispatch the next decode step while the previous one runs, and handle that one's tokens while
    # the next runs (scheduler/stepping.py `_step_overlapped`; SGLang's overlap schedule)
    overlap_schedule: bool = True

    def __post_init__(self):
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests={self.max_running_requests} must be >= 1")
        if self.load_balance_method not in LOAD_BALANCE_METHODS:
            raise ValueError(
                f"load_balance_method={self.load_balance_method!r} must be one of {LOAD_BALANCE_METHODS}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy={self.schedule_policy!r} must be one of {SCHEDULE_POLICIES}")


@dataclasses.dataclass
class _RankPlan:
    """One rank's share of the step being scheduled."""

    works: list[SeqWork]
    reqs: list[Req]
    blocks_left: int  # prefill blocks still free in this rank's section
    headroom: int  # pages kept free for this rank's decoding requests when admitting
    open: bool = True  # may still admit (False once a prefill on it could not get pages)


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_queued_requests`; the caller should retry later (HTTP 503)."""


class Scheduler(Admission, Stepping):
    """Owns every request between arrival and finish. Not thread-safe: one thread drives `step`."""

    def __init__(self, runner: ModelRunner, cfg: SchedulerConfig, eos_ids: frozenset[int],
                 decode: Callable[[list[int]], str] | None = None, draft_runner: ModelRunner | None = None):
        self.runner = runner
        self.cfg = cfg
        self.eos_ids = eos_ids
        self.decode = decode
        rc = runner.cfg
        self.page_size = rc.page_size
        self.dp_size = rc.dp_size
        # Per data-parallel rank: page and row ids are local to the rank's shard of the pools.
        self.rank_pages = [PageAllocator(rc.num_pages) for _ in range(self.dp_size)]
        self.rank_tables = [
            ReqToTokenPool(cfg.max_running_requests, rc.buckets.max_pages, pages, rc.page_size)
            for pages in self.rank_pages
        ]
        recurrent = runner.pools.recurrent is not None
        self.prefix_cache_off_reason = (
            "disabled" if not cfg.prefix_cache
            else "no snapshot slots for the recurrent state (--max-state-snapshots 0)"
            if recurrent and not rc.state_snapshots else None)
        on = self.prefix_cache_off_reason is None
        paged = runner.pools.kv is not None or not recurrent  # no attention layers: no pages to cache
        self.rank_caches = [
            RankPrefixCache(pages, table, SnapshotAllocator(rc.state_snapshots + 1) if recurrent else None,
                            paged=paged, unit=cfg.recurrent_page_size) if on else None
            for pages, table in zip(self.rank_pages, self.rank_tables)
        ]
        # Snapshots of the recurrent state: prefill chunks end at, and states are saved at, multiples of this.
        self.snapshot_unit = self.rank_caches[0].page_size if on and recurrent else 0
        self.num_cached_prompt_tokens = 0  # prompt tokens admissions found in the cache (first admissions)
        self.num_computed_prompt_tokens = 0  # prompt tokens first admissions had to compute
        self.waiting: collections.deque[Req] = collections.deque()
        self.running: list[Req] = []  # admitted, in admission order
        self.live: dict[str, Req] = {}  # every request waiting or running, by rid
        self.num_steps = 0
        # (works, reqs, layout, outputs) of a step dispatched and not yet collected (the overlap schedule)
        self._inflight: tuple | None = None
        self.num_overlapped_steps = 0  # steps dispatched before the previous step's tokens were collected
        # With a speculator: whether the last scheduled step verifies no drafts for a while on every rank
        # (declined by the measured step times, or no room: `Speculator.add_drafts`; it may then be left in
        # flight), and the steps chained after it without drafting since
        self._verifies_none = False
        self._undrafted_chain = 0
        self._step_started = 0.0  # perf_counter at the start of the step in progress (its time is recorded)
        self.num_retractions = 0
        self.num_finished = 0
        self.num_admitted_per_rank = [0] * self.dp_size
        self._next_rank = 0  # round_robin: the rank whose turn it is
        # Speculative decoding: why it is off (None: on), and its drafts and counts (speculative.py).
        self.speculative_off_reason = (
            "not configured" if cfg.speculative is None
            else "no scratch state slots for draft rows (RunnerConfig.draft_state_slots 0)"
            if recurrent and not rc.draft_state_slots else None)
        self.speculator = None if self.speculative_off_reason is not None else Speculator(
            cfg.speculative, rc.buckets, rc.page_size, rc.mask_words, cfg.max_context_len, self._stop_mask,
            max_draft_rows=rc.draft_state_slots if recurrent else None,
            penalties=rc.max_draft_tokens >= cfg.speculative.num_draft_tokens)
        if self.speculator is not None and cfg.speculative.algorithm == "standalone":
            if draft_runner is None:
                raise ValueError("speculative_algorithm 'standalone' needs the draft model's runner")
            self.speculator.model_drafter = ModelDrafter(
                draft_runner, self.rank_tables, cfg.chunked_prefill_size, runner.model_cfg.vocab_size)

    @property
    def pages(self) -> PageAllocator:
        """The page allocator of a single-rank scheduler (per rank: `rank_pages`)."""
        if self.dp_size != 1:
            raise AttributeError("pages are per rank with dp_size > 1: use rank_pages")
        return self.rank_pages[0]

    @property
    def req_to_token(self) -> ReqToTokenPool:
        """The request table of a single-rank scheduler (per rank: `rank_tables`)."""
        if self.dp_size != 1:
            raise AttributeError("request tables are per rank with dp_size > 1: use rank_tables")
        return self.rank_tables[0]

    # ---- requests in and out -----------------------------------------------------------------

    @property
    def rank_capacity_tokens(self) -> int:
        """Tokens one rank's pages hold (a request lives on one rank)."""
        return (self.rank_pages[0].num_pages - 1) * self.page_size

    @property
    def capacity_tokens(self) -> int:
        """Tokens all ranks' pages hold."""
        return self.dp_size * self.rank_capacity_tokens

    @property
    def num_free_tokens(self) -> int:
        return sum(p.num_free for p in self.rank_pages) * self.page_size

    @property
    def num_available_tokens(self) -> int:
        """Free tokens plus those the prefix cache holds unlocked (evicted as soon as they are needed)."""
        evictable = sum(c.tree.evictable_pages for c in self.rank_caches if c is not None)
        return self.num_free_tokens + evictable * self.page_size

    def validate(self, req: Req) -> None:
        """Raises ValueError if `req` can never run here: a token id outside the vocabulary, more logit_bias
        entries or top logprobs than the step has room for, too long for the context or the pool, or a rid
        already in use. Callers check these first where they can name the field; this is the backstop that
        keeps a bad value from reaching (and failing) a step."""
        n = len(req.prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if req.rid in self.live:
            raise ValueError(f"request id {req.rid!r} is already in use by a request in flight")
        rc = self.runner.cfg
        ids = np.asarray(req.prompt_ids)
        if ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= rc.vocab_size:
            raise ValueError(f"prompt token ids must be integers in [0, {rc.vocab_size}) (the vocabulary)")
        req.params.check_vocab(rc.vocab_size)
        if len(req.params.logit_bias) > rc.max_bias:
            raise ValueError(f"logit_bias has {len(req.params.logit_bias)} entries; at most {rc.max_bias} "
                             "are allowed (--max-logit-bias)")
        if not 0 <= req.top_logprobs_num <= rc.max_top_logprobs:
            raise ValueError(f"top_logprobs_num={req.top_logprobs_num} must be in [0, {rc.max_top_logprobs}]")
        limit = min(self.cfg.max_context_len, self.rank_capacity_tokens)
        if n + req.params.max_new_tokens > limit:
            raise ValueError(
                f"prompt ({n} tokens) + max_new_tokens ({req.params.max_new_tokens}) = "
                f"{n + req.params.max_new_tokens} exceeds the limit of {limit} tokens "
                f"(context length {self.cfg.max_context_len}, KV pool {self.rank_capacity_tokens}"
                f"{' per data-parallel rank' if self.dp_size > 1 else ''})"
            )

    def add_request(self, req: Req) -> None:
        self.validate(req)
        if len(self.waiting) >= self.cfg.max_queued_requests:
            raise QueueFullError(f"{len(self.waiting)} requests already waiting")
        self.waiting.append(req)
        self.live[req.rid] = req

    def abort(self, rid: str, message: str = "aborted", status: int | None = None) -> Req | None:
        """Finishes `rid` with reason abort (`status`: the HTTP status its client gets, None for a client's
        own abort) wherever it is, returning its pages; None if no such request is waiting or running."""
        req = self.live.pop(rid, None)
        if req is None:
            return None
        if req in self.running:
            self._release(req, cache=status is None)
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.finish_reason = FinishReason("abort", message=message, status=status)
        req.finish_time = time.perf_counter()
        return req

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._inflight)

    def _release(self, req: Req, cache: bool = True) -> None:
        """Frees the request's row and pages; with the prefix cache, first caches its computed tokens (unless
        `cache` is False: a failed request's K/V is not trusted) and releases its lock."""
        if req.row is None:
            return
        prefix = self.rank_caches[req.dp_rank]
        if prefix is not None:
            if cache:
                _, taken = prefix.insert(req.row, req.all_ids[: req.num_computed], req.prefix_node,
                                         keep=False, snapshot=prefix.tracked(req), pinned=req.prefix_pinned)
                if taken:
                    req.track_slot = None
            else:
                prefix.unlock(req.prefix_node, pinned=req.prefix_pinned)
            if req.track_slot is not None:
                prefix.free_snapshot(req.track_slot)
            req.prefix_node, req.prefix_pinned, req.track_slot = None, False, None
            req.state_load, req.save_points = 0, ()
        self.rank_tables[req.dp_rank].free_row(req.row)
        req.row, req.state_fix, req.draft_computed, req.penalty_uncount = None, 0, 0, ()

    def _running_on(self, rank: int) -> list[Req]:
        return [r for r in self.running if r.dp_rank == rank]

    def check_integrity(self) -> None:
        for rank, (table, prefix) in enumerate(zip(self.rank_tables, self.rank_caches)):
            if prefix is None:
                table.check_integrity()
            else:
                running = self._running_on(rank)
                prefix.check_integrity(sum(r.prefix_node is not prefix.root for r in running),
                                       [r.track_slot for r in running if r.track_slot is not None])
        rows = [(r.dp_rank, r.row) for r in self.running]
        assert all(rank in range(self.dp_size) and row is not None for rank, row in rows) and (
            len(set(rows)) == len(rows)), "running requests must own distinct rows on a valid rank"
        assert {r.rid for r in self.running} | {r.rid for r in self.waiting} == set(self.live) and (
            len(self.live) == len(self.running) + len(self.waiting)), "live must be exactly waiting + running"

    # ---- one iteration -----------------------------------------------------------------------

    def step(self) -> list[ReqOutput]:
        """Schedules and runs one batch; returns what each touched request produced (may be empty).

        A failure while scheduling, building the batch for or finishing one request aborts that request
        (its output carries finish reason abort, status 500, and the error) and the step is scheduled again
        without it; when a failure cannot be pinned on one request (the device step itself), every request
        of the step is aborted. Only a failure that leaves the pools unusable propagates."""
        failed: list[ReqOutput] = []
        while True:
            try:
                return failed + self._step()
            except RequestsFailed as f:
                if self.runner.pools_lost():
                    raise f.error
                failed += [self.fail(req, f.error) for req in f.reqs]

    def fail(self, req: Req, error: BaseException) -> ReqOutput:
        """Aborts `req` because serving it raised `error` (logged with its traceback); returns its output."""
        logger.error("request %s failed and was aborted: %s: %s", req.rid, type(error).__name__, error,
                     exc_info=error)
        message = f"internal error: {type(error).__name__}: {error}"
        if self.abort(req.rid, message, status=500) is None:  # already finished: report the failure anyway
            req.finish_reason = FinishReason("abort", message=message, status=500)
        return ReqOutput(req.rid, [], req.finish_reason)

    def _step(self) -> list[ReqOutput]:
        self._step_started = time.perf_counter()
        if self._inflight is not None:
            return self._step_overlapped()
        self._undrafted_chain = 0
        works, reqs = self._schedule()
        while (stuck := self._stuck_rank(reqs)) is not None:
            # Prefills stuck waiting for pages that only they hold: preempt the rank's youngest.
            self._retract(max(self._running_on(stuck), key=lambda r: r.admitted_at))
            works, reqs = self._schedule()
        if not works:
            return []
        self.num_steps += 1
        # a verify step, or one that first moves accepted drafts' states (state_fix), runs alone
        multi = (1 if any(w.draft is not None or w.state_fix for w in works)
                 else self._multi_step_count(reqs))
        if multi > 1:
            return self._run_multi(works, reqs, multi)
        want_input = any(r.wants_input_logprobs and not w.is_decode for w, r in zip(works, reqs))
        batch, layout = self._build(works, reqs, want_input)
        if self._may_overlap(works, reqs):
            self._dispatch(works, reqs, batch, layout)  # its tokens are collected while the next step runs
            return []
        host = self._run(works, reqs, None, self.runner.step, batch, layout.shape)
        return self._collect(works, reqs, layout, host, multi=None)

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
            del self.live[req.rid]
            self.num_finished += 1

    # ---- scheduling --------------------------------------------------------------------------

    def _schedule(self, drafts: bool = True) -> tuple[list[SeqWork], list[Req]]:
        """The step's works and their requests; `drafts=False`: none drafts (a step chained after one in
        flight, whose tokens the drafts would follow)."""
        plans = [self._schedule_rank(rank) for rank in range(self.dp_size)]
        self._admit_waiting(plans)
        if self.speculator is not None and drafts:
            declined = [self.speculator.add_drafts(plan.works, plan.reqs, self.rank_tables[rank])
                        for rank, plan in enumerate(plans)]
            self._verifies_none = all(declined)  # (one rank's drafts declined, another's looked up: no)
        return [w for p in plans for w in p.works], [r for p in plans for r in p.reqs]

    def speculative_info(self) -> dict:
        """Speculative decoding's configuration and acceptance so far (for /get_server_info)."""
        if self.speculator is None:
            return {"enabled": False, "reason": self.speculative_off_reason}
        return self.speculator.info()

    def _schedule_rank(self, rank: int) -> _RankPlan:
        """The rank's decode tokens, then chunks of the prefills it is running, within its prefill budget."""
        running = self._running_on(rank)
        decoding = [r for r in running if not r.in_prefill]
        while decoding and not self._reserve_all(decoding, 1):
            # Out of pages: preempt the rank's youngest request (decoding or not) until the rest fit.
            victim = max(running, key=lambda r: r.admitted_at)
            self._retract(victim)
            running.remove(victim)
            if victim in decoding:
                decoding.remove(victim)
        bs = self.runner.cfg.buckets.prefill_block_size
        plan = _RankPlan([self._work(r, r.seq_len - 1, 1, is_decode=True) for r in decoding], list(decoding),
                         min(self.cfg.chunked_prefill_size // bs, self.runner.cfg.buckets.max_prefill_blocks),
                         headroom=len(decoding))
        for req in [r for r in running if r.in_prefill]:
            if plan.blocks_left <= 0:
                break
            n = self._chunk_len(rank, req, req.num_computed,
                                min(req.seq_len - req.num_computed, plan.blocks_left * bs))
            self._make_room(rank, self.rank_tables[rank].pages_needed(req.row, req.num_computed + n))
            if not self.rank_tables[rank].reserve(req.row, req.num_computed + n):
                plan.open = False  # continue this prefill next step, once decode requests free pages
                break
            self._add_prefill(plan, req, n)
        return plan

    def _add_prefill(self, plan: _RankPlan, req: Req, n: int) -> None:
        plan.works.append(self._work(req, req.num_computed, n, is_decode=False))
        plan.reqs.append(req)
        plan.blocks_left -= -(-n // self.runner.cfg.buckets.prefill_block_size)

    def _stuck_rank(self, reqs: list[Req]) -> int | None:
        """A rank running requests none of which got work this step (prefills waiting for pages they hold)."""
        busy = {r.dp_rank for r in reqs}
        return next((r.dp_rank for r in self.running if r.dp_rank not in busy), None)

    def _reserve_all(self, reqs: list[Req], steps: int) -> bool:
        """Grows every request by `steps` tokens if each rank has the pages; else changes nothing."""
        need = [0] * self.dp_size
        for r in reqs:
            need[r.dp_rank] += self.rank_tables[r.dp_rank].pages_needed(r.row, r.num_computed + steps)
        if not all([self._make_room(rank, n) for rank, n in enumerate(need)]):
            return False
        for r in reqs:
            self.rank_tables[r.dp_rank].reserve(r.row, r.num_computed + steps)
        return True

    def _retract(self, req: Req) -> None:
        """Preempts `req`: frees its pages; it rejoins the queue front and later recomputes its tokens."""
        self._release(req)
        self.running.remove(req)
        req.num_computed = 0
        req.num_retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(req)
