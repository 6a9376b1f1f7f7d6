"""Mamba-2 through our Engine against transformers' Mamba2ForCausalLM on tiny random checkpoints (fp32)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from tests.hf_reference import (
    check_no_near_tie,
    hf_logprobs,
    parity_tests,
    serve_and_compare,
    write_word_tokenizer,
)

VOCAB = 300
NUM_NEW_TOKENS = 32
# With 16-token blocks (the SSD chunk) and 64-token prefill chunks: one prompt inside a block, one across
# two block boundaries ending mid-block, one prefilled over two steps (64 + 6) so the second continues
# the state left in its slot. Two running requests at most: the third prompt waits and then takes the slot
# a finished request left its final state in, which it must ignore (it starts at position 0).
PROMPT_LENS = (5, 37, 70)
ATOL = 1e-4
ENGINE_ARGS = dict(
    in_process=True, dtype="float32", max_running_requests=2, chunked_prefill_size=64, prefill_block_size=16,
    context_length=256, page_size=16,
)


@dataclasses.dataclass(frozen=True)
class Case:
    overrides: dict[str, Any]
    # Picked so that every greedy step's top-2 logprob gap is well above fp32 rounding (checked below).
    seed: int


CASES = {
    "groups2_bias": Case(dict(n_groups=2, use_bias=True, use_conv_bias=True, tie_word_embeddings=False), 3),
    # A binding time_step_limit: HF clamps dt only in its chunked (prefill) path, so this case's HF greedy
    # reference recomputes the whole sequence each token instead of using HF's cached decode step.
    "groups1_tied_dt_limit": Case(
        dict(n_groups=1, use_bias=False, use_conv_bias=False, tie_word_embeddings=True,
             time_step_limit=(0.0, 0.5)),
        seed=0,
    ),
}


def _save_checkpoint(path: str, case: Case):
    """Writes a random 2-layer Mamba-2 (and a tokenizer) to `path`; returns the HF model."""
    cfg = transformers.Mamba2Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16, state_size=16,
        expand=2, conv_kernel=4, chunk_size=16, layer_norm_epsilon=1e-5, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, **case.overrides,
    )
    torch.manual_seed(case.seed)
    model = transformers.Mamba2ForCausalLM(cfg).float().eval()
    # HF initializes norms to one, biases and D to constants, and dt small enough (0.001..0.1) that the
    # state barely matters: randomize them all so that skipping any one of them shows.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            elif name.endswith((".bias", ".dt_bias")):
                param.copy_(0.3 * torch.randn_like(param))
            elif name.endswith(".D"):
                param.copy_(torch.randn_like(param))
            elif name.endswith(".A_log"):  # decays from slow (A = -0.05) to fast (A = -1.5)
                param.copy_(torch.log(torch.empty_like(param).uniform_(0.05, 1.5)))
    model.save_pretrained(path)
    write_word_tokenizer(path, VOCAB)
    return model


@torch.no_grad()
def hf_greedy(model, prompt: list[int], num_tokens: int, cached: bool) -> list[int]:
    """HF greedy tokens, through its own cache (`cache_params`, not `past_key_values`) or recomputing."""
    tokens: list[int] = []
    out = model(torch.tensor([prompt]), use_cache=cached)
    while True:
        tokens.append(int(out.logits[0, -1].argmax()))
        if len(tokens) == num_tokens:
            return tokens
        if cached:
            out = model(torch.tensor([[tokens[-1]]]), cache_params=out.cache_params, use_cache=True)
        else:
            out = model(torch.tensor([prompt + tokens]), use_cache=False)


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def run(request, tmp_path_factory) -> dict[str, Any]:
    """One Engine per case, one batched generate over all prompts, and HF's answers for the same prompts."""
    name = request.param
    case = CASES[name]
    path = str(tmp_path_factory.mktemp(name))
    hf_model = _save_checkpoint(path, case)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in PROMPT_LENS]
    res = serve_and_compare(path, hf_model, prompts, ENGINE_ARGS, NUM_NEW_TOKENS,
                            greedy=lambda m, p, n: hf_greedy(m, p, n,
                                                             math.isinf(m.config.time_step_limit[1])))
    return {"name": name, "hf_model": hf_model, **res}


def test_checkpoint_is_the_intended_architecture(run) -> None:
    # Guards the cases themselves: a feature the checkpoint lacks would make a case test nothing.
    from safetensors import safe_open

    with open(os.path.join(run["path"], "config.json")) as f:
        cfg = json.load(f)
    with safe_open(os.path.join(run["path"], "model.safetensors"), framework="np") as f:
        names = set(f.keys())
    name = run["name"]
    assert cfg["architectures"] == ["Mamba2ForCausalLM"]
    assert cfg["n_groups"] == (2 if name == "groups2_bias" else 1)
    assert ("lm_head.weight" not in names) == (name == "groups1_tied_dt_limit")
    assert ("backbone.layers.0.mixer.in_proj.bias" in names) == (name == "groups2_bias")
    assert ("backbone.layers.0.mixer.out_proj.bias" in names) == (name == "groups2_bias")
    assert ("backbone.layers.0.mixer.conv1d.bias" in names) == (name == "groups2_bias")
    if name == "groups1_tied_dt_limit":
        # The limit binds: lifting it changes HF's answer well beyond the tolerance.
        model, ids = run["hf_model"], run["prompts"][2]
        mixers = [layer.mixer for layer in model.backbone.layers]
        for m in mixers:
            m.time_step_limit = (0.0, float("inf"))
        try:
            unclamped = hf_logprobs(model, ids)
        finally:
            for m in mixers:
                m.time_step_limit = (0.0, 0.5)
        assert np.abs(unclamped - hf_logprobs(model, ids)).max() > 100 * ATOL
    for out, prompt, lps in zip(run["outs"], run["prompts"], run["hf_lps"], strict=True):
        check_no_near_tie(name, prompt, lps)
        meta = out["meta_info"]
        assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(prompt), NUM_NEW_TOKENS)


test_prompt_logprobs_match_hf, test_greedy_tokens_match_hf, test_output_logprobs_match_hf = parity_tests(
    ATOL, NUM_NEW_TOKENS
)
