"""Speculative decoding: draft tokens proposed on the host, verified by the target model in the decode step.

A decoding request with a draft d_1 .. d_k feeds its last token and the k drafts as k + 1 decode rows of one
step (positions p .. p + k, one page table row; every layer writes the K/V of all of a step's tokens before
any row attends, so row i sees the drafts before it). Row i samples the token after position p + i exactly
as a plain decode step at that position would: same logits processing, same random draw (the sampler keys
its randomness on the request's seed and the position). The host keeps row 0's token, then row i's while
row i - 1's token equals d_i. For greedy rows this is exact verification; for sampled rows it is rejection
sampling against a drafter that proposes one token with probability 1: the draft is accepted with the
target's probability of it, and a rejected position emits a token drawn from the target's distribution
without the draft, i.e. the target distribution is preserved. Both ways the output is token for token the
output without speculation (given the seed).

Rollback: the K/V of rejected drafts stays in slots past the request's length, where the next step's
tokens overwrite it (attention never reads past a row's position), and pages reserved for drafts that
were not kept are freed at once. Recurrent layers: each draft row continues the state of the row before
it and leaves its own in a scratch slot; the scratch slot of the last accepted draft row is copied into
the request's slot before its next step (kernels/chains.py, `Req.state_fix`). Penalties: the counts of
rejected drafts are taken back before the next step (`Req.penalty_uncount`).

How many drafts a step verifies (`SpeculativeConfig.adaptive`): verify rows are not free (on a CPU each costs
~30% of a one-row step; on an H100 a step of 128 rows costs 1.4x one of 32), so a decode-only
step weighs what each candidate decode bucket would yield against what a step of that shape was measured to
take (`StepTimes`, the scheduler's wall time per decode-only step), and takes the bucket with the most
expected tokens per second (`choose_draft_rows`). A draft row's expected yield is its request's acceptance
rate to the power of its place in the draft (`acceptance`), so the rows go first to the drafts most likely
to be kept. Speculation thus turns itself off where it does not pay (a full or large batch on a GPU, a
request whose drafts keep failing) and comes back when the measured costs say it does.

Drafters: `ngram` (prompt lookup): the longest suffix of the request's tokens (at most `max_match` and at
least `min_match` tokens) that occurred earlier in them, and the tokens that followed its latest earlier
occurrence. `standalone`: a draft model, greedily (scheduler/draft_model.py).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from memory import ReqToTokenPool
from runtime.batch_builder import SeqWork
from runtime.buckets import Buckets
from scheduler.request import Req

ALGORITHMS = ("ngram", "standalone")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    algorithm: str = "ngram"
    num_draft_tokens: int = 7  # drafts verified per request and step, at most (standalone: its draft steps)
    max_match: int = 3  # longest suffix looked up (tokens)
    # shortest suffix looked up: 1-token matches drafted junk on free chat (SmolLM2, bench.speculative: 11%
    # of drafts accepted, 0.94x the plain tokens/s; with 2: 28%, 1.00x, and the same 1.4x on grounded tasks)
    min_match: int = 2
    draft_model_path: str | None = None  # standalone: the draft model (scheduler/draft_model.py)
    # weigh each step's drafts against measured step times (module docstring); False: verify every draft
    # the decode bucket has room for
    adaptive: bool = True

    def __post_init__(self):
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"speculative_algorithm={self.algorithm!r} is not supported; known: "
                             f"{', '.join(ALGORITHMS)}")
        if (self.algorithm == "standalone") != (self.draft_model_path is not None):
            raise ValueError("speculative_draft_model_path is needed by, and only by, "
                             "speculative_algorithm 'standalone'")
        if self.num_draft_tokens < 1:
            raise ValueError(f"speculative_num_draft_tokens={self.num_draft_tokens} must be >= 1")
        if not 1 <= self.min_match <= self.max_match:
            raise ValueError("speculative_ngram_min_match_window_size / max_match_window_size must satisfy "
                             f"1 <= min ({self.min_match}) <= max ({self.max_match})")


def grammar_draft_masks(grammar, draft: np.ndarray, words: int) -> np.ndarray:
    """i32[j, words]: the tokens `grammar` (a scheduler.grammar.GrammarMatcher) allows after each of the
    draft's first j tokens, j the length of the prefix it accepts (a refused token could never be accepted:
    the row before it samples under the mask that refuses it). The matcher is left as it was."""
    masks = []
    for token in np.asarray(draft).tolist():
        if not grammar.accept_token(token):
            break
        masks.append(np.zeros(words, np.int32))
        grammar.fill_bitmask(masks[-1])
    grammar.rollback(len(masks))
    return np.asarray(masks, np.int32).reshape(len(masks), words)


def ngram_draft(ids: np.ndarray, k: int, min_match: int, max_match: int) -> np.ndarray:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix of `ids` (of
    `max_match` down to `min_match` tokens) that occurs earlier; empty if none does. One pass over the ids:
    the reference that `NgramIndex`, which serves, is tested against."""
    ids = np.asarray(ids)
    n_ids = len(ids)
    if n_ids <= min_match:
        return np.zeros(0, np.int32)
    # Candidate ends e (min_match - 1 .. n_ids - 2) of an earlier occurrence of the `min_match`-token suffix,
    # found by comparing shifted views; then extended backwards only at those few candidates. One pass over
    # the ids whatever `max_match` is (searching each length separately cost ~1 ms a request at 2k tokens
    # with max_match 6, every decode step).
    ends = np.arange(min_match - 1, n_ids - 1)
    hit = np.ones(len(ends), bool)
    for i in range(min_match):
        hit &= ids[min_match - 1 - i: n_ids - 1 - i] == ids[n_ids - 1 - i]
    ends = ends[hit]
    if not ends.size:
        return np.zeros(0, np.int32)
    lengths = np.full(len(ends), min_match)
    for i in range(min_match, min(max_match, n_ids - 1)):
        more = (lengths == i) & (ends >= i)
        more[more] = ids[ends[more] - i] == ids[n_ids - 1 - i]
        lengths += more
    best = lengths == lengths.max()
    start = int(ends[best][-1]) + 1  # the latest occurrence of the longest suffix
    return ids[start : start + k].astype(np.int32)


