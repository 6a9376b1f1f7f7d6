"""Speculative decoding's host-side choices (scheduler/speculative.py), without an engine: the ngram drafter
(`ngram_draft`, and the `NgramIndex` that serves it, against the definition), and the cost model that weighs
draft rows against measured step times (`choose_draft_rows`, `StepTimes`). The engine with drafts verified:
test_speculative.py."""

from __future__ import annotations

import numpy as np

from scheduler.speculative import NgramIndex, SpeculativeConfig, StepTimes, choose_draft_rows, ngram_draft


def test_ngram_draft_takes_the_longest_suffix_and_its_latest_occurrence():
    ids = np.array([5, 6, 7, 1, 5, 6, 8, 2, 9, 5, 6])
    # suffix (5, 6): occurrences at 0 and 4; the latest (4) was followed by 8, 2, 9
    assert ngram_draft(ids, 3, 1, 3).tolist() == [8, 2, 9]
    assert ngram_draft(ids, 10, 1, 3).tolist() == [8, 2, 9, 5, 6]  # up to the end
    # a longer suffix wins over a more recent shorter one: (9, 5, 6) never occurred, (x, 5, 6) neither;
    ids2 = np.array([1, 2, 3, 4, 9, 3, 4, 7, 2, 3, 4])
    assert ngram_draft(ids2, 2, 1, 3).tolist() == [9, 3]  # (2, 3, 4) at 1, not (3, 4) at 5
    assert ngram_draft(ids2, 2, 1, 2).tolist() == [7, 2]  # at most 2: (3, 4)'s latest, at 5
    assert ngram_draft(np.array([1, 2, 3]), 4, 1, 3).size == 0  # nothing repeats
    assert ngram_draft(np.array([4]), 4, 1, 3).size == 0
    assert ngram_draft(np.array([4, 4]), 4, 2, 3).size == 0  # below the minimum match
    assert ngram_draft(np.array([4, 4]), 4, 1, 3).tolist() == [4]


def _ngram_by_definition(ids: list[int], k: int, min_match: int, max_match: int) -> list[int]:
    for n in range(max_match, min_match - 1, -1):  # the longest suffix first
        for j in range(len(ids) - n - 1, -1, -1):  # its latest earlier occurrence ids[j : j + n]
            if n < len(ids) and ids[j: j + n] == ids[len(ids) - n:]:
                return ids[j + n: j + n + k]
    return []


def test_ngram_draft_matches_its_definition_on_random_token_runs():
    rng = np.random.default_rng(0)
    for _ in range(3000):
        ids = rng.integers(0, int(rng.integers(1, 5)), int(rng.integers(0, 40))).tolist()
        min_match = int(rng.integers(1, 4))
        max_match, k = int(rng.integers(min_match, 8)), int(rng.integers(1, 6))
        assert ngram_draft(np.array(ids), k, min_match, max_match).tolist() == _ngram_by_definition(
            ids, k, min_match, max_match), (ids, k, min_match, max_match)


def test_ngram_index_grown_in_chunks_drafts_what_the_definition_does():
    """The serving drafter: tokens appended a few at a time (a prompt, then accepted tokens), a draft asked
    after each append."""
    rng = np.random.default_rng(1)
    for _ in range(400):
        min_match = int(rng.integers(1, 4))
        max_match = int(rng.integers(min_match, 6))
        index, ids, vocab = NgramIndex(min_match, max_match), [], int(rng.integers(1, 6))
        while len(ids) < 40:
            chunk = rng.integers(0, vocab, int(rng.integers(1, 9))).tolist()
            index.extend(chunk)
            ids += chunk
            k = int(rng.integers(1, 8))
            assert index.draft(k) == _ngram_by_definition(ids, k, min_match, max_match), (ids, k, min_match,
                                                                                          max_match)


def test_the_drafter_keeps_an_index_below_the_cap_and_passes_over_the_tokens_above(monkeypatch):
    """`Speculator.ngram`: a request's index grows with its outputs; past NGRAM_INDEX_MAX_TOKENS it is
    dropped (its host memory) and drafts come from one pass over the tokens, the same drafts."""
    import types

    from runtime.sampling_params import SamplingParams
    from scheduler import speculative
    from scheduler.request import Req

    monkeypatch.setattr(speculative, "NGRAM_INDEX_MAX_TOKENS", 40)
    drafter = types.SimpleNamespace(cfg=SpeculativeConfig())
    rng = np.random.default_rng(2)
    req = Req("r", rng.integers(0, 4, 20).tolist(), SamplingParams(), seed=0)
    while len(req.prompt_ids) + len(req.output_ids) < 60:
        ids = req.prompt_ids + req.output_ids
        drafted = speculative.Speculator.ngram(drafter, req, 5).tolist()
        assert drafted == _ngram_by_definition(ids, 5, 2, 3)
        assert (req.ngram_index is not None) == (len(ids) <= 40)
        req.output_ids += rng.integers(0, 4, int(rng.integers(1, 4))).tolist()


