"""Scheduling must not change results: batched == alone, chunked == one-shot, paged sizes, retraction,
multi-step decode. Greedy outputs and allocator integrity are checked after every scenario."""

from __future__ import annotations

import pytest

from serve import Engine
from tests.helpers import (
    INVARIANCE_PROMPT_LENS,
    alone_and_batched,
    assert_idle_and_consistent,
    greedy,
    outputs_of,
    random_prompts,
)
from tests.tiny_models import save_tiny_llama

# Every scenario starts an engine on a tiny Llama (1-10 s each).
pytestmark = pytest.mark.slow

GREEDY = greedy(24)
BASE = dict(in_process=True, dtype="float32", max_running_requests=8, chunked_prefill_size=64,
            context_length=256, max_total_tokens=4096, skip_tokenizer_init=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(1, 512, INVARIANCE_PROMPT_LENS)


@pytest.fixture(scope="module")
def reference(model_dir, prompts):
    """Each prompt alone on the base engine (the outputs every other scenario must reproduce), and batched."""
    with Engine(model=model_dir, **BASE) as engine:
        alone, batched = alone_and_batched(engine, prompts, GREEDY)
        assert_idle_and_consistent(engine)
    return alone, batched


def run(model_dir, prompts, **overrides):
    """Greedy outputs of all prompts batched on an engine with `overrides`, and its scheduler."""
    with Engine(model=model_dir, **{**BASE, **overrides}) as engine:
        outs = outputs_of(engine, prompts, GREEDY)
        assert_idle_and_consistent(engine)
        return outs, engine.scheduler


def test_batch_of_eight_equals_each_alone(reference):
    alone, batched = reference
    assert batched == alone


def test_small_chunks_equal_one_shot_prefill(model_dir, prompts, reference):
    outs, sched = run(model_dir, prompts, chunked_prefill_size=16)
    assert outs == reference[0]


def test_page_size_one_equals_page_size_sixteen(model_dir, prompts, reference):
    outs, _ = run(model_dir, prompts, page_size=1)
    assert outs == reference[0]


def test_retraction_under_a_small_pool_gives_the_same_outputs(model_dir, prompts, reference):
    # 8 requests need ~30 pages of 16 at the end; 14 pages force preemption and recomputation.
    outs, sched = run(model_dir, prompts, max_total_tokens=14 * 16)
    assert sched.num_retractions > 0, "the pool was not small enough to force retraction"
    assert outs == reference[0]


def test_multi_step_decode_equals_single_step(model_dir, prompts, reference):
    outs, sched = run(model_dir, prompts, num_continuous_decode_steps=4)
    assert outs == reference[0]


def test_running_every_program_on_padding_changes_nothing(model_dir, prompts, reference):
    """What precompile does on an accelerator (`run_each_once`), here between two passes over the prompts:
    the padding writes only the dummy page, row and slot, so the second pass's cached prefixes and outputs
    are what they were."""
    with Engine(model=model_dir, **{**BASE, "num_continuous_decode_steps": 4}) as engine:
        assert outputs_of(engine, prompts, GREEDY) == reference[0]
        runner = engine.scheduler.runner
        assert any(kind == "multi" for kind, _ in runner._compiled)
        runner.run_each_once()
        again = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [o["output_ids"] for o in again] == reference[0]
        assert sum(o["meta_info"]["cached_tokens"] for o in again) > 0
        assert_idle_and_consistent(engine)


def test_multi_step_trims_tokens_past_a_stop(model_dir, prompts, reference):
    # Stop on a token that greedy decoding emits mid-run: the multi-step run must end right there.
    target = reference[0][1][9]
    params = {**GREEDY, "stop_token_ids": [target]}
    engine = Engine(model=model_dir, **{**BASE, "num_continuous_decode_steps": 4})
    try:
        out = engine.generate(input_ids=prompts[1], sampling_params=params)
        assert out["output_ids"] == reference[0][1][: reference[0][1].index(target) + 1]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": target}
        assert_idle_and_consistent(engine)
    finally:
        engine.shutdown()


def test_too_long_request_is_rejected_with_the_reason(model_dir):
    engine = Engine(model=model_dir, **BASE)
    try:
        with pytest.raises(ValueError, match="exceeds the limit of 256 tokens"):
            engine.generate(input_ids=list(range(3, 250)), sampling_params={"max_new_tokens": 20})
        with pytest.raises(ValueError, match="unknown sampling params"):
            engine.generate(input_ids=[5, 6], sampling_params={"max_tokens": 20})
        assert_idle_and_consistent(engine)
    finally:
        engine.shutdown()
