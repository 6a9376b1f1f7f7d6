"""Qwen3-Next (Gated DeltaNet linear attention + gated softmax attention, MoE with a shared expert and a dense
MLP layer) and the Qwen3.5 text models (dense and MoE) against transformers on tiny checkpoints."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers import LOGPROB_ATOL, random_prompts
from tests.hf_reference import check_no_near_ties_and_lengths, hf_greedy_recomputed, parity_tests, serve_case
from tests.models.test_hybrid_parity import ENGINE_ARGS, NUM_NEW_TOKENS, PROMPT_LENS, VOCAB
from tests.tiny_models import (
    random_hf_model,
    read_checkpoint,
    save_with_word_tokenizer,
    spread_norms_and_biases,
)

pytestmark = pytest.mark.slow

# Prompts of 5, 37 and 70 tokens in 16-token prefill blocks (the delta rule's chunk) and 32-token prefill
# chunks: one inside a block, one crossing blocks with a partial last one, one split over engine steps.
LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
HF_CONFIG = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "layer_types": LAYER_TYPES,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "partial_rotary_factor": 0.25,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,  # two value heads per key head
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "intermediate_size": 96,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [1],  # layer 1 has a dense MLP
    "norm_topk_prob": True,
    "initializer_range": 0.06,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}
# Qwen3.5's text models: separate q/k/v, z, b and a projections; dense MLPs everywhere or MoE everywhere.
_SHARED = {k: v for k, v in HF_CONFIG.items() if k not in (
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
    "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob")}
CASES = {
    "qwen3_next": ("qwen3_next", HF_CONFIG),
    "qwen3_5": ("qwen3_5_text", _SHARED),
    "qwen3_5_moe": ("qwen3_5_moe_text", {**_SHARED, "num_experts": 4, "num_experts_per_tok": 2,
                                          "moe_intermediate_size": 32,
                                          "shared_expert_intermediate_size": 48}),
}
SEED = 3


def save_checkpoint(path: str, case: str = "qwen3_next"):
    """Writes a random checkpoint (and a tokenizer) to `path`; returns the HF model, in float64.

    The reference runs in float64: transformers' own float32 forward differs from its float64 one by 2e-5 to
    5e-3 in logprob on tiny random checkpoints of this architecture (a scan of seeds and init ranges), often
    more than the tolerance, while the float64 forward is the exact answer both float32 implementations
    approximate. SEED and the init range are picked where that float32 noise is small (2.9e-5) and no greedy
    step is a near-tie.
    """
    model_type, config = CASES[case]
    model = random_hf_model(model_type, SEED, **config)
    spread_norms_and_biases(model)
    save_with_word_tokenizer(model, path, VOCAB)
    model.config._experts_implementation = "eager"  # its grouped matmul has no float64
    return model.double()


@pytest.fixture(scope="module", params=list(CASES))
def run(request, tmp_path_factory) -> dict[str, Any]:
    return serve_case(tmp_path_factory, request.param, lambda path: save_checkpoint(path, request.param),
                      random_prompts(0, VOCAB, PROMPT_LENS), ENGINE_ARGS, NUM_NEW_TOKENS,
                      hf_greedy_fn=hf_greedy_recomputed)


def test_checkpoint_has_the_intended_features(run) -> None:
    from models.qwen3_next import config_from_hf

    cfg, names = read_checkpoint(run["path"])
    assert cfg["layer_types"] == LAYER_TYPES
    ours = config_from_hf(cfg)
    assert ours.cache_spec.num_kv_layers == 1 and ours.cache_spec.recurrent.num_layers == 3
    assert ours.cache_spec.recurrent.ssm_shape == (4, 16, 8) and ours.attention.rotary_dim == 4
    split = "in_proj_qkv" if run["name"].startswith("qwen3_5") else "in_proj_qkvz"
    assert {f"model.layers.0.linear_attn.{split}.weight", "model.layers.2.self_attn.q_norm.weight"} <= names
    sparse = {"qwen3_next": (True, False, True, True), "qwen3_5": (False,) * 4, "qwen3_5_moe": (True,) * 4}
    assert ours.sparse_layers == sparse[run["name"]]
    if any(ours.sparse_layers):
        assert "model.layers.0.mlp.shared_expert_gate.weight" in names
    check_no_near_ties_and_lengths(run, NUM_NEW_TOKENS)


test_prompt_logprobs_match_hf, test_greedy_tokens_match_hf, test_output_logprobs_match_hf = parity_tests(
    LOGPROB_ATOL, NUM_NEW_TOKENS
)
