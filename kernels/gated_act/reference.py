"""The gated activation of a fused gate|up projection, in plain jnp (the native CPU kernel's oracle)."""

from __future__ import annotations

import jax


def silu_mul(y: jax.Array) -> jax.Array:
    """silu(gate) * up for y [..., 2I] whose channels interleave gate and up (models/fused.py) -> [..., I]."""
    pairs = y.reshape(*y.shape[:-1], -1, 2)
    return jax.nn.silu(pairs[..., 0]) * pairs[..., 1]
