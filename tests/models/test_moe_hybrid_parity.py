"""Recurrent + MoE hybrids (Jamba, Granite-4.0-H) against transformers on tiny random checkpoints."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

from tests.helpers import LOGPROB_ATOL, prefill_logits, random_prompts
from tests.hf_reference import (
    check_no_near_ties_and_lengths,
    hf_greedy_with_positions,
    parity_tests,
    serve_case,
)
from tests.models.test_hybrid_parity import ENGINE_ARGS, NUM_NEW_TOKENS, PROMPT_LENS, VOCAB, Case
from tests.models.test_hybrid_parity import save_checkpoint as save_hybrid_checkpoint
from tests.tiny_models import read_checkpoint

COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts_per_tok": 2,
    "initializer_range": 0.15,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}
# Granite's scalars away from 1.0 (and the attention multiplier away from head_dim ** -0.5 = 0.25).
GRANITE_MULTIPLIERS = {
    "embedding_multiplier": 2.0,
    "residual_multiplier": 0.7,
    "attention_multiplier": 0.2,
    "logits_scaling": 1.6,
}


def _expert_names(prefix: str, names: set) -> bool:
    """The layer under `prefix` has routed experts, per expert or fused."""
    return f"{prefix}experts.0.gate_proj.weight" in names or f"{prefix}experts.gate_up_proj" in names


def _check_jamba(cfg: dict, names: set) -> None:
    from models.jamba import config_from_hf

    ours = config_from_hf(cfg)
    # Attention + experts, Mamba + experts and Mamba + dense MLP all occur.
    assert ours.layer_types == ("mamba", "attention", "mamba", "mamba")
    assert ours.sparse_layers == (False, True, False, True)
    assert ours.num_experts == 4 and ours.num_experts_per_tok == 2
    assert all(_expert_names(f"model.layers.{i}.feed_forward.", names) for i in (1, 3))
    assert {
        "model.layers.0.feed_forward.gate_proj.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.0.mamba.dt_layernorm.weight",
        "model.layers.0.mamba.in_proj.bias",
        "model.layers.1.feed_forward.router.weight",
    } <= names


def _check_granite(cfg: dict, names: set) -> None:
    for key, value in GRANITE_MULTIPLIERS.items():
        assert cfg[key] == value, key
    assert cfg["layer_types"] == ["linear_attention", "full_attention", "linear_attention", "full_attention"]
    assert cfg["position_embedding_type"] == "rope" and cfg["mamba_n_groups"] > 1
    assert cfg["num_local_experts"] == 4 and cfg["shared_intermediate_size"] > 0
    prefix = "model.layers.1.block_sparse_moe."
    assert f"{prefix}input_linear.weight" in names or f"{prefix}experts.gate_up_proj" in names
    assert {
        "model.layers.1.self_attn.o_proj.bias",
        "model.layers.0.mamba.in_proj.bias",
        "model.layers.0.shared_mlp.input_linear.weight",
    } <= names


CASES = {
    # Layers: Mamba + MLP, attention + experts, Mamba + MLP, Mamba + experts.
    "jamba": Case(
        "jamba",
        {
            "intermediate_size": 96,
            "num_experts": 4,
            "attn_layer_period": 4,
            "attn_layer_offset": 1,
            "expert_layer_period": 2,
            "expert_layer_offset": 1,
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "mamba_proj_bias": True,
        },
        _check_jamba,
        seed=15,
    ),
    # Mamba-2 and RoPE attention alternating, each followed by 4 experts (top 2) plus the shared MLP.
    "granitemoehybrid": Case(
        "granitemoehybrid",
        {
            "intermediate_size": 64,
            "shared_intermediate_size": 96,
            "num_local_experts": 4,
            "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
            "position_embedding_type": "rope",
            "attention_bias": True,
            "mamba_n_heads": 8,
            "mamba_n_groups": 2,
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_chunk_size": 16,
            "mamba_proj_bias": True,
            **GRANITE_MULTIPLIERS,
        },
        _check_granite,
        seed=11,
    ),
}


def save_checkpoint(path: str, case: Case):
    return save_hybrid_checkpoint(path, case, COMMON)


# An engine and a Hugging Face model per case (2-5 s): the tests that use `run` are marked slow.
@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def run(request, tmp_path_factory) -> dict[str, Any]:
    """One Engine per case, one batched generate over all prompts, and HF's answers for the same prompts."""
    name = request.param
    return serve_case(tmp_path_factory, name, lambda path: save_checkpoint(path, CASES[name]),
                      random_prompts(0, VOCAB, PROMPT_LENS), ENGINE_ARGS, NUM_NEW_TOKENS,
                      hf_greedy_fn=hf_greedy_with_positions)


@pytest.mark.slow
def test_checkpoint_has_the_intended_features(run) -> None:
    # Guards the cases themselves: an override that transformers dropped would make a case test nothing new.
    CASES[run["name"]].check(*read_checkpoint(run["path"]))
    check_no_near_ties_and_lengths(run, NUM_NEW_TOKENS)


test_prompt_logprobs_match_hf, test_greedy_tokens_match_hf, test_output_logprobs_match_hf = map(
    pytest.mark.slow, parity_tests(LOGPROB_ATOL, NUM_NEW_TOKENS)  # they use `run`
)


def test_granite_dense_nope_tied_prefill_matches_hf(tmp_path) -> None:
    """Granite's other forms: no routed experts (the shared MLP alone), attention without RoPE, and a tied
    LM head under logits_scaling. One prefill forward (no engine: a single small compile) against HF."""
    import jax.numpy as jnp

    from models.loader import load_model

    overrides = {
        **CASES["granitemoehybrid"].overrides,
        "num_local_experts": 0,
        "position_embedding_type": None,
        "tie_word_embeddings": True,
    }
    hf_model = save_checkpoint(
        str(tmp_path), dataclasses.replace(CASES["granitemoehybrid"], overrides=overrides)
    )
    cfg, model = load_model(str(tmp_path), jnp.float32)
    assert cfg.num_experts == 0 and cfg.attention.rope is None and model.lm_head is None
    assert model.layers["1"].moe is None and cfg.layer_types.count("attention") == 2

    prompt = np.random.default_rng(1).integers(3, VOCAB, size=37).tolist()
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt])).logits[0].float().numpy()
    np.testing.assert_allclose(prefill_logits(cfg, model, prompt), expected, atol=LOGPROB_ATOL, rtol=0)
