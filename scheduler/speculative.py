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
were not kept are freed at once.

Drafter (`--speculative-algorithm ngram`, prompt lookup): the longest suffix of the request's tokens (at
most `max_match` and at least `min_match` tokens) that occurred earlier in them, and the tokens that
followed its latest earlier occurrence.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

ALGORITHMS = ("ngram",)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    algorithm: str = "ngram"
    num_draft_tokens: int = 4  # drafts verified per request and step, at most
    max_match: int = 3  # longest suffix looked up (tokens)
    # shortest suffix looked up: 1-token matches drafted junk on free chat (SmolLM2, bench.speculative: 11%
    # of drafts accepted, 0.94x the plain tokens/s; with 2: 28%, 1.00x, and the same 1.4x on grounded tasks)
    min_match: int = 2

    def __post_init__(self):
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"speculative_algorithm={self.algorithm!r} is not supported; known: "
                             f"{', '.join(ALGORITHMS)}")
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
    `max_match` down to `min_match` tokens) that occurs earlier; empty if none does."""
    ids = np.asarray(ids)
    n_ids = len(ids)
    for n in range(min(max_match, n_ids - 1), min_match - 1, -1):
        # Windows starting at 0 .. n_ids - n - 1: every occurrence but the suffix itself.
        windows = sliding_window_view(ids[:-1], n)
        hits = np.flatnonzero((windows == ids[n_ids - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return ids[start : start + k].astype(np.int32)
    return np.zeros(0, np.int32)
