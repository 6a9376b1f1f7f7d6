"""Helpers the portable Pallas kernels share (chunked SSD and GLA): compiler settings, dots, prefix sums."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton


def compiler_params(interpret: bool):
    """Per-backend settings: heads split across TPU cores; on GPU, Triton (not Mosaic GPU, the default for
    a bare pallas_call), and no software pipelining: a program is one loop with a carried state."""
    if interpret:
        return None
    platform = jax.default_backend()
    if platform == "tpu":
        return pltpu.CompilerParams(dimension_semantics=("parallel",))
    if platform == "gpu":
        return pltriton.CompilerParams(num_warps=4, num_stages=1)
    return None


def dot(a: jax.Array, b: jax.Array, contract: tuple[int, int]) -> jax.Array:
    """f32 a . b contracting a's axis contract[0] with b's axis contract[1] (2-D operands, same dtype)."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(
        a,
        b,
        ((contract[:1], contract[1:]), ((), ())),
        precision=precision,
        preferred_element_type=jnp.float32,
    )


def cumulative(a: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Prefix sums of a chunk's log decays a f32[1, L] as a column [L, 1], a row [1, L], and the total [1, 1].

    Masked row sums over an [L, L] square instead of a cumsum (which Mosaic cannot lower); the row form
    reads the column's diagonal back, so both hold the same numbers.
    """
    n = a.shape[-1]
    row = lax.broadcasted_iota(jnp.int32, (n, n), 0)  # l
    col = lax.broadcasted_iota(jnp.int32, (n, n), 1)  # s
    cum_col = jnp.sum(jnp.where(col <= row, a, 0.0), axis=1, keepdims=True)  # [L, 1] sum_{s <= l} a[s]
    cum_row = jnp.sum(jnp.where(col == row, cum_col, 0.0), axis=0, keepdims=True)  # [1, L]
    return cum_col, cum_row, jnp.sum(a, axis=1, keepdims=True)
