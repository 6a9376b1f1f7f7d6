"""Reference answers from Hugging Face transformers (torch, fp32) for parity tests, and a word-level tokenizer."""

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


def check_top(ours: list[tuple[float, int]], hf_row: np.ndarray, where: str, atol: float = 1e-4) -> None:
    """Our top logprobs (logprob, id) equal HF's row: same ids in order, logprobs within `atol`."""
    k = len(ours)
    top_ids = np.argsort(-hf_row, kind="stable")[:k]
    assert [t for _, t in ours] == top_ids.tolist(), where
    np.testing.assert_allclose([lp for lp, _ in ours], hf_row[top_ids], atol=atol, rtol=0, err_msg=where)


