"""Kimi-Linear (Kimi Delta Attention: the delta rule with a decay per key channel; MLA without positional
encoding; grouped sigmoid-routed experts with a shared expert, a dense first layer) and Ling 3
(`bailing_hybrid`: the same with rotary MLA, gated heads and bounded forget gates) against transformers on
tiny checkpoints."""

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
LINEAR = "linear_attention"

LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
HF_CONFIG = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "layer_types": LAYER_TYPES,
    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "q_lora_rank": None,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "linear_num_heads": 2,
    "linear_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "moe_intermediate_size": 32,
    "n_shared_experts": 1,
    "intermediate_size": 96,
    "routed_scaling_factor": 2.0,
    "initializer_range": 0.06,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}
# Ling 3 (bailing_hybrid): MLA with rotated rope channels and per-head output gates, single-projection KDA
# gates with the bounded forget gate, the last layer of each group of 3 MLA.
LING_CONFIG = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "layer_group_size": 3,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 16,  # the KDA heads' (their count is num_attention_heads)
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "short_conv_kernel_size": 4,
    "kda_safe_gate": True,
    "kda_lower_bound": -5.0,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "moe_intermediate_size": 32,
    "n_shared_experts": 1,
    "intermediate_size": 96,
    "routed_scaling_factor": 2.0,
    "rope_theta": 10000.0,
    "num_mtp_layers": 0,
    "initializer_range": 0.06,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}
CASES = {"kimi_linear": ("kimi_linear", HF_CONFIG, 2), "bailing_hybrid": ("bailing_hybrid", LING_CONFIG, 0)}


def save_checkpoint(path: str, case: str = "kimi_linear"):
    """Writes a random checkpoint (and a tokenizer) to `path`; returns the HF model in float64 (as for
    Qwen3-Next, tests/models/test_qwen3_next_parity.py: the delta rule's float32 rounding in transformers'
    own forward is larger than the tolerance on tiny random models)."""
    import torch

    model_type, config, seed = CASES[case]
    model = random_hf_model(model_type, seed, **config)
    spread_norms_and_biases(model)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn_like(buf))  # changes the choice for some tokens
    save_with_word_tokenizer(model, path, VOCAB)
    model.config._experts_implementation = "eager"  # its grouped matmul has no float64
    return model.double()


@pytest.fixture(scope="module", params=list(CASES))
def run(request, tmp_path_factory) -> dict[str, Any]:
    return serve_case(tmp_path_factory, request.param, lambda path: save_checkpoint(path, request.param),
                      random_prompts(0, VOCAB, PROMPT_LENS), ENGINE_ARGS, NUM_NEW_TOKENS,
                      hf_greedy_fn=hf_greedy_recomputed)


def test_checkpoint_has_the_intended_features(run) -> None:
    from models.kimi_linear import config_from_hf

    cfg, names = read_checkpoint(run["path"])
    ours = config_from_hf(cfg)
    if run["name"] == "bailing_hybrid":
        assert ours.layer_types == (LINEAR, LINEAR, "full_attention", LINEAR)
        assert ours.mla.rope is not None and ours.mla.head_gate and ours.gate_lower_bound == -5.0
        assert not ours.low_rank_gates and ours.cache_spec.recurrent.ssm_shape == (4, 16, 16)
        # Ling 3 checkpoint names: `attention.` (its output `dense`), `word_embeddings`, `gate.expert_bias`
        assert {"model.layers.2.attention.g_proj.weight", "model.layers.0.attention.f_proj.weight",
                "model.word_embeddings.weight", "model.layers.1.mlp.gate.expert_bias"} <= names
        check_no_near_ties_and_lengths(run, NUM_NEW_TOKENS)
        return
    assert ours.layer_types == tuple(LAYER_TYPES) and ours.sparse_layers == (False, True, True, True)
    assert ours.cache_spec.num_kv_layers == 1 and ours.cache_spec.latent_kv
    assert ours.cache_spec.recurrent.ssm_shape == (2, 16, 16) and ours.mla.rope is None
    assert ours.routing.num_experts == 8 and ours.routing.n_group == 2 and ours.n_shared_experts == 1
    # transformers saves the hub checkpoints' names: one conv per q, k, v; `block_sparse_moe`, w1 / w3 / w2
    assert {"model.layers.0.self_attn.f_a_proj.weight", "model.layers.0.self_attn.q_conv1d.weight",
            "model.layers.2.self_attn.kv_b_proj.weight",
            "model.layers.1.block_sparse_moe.experts.0.w1.weight",
            "model.layers.1.block_sparse_moe.shared_experts.gate_proj.weight",
            "model.layers.0.block_sparse_moe.gate_proj.weight"} <= names
    check_no_near_ties_and_lengths(run, NUM_NEW_TOKENS)


test_prompt_logprobs_match_hf, test_greedy_tokens_match_hf, test_output_logprobs_match_hf = parity_tests(
    LOGPROB_ATOL, NUM_NEW_TOKENS
)
