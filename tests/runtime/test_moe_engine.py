"""Scheduling must not change a sparse mixture-of-experts model's results (issue 6): batched == alone, cached
decode == full recompute, prefill in chunks of 7 == chunks of 64, retraction under a small KV pool ==
unconstrained; pages and request rows are all free after every scenario.

Two attention-only MoE checkpoints: Qwen3-MoE with a dense layer between two sparse ones (the layers run
unstacked) and Qwen2-MoE with a sigmoid-gated shared expert (stacked, one `lax.scan`). Both route each
token to 2 of 8 experts, so a single decode token leaves most experts' groups empty and a batch of eight
spreads over them; a routing test guards that the tokens really disagree on their experts."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from models.moe import config_from_hf
from serve import Engine
from tests.helpers import (
    INVARIANCE_PROMPT_LENS,
    MIN_GREEDY_GAP,
    RECOMPUTE_ATOL,
    assert_decode_equals_recompute,
    assert_idle_and_consistent,
    greedy,
    outputs_of,
    random_prompts,
    recompute,
)
from tests.hf_reference import hf_router_scores
from tests.models.test_moe_parity import VOCAB, Case, save_checkpoint
from tests.tiny_models import read_checkpoint

# Every scenario starts an engine on tiny MoE models (1-10 s each).
pytestmark = pytest.mark.slow

GREEDY = greedy(24)
LONG = greedy(64)
# 47 usable pages of 16: eight requests of 24 new tokens fit (~39 pages at the end), of 64 do not (~60 pages),
# so the same engine (no second compile) gives the unconstrained batch and the retracting one.
BASE = dict(in_process=True, dtype="float32", max_running_requests=8, chunked_prefill_size=64,
            prefill_block_size=16, context_length=256, page_size=16, max_total_tokens=48 * 16,
            skip_tokenizer_init=True)
TOP_K = 2

CASES = {
    # Sparse, dense, sparse: the dense middle layer makes the layers differ in shape (Python loop, not scan).
    "qwen3_moe": Case("qwen3_moe", 3, dict(num_experts=8, moe_intermediate_size=32, norm_topk_prob=True,
                                           mlp_only_layers=[1]), fused_on_disk=True, seed=7),
    # All layers sparse (stacked and scanned), each with the shared expert beside the routed ones.
    "qwen2_moe": Case("qwen2_moe", 2, dict(num_experts=8, moe_intermediate_size=32, norm_topk_prob=False,
                                           shared_expert_intermediate_size=48), fused_on_disk=False, seed=23),
}


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(2, VOCAB, INVARIANCE_PROMPT_LENS)


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def moe(request, tmp_path_factory, prompts) -> dict[str, Any]:
    """On one base engine: each prompt alone (64 tokens, with logprobs), all eight batched for 24 tokens
    (they fit in the pool) and for 64 (they do not: retraction), and each prompt + its output but the last
    token recomputed in one prefill; with HF's router scores on each prompt + output."""
    name = request.param
    path = str(tmp_path_factory.mktemp(name))
    hf_model = save_checkpoint(path, CASES[name])
    with Engine(model=path, **BASE) as engine:
        s = engine.scheduler
        alone = [engine.generate(input_ids=p, sampling_params=LONG, return_logprob=True, top_logprobs_num=2)
                 for p in prompts]
        assert s.num_retractions == 0, "a request alone was retracted: the pool is too small"
        batched = outputs_of(engine, prompts, GREEDY)
        batch_retractions = s.num_retractions
        assert_idle_and_consistent(engine)
        retracted = outputs_of(engine, prompts, LONG)
        retractions = s.num_retractions - batch_retractions
        assert_idle_and_consistent(engine)
        recomputed = [recompute(engine, p, a) for p, a in zip(prompts, alone)]
        assert_idle_and_consistent(engine)
    full = [p + a["output_ids"] for p, a in zip(prompts, alone)]
    return {"name": name, "path": path, "alone": alone, "batched": batched, "retracted": retracted,
            "batch_retractions": batch_retractions, "retractions": retractions, "recomputed": recomputed,
            # each f32[sparse layers, len, experts]
            "routing": [hf_router_scores(hf_model, ids) for ids in full]}


def outputs(moe, num_tokens: int = LONG["max_new_tokens"]) -> list[list[int]]:
    """The first `num_tokens` greedy tokens of each prompt alone (greedy: a prefix of the longer run)."""
    return [a["output_ids"][:num_tokens] for a in moe["alone"]]


