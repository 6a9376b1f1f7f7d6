"""Reference answers from Hugging Face transformers (torch, fp32) for parity tests; a word-level tokenizer."""

from __future__ import annotations

import os

import numpy as np
import torch


def write_word_tokenizer(path: str, vocab: int) -> None:
    """A word-level tokenizer "t0".."t{vocab-1}": the Engine needs one, these tests feed token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(path, "tokenizer.json"))


@torch.no_grad()
def hf_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy continuation with HF's KV cache; no eos check, so exactly `num_tokens` come back."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens: list[int] = []
    while True:
        tokens.append(int(out.logits[0, -1].argmax()))
        if len(tokens) == num_tokens:
            return tokens
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)


@torch.no_grad()
def hf_logprobs(model, ids: list[int]) -> np.ndarray:
    """f32[len(ids), vocab]: row i is log p(. | ids[:i+1]) from one forward pass over `ids`."""
    logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1).numpy()


def serve_and_compare(path: str, hf_model, prompts: list[list[int]], engine_args: dict, num_new_tokens: int,
                      greedy=None, inspect=None) -> dict:
    """Our Engine's greedy run over `prompts` batched (prompt and output logprobs, top 5), HF's greedy tokens
    for each prompt (`greedy(model, prompt, n)`, default `hf_greedy`), and HF's logprobs teacher-forced on
    our tokens (comparable even if the greedy paths were to part): {"path", "prompts", "outs", "hf_tokens",
    "hf_lps", "inspected"}, the last `inspect(engine)` after the run (None without `inspect`)."""
    from serve import Engine

    engine = Engine(model=path, **engine_args)
    try:
        outs = engine.generate(
            input_ids=prompts,
            sampling_params={"temperature": 0, "max_new_tokens": num_new_tokens, "ignore_eos": True},
            return_logprob=True, logprob_start_len=0, top_logprobs_num=5,
        )
        inspected = inspect(engine) if inspect else None
    finally:
        engine.shutdown()
    greedy = greedy or hf_greedy
    return {
        "path": path, "prompts": prompts, "outs": outs,
        "hf_tokens": [greedy(hf_model, p, num_new_tokens) for p in prompts],
        "hf_lps": [hf_logprobs(hf_model, p + o["output_ids"]) for p, o in zip(prompts, outs, strict=True)],
        "inspected": inspected,
    }


def check_top(ours: list[tuple[float, int]], hf_row: np.ndarray, where: str, atol: float = 1e-4) -> None:
    """Our top logprobs (logprob, id) equal HF's row: same ids in order, logprobs within `atol`."""
    k = len(ours)
    top_ids = np.argsort(-hf_row, kind="stable")[:k]
    assert [t for _, t in ours] == top_ids.tolist(), where
    np.testing.assert_allclose([lp for lp, _ in ours], hf_row[top_ids], atol=atol, rtol=0, err_msg=where)




def check_prompt_logprobs(where: str, prompt: list[int], out: dict, lps: np.ndarray,
                          atol: float = 1e-4) -> None:
    """Our prompt logprobs (from logprob_start_len=0) and top-k equal HF's `lps` (hf_logprobs of the
    sequence)."""
    meta = out["meta_info"]
    got = meta["input_token_logprobs"]
    assert [t for _, t in got] == prompt and got[0][0] is None, where
    expected = [lps[i - 1, prompt[i]] for i in range(1, len(prompt))]
    np.testing.assert_allclose([lp for lp, _ in got[1:]], expected, atol=atol, rtol=0,
                               err_msg=f"{where}: prompt of {len(prompt)}")
    assert meta["input_top_logprobs"][0] is None, where
    for i in range(1, len(prompt)):
        check_top(meta["input_top_logprobs"][i], lps[i - 1], f"{where}: prompt position {i}", atol)


def check_greedy_tokens(where: str, out: dict, hf_tokens: list[int]) -> None:
    assert out["output_ids"] == hf_tokens, where
    # Random weights that collapse to one repeated token would make this comparison weak.
    assert len(set(hf_tokens)) >= 4, f"{where}: degenerate model {hf_tokens}"


def check_output_logprobs(where: str, prompt: list[int], out: dict, lps: np.ndarray,
                          atol: float = 1e-4) -> None:
    """Output logprobs and top-k equal HF's teacher-forced `lps` over prompt + our output."""
    meta = out["meta_info"]
    got = meta["output_token_logprobs"]
    assert [t for _, t in got] == out["output_ids"], where
    rows = [len(prompt) - 1 + j for j in range(len(got))]
    expected = [lps[r, t] for r, t in zip(rows, out["output_ids"])]
    np.testing.assert_allclose([lp for lp, _ in got], expected, atol=atol, rtol=0,
                               err_msg=f"{where}: prompt of {len(prompt)}")
    for j, r in enumerate(rows):
        check_top(meta["output_top_logprobs"][j], lps[r], f"{where}: output {j}", atol)


def parity_tests(atol: float, num_new_tokens: int):
    """The three parity tests of a module whose `run` fixture gives `serve_and_compare`'s dict plus "name":
    prompt logprobs (and top-k), greedy tokens, output logprobs (and top-k) against HF. Assign them to
    module-level `test_*` names so pytest collects them."""

    def test_prompt_logprobs_match_hf(run) -> None:
        for prompt, out, lps in zip(run["prompts"], run["outs"], run["hf_lps"]):
            check_prompt_logprobs(run["name"], prompt, out, lps, atol)

    def test_greedy_tokens_match_hf(run) -> None:
        for prompt, out, hf_tokens in zip(run["prompts"], run["outs"], run["hf_tokens"]):
            check_greedy_tokens(f"{run['name']} prompt of {len(prompt)}", out, hf_tokens)

    def test_output_logprobs_match_hf(run) -> None:
        for prompt, out, lps in zip(run["prompts"], run["outs"], run["hf_lps"]):
            assert len(out["output_ids"]) == num_new_tokens
            check_output_logprobs(run["name"], prompt, out, lps, atol)

    return test_prompt_logprobs_match_hf, test_greedy_tokens_match_hf, test_output_logprobs_match_hf


def check_no_near_tie(where: str, prompt: list[int], lps: np.ndarray, min_gap: float = 1e-3) -> None:
    """Every greedy step's top-2 gap is far above a correct fp32 run's ~1e-5 error: otherwise "tokens
    identical" would hinge on rounding order, not on correctness (pick another seed)."""
    top2 = np.sort(lps[len(prompt) - 1 : -1], axis=-1)[:, -2:]
    gap = (top2[:, 1] - top2[:, 0]).min()
    assert gap > min_gap, f"{where}: a greedy step is a near-tie ({gap=:.2g}); pick another seed"
