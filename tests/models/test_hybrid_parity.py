"""SSM+attention hybrids (Nemotron-H, Bamba, Falcon-H1) against transformers on tiny random checkpoints."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
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
from tests.tiny_models import (
    random_hf_model,
    read_checkpoint,
    save_with_word_tokenizer,
    spread_norms_and_biases,
)

VOCAB = 300
NUM_NEW_TOKENS = 32
# With 16-token prefill blocks (the SSD chunk) and 32-token prefill chunks: one prompt inside a block, one
# crossing blocks with a partial last one, one split across engine steps (32 + 32 + 6) so later steps
# continue the recurrent and conv state from the slot.
PROMPT_LENS = (5, 37, 70)
# Two running requests and 32-token prefill chunks keep the engine at 4 step programs (compile time is most
# of this file's cost) while prefill steps still pack several sequences and carry decode tokens.
ENGINE_ARGS = {
    "in_process": True,
    "dtype": "float32",
    "max_running_requests": 2,
    "chunked_prefill_size": 32,
    "prefill_block_size": 16,
    "context_length": 256,
    "max_total_tokens": 2048,
    "page_size": 16,
}
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "initializer_range": 0.15,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}
# muP multipliers away from 1.0 (and from each other) so that a model skipping or swapping one fails.
FALCON_MULTIPLIERS = {
    "embedding_multiplier": 1.5,
    "lm_head_multiplier": 0.7,
    "mlp_multipliers": [1.3, 0.8],
    "key_multiplier": 0.9,
    "attention_in_multiplier": 0.8,
    "attention_out_multiplier": 1.2,
    "ssm_in_multiplier": 1.25,
    "ssm_out_multiplier": 0.75,
    "ssm_multipliers": [1.1, 0.9, 1.2, 0.8, 1.3],
}


@dataclasses.dataclass(frozen=True)
class Case:
    model_type: str
    overrides: dict[str, Any]
    # Asserts that the saved config.json and tensor names have the case's features.
    check: Callable[[dict, set], None]
    # Picked so that every greedy step's top-2 logprob gap is well above the error of a correct fp32 run.
    seed: int


def _check_nemotron_h(cfg: dict, names: set) -> None:
    assert cfg["layers_block_type"] == ["linear_attention", "full_attention", "linear_attention", "mlp"]
    assert cfg["n_groups"] > 1 and cfg["mlp_hidden_act"] == "relu2"
    # transformers writes Nemotron-H under NVIDIA's `backbone.` prefix.
    assert {"backbone.layers.0.mixer.in_proj.bias", "backbone.layers.3.mixer.up_proj.bias"} <= names


def _check_bamba(cfg: dict, names: set) -> None:
    assert cfg["attn_layer_indices"] == [1] and cfg["num_hidden_layers"] == 3
    assert cfg["rope_parameters"]["partial_rotary_factor"] == 0.5 and cfg["mamba_n_groups"] > 1
    assert {"model.layers.1.self_attn.o_proj.bias", "model.layers.0.mamba.in_proj.bias"} <= names


def _check_falcon_h1(cfg: dict, names: set) -> None:
    for key, value in FALCON_MULTIPLIERS.items():
        assert cfg[key] == value, key
    assert cfg["mamba_d_ssm"] != cfg["mamba_expand"] * cfg["hidden_size"] and cfg["mamba_n_groups"] > 1
    assert cfg["mamba_rms_norm"] and cfg["head_dim"] * cfg["num_attention_heads"] != cfg["hidden_size"]
    assert {"model.layers.0.mamba.out_proj.bias", "model.layers.0.mamba.in_proj.bias"} <= names


MAMBA = {
    "mamba_n_heads": 8,
    "mamba_n_groups": 2,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_chunk_size": 16,
}
CASES = {
    # Mamba-2, attention (no RoPE), Mamba-2, relu^2 MLP.
    "nemotron_h": Case(
        "nemotron_h",
        {
            "hybrid_override_pattern": "M*M-",
            "head_dim": 16,
            "mamba_num_heads": 8,
            "mamba_head_dim": 16,
            "ssm_state_size": 16,
            "n_groups": 2,
            "conv_kernel": 4,
            "chunk_size": 16,
            "use_bias": True,
            "mlp_bias": True,
        },
        _check_nemotron_h,
        seed=0,
    ),
    # Attention (half the head dims rotate) between two Mamba-2 layers, a gated MLP after each.
    "bamba": Case(
        "bamba",
        {
            "num_hidden_layers": 3,
            "attn_layer_indices": [1],
            "attention_bias": True,
            "mlp_bias": True,
            "mamba_proj_bias": True,
            **MAMBA,
        },
        _check_bamba,
        seed=0,
    ),
    # Attention and Mamba-2 side by side in every layer; d_ssm (96) is not expand * hidden (128).
    "falcon_h1": Case(
        "falcon_h1",
        {
            "num_hidden_layers": 2,
            "head_dim": 24,
            "mamba_d_ssm": 96,
            "mamba_rms_norm": True,
            "mamba_norm_before_gate": False,
            "projectors_bias": True,
            "mamba_proj_bias": True,
            **MAMBA,
            "mamba_n_heads": 6,
            **FALCON_MULTIPLIERS,
        },
        _check_falcon_h1,
        seed=1,
    ),
}


def save_checkpoint(path: str, case: Case, common: dict[str, Any] = COMMON):
    """Writes a random checkpoint of `case` (config `common` + its overrides, and a tokenizer) to `path`;
    returns the HF model."""
    model = random_hf_model(case.model_type, case.seed, **{**common, **case.overrides})

    def spread_mixer(name, param):
        if name.endswith(".D"):  # HF initializes D to one, like norms
            param.copy_(1.0 + 0.3 * torch.randn_like(param))
        elif name.endswith(".dt_bias"):
            # softplus(dt) well above every dt clamp (Nemotron-H clamps at time_step_min in prefill only).
            param.copy_(0.5 * torch.randn_like(param))

    spread_norms_and_biases(model, spread_mixer)
    return save_with_word_tokenizer(model, path, VOCAB)


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


def test_falcon_h1_ungated_norm_tied_prefill_matches_hf(tmp_path) -> None:
    """Falcon-H1's other mixer form (no RMSNorm: y * silu(z)) and a tied LM head under lm_head_multiplier.

    One prefill forward (no engine: a single small compile) against HF's logits for the same prompt.
    """
    import jax.numpy as jnp

    from models.loader import load_model

    overrides = {**CASES["falcon_h1"].overrides, "mamba_rms_norm": False, "tie_word_embeddings": True}
    case = dataclasses.replace(CASES["falcon_h1"], overrides=overrides)
    hf_model = save_checkpoint(str(tmp_path), case)
    hf_cfg, _ = read_checkpoint(str(tmp_path))
    assert not hf_cfg["mamba_rms_norm"] and hf_cfg["tie_word_embeddings"]
    cfg, model = load_model(str(tmp_path), jnp.float32)
    assert model.lm_head is None and not cfg.mixer.gated_norm

    prompt = np.random.default_rng(1).integers(3, VOCAB, size=37).tolist()
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt])).logits[0].float().numpy()
    np.testing.assert_allclose(prefill_logits(cfg, model, prompt), expected, atol=LOGPROB_ATOL, rtol=0)


@pytest.mark.parametrize(
    "pattern,match", [("M*E-", "moe"), ("M*X", "unknown letters")], ids=["moe", "unknown_letter"]
)
def test_nemotron_h_rejects_unsupported_layers(pattern: str, match: str) -> None:
    from models.nemotron_h import config_from_hf

    hf = {
        "architectures": ["NemotronHForCausalLM"],
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "hybrid_override_pattern": pattern,
    }
    with pytest.raises(ValueError, match=match):
        config_from_hf(hf)
    assert config_from_hf({**hf, "hybrid_override_pattern": "M*M-"}).layer_types == (
        "mamba",
        "attention",
        "mamba",
        "mlp",
    )
