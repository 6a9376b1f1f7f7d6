"""Rotary position embedding (HF's rotate_half layout), full or over a head's leading channels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


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
