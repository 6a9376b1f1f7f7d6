"""Writes a random-weight Hugging Face checkpoint of a real model's shape, with the default model's tokenizer,
so that serving benchmarks can run architectures whose weights are not on this machine.

    python -m bench.random_checkpoint --shape mamba2-130m OUT_DIR
    xlaserve serve --model-path OUT_DIR ...

The weights are transformers' own random initialization (needs torch): outputs are gibberish, speed is
real. The vocabulary is the tokenizer's (SmolLM2's 49,152 tokens), not the original model's.
"""

from __future__ import annotations

import argparse
import os
import shutil

SHAPES = {
    # state-spaces/mamba2-130m
    "mamba2-130m": dict(model_type="mamba2", hidden_size=768, num_hidden_layers=24, state_size=128,
                        head_dim=64, num_heads=24, expand=2, n_groups=1, conv_kernel=4, use_conv_bias=True,
                        use_bias=False, layer_norm_epsilon=1e-5, residual_in_fp32=True,
                        tie_word_embeddings=True, chunk_size=256),
    # Qwen3-Next-80B-A3B's layer shapes, 4 layers (3 Gated DeltaNet, then gated attention) instead of 48,
    # with a dense MLP of 5632 (the HF config's intermediate_size; about the 10 routed experts of 512 plus
    # the shared one that a token runs through) for the MoE: 267 M parameters in the layers (bench/ssm.py
    # --model qwen3-next-4l builds it in memory).
    "qwen3-next-4l": dict(model_type="qwen3_next", hidden_size=2048, num_hidden_layers=4,
                          layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=16,
                          num_key_value_heads=2, head_dim=256,
                          rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0,
                                               partial_rotary_factor=0.25),
                          linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                          linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=0,
                          intermediate_size=5632, rms_norm_eps=1e-6, tie_word_embeddings=False),
}


def write_checkpoint(out_dir: str, shape: dict, tokenizer_dir: str, seed: int = 0) -> str:
    """Saves a random model of `shape` (HF config fields, with model_type) and the tokenizer files of
    `tokenizer_dir` to `out_dir`; returns it."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json")).get_vocab_size()
    fields = {k: v for k, v in shape.items() if k != "model_type"}
    cfg = transformers.AutoConfig.for_model(shape["model_type"], vocab_size=vocab, **fields)
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(cfg).float().save_pretrained(out_dir)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    from serve.model_source import resolve_model
    from serve.server_args import ServerArgs
    from serve.tokenizer import tokenizer_dir

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--shape", default="mamba2-130m", choices=sorted(SHAPES))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    server = ServerArgs()
    cache_dir = server.resolved_cache_dir()
    write_checkpoint(args.out_dir, SHAPES[args.shape], tokenizer_dir(resolve_model(server.model, cache_dir),
                                                                      cache_dir), args.seed)
    print(f"wrote a random {args.shape} to {args.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
