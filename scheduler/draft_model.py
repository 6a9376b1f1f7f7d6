"""The standalone drafter of speculative decoding (`--speculative-algorithm standalone`): a second, smaller
model with the same tokenizer proposes each request's draft, greedily, one token per draft step.

It runs on its own `ModelRunner` (its own compiled steps and pools) but shares the target's page tables: a
request's token at position p has its draft K/V in the draft pool at the slot where the target keeps its own
K/V, in the same pages. So the draft model needs no allocator of its own, and the pages the scheduler
reserves for a request's draft rows (which extend past the positions the draft model writes) cover it.

Per request it keeps `Req.draft_computed`: the leading positions whose draft K/V is right. Before drafting
it catches up on the tokens after that (the whole prompt the first time; afterwards the last accepted draft
token and the token sampled after it): as decode rows of one request when only a few (a catch-up of m tokens
is m consecutive rows, as verify steps feed drafts), as a prefill chunk otherwise. The last catch-up token's
row samples the first draft token, and each further draft step feeds the previous draft token as one decode
row. A catch-up longer than the step's prefill budget goes on over several steps; the request has no draft
until it is done. After verification the draft K/V stays right up to the last accepted draft token
(`after_verify`); what lies past it is overwritten later and never attended to.

Greedy drafting makes the drafter deterministic, so verification is the same as for ngram drafts
(scheduler/speculative.py): exact, and distribution-preserving for sampled requests. Rejection sampling
against the draft model's own distribution would accept more sampled drafts, at the cost of moving the
acceptance onto the device; not done.

A draft model with recurrent layers is refused: its state would have to roll back to the accepted draft too.
"""

from __future__ import annotations

import jax
import numpy as np

from memory import ReqToTokenPool
from runtime.batch_builder import SeqWork, build_dp_step_batch
from runtime.runner import ModelRunner
from runtime.sampling_params import SamplingParams
from scheduler.request import Req

# A catch-up of at most this many tokens runs as consecutive decode rows (else as a prefill chunk).
MAX_ROW_CATCH_UP = 8
_GREEDY = SamplingParams(max_new_tokens=1, temperature=0.0)


class ModelDrafter:
    """Drafts for a step's requests with `runner` (the draft model's), over the target's request tables."""

    def __init__(self, runner: ModelRunner, tables: list[ReqToTokenPool], prefill_tokens: int,
                 target_vocab: int):
        if runner.pools.recurrent is not None:
            raise ValueError("a draft model with recurrent layers is not supported: its state would have to "
                             "roll back to the accepted draft as well")
        self.runner, self.tables, self.target_vocab = runner, tables, target_vocab
        buckets = runner.cfg.buckets
        self.max_rows = buckets.max_decode
        self.max_blocks = min(prefill_tokens // buckets.prefill_block_size, buckets.max_prefill_blocks)
        self.steps = 0  # draft model steps run

    def propose(self, items: list[tuple[Req, int]]) -> list[np.ndarray]:
        """Up to k draft tokens for each (request, k) (fewer or none while a request's catch-up goes on, or
        where a draft token is outside the target's vocabulary). The pages of positions < seq_len + k - 1 must
        be reserved."""
        drafts: list[list[int]] = [[] for _ in items]
        catch_up = []  # (item index, its catch-up work)
        rows, blocks = self.max_rows, self.max_blocks
        bs = self.runner.cfg.buckets.prefill_block_size
        for i, (req, _) in enumerate(items):
            start = min(req.draft_computed, req.seq_len - 1)
            n = req.seq_len - start
            ids = np.asarray(req.tokens(start, req.seq_len), np.int32)
            if n <= min(MAX_ROW_CATCH_UP, rows):
                work = SeqWork(req.row, ids[:1], start, True, _GREEDY, 0, draft=ids[1:] if n > 1 else None)
                rows -= n
            elif blocks > 0:
                n = min(n, blocks * bs)
                work = SeqWork(req.row, ids[:n], start, False, _GREEDY, 0)
                blocks -= -(-n // bs)
            else:
                continue
            req.draft_computed = start + n
            catch_up.append((i, work))
        # A catch-up that reaches the request's last token samples its first draft token.
        drafting = []
        tokens = self._run([w for _, w in catch_up], [items[i][0] for i, _ in catch_up])
        for (i, _), token in zip(catch_up, tokens):
            req = items[i][0]
            if req.draft_computed == req.seq_len:
                drafts[i].append(token)
                drafting.append(i)
        step = 1  # draft step j feeds draft token j (at position seq_len - 1 + j) and samples token j + 1
        vocab = self.target_vocab
        while drafting := [i for i in drafting if len(drafts[i]) < items[i][1] and drafts[i][-1] < vocab]:
            reqs = [items[i][0] for i in drafting]
            works = [SeqWork(req.row, np.asarray(drafts[i][-1:], np.int32), req.seq_len - 1 + step, True,
                             _GREEDY, 0) for req, i in zip(reqs, drafting)]
            for req, i, token in zip(reqs, drafting, self._run(works, reqs)):
                req.draft_computed += 1
                drafts[i].append(token)
            step += 1
        return [np.asarray(_in_vocab(d, self.target_vocab), np.int32) for d in drafts]

    def _run(self, works: list[SeqWork], reqs: list[Req]) -> list[int]:
        """One draft model step over `works`: the token each one's last row samples."""
        if not works:
            return []
        batch, layout = build_dp_step_batch(works, [r.dp_rank for r in reqs], self.runner.cfg,
                                            [t.table for t in self.tables], False)
        out = self.runner.step(batch, layout.shape)
        self.steps += 1
        next_ids = np.asarray(jax.device_get(out.next_ids))
        return [int(next_ids[row + (w.num_rows - 1 if w.is_decode else 0)])
                for w, row in zip(works, layout.seq_rows)]

    @staticmethod
    def after_verify(req: Req, first_position: int, accepted: int) -> None:
        """After a verify step that fed the request's last token at `first_position` and accepted `accepted`
        draft tokens: the draft K/V is right up to the last accepted draft token's position."""
        req.draft_computed = min(req.draft_computed, first_position + 1 + accepted)


def _in_vocab(draft: list[int], vocab: int) -> list[int]:
    """The draft up to its first token the target's vocabulary does not have."""
    for i, t in enumerate(draft):
        if t >= vocab:
            return draft[:i]
    return draft
