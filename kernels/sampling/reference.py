"""Row reductions over logits f32[B, V] for sampling, in plain jnp (the native CPU kernels' oracle)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def argmax_first(x: jax.Array) -> jax.Array:
    """i32[B] index of each row's maximum of f32[B, V], the first one on ties (as jnp.argmax).

    Two plain reductions: XLA:CPU runs jnp.argmax's variadic (value, index) reduction as a scalar loop,
    2.4 ms for 32 rows of a 49152-token vocabulary against 1.1 ms for these. A row with a NaN gets
    index 0 where the maximum propagates NaN (argmax would pick the NaN); XLA:CPU's vectorised max may
    skip it instead."""
    peak = jnp.max(x, axis=-1, keepdims=True)
    ids = jnp.arange(x.shape[-1], dtype=jnp.int32)
    first = jnp.min(jnp.where(x == peak, ids, x.shape[-1]), axis=-1)
    return jnp.where(first < x.shape[-1], first, 0).astype(jnp.int32)


def logsumexp(x: jax.Array) -> jax.Array:
    """f32[B] log(sum(exp(x))) of each row: a token's logprob is its logit minus this."""
    return jax.nn.logsumexp(x.astype(jnp.float32), axis=-1)
