"""Dense projections: `Linear` (x @ kernel + bias) and the LM head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kernels.cpu import matmul
from models.layers.stack import PerLayer


class Linear(nnx.Module):
    """`x @ kernel (+ bias)`, kernel stored [in, out] in the compute dtype (or a `PerLayer` of kernels)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype):
        self.kernel = nnx.Param(jnp.zeros((in_features, out_features), dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.kernel.get_value()
        if isinstance(kernel, PerLayer):
            y = kernel.dot(x)
        else:
            y = matmul(x, kernel)
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        return y


def lm_logits(hidden: jax.Array, embed: jax.Array, lm_head: jax.Array | None,
              scale: float = 1.0) -> jax.Array:
    """f32[N, vocab] logits (times `scale`) for hidden rows f[N, hidden]; `lm_head=None`: tied to `embed`."""
    if lm_head is None:  # tied: contract with the embedding rows, no transposed copy
        out = matmul(hidden, embed, transpose_w=True)
    else:
        out = matmul(hidden, lm_head)
    return out * scale if scale != 1.0 else out
