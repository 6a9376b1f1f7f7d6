"""`--schedule-policy`: the order waiting requests are admitted in. One request running at a time, so the
order they finish in is the order they were admitted in: arrival order under fcfs; under lpm the requests
whose prefix the radix tree holds first (most cached first, ties in arrival order), with the same outputs."""

from __future__ import annotations

import numpy as np
import pytest

from serve import Engine
from serve.server_args import ServerArgs
from tests.helpers import assert_idle_and_consistent
from tests.tiny_models import save_tiny_llama

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
BASE = dict(in_process=True, dtype="float32", max_running_requests=1, chunked_prefill_size=32, page_size=16,
            context_length=256, max_total_tokens=4096, skip_tokenizer_init=True)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")))


def _run(path: str, policy: str, cache: bool = True, **flags) -> tuple[list[int], list[list[int]], list[int]]:
    """A 70-token stem cached first (one request), then six requests submitted together: two uncached, two
    extending the stem, one sharing 40 tokens of it, one uncached. Returns the order they finished in (by
    their latency: one runs at a time), their tokens and their cached-token counts."""
    rng = np.random.default_rng(11)
    stem = rng.integers(3, 500, size=70).tolist()
    prompts = [rng.integers(3, 500, size=50).tolist(), stem + rng.integers(3, 500, size=9).tolist(),
               rng.integers(3, 500, size=50).tolist(), stem[:40] + rng.integers(3, 500, size=30).tolist(),
               stem + rng.integers(3, 500, size=20).tolist(), rng.integers(3, 500, size=40).tolist()]
    engine = Engine(model=path, schedule_policy=policy, disable_radix_cache=not cache, **{**BASE, **flags})
    try:
        engine.generate(input_ids=stem + [7], sampling_params=GREEDY)
        out = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert_idle_and_consistent(engine)
    finally:
        engine.shutdown()
    order = np.argsort([o["meta_info"]["e2e_latency"] for o in out], kind="stable").tolist()
    return order, [o["output_ids"] for o in out], [o["meta_info"]["cached_tokens"] for o in out]


@pytest.mark.parametrize("balance", ["round_robin", "cache_aware"])
def test_lpm_admits_the_longest_cached_prefix_first(tiny_llama, balance):
    """(cache_aware load balancing reads the queue head to pick a rank, with lpm too.)"""
    fcfs_order, fcfs_ids, fcfs_cached = _run(tiny_llama, "fcfs", load_balance_method=balance)
    lpm_order, lpm_ids, lpm_cached = _run(tiny_llama, "lpm", load_balance_method=balance)
    assert fcfs_order == [0, 1, 2, 3, 4, 5]
    # the stem's 64 whole-page tokens (requests 1 and 4), then 32 of its first 40 (3), then the rest
    assert lpm_order == [1, 4, 3, 0, 2, 5], lpm_order
    assert [lpm_cached[i] for i in lpm_order] == [64, 64, 32, 0, 0, 0]
    assert lpm_cached == fcfs_cached and lpm_ids == fcfs_ids


def test_lpm_without_the_cache_is_arrival_order(tiny_llama):
    order, ids, cached = _run(tiny_llama, "lpm", cache=False)
    assert order == [0, 1, 2, 3, 4, 5] and cached == [0] * 6
    assert ids == _run(tiny_llama, "fcfs")[1]


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="schedule_policy='sjf' must be fcfs or lpm"):
        ServerArgs(schedule_policy="sjf")