def test_checkpoint_is_the_intended_architecture(moe, prompts):
    # Guards the cases: a dropped override would leave a case testing nothing new.
    hf, names = read_checkpoint(moe["path"])
    cfg = config_from_hf(hf)
    assert (cfg.num_experts, cfg.num_experts_per_tok) == (8, TOP_K)
    if moe["name"] == "qwen3_moe":
        assert cfg.sparse_layers == (True, False, True) and not cfg.layers_alike
        assert "model.layers.1.mlp.gate_proj.weight" in names  # the dense MLP
        assert cfg.shared_expert_intermediate_size == 0
    else:
        assert cfg.sparse_layers == (True, True) and cfg.layers_alike
        assert "model.layers.1.mlp.shared_expert_gate.weight" in names
        assert cfg.shared_expert_intermediate_size == 48
    assert len(set(map(tuple, outputs(moe)))) == len(prompts), "outputs do not depend on the prompt"
    # Equality of greedy tokens must hinge on correctness, not on rounding order at a near-tie.
    for a in moe["alone"]:
        gaps = [tops[0][0] - tops[1][0] for tops in a["meta_info"]["output_top_logprobs"]]
        gap = min(gaps)
        assert gap > MIN_GREEDY_GAP, f"a greedy step is a near-tie ({gap=:.2g}); pick another seed"


def test_routing_spreads_tokens_over_experts(moe):
    """In each sparse layer the decoded tokens use every expert, at every output index the eight requests'
    tokens do not all pick the same experts, and no token's 2nd and 3rd experts nearly tie (which would
    make the invariances hinge on rounding order). Scores are HF's, which test_moe_parity matches."""
    routing = moe["routing"]
    # The experts of the tokens fed to decode steps: each output but the last (the first comes from prefill).
    decode = np.stack([
        np.argsort(-r[:, r.shape[1] - len(a["output_ids"]) : -1], axis=-1)[..., :TOP_K]
        for r, a in zip(routing, moe["alone"])
    ])  # i32[requests, sparse layers, outputs - 1, top_k]
    num_requests, num_sparse, num_steps, _ = decode.shape
    assert num_sparse == 2
    for layer in range(num_sparse):
        used = np.bincount(decode[:, layer].ravel(), minlength=8)
        assert (used > 0).all(), f"sparse layer {layer}: experts used by decoded tokens {used}"
        for step in range(num_steps):
            chosen = {tuple(sorted(decode[i, layer, step])) for i in range(num_requests)}
            assert len(chosen) > 1, f"sparse layer {layer} output {step}: all requests pick experts {chosen}"
    by_layer = np.sort(decode, axis=-1)
    assert (by_layer[:, 0] != by_layer[:, 1]).any(), "both sparse layers route every token identically"
    ranked = np.sort(np.concatenate([r.reshape(-1, 8) for r in routing]), axis=-1)
    gap = (ranked[:, -TOP_K] - ranked[:, -TOP_K - 1]).min()
    assert gap > 2e-5, f"a token's 2nd and 3rd experts nearly tie ({gap=:.2g}); pick another seed"


def test_batch_of_eight_equals_each_alone(moe):
    assert moe["batch_retractions"] == 0, "the batch was retracted: it would test two invariances at once"
    assert moe["batched"] == outputs(moe, GREEDY["max_new_tokens"])


def test_retraction_under_a_small_kv_pool_gives_the_same_outputs(moe):
    assert moe["retractions"] > 0, "the pool was not small enough to force retraction"
    assert moe["retracted"] == outputs(moe)


def test_cached_decode_equals_full_recompute(moe, prompts):
    for prompt, a, r in zip(prompts, moe["alone"], moe["recomputed"]):
        assert [t for _, t in a["meta_info"]["output_token_logprobs"]] == a["output_ids"]
        assert_decode_equals_recompute(a, r, RECOMPUTE_ATOL, err_msg=f"prompt of {len(prompt)}")


# The reference engine prefills in chunks of 64 tokens (blocks of 16); chunks of 7 make every prompt of more
# than 7 tokens span several steps, its KV written and then attended to across chunk and page boundaries.
def test_prefill_in_chunks_of_seven_equals_chunks_of_64(moe, prompts):
    with Engine(model=moe["path"], **{**BASE, "prefill_block_size": 7, "chunked_prefill_size": 7}) as engine:
        outs = outputs_of(engine, prompts, GREEDY)
        assert_idle_and_consistent(engine)
    assert outs == outputs(moe, GREEDY["max_new_tokens"])
