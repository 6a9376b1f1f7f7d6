"""MiniMax (Lightning linear attention + softmax attention, MoE) against transformers on a tiny checkpoint."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from tests.hf_reference import parity_tests, serve_and_compare, write_word_tokenizer

VOCAB = 300
NUM_NEW_TOKENS = 32
# With 16-token prefill blocks (the linear-attention chunk) and 32-token prefill chunks: one prompt inside a
# block, one crossing blocks with a partial last one, one split across engine steps (32 + 32 + 6) so later
# steps continue the state from the slot.
PROMPT_LENS = (5, 37, 70)
ATOL = 1e-4
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


def _save_checkpoint(path: str):
    """Writes a random checkpoint (and a tokenizer) to `path`; returns the HF model."""
    cfg = transformers.AutoConfig.for_model("minimax", **HF_CONFIG)
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    # HF initializes norms to one, which would let a model that skipped them (or swapped eps) pass.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
    model.save_pretrained(path)
    write_word_tokenizer(path, VOCAB)
    return model


@torch.no_grad()
def _hf_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy without a cache (the whole sequence again each token): MiniMax's cache is its own API."""
    ids = list(prompt)
    for _ in range(num_tokens):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict[str, Any]:
    """One Engine, one batched generate over all prompts, and HF's answers for the same prompts."""
    path = str(tmp_path_factory.mktemp("minimax"))
    hf_model = _save_checkpoint(path)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in PROMPT_LENS]
    res = serve_and_compare(path, hf_model, prompts, ENGINE_ARGS, NUM_NEW_TOKENS, greedy=_hf_greedy)
    return {"name": "minimax", **res}


def test_checkpoint_has_the_intended_features(run) -> None:
    # Guards the case itself: an override that transformers dropped would make it test nothing new.
    from safetensors import safe_open

    from models.minimax import config_from_hf, lightning_slopes

    with open(os.path.join(run["path"], "config.json")) as f:
        cfg = json.load(f)
    with safe_open(os.path.join(run["path"], "model.safetensors"), framework="np") as f:
        names = set(f.keys())
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
    for out, prompt, lps in zip(run["outs"], run["prompts"], run["hf_lps"]):
        top2 = np.sort(lps[len(prompt) - 1 : -1], axis=-1)[:, -2:]
        gap = (top2[:, 1] - top2[:, 0]).min()
        assert gap > 1e-3, f"a greedy step is a near-tie ({gap=:.2g}); pick another seed"
        meta = out["meta_info"]
        assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(prompt), NUM_NEW_TOKENS)


test_prompt_logprobs_match_hf, test_greedy_tokens_match_hf, test_output_logprobs_match_hf = parity_tests(
    ATOL, NUM_NEW_TOKENS
)
