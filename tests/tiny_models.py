"""Small random-weight Hugging Face checkpoints written to disk for tests, and read back."""

from __future__ import annotations

import json
import os
from collections.abc import Callable


def write_word_tokenizer(path: str, vocab: int) -> None:
    """A word-level tokenizer "t0".."t{vocab-1}": the Engine needs one, these tests feed token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(path, "tokenizer.json"))


def random_hf_model(model_type: str, seed: int, **config):
    """transformers' fp32 causal LM of `model_type` with `config`, random weights from `seed`, eager
    attention (the plainest reference), in eval mode."""
    import torch
    import transformers

    cfg = transformers.AutoConfig.for_model(model_type, **config)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()


def spread_norms_and_biases(model, other: Callable | None = None, *, biases: bool = True) -> None:
    """HF initializes norms to one and biases to zero, which would let a model that skipped them pass: norm
    weights become 1 + 0.3 N(0, 1) and (with `biases`) biases 0.3 N(0, 1), in parameter order from torch's
    generator; `other(name, param)` sees every other parameter (under no_grad)."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            elif biases and name.endswith(".bias"):
                param.copy_(0.3 * torch.randn_like(param))
            elif other is not None:
                other(name, param)


def save_with_word_tokenizer(model, path: str, vocab: int, **save_kwargs):
    """Saves `model` (`save_pretrained(path, **save_kwargs)`) and a word tokenizer of `vocab`; returns it."""
    model.save_pretrained(path, **save_kwargs)
    write_word_tokenizer(path, vocab)
    return model


def read_checkpoint(path: str) -> tuple[dict, set[str]]:
    """The checkpoint's config.json and the names of the tensors in its model.safetensors."""
    from safetensors import safe_open

    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    with safe_open(os.path.join(path, "model.safetensors"), framework="np") as f:
        names = set(f.keys())
    return cfg, names


def save_tiny_llama(path: str, *, seed: int = 0, **overrides) -> str:
    """A 2-layer GQA Llama with weights spread enough that greedy tokens vary; returns `path`."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    kwargs = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    random_hf_model("llama", seed, **(kwargs | overrides)).save_pretrained(path)
    return path


def save_tiny_mamba2(path: str, *, seed: int = 0, **overrides) -> str:
    """A 2-layer Mamba-2 (8 heads of 16, 2 groups, state 16) with non-trivial norms; returns `path`."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    kwargs = dict(vocab_size=512, hidden_size=64, expand=2, num_heads=8, head_dim=16, n_groups=2,
                  state_size=16, conv_kernel=4, num_hidden_layers=2, initializer_range=0.2,
                  tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = random_hf_model("mamba2", seed, **(kwargs | overrides))
    spread_norms_and_biases(model, biases=False)
    model.save_pretrained(path)
    return path
