"""Scheduling must not change the results of MLA models (latent KV pool): DeepSeek-V3 (MLA + grouped experts)
and Ling 2.5 (MLA + Lightning linear attention + experts). Batched == alone, cached decode (absorbed MLA) ==
full recompute (expanded MLA), and prefill in chunks of 7 under a KV pool small enough to force retraction
== the base run; pages and request rows all free after each scenario."""

from __future__ import annotations

from typing import Any

import pytest

from serve import Engine
from tests.helpers import (
    INVARIANCE_PROMPT_LENS,
    LOGPROB_ATOL,
    alone_and_batched,
    assert_decode_equals_recompute,
    assert_idle_and_consistent,
    decode_and_recompute,
    greedy,
    outputs_of,
    random_prompts,
)
from tests.models.test_bailing_golden import GOLDEN

# Every scenario starts an engine on tiny DeepSeek-V3 and Ling 2.5 models (1-10 s each).
pytestmark = pytest.mark.slow

GREEDY = greedy(24)
BASE = dict(in_process=True, dtype="float32", max_running_requests=8, chunked_prefill_size=64,
            prefill_block_size=16, context_length=256, page_size=16, max_total_tokens=4096,
            skip_tokenizer_init=True)
# 7-token blocks and chunks: every block a sequence boundary or a state / latent-page hand-over; 10 pages of
# 16 hold the longest request (144 tokens) but not the two longest together: the youngest are retracted and
# recompute later.
CONSTRAINED = dict(prefill_block_size=7, chunked_prefill_size=7, max_total_tokens=10 * 16)


def _deepseek(tmp_path_factory) -> tuple[str, int]:
    from tests.models.test_deepseek_parity import CASES, VOCAB, save_checkpoint

    path = str(tmp_path_factory.mktemp("tiny_deepseek_v3"))
    save_checkpoint(path, CASES["lora_yarn_grouped"])
    return path, VOCAB


@pytest.fixture(scope="module", params=["deepseek_v3", "bailing_moe_v2_5"])
def mla(request, tmp_path_factory) -> dict[str, Any]:
    path, vocab = _deepseek(tmp_path_factory) if request.param == "deepseek_v3" else (GOLDEN, 512)
    prompts = random_prompts(2, vocab, INVARIANCE_PROMPT_LENS)
    with Engine(model=path, **BASE) as engine:
        alone, batched = alone_and_batched(engine, prompts, GREEDY)
        decoded, recomputed = decode_and_recompute(engine, prompts[4], GREEDY)
        assert_idle_and_consistent(engine)
        assert engine.runner.pools.kv.v is None  # a latent pool
    return {"path": path, "prompts": prompts, "alone": alone, "batched": batched, "decoded": decoded,
            "recomputed": recomputed}


def test_batch_of_eight_equals_each_alone(mla):
    assert mla["batched"] == mla["alone"]


def test_absorbed_decode_equals_expanded_recompute(mla):
    # Not RECOMPUTE_ATOL: absorbed and expanded MLA are different contractions of the same weights.
    assert_decode_equals_recompute(mla["decoded"], mla["recomputed"], LOGPROB_ATOL)


def test_chunks_of_seven_with_retraction_equal_the_base_run(mla):
    with Engine(model=mla["path"], **{**BASE, **CONSTRAINED}) as engine:
        outs = outputs_of(engine, mla["prompts"], GREEDY)
        assert engine.scheduler.num_retractions > 0, "the pool was not small enough to force retraction"
        assert_idle_and_consistent(engine)
    assert outs == mla["alone"]
