"""MiniMax (Lightning linear attention + softmax attention, MoE) against transformers on a tiny checkpoint."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from tests.helpers import LOGPROB_ATOL, random_prompts
from tests.hf_reference import (
    check_no_near_ties_and_lengths,
    hf_greedy_recomputed,
    parity_tests,
    serve_case,
)
from tests.models.test_hybrid_parity import ENGINE_ARGS, NUM_NEW_TOKENS, PROMPT_LENS, VOCAB
from tests.tiny_models import (
    random_hf_model,
    read_checkpoint,
    save_with_word_tokenizer,
    spread_norms_and_biases,
)

# Each case's `run` fixture starts an engine and a Hugging Face model (2-5 s a case).
pytestmark = pytest.mark.slow

# The hybrid parity settings: 16-token prefill blocks (here the linear-attention chunk) and 32-token prefill
# chunks, prompts of 5, 37 and 70 tokens: one inside a block, one crossing blocks with a partial last one, one
# split across engine steps (32 + 32 + 6) so later steps continue the state from the slot.
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention"]
# Residual factors away from 1.0 (and from each other) so that a model skipping or swapping one fails.
FACTORS = {
    "linear_attn_alpha_factor": 0.9,
    "linear_attn_beta_factor": 1.2,
    "full_attn_alpha_factor": 1.1,
    "full_attn_beta_factor": 0.8,
    "mlp_alpha_factor": 0.95,
    "mlp_beta_factor": 1.3,
}
HF_CONFIG = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "layer_types": LAYER_TYPES,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "initializer_range": 0.15,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
    **FACTORS,
}
SEED = 0  # picked so that every greedy step's top-2 logprob gap is well above the error of a correct fp32 run


def save_checkpoint(path: str):
    """Writes a random checkpoint (and a tokenizer) to `path`; returns the HF model."""
    model = random_hf_model("minimax", SEED, **HF_CONFIG)
    spread_norms_and_biases(model)  # it has no biases
    return save_with_word_tokenizer(model, path, VOCAB)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict[str, Any]:
    """One Engine, one batched generate over all prompts, and HF's answers for the same prompts."""
    return serve_case(tmp_path_factory, "minimax", save_checkpoint, random_prompts(0, VOCAB, PROMPT_LENS),
                      ENGINE_ARGS, NUM_NEW_TOKENS,
                      hf_greedy_fn=hf_greedy_recomputed)  # no cache: MiniMax's cache is its own API


def test_checkpoint_has_the_intended_features(run) -> None:
    # Guards the case itself: an override that transformers dropped would make it test nothing new.
    from safetensors import safe_open

    from models.minimax import config_from_hf, lightning_slopes

    cfg, names = read_checkpoint(run["path"])
    with safe_open(os.path.join(run["path"], "model.safetensors"), framework="np") as f:
        # HF's layer-dependent decay slopes (layer 2 of 3: depth factor ~0, so the slopes are ~0).
        hf_slopes = [f.get_tensor(f"model.layers.{i}.self_attn.slope_rate").reshape(-1) for i in (0, 2)]
    assert cfg["layer_types"] == LAYER_TYPES and cfg["num_local_experts"] == 4
    for key, value in FACTORS.items():
        assert cfg[key] == value, key
    assert {"model.layers.0.self_attn.output_gate.weight", "model.layers.1.self_attn.q_proj.weight"} <= names
    ours = config_from_hf(cfg)
    assert ours.cache_spec.num_kv_layers == 1 and ours.cache_spec.recurrent.num_layers == 2
    for i, want in zip((0, 2), hf_slopes):
        np.testing.assert_allclose(lightning_slopes(4, i, 3), want, rtol=1e-6, err_msg=f"layer {i}")
    check_no_near_ties_and_lengths(run, NUM_NEW_TOKENS)


test_prompt_logprobs_match_hf, test_greedy_tokens_match_hf, test_output_logprobs_match_hf = parity_tests(
    LOGPROB_ATOL, NUM_NEW_TOKENS
)
