"""Building blocks shared by decoder families: linear, RMSNorm, rotary embedding, gated MLP."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


class Linear(nnx.Module):
    """`x @ kernel (+ bias)` with kernel stored [in, out] in the compute dtype."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype):
        self.kernel = nnx.Param(jnp.zeros((in_features, out_features), dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jnp.dot(x.astype(self.kernel.dtype), self.kernel[...], preferred_element_type=jnp.float32)
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        return y


class RMSNorm(nnx.Module):
    """RMSNorm with float32 statistics; the output is cast back to `out_dtype` before the weight, as HF does."""

    def __init__(self, dim: int, *, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array, out_dtype=None) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        out_dtype = out_dtype or self.weight.dtype
        return self.weight[...].astype(out_dtype) * normed.astype(out_dtype)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, scale: float = 1.0) -> jax.Array:
    """Rotates the first 2*len(inv_freq) channels of x f[T, heads, head_dim] (HF rotate_half layout).

    `scale` multiplies cos and sin (YaRN's `attention_scaling`; `RopeConfig.attention_scaling`).
    """
    rot = 2 * inv_freq.shape[0]
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # f32[T, rot/2]
    cos = jnp.cos(angles)[:, None, :]
    sin = jnp.sin(angles)[:, None, :]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    x32 = x[..., :rot].astype(jnp.float32)
    x1, x2 = x32[..., : rot // 2], x32[..., rot // 2 :]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
    return rotated if rot == x.shape[-1] else jnp.concatenate([rotated, x[..., rot:]], axis=-1)


ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


class GatedMLP(nnx.Module):
    """down(act(gate(x)) * up(x)); gate and up are fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int, *, act: str, bias: bool, dtype):
        self.gate_up = Linear(hidden, 2 * intermediate, bias=bias, dtype=dtype)
        self.down = Linear(intermediate, hidden, bias=bias, dtype=dtype)
        self.act = ACTIVATIONS[act]

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = jnp.split(self.gate_up(x), 2, axis=-1)
        return self.down(self.act(gate) * up)


def lm_logits(hidden: jax.Array, embed: jax.Array, lm_head: jax.Array | None, scale: float = 1.0) -> jax.Array:
    """f32[N, vocab] logits (times `scale`) for hidden rows f[N, hidden]; `lm_head=None`: tied to `embed`."""
    if lm_head is None:  # tied: contract with the embedding rows, no transposed copy
        out = jnp.einsum("nd,vd->nv", hidden.astype(embed.dtype), embed, preferred_element_type=jnp.float32)
    else:
        out = jnp.dot(hidden.astype(lm_head.dtype), lm_head, preferred_element_type=jnp.float32)
    return out * scale if scale != 1.0 else out
