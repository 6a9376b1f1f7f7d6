"""Our Engine against transformers on the same tiny random-weight checkpoints (fp32, tight tolerance)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import transformers

from models.registry import supported_architectures
from serve import Engine
from tests.helpers import LOGPROB_ATOL, random_prompts
from tests.hf_reference import check_no_near_ties_and_lengths, parity_tests, serve_case
from tests.tiny_models import (
    random_hf_model,
    read_checkpoint,
    save_with_word_tokenizer,
    spread_norms_and_biases,
    write_word_tokenizer,
)

VOCAB = 300
NUM_NEW_TOKENS = 32
# Covers one prompt shorter than a page, one exactly a page, one a token short of a prefill chunk, and one
# that is chunked (64 + 46) and whose positions run past the llama3 case's original context (32).
PROMPT_LENS = (5, 16, 63, 110)
ENGINE_ARGS = dict(
    in_process=True, dtype="float32", max_running_requests=4, chunked_prefill_size=64, context_length=256,
    max_total_tokens=2048, page_size=16,
)


@dataclasses.dataclass(frozen=True)
class Case:
    model_type: str
    overrides: dict[str, Any]
    # Picked so that every greedy step's top-2 logprob gap is >= 5e-3, far above the ~4e-6 error of a correct
    # fp32 run: a near-tie would make "tokens identical" hinge on rounding order, not on correctness.
    seed: int


CASES = {
    "llama": Case("llama", dict(tie_word_embeddings=False), seed=5),
    "llama3_rope": Case(
        "llama",
        dict(
            tie_word_embeddings=False,
            # original_max_position_embeddings=32 puts head_dim 16's wavelengths in all three llama3 bands
            # (< 8 kept, 8..32 smoothed, > 32 divided by `factor`).
            rope_parameters=dict(
                rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
        seed=1,
    ),
    "qwen2_tied_bias": Case("qwen2", dict(tie_word_embeddings=True), seed=5),
    # head_dim 32 with hidden 64 and 4 heads: q_proj is 64 -> 128, not square.
    "qwen3_qk_norm_head_dim": Case("qwen3", dict(tie_word_embeddings=False, head_dim=32), seed=0),
}


def save_checkpoint(path: str, case: Case):
    """Writes a random 2-layer GQA model of `case` (and a tokenizer) to `path`; returns the HF model."""
    model = random_hf_model(
        case.model_type, case.seed, vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, initializer_range=0.15, bos_token_id=1, eos_token_id=2, **case.overrides,
    )
    spread_norms_and_biases(model)
    return save_with_word_tokenizer(model, path, VOCAB)


# An engine and a Hugging Face model per case (2-5 s): the tests that use `run` are marked slow.
@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def run(request, tmp_path_factory) -> dict[str, Any]:
    """One Engine per case, one batched generate over all prompts, and HF's answers for the same prompts."""
    name = request.param
    return serve_case(tmp_path_factory, name, lambda path: save_checkpoint(path, CASES[name]),
                      random_prompts(0, VOCAB, PROMPT_LENS), ENGINE_ARGS, NUM_NEW_TOKENS)


@pytest.mark.slow
def test_checkpoint_is_the_intended_architecture(run) -> None:
    # Guards the cases themselves: an override that transformers dropped would make a case test nothing new.
    cfg, names = read_checkpoint(run["path"])
    name = run["name"]
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    assert (rope.get("rope_type") == "llama3") == (name == "llama3_rope")
    assert ("lm_head.weight" not in names) == (name == "qwen2_tied_bias")
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == (name == "qwen2_tied_bias")
    assert ("model.layers.0.self_attn.q_norm.weight" in names) == (name == "qwen3_qk_norm_head_dim")
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    assert (head_dim * cfg["num_attention_heads"] != cfg["hidden_size"]) == (name == "qwen3_qk_norm_head_dim")
    check_no_near_ties_and_lengths(run, NUM_NEW_TOKENS)
    assert all(out["meta_info"]["finish_reason"]["type"] == "length" for out in run["outs"])


test_prompt_logprobs_match_hf, test_greedy_tokens_match_hf, test_output_logprobs_match_hf = map(
    pytest.mark.slow, parity_tests(LOGPROB_ATOL, NUM_NEW_TOKENS)  # they use `run`
)


@pytest.mark.parametrize(
    "model_type,architecture",
    [
        ("gpt2", "GPT2LMHeadModel"),
        ("mistral", "MistralForCausalLM"),  # Llama-shaped config keys, so only the registry can refuse it
    ],
)
def test_unsupported_architecture_lists_supported(tmp_path, model_type: str, architecture: str) -> None:
    cfg = transformers.AutoConfig.for_model(
        model_type, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
    )
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(str(tmp_path))
    write_word_tokenizer(str(tmp_path), VOCAB)
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["architectures"] == [architecture]
    supported = ", ".join(supported_architectures())
    assert "LlamaForCausalLM" in supported and architecture not in supported
    with pytest.raises(ValueError, match=rf"{architecture}.*supported: {supported}"):
        Engine(model=str(tmp_path), **ENGINE_ARGS)
