"""Scheduling must not change a recurrent model's results: cached decode == recompute, chunked == one-shot,
batched == alone, few state slots == many. Slots and pages are all free after every scenario."""

from __future__ import annotations

import pytest

from serve import Engine
from tests.helpers import (
    INVARIANCE_PROMPT_LENS,
    RECOMPUTE_ATOL,
    alone_and_batched,
    assert_decode_equals_recompute,
    assert_idle_and_consistent,
    decode_and_recompute,
    greedy,
    outputs_of,
    random_prompts,
)
from tests.tiny_models import save_tiny_mamba2

# Every scenario starts an engine on tiny Mamba-2, Nemotron-H, MiniMax and Qwen3-Next models (1-10 s each).
pytestmark = pytest.mark.slow

GREEDY = greedy(24)
BASE = dict(in_process=True, dtype="float32", max_running_requests=8, chunked_prefill_size=64,
            prefill_block_size=16, context_length=512, skip_tokenizer_init=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_mamba2(str(tmp_path_factory.mktemp("tiny_mamba2")))


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(2, 512, INVARIANCE_PROMPT_LENS)


def run(model_dir, prompts, **overrides):
    """Greedy outputs of all prompts batched on an engine with `overrides`, and (max running, state slots)."""
    with Engine(model=model_dir, **{**BASE, **overrides}) as engine:
        outs = outputs_of(engine, prompts, GREEDY)
        assert_idle_and_consistent(engine)
        return outs, (engine.scheduler.cfg.max_running_requests, engine.runner.pools.recurrent.num_slots)


@pytest.fixture(scope="module")
def reference(model_dir, prompts):
    """Each prompt alone, and all eight batched, on the base engine; plus a decode-vs-recompute probe."""
    with Engine(model=model_dir, **BASE) as engine:
        alone, batched = alone_and_batched(engine, prompts, GREEDY)
        assert_idle_and_consistent(engine)
        decoded, recomputed = decode_and_recompute(engine, prompts[4], GREEDY)
        assert_idle_and_consistent(engine)
    return {"alone": alone, "batched": batched, "decoded": decoded, "recomputed": recomputed}


def test_batch_of_eight_equals_each_alone(reference):
    assert reference["batched"] == reference["alone"]


def test_cached_decode_equals_full_recompute(reference):
    assert_decode_equals_recompute(reference["decoded"], reference["recomputed"], RECOMPUTE_ATOL)


# The reference engine prefills in chunks of 64 tokens (blocks of 16); these redo it in chunks of 7 (every
# block a sequence boundary or a state hand-over) and of 1000 (whole prompts, several per step).
def test_prefill_in_chunks_of_seven_equals_chunks_of_64(model_dir, prompts, reference):
    outs, _ = run(model_dir, prompts, prefill_block_size=7, chunked_prefill_size=7)
    assert outs == reference["alone"]


def test_prefill_in_chunks_of_1000_with_two_state_slots(model_dir, prompts, reference):
    # Two slots also cap concurrency at two: the eight requests queue and reuse each other's slots.
    outs, (max_running, num_slots) = run(model_dir, prompts, prefill_block_size=8, chunked_prefill_size=1000,
                                         max_recurrent_slots=2)
    assert (max_running, num_slots) == (2, 3)  # two slots + the dummy
    assert outs == reference["alone"]


# ---- a hybrid (Mamba-2 + attention): KV pages run out, requests are retracted and recomputed ------------

@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    from tests.models.test_hybrid_parity import CASES, save_checkpoint

    path = str(tmp_path_factory.mktemp("tiny_nemotron_h"))
    save_checkpoint(path, CASES["nemotron_h"])
    return path


def test_hybrid_retraction_under_a_small_kv_pool_gives_the_same_outputs(hybrid_dir, prompts):
    prompts = [[t % 300 for t in p] for p in prompts]  # the hybrid case's vocabulary
    base = dict(BASE, context_length=256, page_size=16)
    roomy, _ = run(hybrid_dir, prompts, **base, max_total_tokens=4096)
    # 8 requests need ~30 pages at the end
    with Engine(model=hybrid_dir, **base, max_total_tokens=14 * 16) as engine:
        outs = outputs_of(engine, prompts, GREEDY)
        assert engine.scheduler.num_retractions > 0, "the pool was not small enough to force retraction"
        assert_idle_and_consistent(engine)
    assert len(set(map(tuple, roomy))) > 4
    assert outs == roomy


def test_multi_step_decode_equals_single_step(model_dir, prompts, reference):
    outs, _ = run(model_dir, prompts, num_continuous_decode_steps=4)
    assert outs == reference["alone"]


# ---- MiniMax (Lightning linear attention + full attention + experts), Qwen3-Next (Gated DeltaNet + gated
# attention + experts) and Kimi-Linear (KDA + MLA + experts): the same invariances ----------------------

def _save_minimax(path):
    from tests.models.test_minimax_parity import save_checkpoint

    save_checkpoint(path)


def _save_qwen3_next(path):
    from tests.models.test_qwen3_next_parity import save_checkpoint

    save_checkpoint(path)


def _save_kimi_linear(path):
    from tests.models.test_kimi_linear_parity import save_checkpoint

    save_checkpoint(path)


@pytest.fixture(scope="module", params=["minimax", "qwen3_next", "kimi_linear"])
def minimax(request, tmp_path_factory, prompts):
    """The base engine's outputs for the eight prompts alone, batched, and a decode-vs-recompute probe."""
    path = str(tmp_path_factory.mktemp(f"tiny_{request.param}"))
    {"minimax": _save_minimax, "qwen3_next": _save_qwen3_next,
     "kimi_linear": _save_kimi_linear}[request.param](path)
    prompts = [[t % 300 for t in p] for p in prompts]  # its vocabulary
    base = dict(BASE, context_length=256, page_size=16, max_total_tokens=4096)
    with Engine(model=path, **base) as engine:
        alone, batched = alone_and_batched(engine, prompts, GREEDY)
        decoded, recomputed = decode_and_recompute(engine, prompts[4], GREEDY)
        assert_idle_and_consistent(engine)
    return {"path": path, "prompts": prompts, "base": base, "alone": alone, "batched": batched,
            "decoded": decoded, "recomputed": recomputed}


def test_minimax_batch_equals_alone_and_decode_equals_recompute(minimax):
    assert minimax["batched"] == minimax["alone"]
    assert_decode_equals_recompute(minimax["decoded"], minimax["recomputed"], RECOMPUTE_ATOL)


@pytest.mark.parametrize("overrides", [
    # the linear-attention state handed over every block; decode steps fused 4 at a time, the states carried
    # from step to step inside one program
    {"prefill_block_size": 7, "chunked_prefill_size": 7, "num_continuous_decode_steps": 4},
    {"max_total_tokens": 14 * 16},  # 8 requests need ~30 pages at the end: retraction and recompute
], ids=["chunks_of_7_multi_step", "small_kv_pool"])
def test_minimax_scheduling_does_not_change_outputs(minimax, overrides):
    with Engine(model=minimax["path"], **{**minimax["base"], **overrides}) as engine:
        outs = outputs_of(engine, minimax["prompts"], GREEDY)
        if "max_total_tokens" in overrides:
            assert engine.scheduler.num_retractions > 0, "the pool was not small enough to force retraction"
        assert_idle_and_consistent(engine)
    assert outs == minimax["alone"]
