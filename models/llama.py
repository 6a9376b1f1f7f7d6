"""Llama-family decoders (Llama, Qwen2, Qwen3): GQA attention over paged KV, gated MLP, layers scanned."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from memory import MemoryPools
from models.batch import ForwardBatch
from models.config import ModelConfig
from models.layers.attention import Attention, attention_params_from_hf
from models.layers.causal_lm import CausalLM
from models.layers.decoder import DecoderLayer, decoder_layer_params
from models.layers.mlp import GatedMLP, gated_mlp_params_from_hf
from models.layers.stack import layer_stack, scan_layers

config_from_hf = ModelConfig.from_hf


def decoder_layer(cfg: ModelConfig, *, dtype) -> DecoderLayer:
    d = cfg.hidden_size
    return DecoderLayer(
        d, cfg.rms_norm_eps, Attention(d, cfg.attention, dtype=dtype),
        GatedMLP(d, cfg.intermediate_size, act=cfg.hidden_act, bias=cfg.mlp_bias, dtype=dtype), dtype=dtype,
    )


class LlamaForCausalLM(CausalLM):
    """Decoder whose layers run in one `lax.scan` (models/layers/stack.py:`scan_layers`).

    Scanning compiles one layer body instead of `num_layers` copies, which keeps precompiling every
    shape bucket fast; the KV pools ride in the scan carry so XLA updates them in place. Layer weights are
    kept per layer and picked by `lax.switch` (CPU, which would copy a dynamic slice of stacked weights out
    every step) or stacked on a leading axis by the loader (GPU/TPU): `layer_stack`, `stack_layers`.
    """

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32):
        self.cfg = cfg
        self.dtype = dtype
        self.init_ends(cfg, cfg.rms_norm_eps, dtype=dtype)
        self.layers = layer_stack(lambda: decoder_layer(cfg, dtype=dtype), cfg.num_layers)

    def __call__(self, batch: ForwardBatch, pools: MemoryPools) -> tuple[jax.Array, MemoryPools]:
        """Runs all layers; returns the final-normed hidden states f[T, hidden] and the updated pools."""
        kv = pools.kv
        x = self.embed_tokens(batch.input_ids)

        def step(layer, index, carry):
            x, kv = carry
            return layer(x, batch, kv, index)

        x, kv = scan_layers(self.layers, self.cfg.num_layers, step, (x, kv))
        return self.norm(x, self.dtype), pools._replace(kv=kv)


def params_from_hf(cfg: ModelConfig, get) -> dict[tuple, np.ndarray]:
    """Maps HF tensors (fetched by name with `get`) to our parameter paths, fusing and transposing.

    HF linear weights are [out, in]; ours are [in, out], q/k/v and gate/up fused on `out` in the
    layouts of models/fused.py, and layer i's parameters under ("layers", i, ...).
    """
    out = {("embed",): get("model.embed_tokens.weight"), ("norm", "weight"): get("model.norm.weight")}
    if not cfg.tie_word_embeddings:
        out[("lm_head",)] = get("lm_head.weight").T
    for i in range(cfg.num_layers):
        prefix = f"model.layers.{i}."
        layer = decoder_layer_params(
            get, prefix, attention_params_from_hf(cfg.attention, get, prefix + "self_attn"),
            gated_mlp_params_from_hf(get, prefix + "mlp", bias=cfg.mlp_bias),
        )
        out.update({("layers", i, *path): value for path, value in layer.items()})
    return out