SIZES = (1, 2, 4, 8, 16, 32)


def _plain(costs: dict[int, float]):
    """A cost function of (rows, verify) from costs by rows: a verify step costs what a plain one does."""
    return lambda b, verify: costs.get(b)


def test_draft_rows_are_chosen_by_expected_tokens_per_second():
    gains = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]  # one request's 7 drafts, acceptance ~0.9 each down the line
    flat = {b: 1.0 for b in SIZES}  # a GPU at batch 1: any row count costs the same
    assert choose_draft_rows(1, gains, SIZES, 32, _plain(flat)) == 7  # all drafts (the 8-row bucket)
    assert choose_draft_rows(1, gains, SIZES, 3, _plain(flat)) == 3  # capped by the room (scratch slots)
    linear = {b: float(b) for b in SIZES}  # every row costs a plain step: a draft (< 1 token) never pays
    assert choose_draft_rows(1, gains, SIZES, 32, _plain(linear)) == 0
    fixed = {b: 1.0 + b for b in SIZES}  # a fixed part as large as a row's: (1 + 2.4) / 5 beats 1 / 2
    assert choose_draft_rows(1, gains, SIZES, 32, _plain(fixed)) == 3  # and 1.9 / 3 and 5.2 / 9
    assert choose_draft_rows(1, [0.2] * 7, SIZES, 32, _plain(fixed)) == 0
    # batch 32 where rows cost: the 32-row bucket (no drafts) beats 64 rows of half-likely drafts
    busy = {32: 5.0, 64: 11.0, 128: 20.0}
    sizes = (*SIZES, 64, 128)
    assert choose_draft_rows(32, [0.5] * 32 + [0.25] * 32, sizes, 96, _plain(busy)) == 0
    # padding rows are free: 3 requests in the 4-row bucket take the best draft whatever the costs
    assert choose_draft_rows(3, [0.9, 0.1], SIZES, 29, _plain({4: 1.0, 8: 100.0})) == 1
    # unmeasured buckets: the smallest is measured first, then a larger one is scored at the cost below it
    # (a lower bound), so it is tried once and then judged on its own measurement
    assert choose_draft_rows(1, gains, SIZES, 32, _plain({})) == 0
    assert choose_draft_rows(1, gains, SIZES, 32, _plain({1: 1.0})) == 7
    assert choose_draft_rows(1, gains, SIZES, 32, _plain({1: 1.0, 8: 4.0})) == 3  # 4 rows not yet measured
    assert choose_draft_rows(1, gains, SIZES, 32, _plain({1: 1.0, 4: 3.5, 8: 6.0})) == 1  # 2 rows: try them
    assert choose_draft_rows(1, gains, SIZES, 32, _plain({1: 1.0, 2: 2.5, 4: 3.5, 8: 6.0})) == 0
    # a verify step dearer than a plain one of its shape (host work, outputs): padding drafts are weighed too
    dear = {(4, False): 1.0, (4, True): 1.5, (8, True): 100.0}
    assert choose_draft_rows(3, [0.9, 0.1], SIZES, 29, lambda b, verify: dear.get((b, verify))) == 0
    dear[4, True] = 1.2  # (3 + 0.9) / 1.2 > 3 / 1
    assert choose_draft_rows(3, [0.9, 0.1], SIZES, 29, lambda b, verify: dear.get((b, verify))) == 1
    # verify steps not measured yet: scored at their shape's plain cost, or the one below (tried, then judged)
    assert choose_draft_rows(3, [0.9, 0.1], SIZES, 29, lambda b, verify: {4: 1.0}.get(b) if not verify
                             else None) == 2


def test_step_times_average_recent_steps_and_go_stale():
    times = StepTimes(weight=0.5, stale_after=3)
    plain, verify, small = (4, 8, False), (4, 8, True), (1, 8, False)
    assert times.estimate(plain) is None
    times.record(plain, 50.0)  # a shape's first run (one-time costs) is not counted
    assert times.estimate(plain) is None
    times.record(plain, 2.0)
    times.record(plain, 4.0)
    assert times.estimate(plain) == 3.0 and times.info() == {"4x8": 3000.0}
    assert times.estimate(verify) is None  # verify steps of the shape are timed apart
    for _ in range(3):
        times.record(small, 1.0)
    assert times.estimate(plain) == 3.0
    times.record(small, 1.0)  # 4 steps since `plain` was refreshed: measured again before it is trusted
    assert times.estimate(plain) is None and times.info() == {"1x8": 1000.0}
    times.record(plain, 10.0)
    assert times.estimate(plain) == 10.0  # a stale average is restarted, not blended
    times.record(verify, 9.0)
    times.record(verify, 7.0)
    assert times.info() == {"1x8": 1000.0, "4x8": 10000.0, "4x8 verify": 7000.0}
