"""Dense projections: `Linear` (x @ kernel + bias) and the LM head, in the model dtype or grouped 4-/8-bit."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from kernels.cpu import matmul
from kernels.quant import embed_rows, qmatmul
from models.layers.stack import PerLayer


class QuantizedWeight(NamedTuple):
    """A weight W[n, k] in grouped 4- or 8-bit form (kernels/quant/reference.py): `zero` is None for 8 bits
    (int8 or fp8 `q`). Each part may be a `PerLayer` (a layer scan's weights, one array per layer)."""

    q: jax.Array
    scale: jax.Array
    zero: jax.Array | None
    # how x is rounded before each product: "none", "int8" or "bf16" (`--activation-quantization`); static
    activations: str = "none"
    # "rows" (kernels/quant/reference.py's layout) or "panels" (its stored panels, `to_panels`); static
    layout: str = "rows"

    def dot(self, x: jax.Array) -> jax.Array:
        """f32 x[..., k] @ W.T (x f32, or bf16 in a bfloat16 model: `qmatmul_reference` says how each is
        multiplied)."""
        activations, layout = self.activations, self.layout
        if not isinstance(self.q, PerLayer):
            return qmatmul(x, self.q, self.scale, self.zero, activations=activations, layout=layout)
        zeros = self.zero.arrays if self.zero is not None else [None] * len(self.q.arrays)

        def branch(q, s, z):
            return lambda x: qmatmul(x, q, s, z, activations=activations, layout=layout)

        branches = [branch(*a) for a in zip(self.q.arrays, self.scale.arrays, zeros)]
        return jax.lax.switch(self.q.index, branches, x)

    def rows(self, ids: jax.Array) -> jax.Array:
        """f32[..., k]: rows `ids` of W (an embedding table)."""
        return embed_rows(self.q, self.scale, self.zero, ids, layout=self.layout)

    @classmethod
    def of(cls, q, scale, zero, activations: str = "none", layout: str = "rows") -> QuantizedWeight:
        """From a module's parameters (`zero` None for 8 bits)."""
        return cls(q.get_value(), scale.get_value(), None if zero is None else zero.get_value(), activations,
                   layout)


class Linear(nnx.Module):
    """`x @ kernel (+ bias)`, kernel stored [in, out] in the compute dtype (or a `PerLayer` of kernels).

    Quantized (models/quantization.py `quantize_linears`), `kernel` is None and `qkernel` / `qscale` /
    `qzero` hold the weight transposed, W[out, in], in the grouped layout of kernels/quant."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype):
        self.dtype = dtype  # the compute dtype (activations), whatever the weights are stored in
        self.kernel = nnx.Param(jnp.zeros((in_features, out_features), dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None
        self.qkernel = self.qscale = self.qzero = None
        self.activations = "none"  # models/quantization.py `quantize_linears` sets it
        self.layout = "rows"  # of the quantized weight: models/quantization.py `to_stored_panels` may set it

    @property
    def quantized(self) -> QuantizedWeight | None:
        if self.qkernel is None:
            return None
        return QuantizedWeight.of(self.qkernel, self.qscale, self.qzero, self.activations, self.layout)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.qkernel is not None:  # in the compute dtype, as `matmul` casts x to a bf16 kernel's dtype
            y = self.quantized.dot(x.astype(self.dtype))
        else:
            kernel = self.kernel.get_value()
            y = kernel.dot(x) if isinstance(kernel, PerLayer) else matmul(x, kernel)
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        return y


def lm_logits(hidden: jax.Array, embed: jax.Array | QuantizedWeight,
              lm_head: jax.Array | QuantizedWeight | None, scale: float = 1.0) -> jax.Array:
    """f32[N, vocab] logits (times `scale`) for hidden rows f[N, hidden]; `lm_head=None`: tied to `embed`.
    A quantized `lm_head` is stored [vocab, hidden] like the embedding."""
    if lm_head is None:  # tied: contract with the embedding rows, no transposed copy
        quantized = isinstance(embed, QuantizedWeight)
        out = embed.dot(hidden) if quantized else matmul(hidden, embed, transpose_w=True)
    elif isinstance(lm_head, QuantizedWeight):
        out = lm_head.dot(hidden)
    else:
        out = matmul(hidden, lm_head)
    return out * scale if scale != 1.0 else out
