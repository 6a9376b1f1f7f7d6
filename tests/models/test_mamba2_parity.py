"""Mamba-2 through our Engine against transformers' Mamba2ForCausalLM on tiny random checkpoints (fp32)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from tests.helpers import LOGPROB_ATOL, random_prompts
from tests.hf_reference import (
    check_no_near_ties_and_lengths,
    hf_greedy_recomputed,
    hf_greedy_recurrent,
    hf_logprobs,
    parity_tests,
    serve_case,
)
from tests.tiny_models import read_checkpoint, save_with_word_tokenizer, spread_norms_and_biases

# Each case's `run` fixture starts an engine and a Hugging Face model (2-5 s a case).
pytestmark = pytest.mark.slow

VOCAB = 300
NUM_NEW_TOKENS = 32
# With 16-token blocks (the SSD chunk) and 64-token prefill chunks: one prompt inside a block, one across
# two block boundaries ending mid-block, one prefilled over two steps (64 + 6) so the second continues
# the state left in its slot. Two running requests at most: the third prompt waits and then takes the slot
# a finished request left its final state in, which it must ignore (it starts at position 0).
PROMPT_LENS = (5, 37, 70)
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


def save_checkpoint(path: str, case: Case):
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
    def spread_mixer(name, param):
        if name.endswith(".dt_bias"):
            param.copy_(0.3 * torch.randn_like(param))
        elif name.endswith(".D"):
            param.copy_(torch.randn_like(param))
        elif name.endswith(".A_log"):  # decays from slow (A = -0.05) to fast (A = -1.5)
            param.copy_(torch.log(torch.empty_like(param).uniform_(0.05, 1.5)))

    spread_norms_and_biases(model, spread_mixer)
    return save_with_word_tokenizer(model, path, VOCAB)


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def run(request, tmp_path_factory) -> dict[str, Any]:
    """One Engine per case, one batched generate over all prompts, and HF's answers for the same prompts."""
    name = request.param
    case = CASES[name]
    limited = "time_step_limit" in case.overrides  # see "groups1_tied_dt_limit"
    return serve_case(tmp_path_factory, name, lambda path: save_checkpoint(path, case),
                      random_prompts(0, VOCAB, PROMPT_LENS), ENGINE_ARGS, NUM_NEW_TOKENS,
                      hf_greedy_fn=hf_greedy_recomputed if limited else hf_greedy_recurrent)


def test_checkpoint_is_the_intended_architecture(run) -> None:
    # Guards the cases themselves: a feature the checkpoint lacks would make a case test nothing.
    cfg, names = read_checkpoint(run["path"])
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
        assert np.abs(unclamped - hf_logprobs(model, ids)).max() > 100 * LOGPROB_ATOL
    check_no_near_ties_and_lengths(run, NUM_NEW_TOKENS)


test_prompt_logprobs_match_hf, test_greedy_tokens_match_hf, test_output_logprobs_match_hf = parity_tests(
    LOGPROB_ATOL, NUM_NEW_TOKENS
)