# Requests longer than this draft with the one-pass `ngram_draft` (~140 us at 8k tokens) instead of keeping
# an `NgramIndex` (~250 bytes of host memory a token: 2 MB at 8k tokens, 33 MB at 128k).
NGRAM_INDEX_MAX_TOKENS = 8192


class NgramIndex:
    """`ngram_draft` kept up to date as a request's tokens grow: the latest end position of each of its
    n-grams of `min_match` to `max_match` tokens, so a draft is `max_match` dictionary lookups (~4 us a
    request and step) instead of a pass over the tokens (10 us at 300 tokens, 40 us at 2k, every step)."""

    def __init__(self, min_match: int, max_match: int):
        self.min_match, self.max_match = min_match, max_match
        self.ids: list[int] = []
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> end of its latest occurrence before the last

    def extend(self, tokens: list[int]) -> None:
        """Appends `tokens` and indexes the n-grams that now end before the last token."""
        old = len(self.ids)
        self.ids += tokens
        ids, n = self.ids, len(self.ids)
        for length in range(self.min_match, self.max_match + 1):
            # n-grams starting at s in [first, n - 1 - length]: ending at old - 1 (the last token before)
            # up to n - 2; dict.update keeps the latest end of a repeated one
            first = max(old - length, 0)
            count = n - length - first
            if count > 0:
                grams = zip(*(ids[first + i : first + i + count] for i in range(length)))
                self.ends.update(zip(grams, range(first + length - 1, first + length - 1 + count)))

    def draft(self, k: int) -> list[int]:
        """`ngram_draft(self.ids, k, ...)`."""
        ids, n = self.ids, len(self.ids)
        for length in range(min(self.max_match, n - 1), self.min_match - 1, -1):
            end = self.ends.get(tuple(ids[n - length:]))
            if end is not None:
                return ids[end + 1 : end + 1 + k]
        return []


