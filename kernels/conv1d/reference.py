"""Plain-jnp depthwise causal conv1d over block-laid-out sequences, reading and writing a conv-state pool."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_conv1d_prefill(
    x: jax.Array,  # f[num_blocks, block_size, C] conv inputs of the prefill blocks
    weight: jax.Array,  # f[C, K] depthwise taps; tap K-1 multiplies the current token
    bias: jax.Array | None,  # f[C]
    conv_pool: jax.Array,  # f[num_layers, slots, C, K-1] last K-1 inputs of each slot's sequence, oldest first
    layer: jax.Array | int,
    slots: jax.Array,  # i32[num_blocks] state slot of each block's sequence (0: padding)
    lens: jax.Array,  # i32[num_blocks] real tokens in each block
    starts: jax.Array,  # bool[num_blocks] first block of its sequence this step
    ends: jax.Array,  # bool[num_blocks] last block of its sequence this step
    has_init: jax.Array,  # bool[num_blocks] continue from the slot's conv state (else zeros)
) -> tuple[jax.Array, jax.Array]:
    """y[b, i] = bias + sum_k weight[:, k] * u[b, i + k - (K-1)], u = the sequence's inputs with its history.

    A sequence's blocks are consecutive and only its last block is partial, so the K-1 inputs before a
    block are the previous block's last K-1 inputs, or (for its first block) the slot's conv state, or
    zeros for a sequence starting at position 0. Returns (y f32[num_blocks, block_size, C], conv_pool) with
    each sequence's last K-1 real inputs written to its slot (other blocks write the dummy slot 0).
    """
    nb, bs, c = x.shape
    k = weight.shape[1]
    if bs < k - 1:
        raise ValueError(f"block_size={bs} must be >= conv_kernel - 1 = {k - 1}")
    x = x.astype(jnp.float32)
    stored = conv_pool[layer, slots].astype(jnp.float32)  # [nb, C, K-1]
    stored = jnp.where(has_init[:, None, None], stored, 0.0).transpose(0, 2, 1)  # [nb, K-1, C]
    prev_tail = jnp.concatenate([jnp.zeros((1, k - 1, c), x.dtype), x[:-1, bs - (k - 1) :]], axis=0)
    history = jnp.where(starts[:, None, None], stored, prev_tail)
    ext = jnp.concatenate([history, x], axis=1)  # [nb, K-1+bs, C]
    w = weight.astype(jnp.float32)
    y = sum(ext[:, j : j + bs] * w[:, j] for j in range(k))
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    # The K-1 inputs ending at the block's last real token: ext[lens .. lens+K-2].
    idx = lens[:, None] + jnp.arange(k - 1)[None, :]  # [nb, K-1]
    tail = jnp.take_along_axis(ext, idx[:, :, None], axis=1)  # [nb, K-1, C]
    write_to = jnp.where(ends, slots, 0)
    conv_pool = conv_pool.at[layer, write_to].set(tail.transpose(0, 2, 1).astype(conv_pool.dtype))
    return y, conv_pool


def causal_conv1d_decode(
    x: jax.Array,  # f[D, C] one new input per decode row
    weight: jax.Array,  # f[C, K]
    bias: jax.Array | None,  # f[C]
    conv_pool: jax.Array,  # f[num_layers, slots, C, K-1]
    layer: jax.Array | int,
    slots: jax.Array,  # i32[D] (0: padding row)
) -> tuple[jax.Array, jax.Array]:
    """One conv step per decode row: returns (y f32[D, C], conv_pool with the window shifted by one)."""
    window = jnp.concatenate([conv_pool[layer, slots].astype(jnp.float32), x.astype(jnp.float32)[:, :, None]], axis=2)
    y = jnp.einsum("dck,ck->dc", window, weight.astype(jnp.float32))
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    conv_pool = conv_pool.at[layer, slots].set(window[:, :, 1:].astype(conv_pool.dtype))
    return y, conv_pool
