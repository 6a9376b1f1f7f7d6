"""The pre-norm residual layer of Llama-style decoders: x += attn(norm(x)); x += mlp(norm(x))."""

from __future__ import annotations

import jax
from flax import nnx

from memory import KVPool
from models.batch import ForwardBatch
from models.layers.norm import RMSNorm


class DecoderLayer(nnx.Module):
    """`attn` (GQA or MLA over the KV pool) then `mlp` (dense or MoE), each after its RMSNorm and added to
    the residual stream, which stays float32 whatever the compute dtype. The scope names label the two
    blocks in profiles."""

    def __init__(self, hidden: int, eps: float, attn: nnx.Module, mlp: nnx.Module, *, dtype,
                 attn_scope: str = "attention", mlp_scope: str = "mlp"):
        self.input_norm = RMSNorm(hidden, eps=eps, dtype=dtype)
        self.attn = attn
        self.post_attn_norm = RMSNorm(hidden, eps=eps, dtype=dtype)
        self.mlp = mlp
        self.attn_scope, self.mlp_scope = attn_scope, mlp_scope

    def __call__(self, x, batch: ForwardBatch, kv: KVPool, layer) -> tuple[jax.Array, KVPool]:
        with jax.named_scope(self.attn_scope):
            h, kv = self.attn(self.input_norm(x), batch, kv, layer)
        x = x + h
        with jax.named_scope(self.mlp_scope):
            x = x + self.mlp(self.post_attn_norm(x))
        return x, kv


def decoder_layer_params(get, prefix: str, attn: dict, mlp: dict) -> dict[tuple[str, ...], object]:
    """A `DecoderLayer`'s parameters: HF's `{prefix}input_layernorm` and `post_attention_layernorm`
    weights, and the attention and MLP blocks' own name maps placed under "attn" and "mlp"."""
    return {
        ("input_norm", "weight"): get(prefix + "input_layernorm.weight"),
        ("post_attn_norm", "weight"): get(prefix + "post_attention_layernorm.weight"),
        **{("attn", *path): value for path, value in attn.items()},
        **{("mlp", *path): value for path, value in mlp.items()},
    }