class StepTimes:
    """Seconds a decode-only step takes, by step shape (decode rows, page width, whether it verifies drafts:
    a verify step costs more than a plain step of the same shape), as measured: an average leaning on recent
    steps, refreshed by every step of that shape. An estimate not refreshed for `stale_after` decode steps
    counts as unmeasured again, so a shape once measured slow (a noisy step, a shorter context) is tried
    again now and then. A shape's first step is not counted: a program's first run carries one-time costs
    (on an H100, 12-17 ms against the 4 ms of its later runs)."""

    def __init__(self, weight: float = 0.25, stale_after: int = 512):
        self.weight, self.stale_after = weight, stale_after
        self.steps = 0  # decode-only steps recorded
        self.table: dict[tuple[int, int, bool], tuple[float, int]] = {}  # shape -> (seconds, last step)
        self.seen: set[tuple[int, int, bool]] = set()  # shapes whose first step was run

    def record(self, shape: tuple[int, int, bool], seconds: float) -> None:
        self.steps += 1
        if shape not in self.seen:
            self.seen.add(shape)
            return
        old = self.estimate(shape)
        self.table[shape] = (seconds if old is None else old + self.weight * (seconds - old), self.steps)

    def estimate(self, shape: tuple[int, int, bool]) -> float | None:
        entry = self.table.get(shape)
        return None if entry is None or self.steps - entry[1] > self.stale_after else entry[0]

    def info(self) -> dict[str, float]:
        """Fresh estimates in ms, keyed "<decode rows>x<page width>[ verify]"."""
        return {f"{rows}x{width}{' verify' if verify else ''}": round(1e3 * t, 3)
                for (rows, width, verify), (t, _) in sorted(self.table.items())
                if self.estimate((rows, width, verify)) is not None}


def choose_draft_rows(base: int, gains: Sequence[float], sizes: Sequence[int], room: int,
                      cost: Callable[[int, bool], float | None]) -> int:
    """Draft rows for a decode-only step of `base` rows: no drafts, or those filling a decode bucket (one of
    `sizes`), whichever gives the most expected tokens per second. `gains` are the expected tokens each draft
    row would add, best first; `room` caps the draft rows; `cost(b, verify)` is the measured seconds of a
    step of b rows, verifying drafts or not (None: not measured). An unmeasured verify step is scored with
    the cost of the plain step of its shape, an unmeasured bucket with the cost of the largest measured one
    below it (a step of more rows costs at least as much), or taken at once if none below is measured: a
    step of that shape then measures it. Ties go to the fewer rows."""
    first = next(b for b in sizes if b >= base)
    most = base + min(len(gains), room)
    candidates = [(first, 0)] + [(b, min(b - base, len(gains), room)) for b in sizes if b >= first]
    best, best_score, below = 0, -1.0, None
    for b, extra in candidates:
        seconds = cost(b, extra > 0)
        if seconds is None and extra:
            seconds = cost(b, False)
        if seconds is None:
            if below is None:
                return extra  # nothing measured at or below b: measure b
            seconds = below
        else:
            below = max(below or 0.0, seconds)
        score = (base + sum(gains[:extra])) / seconds
        if score > best_score:
            best, best_score = extra, score
        if b >= most:
            break
    return best


