"""Scheduling must not change the results of MLA models (latent KV pool): DeepSeek-V3 (MLA + grouped experts)
and Ling 2.5 (MLA + Lightning linear attention + experts). Batched == alone, cached decode (absorbed MLA) ==
full recompute (expanded MLA), and prefill in chunks of 7 under a KV pool small enough to force retraction
== the base run; pages and request rows all free after each scenario."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from serve import Engine
from tests.models.test_bailing_golden import GOLDEN
from tests.runtime.test_recurrent_engine import assert_idle_and_consistent

GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
BASE = dict(in_process=True, dtype="float32", max_running_requests=8, chunked_prefill_size=64,
            prefill_block_size=16, context_length=256, page_size=16, max_total_tokens=4096,
            skip_tokenizer_init=True)
# 7-token blocks and chunks: every block a sequence boundary or a state / latent-page hand-over; 10 pages of
# 16 hold the longest request (144 tokens) but not the two longest together: the youngest are retracted and
# recompute later.
CONSTRAINED = dict(prefill_block_size=7, chunked_prefill_size=7, max_total_tokens=10 * 16)


def _deepseek(tmp_path_factory) -> tuple[str, int]:
    from tests.models.test_deepseek_parity import CASES, VOCAB, _save_checkpoint

    path = str(tmp_path_factory.mktemp("tiny_deepseek_v3"))
    _save_checkpoint(path, CASES["lora_yarn_grouped"])
    return path, VOCAB


@pytest.fixture(scope="module", params=["deepseek_v3", "bailing_moe_v2_5"])
def mla(request, tmp_path_factory) -> dict[str, Any]:
    path, vocab = _deepseek(tmp_path_factory) if request.param == "deepseek_v3" else (GOLDEN, 512)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, vocab, size=n).tolist() for n in (5, 17, 33, 64, 90, 3, 48, 120)]
    engine = Engine(model=path, **BASE)
    try:
        alone = [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts]
        batched = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=GREEDY)]
        decoded = engine.generate(input_ids=prompts[4], sampling_params=GREEDY, return_logprob=True)
        recomputed = engine.generate(input_ids=prompts[4] + decoded["output_ids"][:-1],
                                     sampling_params={**GREEDY, "max_new_tokens": 1}, return_logprob=True,
                                     logprob_start_len=len(prompts[4]) - 1)
        assert_idle_and_consistent(engine)
        assert engine.runner.pools.kv.v is None  # a latent pool
    finally:
        engine.shutdown()
    assert len(set(map(tuple, alone))) > 4, "random model is degenerate: outputs do not depend on the prompt"
    return {"path": path, "prompts": prompts, "alone": alone, "batched": batched, "decoded": decoded,
            "recomputed": recomputed}


def test_batch_of_eight_equals_each_alone(mla):
    assert mla["batched"] == mla["alone"]


def test_absorbed_decode_equals_expanded_recompute(mla):
    decoded = mla["decoded"]["meta_info"]["output_token_logprobs"]
    recomputed = mla["recomputed"]["meta_info"]["input_token_logprobs"][1:]
    assert [t for _, t in recomputed] == [t for _, t in decoded[:-1]]
    np.testing.assert_allclose([lp for lp, _ in recomputed], [lp for lp, _ in decoded[:-1]], atol=1e-4,
                               rtol=0)


def test_chunks_of_seven_with_retraction_equal_the_base_run(mla):
    engine = Engine(model=mla["path"], **{**BASE, **CONSTRAINED})
    try:
        outs = [o["output_ids"] for o in engine.generate(input_ids=mla["prompts"], sampling_params=GREEDY)]
        assert engine.scheduler.num_retractions > 0, "the pool was not small enough to force retraction"
        assert_idle_and_consistent(engine)
    finally:
        engine.shutdown()
    assert outs == mla["alone"]
