"""Small random-weight Hugging Face checkpoints written to disk for tests."""

from __future__ import annotations

import os


def save_tiny_llama(path: str, *, seed: int = 0, **overrides) -> str:
    """A 2-layer GQA Llama with weights spread enough that greedy tokens vary; returns `path`."""
    import torch
    import transformers

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    kwargs = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    cfg = transformers.AutoConfig.for_model("llama", **kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    model.save_pretrained(path)
    return path


def save_tiny_mamba2(path: str, *, seed: int = 0, **overrides) -> str:
    """A 2-layer Mamba-2 (8 heads of 16, 2 groups, state 16) with non-trivial norms; returns `path`."""
    import torch
    import transformers

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    kwargs = dict(vocab_size=512, hidden_size=64, expand=2, num_heads=8, head_dim=16, n_groups=2,
                  state_size=16, conv_kernel=4, num_hidden_layers=2, initializer_range=0.2,
                  tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    kwargs.update(overrides)
    cfg = transformers.AutoConfig.for_model("mamba2", **kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
    model.save_pretrained(path)
    return path