class Speculator:
    """The host side of speculative decoding for one scheduler: drafts for a step's decode works, and the
    acceptance counts (the verification itself is scheduler/outputs.py `append_tokens`). `drafter(req, k)`
    proposes up to k tokens (ngram by default; tests put in their own)."""

    def __init__(self, cfg: SpeculativeConfig, buckets: Buckets, page_size: int, mask_words: int,
                 max_context_len: int, stop_mask: Callable[[Req], np.ndarray],
                 max_draft_rows: int | None = None, penalties: bool = True):
        self.cfg, self.buckets, self.page_size, self.mask_words = cfg, buckets, page_size, mask_words
        # draft rows per rank and step, at most (a recurrent model's scratch state slots); None: no limit
        self.max_draft_rows = max_draft_rows
        # requests with penalties may draft (the runner takes back the counts of later and rejected drafts)
        self.penalties = penalties
        self.max_context_len, self.stop_mask = max_context_len, stop_mask
        self.drafter: Callable[[Req, int], np.ndarray] = self.ngram
        self.model_drafter = None  # standalone: a scheduler.draft_model.ModelDrafter (drafts all at once)
        self.verify_steps = self.draft_tokens = self.accepted_tokens = self.rejections = 0
        self.step_times = StepTimes()  # adaptive: the scheduler records each decode-only step's wall time
        self.declined_steps = 0  # decode-only steps with drafts at hand where the costs said verify none

    def ngram(self, req: Req, k: int) -> np.ndarray:
        index = req.ngram_index
        length = len(req.prompt_ids) + len(req.output_ids)
        if length > NGRAM_INDEX_MAX_TOKENS:
            req.ngram_index = None
            return ngram_draft(np.asarray(req.all_ids, np.int32), k, self.cfg.min_match, self.cfg.max_match)
        if index is None or len(index.ids) > length:  # (tokens only grow; rebuilt were they ever replaced)
            index = req.ngram_index = NgramIndex(self.cfg.min_match, self.cfg.max_match)
        index.extend(req.tokens(len(index.ids), length))
        return np.asarray(index.draft(k), np.int32)

    def add_drafts(self, works: list[SeqWork], reqs: list[Req], table: ReqToTokenPool) -> bool:
        """Gives a rank's decode works (`works`, `reqs` its step plan) a draft to verify where the request may
        speculate. Drafts never add padding: a decode-only step's rows end on a decode bucket size (the one
        the step needs without drafts, or the largest one the drafts fill), a mixed step's within its decode
        section; and they take only free pages (never evict cached ones or preempt anything), so a full
        batch or pool turns them off. Where drafts are not weighed (`--speculative-fixed-drafts`, or a draft
        model, each of whose tokens costs a step of its own), a request whose draft was wholly rejected skips
        drafting for 1, 3, 7, then 15 steps; weighed ngram drafts need no such back-off, a request's
        rejections lowering its acceptance rate and so its rows (docs/benchmarks.md, session 41). With a
        draft model, each request's share of the rows and its pages are settled first and the model then
        drafts that many tokens (scheduler/draft_model.py).
        Returns whether drafts were at hand and the measured step times said to verify none
        (`declined_steps`), or the rank's step has no room for any or no decode work: then it verifies
        nothing for a while, and where every rank's does, the overlap schedule may leave the step in flight
        (`_may_overlap`). (A step where no request had a draft stays synchronous: leaving it in flight too,
        with 1 or 3 steps chained after it without looking drafts up, measured no better on a CPU.)"""
        sizes = self.buckets.decode_sizes
        base = sum(w.num_rows for w in works if w.is_decode)
        # Rows the drafts may take at most: no draft is looked up (host work, every step) for a full step, or
        # once the requests before could fill them.
        room = self.buckets.max_decode - base
        if self.max_draft_rows is not None:
            room = min(room, self.max_draft_rows)
        # No room (until a request finishes, which ends a chain of overlapped steps), or no decode work
        # (nothing to draft for, as on an idle data-parallel rank): nothing to look up
        if room <= 0 or base == 0:
            return True
        wanted = []  # (work, request, tokens it may draft; its ngram draft, or None for the draft model)
        asked = 0  # draft rows in `wanted`
        for w, req in zip(works, reqs):
            p = req.params
            if not w.is_decode or (p.uses_penalties and not self.penalties):
                continue
            if req.spec_skip > 0 and (not self.cfg.adaptive or self.model_drafter is not None):
                req.spec_skip -= 1
                continue
            if asked >= room:
                continue
            k = min(self.cfg.num_draft_tokens, p.max_new_tokens - len(req.output_ids) - 1,
                    self.max_context_len - req.seq_len)
            if k <= 0:
                continue
            if self.model_drafter is not None:
                wanted.append((w, req, k, None))
                asked += k
                continue
            draft = np.asarray(self.drafter(req, k)[:k], np.int32)
            if len(draft):
                wanted.append((w, req, len(draft), draft))
                asked += len(draft)
        if not wanted:
            return False
        # The expected tokens each draft row adds (a draft's j-th token adds acceptance ** j), best first;
        # a step's draft rows go to the best of them (a prefix of each request's draft).
        rates = [self.acceptance(req) for _, req, _, _ in wanted]
        gains = sorted(((rates[i] ** j, i) for i, (_, _, n, _) in enumerate(wanted) for j in range(1, n + 1)),
                       reverse=True)
        budget = room
        if all(w.is_decode for w in works):
            if self.cfg.adaptive:
                longest = max(req.seq_len for w, req in zip(works, reqs) if w.is_decode)
                pages = -(-(longest + 1) // self.page_size)
                width = self.buckets.pick(0, base, min(pages, self.buckets.max_pages)).pages
                budget = choose_draft_rows(base, [g for g, _ in gains], sizes, room,
                                           lambda b, verify: self.step_times.estimate((b, width, verify)))
                if budget == 0:
                    self.declined_steps += 1
                    return True
            else:  # the largest bucket the drafts fill, or the padding of the one the step needs
                target = base + min(asked, room)
                fits = [b for b in sizes if base <= b <= target]
                budget = min(budget, max(fits or [next(b for b in sizes if b >= base)]) - base)
        rows = collections.Counter(i for _, i in gains[:budget])
        granted = []  # (work, request, rows, draft)
        for i, (w, req, _, draft) in enumerate(wanted):
            n = rows[i]
            if not n or not table.pages.can_allocate(table.pages_needed(req.row, req.seq_len + n)):
                continue
            table.reserve(req.row, req.seq_len + n)
            granted.append((w, req, n, draft))
        if self.model_drafter is not None and granted:
            drafts = self.model_drafter.propose([(req, n) for _, req, n, _ in granted])
            granted = [(w, req, n, d) for (w, req, n, _), d in zip(granted, drafts)]
        for w, req, n, draft in granted:
            draft = draft[:n]
            masks = self.draft_masks(req, draft) if len(draft) else None
            if masks is not None:
                draft = draft[: len(masks)]  # a draft token the grammar refuses could never be accepted
            if len(draft):  # (pages reserved past a shorter draft go back after the step)
                w.draft = draft
                w.draft_masks = None if masks is None else masks[: len(draft)]
            else:
                table.truncate(req.row, req.seq_len)
        return False

    def acceptance(self, req: Req) -> float:
        """The chance that `req`'s next draft token is kept, given the ones before it were: its accepted draft
        tokens against its rejections (a verify step stops at its first rejected token), with two
        pseudo-counts at the rate over every request so far."""
        overall = (self.accepted_tokens + 1) / (self.accepted_tokens + self.rejections + 2)
        kept, lost = req.spec_accepted_tokens, req.spec_rejections
        return (kept + 2 * overall) / (kept + lost + 2)

    def draft_masks(self, req: Req, draft: np.ndarray) -> np.ndarray | None:
        """The allowed-token mask of each draft row (the token after draft token i): the grammar's state after
        the draft up to i (`grammar_draft_masks`), or the stop suppression of that output position while
        min_new_tokens holds; None when no row needs one."""
        if req.grammar is not None:
            return grammar_draft_masks(req.grammar, draft, self.mask_words)
        p = req.params
        if len(req.output_ids) < p.min_new_tokens:  # row 0 holds the stop tokens back: each draft row says
            held, everything = self.stop_mask(req), np.full(self.mask_words, -1, np.int32)
            return np.stack([held if len(req.output_ids) + i < p.min_new_tokens else everything
                             for i in range(1, len(draft) + 1)])
        return None

    @staticmethod
    def counts_of(req: Req) -> tuple[int, int, int, int]:
        return req.spec_verify_steps, req.spec_draft_tokens, req.spec_accepted_tokens, req.spec_rejections

    def count(self, req: Req, before: tuple[int, int, int, int]) -> int:
        """Adds what verifying `req`'s draft changed in its counts (`counts_of` before) to the totals; returns
        the draft tokens it accepted."""
        steps, drafts, accepted, rejections = (a - b for a, b in zip(self.counts_of(req), before))
        self.verify_steps += steps
        self.draft_tokens += drafts
        self.accepted_tokens += accepted
        self.rejections += rejections
        return accepted

    def info(self) -> dict:
        steps, drafts = self.verify_steps, self.draft_tokens
        return {
            "enabled": True, **dataclasses.asdict(self.cfg),
            "verify_steps": steps, "draft_tokens": drafts, "accepted_tokens": self.accepted_tokens,
            # tokens a verifying request gains per step: the accepted drafts and the one sampled after them
            "mean_accept_length": (1 + self.accepted_tokens / steps) if steps else None,
            "acceptance_rate": self.accepted_tokens / drafts if drafts else None,
            **({"draft_model_steps": self.model_drafter.steps} if self.model_drafter is not None else {}),
            # adaptive: decode-only steps that had drafts and verified none, and the step times weighed
            "declined_steps": self.declined_steps, "step_ms": self.step_times.info(),
        }
