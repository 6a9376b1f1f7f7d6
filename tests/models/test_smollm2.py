"""SmolLM2-135M-Instruct end to end, and against transformers on the same dequantized GGUF weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from tests.helpers import LOGPROB_ATOL, greedy
from tests.hf_reference import hf_logprobs

# SmolLM2-135M served, and loaded into transformers (~15 s).
pytestmark = pytest.mark.slow

NUM_NEW_TOKENS = 32
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    # Longer than one 128-token prefill chunk, so the comparison also covers chunked prefill.
    [
        {"role": "system", "content": "You are a careful assistant. " * 16},
        {"role": "user", "content": "List three uses of copper and explain each one in a sentence or two. "
                                    "Mention electrical wiring, plumbing, and one more of your choice."},
    ],
]
GREEDY = greedy(NUM_NEW_TOKENS)


@pytest.fixture(scope="module")
def hf_model(smollm2_gguf: str):
    """transformers' LlamaForCausalLM holding exactly the float32 weights our loader dequantizes."""
    from transformers.initialization import no_init_weights

    from models.weights.gguf import read_gguf

    ckpt = read_gguf(smollm2_gguf)
    config = transformers.LlamaConfig(**ckpt.config)
    config._attn_implementation = "eager"
    with no_init_weights():  # every parameter is overwritten below; skips ~4 s of random init
        model = transformers.LlamaForCausalLM(config).float().eval()
    state = {name: torch.from_numpy(array) for name, array in ckpt.tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)
    model.tie_weights()  # no_init_weights also skipped the tying that __init__ would do
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    return model


@pytest.fixture(scope="module")
def prompts(smollm2_engine) -> list[list[int]]:
    ids = [smollm2_engine.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True)
           for c in CONVERSATIONS]
    assert len(ids[0]) < 128 < len(ids[1]) < 512 - NUM_NEW_TOKENS
    return ids


@pytest.fixture(scope="module")
def ours(smollm2_engine, prompts) -> list[dict]:
    return smollm2_engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True,
                                   logprob_start_len=0)


@pytest.fixture(scope="module")
def hf_lps(hf_model, prompts, ours) -> list[np.ndarray]:
    """Per prompt, f32[prompt + 32, vocab]: HF's log p(. | ids[:i+1]) teacher-forced on our tokens."""
    return [hf_logprobs(hf_model, p + o["output_ids"]) for p, o in zip(prompts, ours)]


def test_chat_answers_capital_of_france(smollm2_engine) -> None:
    out = smollm2_engine.chat(CONVERSATIONS[0], sampling_params={"temperature": 0, "max_new_tokens": 32})
    assert "Paris" in out["text"], out["text"]


def test_greedy_tokens_match_transformers(hf_lps, prompts, ours) -> None:
    # HF's greedy loop would emit our tokens exactly when each of them is HF's argmax given the prompt and
    # our tokens before it, which one teacher-forced forward shows (a step-by-step loop costs ~10x more here).
    for prompt, out, lps in zip(prompts, ours, hf_lps):
        assert len(out["output_ids"]) == NUM_NEW_TOKENS
        hf_argmax = lps[len(prompt) - 1 : -1].argmax(axis=-1).tolist()
        first_diff = next((j for j, (a, b) in enumerate(zip(out["output_ids"], hf_argmax)) if a != b), None)
        assert first_diff is None, (
            f"prompt of {len(prompt)}: token {first_diff} is {out['output_ids'][first_diff]}, "
            f"HF's greedy choice is {hf_argmax[first_diff]}"
        )


def test_logprobs_match_transformers(hf_lps, prompts, ours) -> None:
    for prompt, out, lps in zip(prompts, ours, hf_lps):
        meta = out["meta_info"]
        got_in = meta["input_token_logprobs"]
        assert got_in[0] == (None, prompt[0]) and [t for _, t in got_in] == prompt
        expected_in = [lps[i - 1, prompt[i]] for i in range(1, len(prompt))]
        np.testing.assert_allclose([lp for lp, _ in got_in[1:]], expected_in, atol=LOGPROB_ATOL, rtol=0,
                                   err_msg=f"prompt logprobs, prompt of {len(prompt)}")
        got_out = meta["output_token_logprobs"]
        assert [t for _, t in got_out] == out["output_ids"]
        expected_out = [lps[len(prompt) - 1 + j, t] for j, t in enumerate(out["output_ids"])]
        np.testing.assert_allclose([lp for lp, _ in got_out], expected_out, atol=LOGPROB_ATOL, rtol=0,
                                   err_msg=f"output logprobs, prompt of {len(prompt)}")
